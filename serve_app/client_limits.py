"""Settings of what one client may cost the service: admission (rates and in-flight caps per key and
per user), the connection deadlines and bounds of Serve's HTTP proxy, and the hard bounds of one
add's body (the `add_limits` settings may lower them; serve_app.memory_protocol enforces them).

Read by serve_app.settings (the application's `args`: `admission`) and, for the proxy, from the
environment alone (`ProxySettings`, KVMEM_PROXY_*): Serve starts its proxy before any application,
so the proxy never sees the YAML `args` (serve_app.ingress.proxy_guard). Imports no implementation.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_FACTS_PER_ADD = 64
MAX_FACT_CHARS = 2_000  # the replica also bounds tokens: one arena entry per fact
MAX_TURNS_PER_ADD = 256
MAX_TURN_CHARS = 20_000


class RateLimit(BaseModel):
    """A token bucket: `per_s` requests a second on average, `burst` at once after a quiet spell."""

    model_config = ConfigDict(extra="forbid")

    per_s: float = Field(1.0, gt=0, description="Requests a second, on average.")
    burst: int = Field(5, ge=1, description="Requests admitted at once after a quiet spell (the bucket's size).")


def _rate(per_s: float, burst: int) -> Any:
    return Field(default_factory=lambda: RateLimit(per_s=per_s, burst=burst))


class UserLimits(BaseModel):
    """One user's rate per class of request (serve_app.ingress.admission.request_class): a person may
    chat once a second with bursts of 5 and add a session's turns in a burst of 10. A connection that
    keeps calling while refused spends tokens all the same (serve_app.ingress.admission), so only what
    honours Retry-After gets through; config.gpu.yaml gives a GPU's users more."""

    model_config = ConfigDict(extra="forbid")

    chats: RateLimit = _rate(1.0, 5)
    writes: RateLimit = _rate(1.0, 10)
    reads: RateLimit = _rate(5.0, 20)


class KeyLimits(BaseModel):
    """A key's own rates per class, for a key of several users (an application's backend): what it
    may spend in all, each of its users still within their own UserLimits."""

    model_config = ConfigDict(extra="forbid")

    chats: RateLimit = _rate(16.0, 32)
    writes: RateLimit = _rate(16.0, 64)
    reads: RateLimit = _rate(80.0, 160)


class AdmissionSettings(BaseModel):
    """Who may start how much, checked before a request's body is read (429 with Retry-After).

    Applies to user-bound keys (`auth.mode: keys`); an admin key (and every caller with `auth.mode:
    off`) is the operator's and is not limited. A key bound to one user spends that user's
    buckets before its body is read; a key of several users spends its own buckets then, and the
    buckets of the user a request names once the body is parsed (before any call to a replica)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: no rate limits and no in-flight caps (the connection bounds stay).")
    per_user: UserLimits = Field(
        default_factory=UserLimits,
        description="Each user's buckets (whatever key acts for the user): chats (and text completions), writes "
        "(memory adds, updates, deletes), reads (everything else).",
    )
    per_key: KeyLimits = Field(default_factory=KeyLimits, description="Each key of several users: its own buckets.")
    max_engine_requests_per_key: int = Field(
        1,
        ge=1,
        description="Chats and completions of a key of one user running at once (their answers not yet given); more: "
        "429. One on the 2-core CPU service, whose engine answers one or two short chats a second in all: two of one "
        "user's chats at once made another user's twice as slow (docs/hostile.md); config.gpu.yaml: 8.",
    )
    max_engine_requests_per_shared_key: int = Field(
        8, ge=1, description="The same for a key of several users (an application's backend), in all; config.gpu.yaml: 64."
    )
    max_writes_per_key: int = Field(
        4, ge=1, description="Memory writes of one key running at once (an add extracts or queues encodes); more: 429."
    )
    refusal_hold_s: float = Field(
        1.0,
        ge=0,
        le=10,
        description="A key that calls again before the Retry-After it was given has its next refusal answered only "
        "after this long at most (or when Retry-After runs out, if sooner), so a client that ignores Retry-After "
        "is paced instead of costing the service a request per round trip (such a call also costs a token). 0: "
        "always answer at once.",
    )
    max_held_per_key: int = Field(
        8, ge=0, description="Refusals of one key held at once (refusal_hold_s); past it, refused at once with Connection: close."
    )
    sync_interval_s: float = Field(
        1.0,
        gt=0,
        description="With several ingress processes, each reports the keys it admitted to Redis this often and learns in "
        "how many processes each key is active; a key active in n processes gets 1/n of its rates and caps in each "
        "(one Redis round trip per interval, none per request). One ingress process: no Redis at all.",
    )


class ProxySettings(BaseSettings):
    """Connection bounds in Serve's HTTP proxy (uvicorn), which Ray Serve 2.60 does not expose.

    From the environment only (KVMEM_PROXY_HEADER_TIMEOUT_S, ...), in the proxy process that
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=serve_app.ingress.proxy_guard:install loads
    (scripts/serve.sh, k8s/rayservice.yaml). Idle keep-alive is Serve's own http_options.keep_alive_timeout_s."""

    model_config = SettingsConfigDict(env_prefix="KVMEM_PROXY_", extra="ignore")

    header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds from a connection's first byte of a request (or its opening) to the end of its headers; past it: 408, closed."
    )
    max_header_bytes: int = Field(
        65_536, ge=1024, description="Bytes of a request line and headers; past it: 431, closed (uvicorn's httptools parser has no bound)."
    )
    max_connections_per_client: int = Field(
        128, ge=1, description="Open connections from one client address; a connection past it is answered 429 and closed."
    )
