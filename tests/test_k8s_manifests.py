"""Offline checks of the Kubernetes manifests in k8s/ and of config.yaml (no cluster, no Ray start).

Its serveConfigV2 string, config.yaml and config.gpu.yaml are validated with Ray Serve's own
config schema (ray.serve.schema, shipped with Ray: nothing outside the repository is needed),
every key of them must be one Serve's schema models define (they let unknown keys through), and
their `args` must be ServiceSettings. k8s/redis.yaml is checked for the wiring RayService relies on.
The lockdown (Redis password, Ray token auth, NetworkPolicies, no exposed Ray ports) is checked in
tests/test_k8s_lockdown.py (this module is near the 400-line bound).

The KubeRay RayService CRD (v1) is no Python package's file, so the check of the whole
manifest against it (unknown fields rejected as `kubectl apply` does) runs only where
KVMEM_KUBERAY_CRD names the CRD file (ray-operator/config/crd/bases/ray.io_rayservices.yaml of
ray-project/kuberay); `.ci/run` passes it when it has one. Elsewhere those tests are skipped.
"""

from __future__ import annotations

import copy
import importlib
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[1]
CRD_ENV = "KVMEM_KUBERAY_CRD"
RAYSERVICE_PATH = REPO / "k8s/rayservice.yaml"
REDIS_PATH = REPO / "k8s/redis.yaml"
CONFIG_PATH = REPO / "config.yaml"
GPU_CONFIG_PATH = REPO / "config.gpu.yaml"
IMPORT_PATH = "serve_app.app:build_app"


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """Copy of a structural OpenAPI schema whose objects with listed properties reject others.

    jsonschema accepts unlisted fields unless told not to; the API server's strict field
    validation (the kubectl default) rejects them, which is what catches a misspelt key.
    Maps (additionalProperties given) and x-kubernetes-preserve-unknown-fields stay open;
    anyOf/allOf/oneOf only carry value checks in structural schemas and are left alone.
    """
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        out["items"] = closed(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(schema["additionalProperties"])
    return out


@pytest.fixture(scope="module")
def rayservice_validator() -> jsonschema.Draft4Validator:
    """Validator for the v1 RayService schema (OpenAPI v3 schemas are JSON Schema draft 4 based)."""
    given = os.environ.get(CRD_ENV)
    if not given:
        pytest.skip(
            f"{CRD_ENV} is not set: the RayService is not checked against the KubeRay CRD (set it to "
            "ray.io_rayservices.yaml of ray-project/kuberay); its serveConfigV2 is still checked"
        )
    crd_path = Path(given)
    assert crd_path.is_file(), f"{CRD_ENV}={given} is not a file"
    crd = yaml.safe_load(crd_path.read_text())
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    schema = closed(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE_PATH.read_text())


def serve_config(source: str) -> dict[str, Any]:
    """The Serve config of `config.yaml` or of the RayService's serveConfigV2."""
    if source == "config.yaml":
        return yaml.safe_load(CONFIG_PATH.read_text())
    return yaml.safe_load(yaml.safe_load(RAYSERVICE_PATH.read_text())["spec"]["serveConfigV2"])


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVMEM_* / REDIS_URL overrides: the args alone must make valid settings."""
    for name in list(os.environ):
        if name.upper().startswith("KVMEM_") or name.upper() == "REDIS_URL":
            monkeypatch.delenv(name)


def schema_errors(validator: jsonschema.Draft4Validator, manifest: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in validator.iter_errors(manifest)
    ]


def containers(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container of the head group and the worker groups."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [container for group in groups for container in group["template"]["spec"]["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def test_rayservice_satisfies_the_crd_schema(
    rayservice_validator: jsonschema.Draft4Validator, rayservice: dict[str, Any]
) -> None:
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert schema_errors(rayservice_validator, rayservice) == []


def _serve_config_as_mapping(manifest: dict[str, Any]) -> None:
    manifest["spec"]["serveConfigV2"] = yaml.safe_load(manifest["spec"]["serveConfigV2"])


def _replicas_as_word(manifest: dict[str, Any]) -> None:
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"


def _ray_start_param_as_int(manifest: dict[str, Any]) -> None:
    manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0


def _head_group_missing(manifest: dict[str, Any]) -> None:
    del manifest["spec"]["rayClusterConfig"]["headGroupSpec"]


def _misspelt_field(manifest: dict[str, Any]) -> None:
    cluster = manifest["spec"]["rayClusterConfig"]
    cluster["workerGroupSpec"] = cluster.pop("workerGroupSpecs")


@pytest.mark.parametrize(
    "breakage",
    [_serve_config_as_mapping, _replicas_as_word, _ray_start_param_as_int, _head_group_missing, _misspelt_field],
)
def test_broken_rayservice_fails_the_crd_schema(
    rayservice_validator: jsonschema.Draft4Validator,
    rayservice: dict[str, Any],
    breakage: Callable[[dict[str, Any]], None],
) -> None:
    manifest = copy.deepcopy(rayservice)
    breakage(manifest)
    assert schema_errors(rayservice_validator, manifest), f"{breakage.__name__} passed validation"


@pytest.mark.parametrize("source", ["config.yaml", "serveConfigV2"])
def test_serve_config_is_valid(source: str, clean_env: None) -> None:
    config = ServeDeploySchema.model_validate(serve_config(source))
    (app,) = config.applications
    assert app.import_path == IMPORT_PATH
    module_name, attribute = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module_name), attribute))
    ServiceSettings.from_args(app.args)


def unknown_serve_keys(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
    """Keys of a Serve config that Serve's schema models do not define, at any depth.

    ServeDeploySchema accepts unknown keys (forward compatibility) and ServeApplicationSchema
    ignores them, so a misspelt `route_prefx` or `deploymnets` would pass `model_validate` and do
    nothing; this walk finds them. Free-form fields (dicts such as `args`, `runtime_env`,
    `user_config`) are not entered: `args` is ServiceSettings' to check."""
    if not isinstance(data, dict):
        return []
    fields = {(f.alias or name): f for name, f in model.model_fields.items()} | dict(model.model_fields)
    unknown = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            unknown.append(where)
            continue
        for nested in serve_models(fields[key].annotation):
            items = value if isinstance(value, list) else [value]
            for index, item in enumerate(items):
                unknown += unknown_serve_keys(nested, item, f"{where}[{index}]" if isinstance(value, list) else where)
    return unknown


def serve_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation of Serve's schema holds (X, Optional[X], List[X], X | str)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in serve_models(arg)]


@pytest.mark.parametrize("source", ["config.yaml", "config.gpu.yaml", "serveConfigV2"])
def test_serve_config_uses_only_keys_serve_knows(source: str) -> None:
    """Needs nothing outside the repository (Ray's own schema models)."""
    config = yaml.safe_load(GPU_CONFIG_PATH.read_text()) if source == "config.gpu.yaml" else serve_config(source)
    ServeDeploySchema.model_validate(config)
    assert unknown_serve_keys(ServeDeploySchema, config) == []


def test_serve_config_v2_is_a_string_of_the_serve_config(rayservice: dict[str, Any]) -> None:
    """KubeRay takes serveConfigV2 as a YAML string (a mapping fails its CRD); checked without the CRD."""
    assert isinstance(rayservice["spec"]["serveConfigV2"], str)


def _app_key_misspelt(config: dict[str, Any]) -> None:
    app = config["applications"][0]
    app["route_prefx"] = app.pop("route_prefix")


def _deployment_option_misspelt(config: dict[str, Any]) -> None:
    config["applications"][0]["deployments"] = [{"name": "ChatAPI", "num_replica": 2}]


def _actor_option_misspelt(config: dict[str, Any]) -> None:
    config["applications"][0]["deployments"] = [{"name": "ChatAPI", "ray_actor_options": {"num_gpu": 1}}]


def _http_option_misspelt(config: dict[str, Any]) -> None:
    config["http_options"]["hots"] = config["http_options"].pop("host")


def _args_key_misspelt(config: dict[str, Any]) -> None:
    config["applications"][0]["args"]["auth"] = {"moed": "keys"}


@pytest.mark.parametrize(
    "breakage", [_app_key_misspelt, _deployment_option_misspelt, _actor_option_misspelt, _http_option_misspelt, _args_key_misspelt]
)
def test_broken_serve_config_v2_is_caught_without_the_crd(breakage: Callable[[dict[str, Any]], None], clean_env: None) -> None:
    config = serve_config("serveConfigV2")
    assert serve_config_problems(config) == []
    breakage(config)
    assert serve_config_problems(config), f"{breakage.__name__} passed validation"


def serve_config_problems(config: dict[str, Any]) -> list[str]:
    """What Serve's schema, the unknown-key walk and ServiceSettings find wrong in a Serve config."""
    try:
        ServeDeploySchema.model_validate(config)
        problems = unknown_serve_keys(ServeDeploySchema, config)
        for app in config["applications"]:
            ServiceSettings.from_args(app.get("args"))
    except ValidationError as error:
        return [str(error)]
    return problems


def test_rayservice_runs_the_config_yaml_application_on_gpus(clean_env: None) -> None:
    local = ServeDeploySchema.model_validate(serve_config("config.yaml")).applications[0]
    cluster = ServeDeploySchema.model_validate(serve_config("serveConfigV2"))
    (app,) = cluster.applications
    assert (app.name, app.route_prefix, app.import_path) == (local.name, local.route_prefix, local.import_path)
    assert cluster.http_options.host == "0.0.0.0", "Serve must listen on the pod address, not loopback"
    settings = ServiceSettings.from_args(app.args)
    assert settings.engine.dtype == "bfloat16"
    # a shard's engines and the shard share each GPU
    assert settings.llm_replicas_per_shard * settings.llm_replica_num_gpus + settings.shard_num_gpus == 1
    assert settings.redis_url is None, "the Redis address comes from REDIS_URL in the containers"


def test_rayservice_runs_config_gpu_yaml_settings(clean_env: None) -> None:
    """The cluster runs what `serve run config.gpu.yaml` runs and docs/gpu.md measures (CUDA graphs,
    block size, HBM tier, ...): the two application args make the same settings."""
    local = ServiceSettings.from_args(yaml.safe_load(GPU_CONFIG_PATH.read_text())["applications"][0]["args"])
    cluster = ServiceSettings.from_args(serve_config("serveConfigV2")["applications"][0]["args"])
    assert cluster.model_dump() == local.model_dump()
    assert cluster.engine.enforce_eager is False


def test_gpu_workers_fit_the_llm_replicas(rayservice: dict[str, Any], clean_env: None) -> None:
    settings = ServiceSettings.from_args(serve_config("serveConfigV2")["applications"][0]["args"])
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus = sum(
        group["minReplicas"] * int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        for group in workers
        for container in group["template"]["spec"]["containers"]
    )
    assert gpus >= settings.llm_replicas * (settings.llm_replica_num_gpus + settings.shard_num_gpus)


def test_containers_are_offline_and_point_at_the_redis_service(rayservice: dict[str, Any]) -> None:
    documents = [doc for doc in yaml.safe_load_all(REDIS_PATH.read_text()) if doc]
    (service,) = [doc for doc in documents if doc["kind"] == "Service"]
    port = service["spec"]["ports"][0]["port"]
    for container in containers(rayservice):
        env = env_of(container)
        assert env.get("HF_HUB_OFFLINE") == "1", container["name"]
        url = urlsplit(env["REDIS_URL"])
        assert (url.scheme, url.hostname, url.port) == ("redis", service["metadata"]["name"], port), container["name"]


def test_redis_is_persistent_and_reachable_through_its_service() -> None:
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all(REDIS_PATH.read_text()) if doc}
    assert set(documents) == {"PersistentVolumeClaim", "Deployment", "Service", "NetworkPolicy"}
    deployment, service, claim = documents["Deployment"], documents["Service"], documents["PersistentVolumeClaim"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()

    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"  # acknowledged means on disk
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"  # full: writes refused (507), nothing evicted
    maxmemory_mib = int(args[args.index("--maxmemory") + 1].removesuffix("mb"))
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and 0 < maxmemory_mib < int(limit.removesuffix("Gi")) * 1024  # refused before the pod is killed
    data_dir = args[args.index("--dir") + 1]
    (volume,) = [v for v in pod["spec"]["volumes"] if v.get("persistentVolumeClaim")]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert {"name": volume["name"], "mountPath": data_dir} in container["volumeMounts"]

    target = service["spec"]["ports"][0]["targetPort"]
    assert target in {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}


def test_the_cluster_requires_api_keys_and_config_yaml_stays_on_loopback(rayservice: dict[str, Any], clean_env: None) -> None:
    """keys mode in the cluster, its admin key from a Secret; the embedded `off` only on loopback."""
    cluster = ServiceSettings.from_args(serve_config("serveConfigV2")["applications"][0]["args"])
    assert cluster.auth.mode == "keys"
    for container in containers(rayservice):
        (admin,) = [e for e in container["env"] if e["name"] == "KVMEM_AUTH__ADMIN_KEY"]
        assert "value" not in admin and admin["valueFrom"]["secretKeyRef"]["name"] == "kvmem-auth", container["name"]
    local = serve_config("config.yaml")
    if ServiceSettings.from_args(local["applications"][0]["args"]).auth.mode == "off":
        assert local["http_options"]["host"] in {"127.0.0.1", "localhost", "::1"}


def test_the_dockerfile_builds_the_image_the_rayservice_names() -> None:
    """The Dockerfile installs the `gpu` extra (cuVS included), ships every package, converts the
    offline models where the RayService looks for them, and .dockerignore keeps local state out."""
    import re
    import tomllib

    dockerfile = (REPO / "Dockerfile").read_text()
    ignored = set((REPO / ".dockerignore").read_text().split())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert any("cuvs-cu13" in dep for dep in project["project"]["optional-dependencies"]["gpu"])
    assert re.search(r'pip install --user "\.\[gpu\]"', dockerfile)
    assert "COPY --chown=ray . ." in dockerfile and "python -m devtools.offline_models --prepare" in dockerfile
    base = re.search(r"^FROM python:(\d+)\.(\d+)", dockerfile, re.M)
    assert base and project["project"]["requires-python"] == ">=3.11,<3.13" and (3, 11) <= tuple(map(int, base.groups())) < (3, 13)
    for package in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert (REPO / package.rstrip("*")).is_dir() and package.rstrip("*") not in ignored
    assert {".venv", ".cache", ".git", ".device-stage", ".serve-stage"} <= ignored
    cache = re.search(r"KVMEM_MODEL_CACHE=(\S+)", dockerfile).group(1)
    doc = yaml.safe_load(RAYSERVICE_PATH.read_text())
    containers = [doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [g["template"]["spec"]["containers"][0] for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    for container in containers:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KVMEM_MODEL_CACHE"] == cache
    command = re.search(r'^CMD \["serve", "run", "([^"]+)"\]', dockerfile, re.M).group(1)
    assert (REPO / command).is_file()
