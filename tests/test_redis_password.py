"""The service's Redis clients connect to a password-protected Redis with the password from the env.

A real redis-server started with requirepass (devtools.local_redis, as k8s/redis.yaml runs it);
the settings come from REDIS_URL and REDIS_PASSWORD as in the Kubernetes containers. Every place
the service opens Redis is used as the service uses it: the ingress's routes (UserDirectory and
KeyStore, serve_app.ingress.routes), the keys CLI, and the shard actor (its FactStore). Without the
password each fails at once saying Redis refused it (StoreUnavailable naming REDIS_PASSWORD in the ingress
and the CLI, redis-py's AuthenticationError in the shard), not a hang or a wrong answer.
"""

from __future__ import annotations

import ast
import asyncio
import json
import secrets
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devtools.local_redis import LocalRedis
from memory.directory import StoreUnavailable
from memory.key_store import hash_key
from memory.records import NewFact
from memory.redis_keys import RedisKeys
from serve_app.ingress import keys_cli
from serve_app.ingress.routes import ChatRoutes
from serve_app.settings import ServiceSettings

PASSWORD = secrets.token_hex(16)
PREFIX = "pw"


@pytest.fixture(scope="module")
def protected_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path_factory.mktemp("redis-pw"), password=PASSWORD) as server:
        yield server


@pytest.fixture()
def service_env(protected_redis: LocalRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The containers' variables: REDIS_URL without a password in it, REDIS_PASSWORD beside it."""
    for name in ("REDIS_PASSWORD", "KVMEM_REDIS_PASSWORD", "KVMEM_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REDIS_URL", protected_redis.url)
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("KVMEM_MEMORY__REDIS_PREFIX", PREFIX)


def admin_client(server: LocalRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url, password=PASSWORD)


def test_the_redis_server_refuses_clients_without_the_password(protected_redis: LocalRedis) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(protected_redis.url).ping()
    assert admin_client(protected_redis).ping()


def test_the_ingress_routes_open_redis_with_the_password(service_env: None, protected_redis: LocalRedis) -> None:
    routes = ChatRoutes()
    routes._init_routes(ServiceSettings())

    async def use() -> tuple[str, object, int]:
        key, _ = await routes.keys.create(["alice"], label="pw test")
        principal = await routes.keys.principal(key)
        await routes.directory.ping()
        shard = await routes.directory.shard_of("alice", 2)
        await routes.keys.close()
        await routes.directory.close()
        return key, principal, shard

    key, principal, shard = asyncio.run(use())
    assert principal is not None and principal.may_act_for("alice") and not principal.may_act_for("bob")
    assert admin_client(protected_redis).exists(routes.keys._key(hash_key(key)))
    assert shard in (0, 1)


def test_the_ingress_without_the_password_fails_clearly(
    service_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_PASSWORD")
    routes = ChatRoutes()
    routes._init_routes(ServiceSettings())

    async def ping() -> None:
        try:
            await routes.directory.ping()
        finally:
            await routes.directory.close()

    with pytest.raises(StoreUnavailable, match="refused this client's password.*REDIS_PASSWORD"):
        asyncio.run(ping())


def test_keys_cli_uses_the_password_from_the_env(
    service_env: None, protected_redis: LocalRedis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    keys_cli.main(["create", "--user", "carol", "--label", "from the shell"])
    created = json.loads(capsys.readouterr().out)
    assert created["users"] == ["carol"] and created["key"]
    keys_cli.main(["list"])
    assert created["key_id"] in capsys.readouterr().out

    monkeypatch.delenv("REDIS_PASSWORD")
    with pytest.raises(StoreUnavailable, match="refused this client's password.*REDIS_PASSWORD"):
        keys_cli.main(["list"])


def test_a_redis_password_in_the_yaml_args_is_refused(service_env: None) -> None:
    for name in ("redis_password", "REDIS_PASSWORD", "KVMEM_REDIS_PASSWORD"):
        with pytest.raises(ValueError, match="comes from the environment"):
            ServiceSettings.from_args({name: "in plain text"})
    assert ServiceSettings.from_args({}).redis_password_value() == PASSWORD  # the environment's is taken


@pytest.mark.slow
def test_the_shard_actor_opens_redis_with_the_password(
    service_env: None, protected_redis: LocalRedis, smollm2_dir: Path
) -> None:
    """start_shard_actor as serve_app.replica.lifecycle calls it: the settings' password reaches the
    actor's MemoryShard and its FactStore, in a Ray worker process."""
    import ray

    from actors.shard_actor import start_shard_actor
    from memory.shard import MemoryShard
    from tests.test_memory_shard import shard_settings

    settings = ServiceSettings()
    memory = shard_settings(window_turns=0)
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        actor = start_shard_actor(
            0, memory, str(smollm2_dir), "float32", settings.redis_url, uuid.uuid4().hex[:8],
            redis_password=settings.redis_password_value(),
        )
        ray.get(actor.ready.remote(), timeout=300)
        (added,) = ray.get(actor.add_facts.remote("dave", [NewFact(text="Dave keeps bees.")]), timeout=120)
        assert added.event == "ADD"
        assert admin_client(protected_redis).exists(RedisKeys(memory.redis_prefix).fact(added.fact_id)), "not in Redis"
        assert [fact.text for fact in ray.get(actor.get_all.remote("dave"), timeout=60)] == ["Dave keeps bees."]
    finally:
        ray.shutdown()
        shutil.rmtree(memory.arena_dir, ignore_errors=True)

    without = shard_settings(window_turns=0)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            MemoryShard(0, without, str(smollm2_dir), "float32", settings.redis_url, uuid.uuid4().hex[:8]).store.r.ping()
    finally:
        shutil.rmtree(without.arena_dir, ignore_errors=True)

REDIS_OPENERS = {"Redis", "StrictRedis", "FactStore", "UserDirectory", "KeyStore", "MemoryShard", "start_shard_actor"}


def test_every_redis_client_the_product_opens_is_given_the_password() -> None:
    """Each call that opens Redis in a production module (redis-py's Redis(...) / Redis.from_url, one
    of the stores' from_url, a MemoryShard or its actor) names a password: a client added later
    without it would work on the loopback Redis of `make serve` and fail only in the cluster."""
    from tests.test_layout import PRODUCT, python_files

    missing = []
    for path in python_files(*PRODUCT):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            target = node.func.value if isinstance(node.func, ast.Attribute) and node.func.attr == "from_url" else node.func
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if name in REDIS_OPENERS and not any("password" in (k.arg or "") for k in node.keywords):
                missing.append(f"{path.relative_to(Path(__file__).parents[1])}:{node.lineno}")
    assert missing == []
