"""API keys and their scopes. Three kinds of key (`serve_rft.config.service.ServiceConfig`;
env ``SERVE_RFT_API_KEYS`` / ``SERVE_RFT_REWARD_KEYS`` / ``SERVE_RFT_ADMIN_KEYS``,
comma-separated); clients send ``Authorization: Bearer <key>`` (what the openai SDK sends).

============  ===================================================================
scope         paths
============  ===================================================================
(open)        ``/health``
inference     ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
              ``/v1/models[/{id}]``
rewards       ``/v1/rewards``, ``/v1/experiences/{id}``
admin         everything else: status, ``/v1/sync/*`` (pin, rollback, promotion,
              drain), ``/docs``, ``/redoc``, ``/openapi.json``
============  ===================================================================

Tenants: every inference and reward key belongs to one tenant (``service.tenants``; the flat
``api_keys`` / ``reward_keys`` to `DEFAULT_TENANT`), and `ApiKeys.check` returns the caller's
`Identity`. A tenant's keys reach only its own completions: a reward or an experience read of
another tenant's completion is answered 404, as for one that does not exist (RFC 9110 §15.5.4, 403
Forbidden: "An origin server that wishes to 'hide' the current existence of a forbidden target
resource MAY instead respond with a status code of 404 (Not Found)"). A ``group_id`` or
``conversation_id`` belongs to the key that sent it (`Identity.owner`,
`serve_rft.buffer.records.client_group`): no other key, of its tenant or not, joins, sizes or
extends it; the tenant's reward keys (and admin keys) reward it.
Admin keys belong to no tenant and reach every completion; what an admin key (or anyone, with no
keys) generates belongs to `DEFAULT_TENANT`.

An inference key has the inference scope, a reward key the rewards scope (its tenant's rewards and
experience reads), an admin key every scope. With no key configured the service is open (it then
binds loopback only unless told otherwise: `serve_rft.config.service.check_exposure`). With keys:
no key, a malformed header or an unknown key gets 401 (code ``invalid_api_key``); a known key
without the path's scope gets 403 (code ``insufficient_scope``, RFC 6750 §3.1: "The request
requires higher privileges than provided by the access token", answered with 403; OpenAI's own
answer to a restricted key lacking a scope says "You have insufficient permissions for this
operation. Missing scopes: ..."). Keys are compared with `hmac.compare_digest` (no timing hint
of how much of a key matched).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Iterable, Mapping

from serve_rft.buffer.quota import key_identity
from serve_rft.config.service import DEFAULT_TENANT
from serve_rft.explorer.http.protocol import ApiError

INFERENCE, REWARDS, ADMIN = "inference", "rewards", "admin"
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models")
REWARD_PATHS = ("/v1/rewards",)
EXPERIENCE_PREFIX = "/v1/experiences/"
OPEN_PATHS = ("/health",)


def required_scope(path: str) -> str | None:
    """The scope a request for ``path`` needs; None for an open path."""
    if path in OPEN_PATHS:
        return None
    if path in INFERENCE_PATHS or path.startswith("/v1/models/"):
        return INFERENCE
    if path in REWARD_PATHS or (path.startswith(EXPERIENCE_PREFIX) and "/" not in path[len(EXPERIENCE_PREFIX):]):
        return REWARDS
    return ADMIN


@dataclass(frozen=True)
class Identity:
    """Who sent a request.

    Attributes:
        tenant: the tenant whose namespace the request's ids (completions it generates, its
            ``group_id`` / ``conversation_id``) belong to: the key's tenant; `DEFAULT_TENANT`
            for an admin key and for a service without keys.
        scopes: the scopes the key grants.
        owner: the key's `key_identity` (a SHA-256 prefix, never the key): the namespace of the
            ``group_id`` / ``conversation_id`` values it sends within its tenant's; '' without keys.
    """

    tenant: str
    scopes: frozenset[str]
    owner: str = ""

    @property
    def admin(self) -> bool:
        """Whether it reaches every tenant's completions (an admin key, or no keys configured)."""
        return ADMIN in self.scopes

    def reaches(self, owner: str | None) -> bool:
        """Whether it may reward or read a completion of tenant ``owner`` (None: unknown)."""
        return owner is not None and (self.admin or owner == self.tenant)

    @property
    def owner_filter(self) -> str | None:
        """The tenant a store call must check a completion against (None: any, for an admin)."""
        return None if self.admin else self.tenant


