"""Starting the real service for a bench (and for the HTTP tests, tests/serve_harness.py): the CPU
service in this process, or `serve run` of a config in a process of its own (docs/bench.md)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.kit.results import REPO
from devtools.local_redis import free_loopback_port


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides`: a dict value merged one level down, anything else replaced."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def small_service_args(redis_url: str, model_dir: Path, namespace: str, arena_dir: str, **overrides: Any) -> dict[str, Any]:
    """ServiceSettings args for a small CPU service: SmolLM2 in the service's own dtype (auto:
    float32 on CPUs without native bf16, where bf16 runs torch's scalar GEMM at ~1 generated
    token/s; bf16 elsewhere), short context, exact index on the CPU.

    Services that share one Redis server each write under their own key prefix
    (`kvmem-<namespace>`): a shard rebuilds its users from Redis at start, and must not adopt
    facts another service left behind."""
    args: dict[str, Any] = {
        "redis_url": redis_url,
        "engine": {"model": str(model_dir), "dtype": "auto", "max_model_len": 1024, "cpu_kv_cache_space_gib": 1},
        "default_max_tokens": 32,
        "llm_replicas": 1,
        "llm_replica_num_cpus": 0,
        "namespace": namespace,
        # admission on, but out of the way of runs about something else (tests/test_hostile_serve.py sets its own)
        "admission": {"per_user": {kind: {"per_s": 1000, "burst": 1000} for kind in ("chats", "writes", "reads")},
                      "max_engine_requests_per_key": 64, "max_writes_per_key": 64, "refusal_hold_s": 0},
        "memory": {
            "window_turns": 2,
            "encode_neighbours": 2,  # short encode prompts, like the window: 2 CPU cores serve every test
            "arena_dir": arena_dir,
            "redis_prefix": f"kvmem-{namespace}",
            "index": {"backend": "exact", "device": "cpu"},
        },
    }
    return merged(args, overrides)


def config_args(config: str = "config.yaml") -> dict[str, Any]:
    """The `args` of a Serve config's application (the settings `serve run` gives the service)."""
    import yaml

    (app,) = yaml.safe_load((REPO / config).read_text())["applications"]
    return app["args"]


@contextmanager
def serve_in_process(settings: dict[str, Any], num_cpus: int = 2, metrics: bool = False,
                     http_options: dict[str, Any] | None = None, timings: dict[str, float] | None = None) -> Iterator[str]:
    """Ray, Serve and the app with these ServiceSettings args in this process, on a free loopback
    port; yields its base URL, shuts Ray down after. `timings` gets the seconds Ray and Serve took
    to start (`ray_and_serve_s`) and the app until it answered (`app_running_s`)."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.ingress.proxy_guard import CALLBACK, CALLBACK_VARIABLE

    port = free_loopback_port()
    os.environ.setdefault(CALLBACK_VARIABLE, CALLBACK)  # Serve's proxy loads the connection bounds, as scripts/serve.sh has it
    init: dict[str, Any] = {"num_cpus": num_cpus, "include_dashboard": False, "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}}}
    if metrics:
        metrics_port = free_loopback_port()
        init["_metrics_export_port"] = metrics_port
        os.environ["KVMEM_TEST_METRICS_URL"] = f"http://127.0.0.1:{metrics_port}/metrics"
    started = time.monotonic()
    ray.init(**init)
    try:
        serve.start(http_options={"keep_alive_timeout_s": 15, **(http_options or {}), "host": "127.0.0.1", "port": port})
        ray_up = time.monotonic()
        serve.run(build_app(settings), name="kvmem", route_prefix="/")
        if timings is not None:
            timings.update(ray_and_serve_s=round(ray_up - started, 2), app_running_s=round(time.monotonic() - ray_up, 2))
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def running_service(redis_url: str, model_dir: Path, namespace: str, metrics: bool = False, **overrides: Any) -> Iterator[str]:
    """The app with small_service_args served on a free loopback port; yields its base URL."""
    arena_dir = tempfile.mkdtemp(prefix=f"kvmem-{namespace}-", dir="/dev/shm")
    try:
        with serve_in_process(small_service_args(redis_url, model_dir, namespace, arena_dir, **overrides), metrics=metrics) as url:
            yield url
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)


@contextmanager
def cpu_service(namespace: str, **overrides: Any) -> Iterator[str]:
    """`running_service` over a fresh local Redis and the staged SmolLM2; yields the base URL."""
    from devtools.local_redis import LocalRedis
    from devtools.offline_models import prepare_smollm2

    with tempfile.TemporaryDirectory() as folder, LocalRedis(Path(folder) / "redis") as redis:
        with running_service(redis.url, prepare_smollm2(), namespace, **overrides) as url:
            yield url


def cpu_dtype() -> str:
    """What the service's dtype "auto" resolves to on this CPU."""
    from serve_app.replica.engine import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def llama8b_dummy_overrides() -> dict[str, str]:
    """The Llama-3.1-8B architecture with random weights and SmolLM2's vocabulary (the model folder
    bench.kit.stage.prepare_serve_stage wrote)."""
    from bench.kit.stage import STAGE

    model = Path("/tmp/kvmem-llama8b")
    shutil.copytree(STAGE / "model", model, dirs_exist_ok=True)
    return {"KVMEM_ENGINE__MODEL": str(model), "KVMEM_ENGINE__LOAD_FORMAT": "dummy", "KVMEM_SERVED_MODEL_NAME": "llama-3.1-8b-shape-dummy"}


