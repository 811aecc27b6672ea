"""API keys and their scopes. Three kinds of key (`serve_rft.config.service.ServiceConfig`;
env ``SERVE_RFT_API_KEYS`` / ``SERVE_RFT_REWARD_KEYS`` / ``SERVE_RFT_ADMIN_KEYS``,
comma-separated); clients send ``Authorization: Bearer <key>`` (what the openai SDK sends).

============  ===================================================================
scope         paths
============  ===================================================================
(open)        ``/health``
inference     ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
              ``/v1/models[/{id}]``
rewards       ``/v1/rewards``
admin         everything else: experiences, status, ``/v1/sync/*`` (pin, rollback,
              promotion, drain), ``/docs``, ``/redoc``, ``/openapi.json``
============  ===================================================================

An inference key has the inference scope, a reward key the rewards scope, an admin key every
scope. With no key configured the service is open (it then binds loopback only unless told
otherwise: `serve_rft.config.service.check_exposure`). With keys: no key, a malformed header or
an unknown key gets 401 (code ``invalid_api_key``); a known key without the path's scope gets
403 (code ``insufficient_scope``, RFC 6750 §3.1: "The request requires higher privileges than
provided by the access token", answered with 403; OpenAI's own answer to a restricted key
lacking a scope says "You have insufficient permissions for this operation. Missing scopes: ...").
Keys are compared with `hmac.compare_digest` (no timing hint of how much of a key matched).
"""

from __future__ import annotations

import hmac
from typing import Iterable

from serve_rft.explorer.protocol import ApiError

INFERENCE, REWARDS, ADMIN = "inference", "rewards", "admin"
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models")
REWARD_PATHS = ("/v1/rewards",)
OPEN_PATHS = ("/health",)


def required_scope(path: str) -> str | None:
    """The scope a request for ``path`` needs; None for an open path."""
    if path in OPEN_PATHS:
        return None
    if path in INFERENCE_PATHS or path.startswith("/v1/models/"):
        return INFERENCE
    if path in REWARD_PATHS:
        return REWARDS
    return ADMIN


class ApiKeys:
    """The configured keys and the scopes each grants.

    Args:
        inference: keys with the inference scope.
        admin: keys with every scope.
        rewards: keys with the rewards scope.
    """

    def __init__(self, inference: Iterable[str], admin: Iterable[str], rewards: Iterable[str] = ()):
        self._keys: list[tuple[bytes, frozenset[str]]] = []
        for keys, scopes in ((inference, {INFERENCE}), (rewards, {REWARDS}), (admin, {INFERENCE, REWARDS, ADMIN})):
            self._keys += [(k.encode(), frozenset(scopes)) for k in keys if k]

    @classmethod
    def from_config(cls, service) -> "ApiKeys":
        """The keys of a `serve_rft.config.service.ServiceConfig`."""
        return cls(service.api_keys, service.admin_keys, service.reward_keys)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (with none, every path is open)."""
        return bool(self._keys)

    def scopes(self, key: str) -> frozenset[str]:
        """The scopes ``key`` grants (empty: unknown). Every configured key is compared."""
        raw, granted = key.encode(), frozenset()
        for known, scopes in self._keys:
            if hmac.compare_digest(raw, known):
                granted |= scopes
        return granted

    def check(self, path: str, authorization: str | None) -> None:
        """Allow or refuse a request for ``path`` with this ``Authorization`` header.

        Raises:
            ApiError: 401 ``invalid_api_key`` (no bearer key, or an unknown one); 403
                ``insufficient_scope`` (a known key without the scope ``path`` needs).
        """
        scope = required_scope(path)
        if not self.enabled or scope is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        granted = self.scopes(key.strip())
        if not granted:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        if scope not in granted:
            takes = {INFERENCE: "an inference or an admin key", REWARDS: "a reward or an admin key",
                     ADMIN: "an admin key"}[scope]
            raise ApiError(403, f"You have insufficient permissions for this operation. Missing scope: "
                           f"{scope} ({path} takes {takes})", code="insufficient_scope")
