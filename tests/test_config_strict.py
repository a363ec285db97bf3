"""Strict configuration: a misspelt key at any level of the `args` stops the build, naming it.

The nesting levels are not listed by hand: `nested_models` walks ServiceSettings' fields (through
Optional, unions, lists and dicts), so a settings model nested later is covered without an edit
here. No Ray start and no vLLM import: `build_app` validates before it binds anything.
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from serve_app.settings import ENGINE_KWARGS_SET_BY_THE_REPLICA, EngineSettings, ServiceSettings

REPO = Path(__file__).resolve().parent.parent
TYPO = "moed"  # no model has such a field


def model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation holds (X, X | None, list[X], dict[str, X], ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return model_classes(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, tuple, set, frozenset, dict):
        return [model for arg in typing.get_args(annotation) for model in model_classes(arg)]
    return []


def nested_models(model: type[BaseModel] = ServiceSettings, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], type[BaseModel]]]:
    """(field path, model) for the root and every settings model reachable from it."""
    found = [(path, model)]
    for name, field in model.model_fields.items():
        for nested in model_classes(field.annotation):
            found += nested_models(nested, (*path, name))
    return found


LEVELS = nested_models()


def args_with_typo(path: tuple[str, ...]) -> dict[str, Any]:
    """{"a": {"b": {TYPO: 1}}} for path ("a", "b")."""
    args: dict[str, Any] = {TYPO: 1}
    for name in reversed(path):
        args = {name: args}
    return args


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVMEM_* overrides; a Redis address so that build_app gets past its Redis check."""
    for name in list(os.environ):
        if name.upper().startswith("KVMEM_") or name.upper() == "REDIS_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never connected to: nothing is deployed


def test_the_walk_finds_every_nesting_level() -> None:
    paths = {".".join(path) for path, _ in LEVELS}
    assert {"", "engine", "auth", "memory", "memory.arena", "memory.index"} <= paths


@pytest.mark.parametrize("path,model", LEVELS, ids=[".".join(p) or "<root>" for p, _ in LEVELS])
def test_every_settings_model_forbids_unknown_fields(path: tuple[str, ...], model: type[BaseModel]) -> None:
    assert model.model_config.get("extra") == "forbid", f"{model.__name__} at {'.'.join(path) or '<root>'}"


@pytest.mark.parametrize("path", [p for p, _ in LEVELS], ids=[".".join(p) or "<root>" for p, _ in LEVELS])
def test_a_typo_at_any_level_stops_the_settings_naming_the_field(path: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as caught:
        ServiceSettings.from_args(args_with_typo(path))
    (error,) = caught.value.errors()
    assert error["type"] == "extra_forbidden" and error["loc"] == (*path, TYPO)
    assert ".".join((*path, TYPO)) in str(caught.value)


@pytest.mark.parametrize("path", [p for p, _ in LEVELS], ids=[".".join(p) or "<root>" for p, _ in LEVELS])
def test_a_typo_at_any_level_stops_the_build(path: tuple[str, ...]) -> None:
    from serve_app.app import build_app

    with pytest.raises(ValidationError, match=".".join((*path, TYPO)).replace(".", r"\.")):
        build_app(args_with_typo(path))


def test_the_issues_examples_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"auth\.moed"):
        ServiceSettings.from_args({"auth": {"moed": "keys"}})
    with pytest.raises(ValidationError, match=r"engine\.tensor_parallel_size"):
        ServiceSettings.from_args({"engine": {"tensor_parallel_size": 2}})


