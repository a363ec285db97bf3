"""The Kubernetes manifests lock the service down (issue 25: no tenant can hurt another).

Redis decides who is an admin (a key hash stored there is trusted) and the Ray head runs any job
it is given (a job can read the admin key from the environment), so neither may be open to the
namespace. Checked offline on the manifests in k8s/ (tests/test_k8s_manifests.py checks their
wiring and schemas):
- Redis requires a password from a Secret, really: the container's own command is run with a real
  redis-server, which must refuse a client without the password;
- the Ray containers get that same Secret, under a name ServiceSettings reads;
- Ray token auth is on for the head and every worker, from a Secret, under the names Ray reads
  (checked with Ray's own token loader);
- the NetworkPolicies, evaluated by `admits` below (the NetworkPolicy rules of the Kubernetes API),
  admit to Redis only the RayService's Ray pods, and to Ray's ports (GCS 6379, dashboard 8265,
  client 10001) only those pods (and the KubeRay operator to the dashboard); Serve's 8000 stays open;
- no Service of type LoadBalancer or NodePort exposes the Ray ports; the head Service is ClusterIP.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from devtools.local_redis import free_loopback_port, redis_server_binary
from serve_app.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
RAYSERVICE_PATH = K8S / "rayservice.yaml"
REDIS_PATH = K8S / "redis.yaml"
RAY_PORTS = {"GCS": 6379, "dashboard": 8265, "Ray client": 10001}
SERVE_PORT = 8000
# labels KubeRay puts on every pod it creates for a RayCluster (labelPod in its pod builder; a
# template's own label of the same key is kept); its head and serve Services select on some of them
KUBERAY_POD_LABELS = {
    "ray.io/is-ray-node": "yes",
    "ray.io/cluster": "kvmem-raycluster-x7k2p",
    "ray.io/identifier": "kvmem-raycluster-x7k2p-head",
    "app.kubernetes.io/name": "kuberay",
    "app.kubernetes.io/created-by": "kuberay-operator",
}
NAMESPACE = {"kubernetes.io/metadata.name": "default"}  # where the manifests are applied
OTHER_NAMESPACE = {"kubernetes.io/metadata.name": "tenant-b"}


def k8s_documents() -> list[dict[str, Any]]:
    """Every object of every manifest in k8s/."""
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def rayservice() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE_PATH.read_text())


def redis_deployment() -> dict[str, Any]:
    (deployment,) = [doc for doc in yaml.safe_load_all(REDIS_PATH.read_text()) if doc and doc["kind"] == "Deployment"]
    return deployment


def ray_groups() -> dict[str, dict[str, Any]]:
    """The head group and each worker group, by name."""
    cluster = rayservice()["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}


def ray_pod_labels(group: dict[str, Any]) -> dict[str, str]:
    """The labels a pod of this group has once KubeRay made it."""
    return KUBERAY_POD_LABELS | group["template"].get("metadata", {}).get("labels", {})


def env_entry(container: dict[str, Any], name: str) -> dict[str, Any]:
    (entry,) = [e for e in container.get("env", []) if e["name"] == name] or [{}]
    assert entry, f"container {container['name']} has no {name}"
    return entry


def secret_ref(container: dict[str, Any], name: str) -> tuple[str, str]:
    """(Secret, key) that env `name` of the container comes from; a literal value fails."""
    entry = env_entry(container, name)
    assert "value" not in entry, f"{container['name']}: {name} is written in the manifest"
    ref = entry["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional"), f"{container['name']}: {name} may be missing"
    return ref["name"], ref["key"]


# ---------------------------------------------------------------- NetworkPolicy semantics


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) on `labels`; {} selects all."""
    if selector is None:
        return False
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        held = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


@dataclass(frozen=True)
class Source:
    """Where a connection comes from: a pod (its labels and namespace's labels) or, with no pod
    labels, an address outside the cluster's pods (a node, a load balancer, the internet)."""

    pod_labels: dict[str, str] | None
    namespace_labels: dict[str, str] = field(default_factory=lambda: dict(NAMESPACE))


def peer_admits(peer: dict[str, Any], source: Source) -> bool:
    if "ipBlock" in peer:
        return source.pod_labels is None  # any outside address: an ipBlock is not about pods
    if source.pod_labels is None:
        return False
    if "namespaceSelector" in peer:
        namespace_ok = selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        namespace_ok = source.namespace_labels == NAMESPACE  # podSelector alone: the policy's namespace
    return namespace_ok and selects(peer.get("podSelector", {}), source.pod_labels)


def port_admits(rule: dict[str, Any], port: int) -> bool:
    ports = rule.get("ports") or []
    return not ports or any(
        p.get("protocol", "TCP") == "TCP" and (p.get("port") is None or p["port"] <= port <= p.get("endPort", p["port"]))
        for p in ports
    )