class ServeRun:
    """A local Redis and `serve run CONFIG` in a process of its own (as an operator starts the
    service), with KVMEM_* `overrides` (default: the Llama-3.1-8B shape with dummy weights),
    `applications` added to the config, and with `fresh` a free port and fresh Redis and arena
    folders, removed at stop."""

    def __init__(self, out: Path, *, config: str = "config.gpu.yaml", overrides: dict[str, str] | None = None,
                 applications: list[dict[str, Any]] | None = None, fresh: bool = False, log_name: str = "serve.log",
                 redis_dir: Path = Path("/tmp/kvmem-bench-redis")) -> None:
        self.out, self.config_name, self.log_name, self.fresh = out, config, log_name, fresh
        self.overrides = llama8b_dummy_overrides() if overrides is None else dict(overrides)
        self.applications = applications or []
        self.port = free_loopback_port() if fresh else 8000
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_key = "kvm-bench-" + secrets.token_hex(16)
        # a fresh folder is a fresh memory (a used one re-encodes its users on start)
        self.redis_dir = Path(tempfile.mkdtemp(prefix="kvmem-bench-redis-")) if fresh else redis_dir
        self.arena_dir = Path(tempfile.mkdtemp(prefix="kvmem-bench-", dir="/dev/shm")) if fresh else None
        if self.arena_dir is not None:
            self.overrides["KVMEM_MEMORY__ARENA_DIR"] = str(self.arena_dir)
        self.process: subprocess.Popen | None = None
        self.redis: Any = None

    def config(self) -> Path:
        import yaml

        doc = yaml.safe_load((REPO / self.config_name).read_text())
        doc["applications"] += self.applications
        doc.setdefault("http_options", {})["port"] = self.port
        path = self.out / f"serve-{Path(self.config_name).stem}-{self.port}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def routing(self) -> str:
        """The topology the config runs (KVMEM_ROUTING overrides it, as for the service)."""
        return os.environ.get("KVMEM_ROUTING") or config_args(self.config_name).get("routing", "router")

    def environment(self) -> dict[str, str]:
        from devtools.local_redis import LocalRedis
        from serve_app.ingress.proxy_guard import CALLBACK

        self.redis = LocalRedis(self.redis_dir, own_session=True).start()
        site = Path("/tmp/site")
        env = dict(os.environ)
        env.update(
            REDIS_URL=self.redis.url, RAY_AUTH_MODE="token", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0",
            KVMEM_AUTH__ADMIN_KEY=self.admin_key,
            KVMEM_MEMORY__INDEX__CAGRA_MIN_VECTORS="256",  # a graph over the bench's few thousand facts
            PYTHONPATH=f"{site}:{REPO}",
            # Serve's proxy loads the connection bounds and the 503 for a request whose replica died, as
            # scripts/serve.sh (make serve, make serve-gpu) and the KubeRay manifests set it
            RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=CALLBACK,
            **self.overrides,
        )  # fmt: skip
        from bench.kit.stage import CUVS_LIBS

        libs = [str(site / lib) for lib in CUVS_LIBS if (site / lib).is_dir()]
        if libs:  # cuVS's libraries; a staged nvJitLink (cuVS >= 26.8 needs >= 13.3) goes first
            env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")])
            jitlink = site / "nvidia" / "cu13" / "lib" / "libnvJitLink.so.13"
            if jitlink.exists():
                env["LD_PRELOAD"] = str(jitlink)
        return env

    def launch(self) -> subprocess.Popen:
        """`serve run` started, not waited for. Its own session: with --keep-running it outlives this
        call. SIGINT (stop()) must reach it as Ctrl-C does: a shell's background job starts with it
        ignored, and the child would inherit that (then stop() could only kill, leaving orphans)."""
        config, env = self.config(), self.environment()
        command = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", str(config)]
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=open(self.out / self.log_name, "w"), stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        return self.process

    def start(self, timeout_s: float) -> float:
        """Starts it and waits until /health says ok; returns the seconds that took."""
        import httpx

        from bench.kit.results import tail

        started, last = time.monotonic(), ""
        process = self.launch()
        while time.monotonic() - started < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"serve run exited ({process.returncode}); see {self.log_name}:\n{tail(self.out / self.log_name)}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                if response.status_code == 200:
                    return round(time.monotonic() - started, 1)
                last = response.text[:200]
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(2)
        raise TimeoutError(f"not healthy after {timeout_s:.0f} s ({last}); {self.log_name}:\n{tail(self.out / self.log_name)}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.redis is not None:
            self.redis.stop()
        if self.fresh:
            shutil.rmtree(self.redis_dir, ignore_errors=True)
            shutil.rmtree(self.arena_dir or "/nonexistent", ignore_errors=True)

    def handle(self, startup_s: float | None) -> dict[str, Any]:
        """What a later call needs to measure this service (bench.kit.service.STATE)."""
        return {"url": self.url, "admin_key": self.admin_key, "startup_s": startup_s, "root": str(REPO),
                "serve_pid": self.process.pid if self.process else None, "redis_pid": self.redis.process.pid if self.redis else None,
                "arena_dir": str(self.arena_dir) if self.arena_dir else None}


STATE = Path("/tmp/kvmem-serve-bench.json")  # the handle of a service a call left running (--keep-running)


def left_running(this_checkout: bool = False) -> dict[str, Any] | None:
    """The handle of the service an earlier call left running (STATE), when it still answers /health;
    with `this_checkout`, only one started from this checkout."""
    import httpx

    if not STATE.exists():
        return None
    state = json.loads(STATE.read_text())
    if this_checkout and state.get("root") != str(REPO):
        return None
    try:
        return state if httpx.get(f"{state['url']}/health", timeout=5).status_code == 200 else None
    except httpx.HTTPError:
        return None
