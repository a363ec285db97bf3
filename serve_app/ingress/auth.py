"""Who may do what: API keys, OpenAI style (`Authorization: Bearer <key>`), checked by the ingress.

Each key is bound to the user ids it may act for, or to all of them (an admin key); the keys
themselves live in Redis by hash (memory.key_store). `auth.mode` (serve_app.settings.AuthSettings):
`keys` (the KubeRay manifests: an admin key comes from a Secret as KVMEM_AUTH__ADMIN_KEY) or
`off` (the embedded default: every caller acts as admin, so the service must listen on loopback
only, and says so when it starts). 401 without a valid key, 403 for another user's id; fact-id
routes answer "not yours" with the same 404 as "does not exist" (serve_app.ingress.routes).

The settings admin key is compared with the presented key in constant time and never written to
Redis, so rotating the Secret (and restarting) retires the old key. Copies of it that earlier
versions stored in Redis are revoked once per process, before the first key is looked up
(memory.key_store.KeyStore.revoke_settings_copies). The key is checked before the request's body
is read: serve_app.ingress.gate calls `principal` from the raw Authorization header.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from memory.key_store import SETTINGS_COPY_LABEL, KeyRecord, KeyStore, Principal
from memory.records import StoreUnavailable
from serve_app.protocol import MAX_ID_CHARS
from serve_app.settings import AuthSettings

logger = logging.getLogger(__name__)

ANONYMOUS_ADMIN = Principal(key_id="auth-off", users=None)
SETTINGS_ADMIN = Principal(key_id="admin-settings", users=None)  # stored keys' ids are key_<hex>

__all__ = [
    "ANONYMOUS_ADMIN", "SETTINGS_ADMIN", "Authenticator", "KeyRecord", "KeyStore", "NewKeyRequest", "Principal", "caller",
]

bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer kvm-...` (auth.mode keys).")


class Authenticator:
    """Turns a request's bearer key into a Principal, or an HTTP error."""

    def __init__(self, settings: AuthSettings, keys: KeyStore) -> None:
        self.settings = settings
        self.keys = keys
        secret = settings.admin_key.get_secret_value() if settings.admin_key is not None else ""
        self._admin_key = secret.encode()
        self._copies_revoked = False
        self._revoking = asyncio.Lock()
        if settings.mode == "off":
            logger.warning(
                "auth.mode is off: every client may act for every user. Serve on loopback only "
                "(http_options.host: 127.0.0.1); set auth.mode: keys anywhere else."
            )

    async def principal(self, key: str | None) -> Principal:
        """Who the caller with bearer `key` is: 401 without a valid key, 503 while the key store
        cannot answer (the settings admin key is known without it)."""
        if self.settings.mode == "off":
            return ANONYMOUS_ADMIN
        unauthorized = HTTPException(401, "a valid API key is required (Authorization: Bearer ...)", {"WWW-Authenticate": "Bearer"})
        if not key:
            raise unauthorized
        if self._admin_key and hmac.compare_digest(key.encode(), self._admin_key):
            return SETTINGS_ADMIN
        try:
            await self._revoke_settings_copies()
            principal = await self.keys.principal(key)
        except StoreUnavailable as exc:
            raise HTTPException(503, str(exc), {"Retry-After": "5"}) from exc
        if principal is None:
            raise unauthorized
        return principal

    async def _revoke_settings_copies(self) -> None:
        """Once per process: the settings admin key copies earlier versions stored (so that a
        rotated-away key is not found in the store)."""
        if self._copies_revoked:
            return
        async with self._revoking:
            if not self._copies_revoked:
                revoked = await self.keys.revoke_settings_copies()
                if revoked:
                    logger.warning("revoked %d stored copies of a settings admin key (written by an earlier version)", revoked)
                self._copies_revoked = True

    @staticmethod
    def require_user(principal: Principal, user_id: str) -> None:
        if not principal.may_act_for(user_id):
            raise HTTPException(403, f"this API key may not act for user {user_id!r}")

    @staticmethod
    def require_admin(principal: Principal) -> None:
        if not principal.is_admin:
            raise HTTPException(403, "this route needs an admin API key")


def caller(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    """The Principal the RequestGate admitted (`bearer` only documents the scheme in OpenAPI)."""
    principal = getattr(request.state, "principal", None)
    if not isinstance(principal, Principal):  # the gate did not run: refuse, never admit
        raise HTTPException(401, "a valid API key is required (Authorization: Bearer ...)", {"WWW-Authenticate": "Bearer"})
    return principal


UserId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


class NewKeyRequest(BaseModel):
    """Exactly one kind of key: `{"admin": true}`, or `{"users": [...]}` with at least one user.
    Unknown fields are refused by name (a misspelt `user` once minted an admin key)."""

    model_config = ConfigDict(extra="forbid")

    users: list[UserId] | None = Field(None, min_length=1, max_length=1000, description="User ids the key may act for.")
    admin: StrictBool = Field(False, description="true: a key that acts for every user (then no `users`).")
    label: str = Field("", max_length=256, description="A note to recognise the key by.")

    @model_validator(mode="after")
    def one_kind(self) -> "NewKeyRequest":
        if self.admin and self.users is not None:
            raise ValueError("an admin key acts for every user: give `admin: true` or `users`, not both")
        if not self.admin and self.users is None:
            raise ValueError("give `users` (a non-empty list of user ids) or `admin: true`")
        if self.label == SETTINGS_COPY_LABEL:
            raise ValueError(f"the label {SETTINGS_COPY_LABEL!r} is reserved")
        return self