def test_a_nested_environment_variable_with_a_typo_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVMEM_AUTH__MOED is a nested key like `auth: {moed: ...}`: refused. A top-level KVMEM_*
    name that is no field (KVMEM_MODEL_CACHE, the load test's variables) is not a setting."""
    monkeypatch.setenv("KVMEM_NOT_A_SETTING", "1")
    assert ServiceSettings.from_args(None).auth.mode == "off"
    monkeypatch.setenv("KVMEM_AUTH__MOED", "keys")
    with pytest.raises(ValidationError, match=r"auth\.moed"):
        ServiceSettings.from_args(None)


def test_engine_kwargs_pass_vllm_engine_arguments_through() -> None:
    from serve_app.app import build_app
    from serve_app.replica.engine import engine_kwargs

    args = {"engine": {"dtype": "float32", "engine_kwargs": {"tensor_parallel_size": 2, "max_lora_rnk": 8}}}
    with pytest.raises(ValueError, match=r"engine\.engine_kwargs\.max_lora_rnk"):
        build_app(args)
    args["engine"]["engine_kwargs"].pop("max_lora_rnk")
    assert build_app(args) is not None
    settings = ServiceSettings.from_args(args)
    kwargs = engine_kwargs(settings.engine, "/m", kv_transfer_config="connector")
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["dtype"] == "float32" and kwargs["kv_transfer_config"] == "connector"


def test_an_unknown_engine_argument_is_named_with_the_closest_real_one() -> None:
    from serve_app.replica.engine import UnknownEngineArgument, check_engine_kwargs

    settings = EngineSettings(engine_kwargs={"tensor_paralel_size": 2})
    with pytest.raises(UnknownEngineArgument, match=r"engine\.engine_kwargs\.tensor_paralel_size.*tensor_parallel_size"):
        check_engine_kwargs(settings)


def test_the_replica_checks_engine_kwargs_against_vllm_before_it_builds_an_engine() -> None:
    """At replica start the names are checked against the imported AsyncEngineArgs, before any
    environment is set or model folder read (the model path here does not exist)."""
    from serve_app.replica.engine import UnknownEngineArgument, build_async_engine, build_offline_engine

    settings = EngineSettings(dtype="float32", engine_kwargs={"tensor_parallel_sise": 2})
    for build in (build_async_engine, build_offline_engine):
        with pytest.raises(UnknownEngineArgument, match=r"engine\.engine_kwargs\.tensor_parallel_sise"):
            build(settings, "/no/such/model")


@pytest.mark.parametrize("name", sorted(ENGINE_KWARGS_SET_BY_THE_REPLICA))
def test_engine_kwargs_cannot_set_what_the_replica_sets(name: str) -> None:
    with pytest.raises(ValidationError, match=rf"{name} is set by"):
        ServiceSettings.from_args({"engine": {"engine_kwargs": {name: 1}}})


def test_the_names_read_from_vllms_source_are_vllms_engine_arguments() -> None:
    """The build-time check reads vllm/engine/arg_utils.py without importing vLLM (the builder must
    not load it: tests/test_layout.py); it must find exactly the dataclass's fields. Run in a fresh
    interpreter so that vLLM is not yet loaded when the source is read."""
    import json
    import subprocess
    import sys

    probe = (
        "import json, sys\n"
        "from serve_app.replica.engine import engine_arg_names, loaded_engine_arg_names\n"
        "from_source = engine_arg_names()\n"
        "assert 'vllm' not in sys.modules\n"
        "print(json.dumps([sorted(from_source), sorted(loaded_engine_arg_names())]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from_source, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert from_source == loaded and "tensor_parallel_size" in from_source
    assert set(ENGINE_KWARGS_SET_BY_THE_REPLICA) <= set(from_source), "a reserved name vLLM no longer has"


def serve_configs() -> list[tuple[str, dict[str, Any]]]:
    rayservice = yaml.safe_load((REPO / "k8s/rayservice.yaml").read_text())
    return [
        ("config.yaml", yaml.safe_load((REPO / "config.yaml").read_text())),
        ("config.gpu.yaml", yaml.safe_load((REPO / "config.gpu.yaml").read_text())),
        ("k8s/rayservice.yaml", yaml.safe_load(rayservice["spec"]["serveConfigV2"])),
    ]


@pytest.mark.parametrize("name,config", serve_configs(), ids=[name for name, _ in serve_configs()])
def test_the_shipped_configs_build_under_the_strict_settings(name: str, config: dict[str, Any]) -> None:
    from serve_app.app import build_app

    (app,) = config["applications"]
    ServiceSettings.from_args(app["args"])
    assert build_app(app["args"]) is not None