def admits(target_labels: dict[str, str], port: int, source: Source) -> bool:
    """Whether the manifests' NetworkPolicies let `source` reach TCP `port` of a pod labelled
    `target_labels` in NAMESPACE. Without a policy selecting the pod for Ingress, all may."""
    policies = [
        doc["spec"] for doc in k8s_documents()
        if doc["kind"] == "NetworkPolicy" and selects(doc["spec"]["podSelector"], target_labels)
        and "Ingress" in doc["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return True
    return any(
        port_admits(rule, port) and (not rule.get("from") or any(peer_admits(peer, source) for peer in rule["from"]))
        for policy in policies
        for rule in policy.get("ingress", [])
    )


def strangers() -> dict[str, Source]:
    """Sources that are not this RayService's Ray pods."""
    return {
        "a pod of the namespace": Source({"app": "debug-shell"}),
        "a pod of another namespace": Source({"app": "debug-shell"}, OTHER_NAMESPACE),
        "another namespace's pod with the Ray pods' labels": Source(ray_pod_labels(ray_groups()["head"]), OTHER_NAMESPACE),
        "a pod of the namespace claiming the template label, not made by KubeRay": Source(
            ray_groups()["head"]["template"].get("metadata", {}).get("labels", {}) or {"app": "x"}
        ),
        "an address outside the cluster's pods": Source(None),
    }


# ---------------------------------------------------------------- Redis


def test_redis_requires_a_password_from_a_secret() -> None:
    (container,) = redis_deployment()["spec"]["template"]["spec"]["containers"]
    secret = secret_ref(container, "REDIS_PASSWORD")
    script = " ".join(container.get("command", []))
    assert "requirepass $REDIS_PASSWORD" in script, "redis-server is not given requirepass from REDIS_PASSWORD"
    assert "requirepass" not in " ".join(container.get("args", [])), "requirepass on the command line"
    # the probes authenticate (redis-cli reads REDISCLI_AUTH) and need PONG (NOAUTH exits 0)
    assert secret_ref(container, "REDISCLI_AUTH") == secret
    for probe in ("readinessProbe", "livenessProbe"):
        assert "PONG" in " ".join(container[probe]["exec"]["command"]), probe


def test_the_redis_container_command_refuses_clients_without_the_password(tmp_path: Path) -> None:
    """The manifest's own command and arguments, run with a real redis-server (data folder, port and
    bind address moved to this machine; later arguments win in Redis)."""
    (container,) = redis_deployment()["spec"]["template"]["spec"]["containers"]
    args = list(container.get("args", []))
    args[args.index("--dir") + 1] = str(tmp_path)
    port, password = free_loopback_port(), secrets.token_hex(16)
    command = [*container.get("command", []), *args, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    binary_dir = str(Path(redis_server_binary()).parent)
    env = {"PATH": f"{binary_dir}:{os.environ['PATH']}", "REDIS_PASSWORD": password}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        authenticated = redis.Redis(port=port, password=password, socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, f"the Redis container's command exited: {command}"
            try:
                assert authenticated.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).set("admin-key-hash", "minted")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, password="guessed", socket_timeout=2).ping()
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline, "the password is on redis-server's command line"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_ray_containers_use_the_redis_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    (redis_container,) = redis_deployment()["spec"]["template"]["spec"]["containers"]
    redis_secret = secret_ref(redis_container, "REDIS_PASSWORD")
    for group in ray_groups().values():
        for container in group["template"]["spec"]["containers"]:
            assert secret_ref(container, "REDIS_PASSWORD") == redis_secret, container["name"]
    monkeypatch.setenv("REDIS_PASSWORD", "from-the-secret")
    assert ServiceSettings().redis_password_value() == "from-the-secret"  # the name the service reads


def test_only_the_ray_pods_reach_redis() -> None:
    redis_pod = redis_deployment()["spec"]["template"]["metadata"]["labels"]
    for name, group in ray_groups().items():
        assert admits(redis_pod, 6379, Source(ray_pod_labels(group))), f"the {name} pods cannot reach Redis"
    for who, source in strangers().items():
        assert not admits(redis_pod, 6379, source), f"{who} reaches Redis"


# ---------------------------------------------------------------- Ray


def test_ray_token_auth_is_on_for_the_head_and_every_worker() -> None:
    auth_options = rayservice()["spec"]["rayClusterConfig"].get("authOptions", {})
    assert auth_options.get("mode") == "token", "authOptions.mode: KubeRay does not know the cluster needs a token"
    for name, group in ray_groups().items():
        for container in group["template"]["spec"]["containers"]:
            assert env_entry(container, "RAY_AUTH_MODE").get("value") == "token", f"{name}: token auth off"
            assert secret_ref(container, "RAY_AUTH_TOKEN") == (auth_options["secretName"], "auth_token"), name


def test_ray_reads_the_token_auth_variables_the_manifest_sets(tmp_path: Path) -> None:
    """Ray's own loader, given the head container's auth variables (a HOME without ~/.ray/auth_token)."""
    token = secrets.token_hex(16)
    env = head_auth_env(token)
    probe = (
        "from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode\n"
        "loader = AuthenticationTokenLoader.instance()\n"
        "print(get_authentication_mode() == AuthenticationMode.TOKEN, loader.has_token() and loader.get_raw_token())\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", probe], env=clean | env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", token]


def test_the_pod_templates_leave_kuberays_own_labels_alone() -> None:
    """KubeRay's head and serve Services select pods by its labels (app.kubernetes.io/name: kuberay,
    ray.io/*); a template setting one of them keeps its own value and the Service finds no pod. The
    NetworkPolicies select a label of this project's instead."""
    for name, group in ray_groups().items():
        labels = group["template"].get("metadata", {}).get("labels", {})
        assert not set(labels) & set(KUBERAY_POD_LABELS), f"the {name} template overrides KubeRay's labels"
        assert not [key for key in labels if key.startswith("ray.io/")], name


def head_auth_env(token: str) -> dict[str, str]:
    """The head container's RAY_AUTH_* variables, `token` for the one read from the Secret."""
    (container,) = ray_groups()["head"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", token) for e in container["env"] if e["name"].startswith("RAY_AUTH")}


@pytest.mark.slow
def test_a_ray_head_with_the_manifests_auth_refuses_jobs_without_the_token() -> None:
    """A real Ray head (`ray start`, no CPUs, ports of its own) with the head container's auth
    variables: its jobs API (what KubeRay's dashboard port serves) refuses a job from a caller
    without the token, which is what any pod could do before."""
    token = secrets.token_hex(16)
    home = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length bound
    ports = {name: free_loopback_port() for name in ("port", "dashboard-port", "ray-client-server-port",
                                                     "dashboard-agent-listen-port")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": home} | head_auth_env(token)
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus=0",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--temp-dir={home}/ray",
               "--disable-usage-stats", *(f"--{name}={port}" for name, port in ports.items())]
    head = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    jobs = f"http://127.0.0.1:{ports['dashboard-port']}/api/jobs/"

    def submit(authorization: str | None, timeout_s: float = 10) -> int:
        headers = {"Content-Type": "application/json"} | ({"Authorization": authorization} if authorization else {})
        request = urllib.request.Request(jobs, data=b'{"entrypoint": "env"}', headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code

    try:
        deadline = time.monotonic() + 120
        while True:
            assert head.poll() is None, "ray start exited"
            try:
                urllib.request.urlopen(jobs, timeout=2).close()
                break  # the dashboard answers, and without a token: no auth
            except urllib.error.HTTPError:
                break  # the dashboard answers (401)
            except OSError:
                assert time.monotonic() < deadline, "the dashboard did not answer"
                time.sleep(0.5)
        assert submit(None) == 401
        assert submit("Bearer guessed") == 403
        assert submit(f"Bearer {token}", timeout_s=120) == 200  # an accepted job starts its supervisor first: slow on a loaded machine
    finally:
        stop_session(head)
        shutil.rmtree(home, ignore_errors=True)


def session_members(session_id: int) -> list[int]:
    """Pids of the processes in a session (Ray's workers make process groups of their own)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session_id:  # after "pid (comm)": state, ppid, pgrp, session
                members.append(int(stat.parent.name))
    return members


def stop_session(leader: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to every process of the session `leader` started (and only those)."""
    for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        for pid in session_members(leader.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while leader.poll() is None or [p for p in session_members(leader.pid) if not zombie(p)]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)


def zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


@pytest.mark.parametrize("port_name", sorted(RAY_PORTS))
def test_ray_ports_admit_only_the_clusters_own_pods(port_name: str) -> None:
    port = RAY_PORTS[port_name]
    operator = Source({"app.kubernetes.io/name": "kuberay-operator"}, {"kubernetes.io/metadata.name": "ray-system"})
    for name, group in ray_groups().items():
        target = ray_pod_labels(group)
        for peer_name, peer in ray_groups().items():
            assert admits(target, port, Source(ray_pod_labels(peer))), f"{peer_name} pods cannot reach {name}:{port}"
        for who, source in strangers().items():
            assert not admits(target, port, source), f"{who} reaches the {port_name} port {port} of the {name} pods"
        assert admits(target, port, operator) == (port == RAY_PORTS["dashboard"]), f"the operator and {name}:{port}"


def test_serve_http_stays_open_to_clients() -> None:
    for name, group in ray_groups().items():
        for who, source in strangers().items():
            assert admits(ray_pod_labels(group), SERVE_PORT, source), f"{who} cannot reach Serve on the {name} pods"


def test_no_service_exposes_the_ray_ports() -> None:
    spec = rayservice()["spec"]
    head = spec["rayClusterConfig"]["headGroupSpec"]
    assert head.get("serviceType") == "ClusterIP", "the head Service (dashboard, client, GCS) must be ClusterIP"
    assert not head.get("enableIngress"), "an Ingress to the head (dashboard) is made"
    services = [doc["spec"] for doc in k8s_documents() if doc["kind"] == "Service"]
    services += [s["spec"] for s in (spec.get("serveService"), head.get("headService")) if s]
    for service in services:
        if service.get("type") in {"LoadBalancer", "NodePort"}:
            exposed = {p.get("port") for p in service.get("ports", [])} | {p.get("targetPort") for p in service.get("ports", [])}
            assert not exposed & (set(RAY_PORTS.values()) | {"gcs-server", "dashboard", "client"}), service
    assert not [doc for doc in k8s_documents() if doc["kind"] == "Ingress"], "an Ingress is exposed"
