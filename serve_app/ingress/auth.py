"""Who may do what: API keys, OpenAI style (`Authorization: Bearer <key>`), checked by the ingress.

Each key is bound to the user ids it may act for, or to all of them (an admin key); the keys
themselves live in Redis by hash (memory.key_store). `auth.mode` (serve_app.settings.AuthSettings):
`keys` (the KubeRay manifests: an admin key comes from a Secret as KVMEM_AUTH__ADMIN_KEY) or
`off` (the embedded default: every caller acts as admin, so the service must listen on loopback
only, and says so when it starts). 401 without a valid key, 403 for another user's id; fact-id
routes answer "not yours" with the same 404 as "does not exist" (serve_app.ingress.routes).
"""

from __future__ import annotations

import logging

from fastapi import HTTPException
from fastapi.security import HTTPAuthorizationCredentials

from memory.records import StoreUnavailable
from memory.key_store import KeyRecord, KeyStore, Principal
from serve_app.settings import AuthSettings

logger = logging.getLogger(__name__)

ANONYMOUS_ADMIN = Principal(key_id="auth-off", users=None)

__all__ = ["ANONYMOUS_ADMIN", "Authenticator", "KeyRecord", "KeyStore", "Principal"]


class Authenticator:
    """Turns a request's bearer credentials into a Principal, or an HTTP error."""

    def __init__(self, settings: AuthSettings, keys: KeyStore) -> None:
        self.settings = settings
        self.keys = keys
        self._admin_key_stored = settings.admin_key is None
        if settings.mode == "off":
            logger.warning(
                "auth.mode is off: every client may act for every user. Serve on loopback only "
                "(http_options.host: 127.0.0.1); set auth.mode: keys anywhere else."
            )

    async def principal(self, credentials: HTTPAuthorizationCredentials | None) -> Principal:
        """Who the caller is: 401 without a valid key, 503 while the key store cannot answer."""
        if self.settings.mode == "off":
            return ANONYMOUS_ADMIN
        unauthorized = HTTPException(401, "a valid API key is required (Authorization: Bearer ...)", {"WWW-Authenticate": "Bearer"})
        if credentials is None or not credentials.credentials:
            raise unauthorized
        try:
            if not self._admin_key_stored:
                assert self.settings.admin_key is not None
                await self.keys.create(None, label="admin (settings)", key=self.settings.admin_key.get_secret_value())
                self._admin_key_stored = True
            principal = await self.keys.principal(credentials.credentials)
        except StoreUnavailable as exc:
            raise HTTPException(503, str(exc), {"Retry-After": "5"}) from exc
        if principal is None:
            raise unauthorized
        return principal

    @staticmethod
    def require_user(principal: Principal, user_id: str) -> None:
        if not principal.may_act_for(user_id):
            raise HTTPException(403, f"this API key may not act for user {user_id!r}")

    @staticmethod
    def require_admin(principal: Principal) -> None:
        if not principal.is_admin:
            raise HTTPException(403, "this route needs an admin API key")
