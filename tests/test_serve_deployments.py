"""Serve's own `deployments:` options over the builder's `.options(...)` (README, Configuration).

The builder sets each deployment's options from the application args (ingress_replicas,
llm_replica_num_cpus / _num_gpus, llm_replica_max_ongoing_requests); an entry under the Serve
config's `deployments:` overrides them, by Ray Serve's own rule. These tests run that rule,
`ray.serve._private.application_state.override_deployment_info` (what the controller applies to
the build task's result), on this application's deployments: no Ray start (the one call that
would start Ray, for the deployer's job id, gets a stand-in), no vLLM. Private Ray API, pinned
by requirements/cpu.lock (ray 2.60.0): a Ray upgrade that changes it fails here first.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve._private import deploy_utils
from ray.serve._private.application_state import override_deployment_info
from ray.serve._private.build_app import build_app as build_serve_app
from ray.serve.schema import ServeApplicationSchema

from gpuplan.environment import gpu_env_vars
from serve_app.app import build_app

REPO = Path(__file__).resolve().parent.parent
GPU_ENV = {"env_vars": gpu_env_vars()}  # the builder's environment for the replicas (tests/test_gpu_environment.py)


@pytest.fixture(autouse=True)
def no_ray_and_a_redis_address(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("KVMEM_") or name.upper() == "REDIS_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never connected to
    context = types.SimpleNamespace(get_job_id=lambda: "01000000")
    monkeypatch.setattr(deploy_utils, "ray", types.SimpleNamespace(get_runtime_context=lambda: context))


def deployment_infos(args: dict[str, Any]) -> dict[str, Any]:
    """name -> DeploymentInfo, as the build task hands them to the controller."""
    built = build_serve_app(build_app(args), name="kvmem")
    infos = {}
    for deployment in built.deployments:
        ingress = deployment.name == built.ingress_deployment_name
        deploy_args = deploy_utils.get_deploy_args(
            name=deployment.name,
            replica_config=deployment._replica_config,
            ingress=ingress,
            deployment_config=deployment._deployment_config,
            version="test",
            route_prefix="/" if ingress else None,
        )
        infos[deployment.name] = deploy_utils.deploy_args_to_deployment_info(**deploy_args, app_name="kvmem")
    return infos


def overridden(args: dict[str, Any], deployments: list[dict[str, Any]]) -> dict[str, Any]:
    config = ServeApplicationSchema.model_validate(
        {"import_path": "serve_app.app:build_app", "args": args, "deployments": deployments}
    )
    return override_deployment_info(deployment_infos(args), config)


def options(info: Any) -> tuple[int | None, int, dict[str, Any]]:
    return info.deployment_config.num_replicas, info.deployment_config.max_ongoing_requests, info.replica_config.ray_actor_options


def test_the_deployments_are_named_as_the_readme_says() -> None:
    assert sorted(deployment_infos({"llm_replicas": 2})) == ["ChatAPI", "LLMReplica_0", "LLMReplica_1"]
    assert sorted(deployment_infos({"llm_replicas": 2, "routing": "direct"})) == ["LLMReplica"]


def test_a_deployments_entry_overrides_what_the_args_set() -> None:
    args = {"llm_replicas": 2, "ingress_replicas": 2, "llm_replica_num_gpus": 0.5, "llm_replica_max_ongoing_requests": 64}
    plain = deployment_infos(args)
    assert options(plain["LLMReplica_1"]) == (1, 64, {"num_cpus": 1.0, "num_gpus": 0.5, "runtime_env": GPU_ENV})
    assert options(plain["ChatAPI"])[0] == 2
    infos = overridden(
        args,
        [
            {"name": "ChatAPI", "num_replicas": 4, "max_ongoing_requests": 500},
            {"name": "LLMReplica_1", "max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 2, "num_gpus": 1}},
        ],
    )
    assert options(infos["ChatAPI"])[:2] == (4, 500)
    assert options(infos["LLMReplica_1"]) == (1, 256, {"num_cpus": 2, "num_gpus": 1})
    assert options(infos["LLMReplica_0"]) == (1, 64, {"num_cpus": 1.0, "num_gpus": 0.5, "runtime_env": GPU_ENV})  # not named: the args' options


def test_ray_actor_options_in_the_config_replace_the_builders_whole() -> None:
    """Serve does not merge: a `ray_actor_options` entry without num_cpus drops the builder's
    (Serve's ReplicaConfig then reserves its default, 1 CPU)."""
    infos = overridden({"llm_replica_num_cpus": 3}, [{"name": "LLMReplica_0", "ray_actor_options": {"num_gpus": 1}}])
    assert options(infos["LLMReplica_0"])[2] == {"num_gpus": 1, "num_cpus": 1}


def test_the_ingress_can_autoscale() -> None:
    autoscaling = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 32}
    infos = overridden({}, [{"name": "ChatAPI", "autoscaling_config": autoscaling}])
    config = infos["ChatAPI"].deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 8, 32)


def test_an_entry_naming_no_deployment_is_refused() -> None:
    with pytest.raises(ValueError, match="LLMReplica_2.*does not exist"):
        overridden({"llm_replicas": 2}, [{"name": "LLMReplica_2", "max_ongoing_requests": 8}])
    with pytest.raises(ValueError, match="ChatAPI.*does not exist"):
        overridden({"routing": "direct"}, [{"name": "ChatAPI", "num_replicas": 2}])


@pytest.mark.parametrize("config", ["config.yaml", "config.gpu.yaml", "k8s/rayservice.yaml"])
def test_the_shipped_configs_override_no_replica_count_of_an_llm_deployment(config: str) -> None:
    """One LLM replica per memory shard: LLMReplica_<i> has one replica and `LLMReplica`
    (routing: direct) llm_replicas; a num_replicas or autoscaling_config entry for them would
    break the user -> shard routing. Any other entry must name a deployment that exists."""
    doc = yaml.safe_load((REPO / config).read_text())
    if config.startswith("k8s/"):
        doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
    for app in doc["applications"]:
        entries = app.get("deployments", [])
        for entry in entries:
            if entry["name"].startswith("LLMReplica"):
                assert not {"num_replicas", "autoscaling_config"} & set(entry), entry
        overridden(app.get("args") or {}, entries)


def test_the_readmes_deployments_example_applies() -> None:
    """The `deployments:` example in README's Configuration section is one Serve accepts for this app."""
    import re

    readme = (REPO / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "deployments:" in b]
    (app,) = yaml.safe_load(block)["applications"]
    infos = overridden(app["args"], app["deployments"])
    assert options(infos["LLMReplica_1"]) == (1, 128, {"num_cpus": 2, "num_gpus": 1})
    assert infos["ChatAPI"].deployment_config.autoscaling_config.max_replicas == 8