OPEN = Identity(DEFAULT_TENANT, frozenset({INFERENCE, REWARDS, ADMIN}))
"""The caller of a service without keys (or of an open path): every scope, the default tenant."""


def identity_of(request) -> Identity:
    """The `Identity` the key check stored on ``request`` (`serve_rft.explorer.http.app.authorize`)."""
    return request.state.identity


class ApiKeys:
    """The configured keys, the scopes each grants and the tenant each belongs to.

    Args:
        inference: keys with the inference scope (tenant `DEFAULT_TENANT`).
        admin: keys with every scope (no tenant: they reach every tenant).
        rewards: keys with the rewards scope (tenant `DEFAULT_TENANT`).
        tenants: more tenants: name -> (inference keys, reward keys).
    Raises:
        ValueError: a key in two tenants, or an admin key that is also a tenant's.
    """

    def __init__(self, inference: Iterable[str], admin: Iterable[str], rewards: Iterable[str] = (),
                 tenants: Mapping[str, tuple[Iterable[str], Iterable[str]]] | None = None):
        self._keys: list[tuple[bytes, frozenset[str], str]] = []
        owner: dict[bytes, str] = {}
        groups = [(DEFAULT_TENANT, inference, rewards), *((t, i, r) for t, (i, r) in (tenants or {}).items())]
        entries = [(k, {INFERENCE}, t) for t, i, _ in groups for k in i]
        entries += [(k, {REWARDS}, t) for t, _, r in groups for k in r]
        entries += [(k, {INFERENCE, REWARDS, ADMIN}, "") for k in admin]
        for key, scopes, tenant in entries:
            if not key:
                continue
            raw = key.encode()
            if owner.setdefault(raw, tenant) != tenant:
                raise ValueError("a key belongs to two tenants, or is an admin key and a tenant's: "
                                 "each key belongs to one tenant, an admin key to none")
            self._keys.append((raw, frozenset(scopes), tenant))

    @classmethod
    def from_config(cls, service) -> "ApiKeys":
        """The keys of a `serve_rft.config.service.ServiceConfig` (its tenants included)."""
        tenants = {name: (t.api_keys, t.reward_keys) for name, t in service.tenants.items()}
        extra = tenants.pop(DEFAULT_TENANT, ((), ()))
        return cls([*service.api_keys, *extra[0]], service.admin_keys, [*service.reward_keys, *extra[1]], tenants)

    def tenant_names(self) -> list[str]:
        """Every tenant a configured key belongs to (the default tenant always: admin keys and a
        service without keys log to it), sorted."""
        return sorted({t or DEFAULT_TENANT for _, _, t in self._keys} | {DEFAULT_TENANT})

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (with none, every path is open)."""
        return bool(self._keys)

    def identify(self, key: str) -> Identity | None:
        """The identity of ``key`` (None: unknown). Every configured key is compared."""
        raw, granted, tenant = key.encode(), frozenset(), None
        for known, scopes, owner in self._keys:
            if hmac.compare_digest(raw, known):
                granted |= scopes
                tenant = owner
        if tenant is None:
            return None
        return Identity(tenant or DEFAULT_TENANT, granted, key_identity(key))

    def scopes(self, key: str) -> frozenset[str]:
        """The scopes ``key`` grants (empty: unknown)."""
        found = self.identify(key)
        return found.scopes if found is not None else frozenset()

    def check(self, path: str, authorization: str | None) -> Identity:
        """Allow or refuse a request for ``path`` with this ``Authorization`` header.

        Returns:
            The caller's `Identity` (`OPEN` for an open path or a service without keys).
        Raises:
            ApiError: 401 ``invalid_api_key`` (no bearer key, or an unknown one); 403
                ``insufficient_scope`` (a known key without the scope ``path`` needs).
        """
        scope = required_scope(path)
        if not self.enabled or scope is None:
            return OPEN
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        found = self.identify(key.strip())
        if found is None:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        if scope not in found.scopes:
            takes = {INFERENCE: "an inference or an admin key", REWARDS: "a reward or an admin key",
                     ADMIN: "an admin key"}[scope]
            raise ApiError(403, f"You have insufficient permissions for this operation. Missing scope: "
                           f"{scope} ({path} takes {takes})", code="insufficient_scope")
        return found
