"""Settings of the service: ports, ingress, run directory, Ray, API keys and tenants, per-key
quotas, shutdown; and the rule that an exposed service is never open by accident
(`check_exposure`)."""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from serve_rft.config.base import StrictSection


def _env_list(name: str) -> list[str]:
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]


DEFAULT_TENANT = "default"
"""The tenant of the flat key lists (``api_keys``, ``reward_keys``), of admin keys' own
completions and of a service without keys: its ids are stored unprefixed."""
TENANT_NAME = r"[A-Za-z0-9_.-]{1,64}"
"""A tenant's name, matched whole (`re.fullmatch`): 1-64 letters, digits, ``_ . -`` (it becomes part
of Redis keys and group ids)."""


def _env_tenants() -> dict:
    """``SERVE_RFT_TENANTS``: a JSON object name -> {"api_keys": [...], "reward_keys": [...]}."""
    raw = os.environ.get("SERVE_RFT_TENANTS", "").strip()
    return json.loads(raw) if raw else {}


class ScopeQuota(StrictSection):
    """One scope's per-key token buckets (`serve_rft.buffer.quota`): a request takes one request
    token and its body's bytes in byte tokens; a key short of either gets 429 with Retry-After.
    A rate of 0 leaves that dimension unlimited."""

    requests_per_s: float = Field(
        0.0, ge=0, le=1e6, description="Requests per second one key may make on this scope's routes, "
        "sustained (the bucket's refill rate); 0: unlimited.")
    request_burst: int = Field(
        0, ge=0, le=10_000_000, description="Requests one key may make at once after idling (the "
        "bucket's size); 0: one second's worth, ceil(requests_per_s).")
    bytes_per_s: float = Field(
        0.0, ge=0, le=1e12, description="Request-body bytes per second one key may send to this "
        "scope's routes, sustained; 0: unlimited.")
    bytes_burst: int = Field(
        0, ge=0, le=2**40, description="Request-body bytes one key may send at once after idling, bytes; "
        "0: one second's worth, ceil(bytes_per_s). A single body larger than this is refused (413, "
        "code body_over_quota), so keep it at least the largest body a client needs (at most 8 MiB "
        "is accepted at all).")

    @property
    def limited(self) -> bool:
        """Whether either dimension has a limit."""
        return self.requests_per_s > 0 or self.bytes_per_s > 0

    @property
    def request_capacity(self) -> int:
        """The request bucket's size: ``request_burst``, or one second's worth when 0."""
        return self.request_burst or max(1, math.ceil(self.requests_per_s))

    @property
    def bytes_capacity(self) -> int:
        """The byte bucket's size: ``bytes_burst``, or one second's worth when 0, bytes."""
        return self.bytes_burst or max(1, math.ceil(self.bytes_per_s))


class CostQuota(StrictSection):
    """What one caller may hold of the engines (`serve_rft.buffer.usage`): requests in flight at
    once, and a token budget a request takes up front (its prompt's tokens, estimated by its body
    bytes, plus ``n x max_tokens``) and gets back at its end for what it did not use. 0: that
    dimension is unlimited. Applies to chat and completions."""

    max_in_flight: int = Field(
        0, ge=0, le=1_000_000, description="Chat and completion requests in flight at once (streams "
        "included, until they end); one more gets 429 code in_flight_limit_exceeded; 0: unlimited.")
    tokens_per_s: float = Field(
        0.0, ge=0, le=1e9, description="Tokens per second (prompt + generated), sustained: the token "
        "budget's refill rate; 0: unlimited.")
    tokens_burst: int = Field(
        0, ge=0, le=2**40, description="The token budget's size, tokens; 0: one minute's worth, "
        "ceil(60 x tokens_per_s). A request whose up-front cost exceeds it is refused (413, code "
        "tokens_over_quota): lower n or max_tokens.")

    @property
    def limited(self) -> bool:
        """Whether either dimension has a limit."""
        return self.max_in_flight > 0 or self.tokens_per_s > 0

    @property
    def tokens_capacity(self) -> int:
        """The token budget's size: ``tokens_burst``, or one minute's worth when 0, tokens."""
        return self.tokens_burst or max(1, math.ceil(60 * self.tokens_per_s))


class TenantQuota(CostQuota):
    """`CostQuota` for all keys of one tenant together, and the bytes its experiences, records and
    reward infos may keep in the store (`serve_rft.buffer.usage`)."""

    max_stored_bytes: int = Field(
        0, ge=0, le=2**44, description="Bytes the tenant's experiences, completion records and reward "
        "infos may keep in the store at once, bytes (serve_rft_tenant_stored_bytes); at it, the tenant's "
        "chat, completions and rewards get 429 code storage_quota_exceeded with Retry-After until some "
        "expire; other tenants are unaffected; 0: unlimited.")

    @property
    def limited(self) -> bool:
        return super().limited or self.max_stored_bytes > 0


class TenantKeys(StrictSection):
    """The keys of one tenant: its inference keys and its reward keys (a grader's)."""

    api_keys: list[str] = Field(default_factory=list, repr=False, description="The tenant's inference keys.")
    reward_keys: list[str] = Field(default_factory=list, repr=False, description="The tenant's reward keys: "
                                   "POST /v1/rewards and GET /v1/experiences/{id} of its own completions.")
    quota: TenantQuota | None = Field(None, description="This tenant's own limits, all its keys together "
                                      "(default: service.quotas.per_tenant).")
    key_quota: CostQuota | None = Field(None, description="The limits of each key of this tenant (default: "
                                        "service.quotas.per_key).")
    scope_quotas: dict[Literal["inference", "rewards", "admin"], ScopeQuota] = Field(
        default_factory=dict, description="The request and byte buckets of each key of this tenant, by "
        "scope (default: service.quotas.inference / rewards / admin).")


class QuotasConfig(StrictSection):
    """Per-key quotas by the scope of the route (`serve_rft.explorer.http.auth`): a key's chat,
    completions and models requests draw on its inference buckets, its rewards on its rewards
    buckets, whatever key kind sends them (an admin key chatting is held to the inference quota).
    Buckets live in the store's Redis, shared by every replica. Off by default (every rate 0):
    a fitting rate depends on the deployment (replicas, GPUs, clients), and the demo, load tests
    and benchmarks must never be throttled by a default. Quotas apply only with keys configured:
    without keys there is no caller identity (and the service binds loopback only)."""

    inference: ScopeQuota = Field(default_factory=ScopeQuota, description="Chat, completions, "
                                  "responses and models routes, per key.")
    rewards: ScopeQuota = Field(default_factory=ScopeQuota, description="POST /v1/rewards and "
                                "GET /v1/experiences/{id}, per key.")
    admin: ScopeQuota = Field(default_factory=ScopeQuota, description="Admin routes (status, "
                              "sync operations, API document), per key; unlimited by default.")
    per_key: CostQuota = Field(default_factory=CostQuota, description="Requests in flight and token "
                               "budget of each key (chat and completions); unlimited by default.")
    per_tenant: TenantQuota = Field(default_factory=TenantQuota, description="Requests in flight, token "
                                    "budget and stored bytes of each tenant, all its keys together; "
                                    "unlimited by default.")
    lease_s: float = Field(
        60.0, ge=5.0, le=3600.0, description="A request in flight holds its slot by a lease its replica "
        "renews every lease_s / 3 while it runs; a replica that dies leaves its slots taken at most this "
        "long, s.")
    timeout_s: float = Field(
        1.0, gt=0, le=5.0, description="Bound of one quota check's wait for a free connection (the "
        "replica keeps explorer.max_ongoing_requests; none free in time: 429 quota_check_busy) and of its "
        "Redis call, s. Past it (or with Redis unreachable) each key is held to this replica's share of "
        "its quota from memory for a second (counted: serve_rft_quota_unchecked_total). A replica starved "
        "of CPU (loading weights beside its engine on a small machine) delays its own checks by hundreds of "
        "milliseconds while Redis answers at once, so a bound much under a second refuses callers who are "
        "within their quota.")

    def scope(self, name: str) -> ScopeQuota:
        """The quota of scope ``name`` (inference / rewards / admin)."""
        return getattr(self, name)

    def stores_limited(self, tenants: dict) -> bool:
        """Whether any tenant's stored bytes are limited (``per_tenant`` or a tenant's own
        ``quota``, of ``service.tenants``): the store keeps the tenants' ledger then."""
        own = [t.quota.max_stored_bytes for t in tenants.values() if t.quota is not None]
        return bool(self.per_tenant.max_stored_bytes or any(own))

    @property
    def limited(self) -> bool:
        """Whether any scope has a limit."""
        return (self.inference.limited or self.rewards.limited or self.admin.limited
                or self.per_key.limited or self.per_tenant.limited)


class ServiceConfig(StrictSection):
    # keys are secrets: a refused config's error never echoes them, nor does a repr (repr=False)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    host: str = Field("127.0.0.1", description="Address the HTTP front door binds (serve-rft up). A "
                      "non-loopback address needs keys (api_keys / reward_keys / admin_keys / tenants) or "
                      "allow_unauthenticated: true.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy", description="Front door of a locally started Ray: haproxy = Ray Serve's HAProxy "
        "mode (requests go straight to a replica's own HTTP server; a draining replica's refusals are "
        "retried elsewhere), proxy = Ray Serve's Python proxy with DrainAwareRouter. A joined "
        "cluster keeps the mode it was started with (serve_rft/service/ingress.py).")
    run_dir: str = Field("runs/default", description="Checkpoints, redis data and logs live here.")
    ray_address: str | None = Field(None, description="Existing Ray cluster. None: start one.")
    ray_num_cpus: int = Field(8, ge=1, description="Logical CPUs of a locally started Ray.")
    shutdown_grace_s: float = Field(
        60.0, gt=0, le=3600, description="After SIGINT / SIGTERM / SIGHUP, how long the service gets to stop "
        "(Serve drains, redis-server flushes) before the keeper of `serve-rft up` / `demo` ends its "
        "processes with SIGKILL; a second signal ends them at once, s (serve_rft/service/keeper.py). "
        "Above a replica's graceful_shutdown_timeout_s (30 s, serve_rft/service/app.py), so requests "
        "in flight can finish, plus Ray's and redis-server's stop.")
    metrics_port: int = Field(
        8080, ge=0, le=65535, description="Prometheus endpoint (/metrics) of a locally started Ray "
        "(Ray's metrics export port; 0 picks a free one). A joined cluster keeps its own.")
    api_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_API_KEYS"), repr=False,
        description="Inference keys (env SERVE_RFT_API_KEYS, comma-separated) of the tenant 'default': "
        "chat, completions, models. No keys of any kind: no auth (loopback only, see allow_unauthenticated).")
    reward_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_REWARD_KEYS"), repr=False,
        description="Reward keys (env SERVE_RFT_REWARD_KEYS): POST /v1/rewards and GET "
        "/v1/experiences/{id} of the default tenant's completions, nothing else.")
    admin_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_ADMIN_KEYS"), repr=False,
        description="Admin keys (env SERVE_RFT_ADMIN_KEYS): every route (rewards, experiences, "
        "status, sync operations, /docs and /openapi.json) and inference too.")
    tenants: dict[str, TenantKeys] = Field(
        default_factory=_env_tenants, validate_default=True,
        description="Tenants (env SERVE_RFT_TENANTS as JSON): name -> {api_keys, reward_keys}. A tenant's "
        "keys reach only its own completions (rewards and experience reads of another tenant's get "
        "404), its group_id / conversation_id values are its own, and its prompts never share the "
        "prefix cache with another tenant. The flat api_keys / reward_keys belong to the tenant "
        "'default'; admin keys belong to none and reach every tenant. A key may belong to one tenant "
        "only, and an admin key to no tenant.")
    allow_unauthenticated: bool = Field(
        False, description="Serve with no keys on a non-loopback address (anyone who reaches the port "
        "may chat, post rewards, pin, roll back and read every experience). Without it such a start "
        "is refused; with it every start logs a warning.")
    quotas: QuotasConfig = Field(
        default_factory=QuotasConfig, description="Per-key token-bucket quotas (requests and bytes) "
        "per scope, answered with 429 + Retry-After; off by default (QuotasConfig).")

    @property
    def has_keys(self) -> bool:
        """Whether any key of any scope is configured (auth is on)."""
        return any(k for k in (*self.api_keys, *self.reward_keys, *self.admin_keys,
                               *(k for t in self.tenants.values() for k in (*t.api_keys, *t.reward_keys))))

    def tenant_keys(self) -> dict[str, TenantKeys]:
        """Every tenant's keys: ``tenants`` with the flat lists joined to `DEFAULT_TENANT`."""
        out = dict(self.tenants)
        flat = out.get(DEFAULT_TENANT, TenantKeys())
        out[DEFAULT_TENANT] = TenantKeys(api_keys=[*self.api_keys, *flat.api_keys],
                                         reward_keys=[*self.reward_keys, *flat.reward_keys])
        return out

    @model_validator(mode="after")
    def _one_owner_per_key(self) -> "ServiceConfig":
        # a key in two tenants would reach both tenants' completions; an admin key listed as a
        # tenant's too would be both every tenant's and one tenant's
        owner: dict[str, str] = {k: "admin_keys" for k in self.admin_keys if k}
        for name, keys in self.tenant_keys().items():
            if not re.fullmatch(TENANT_NAME, name):
                raise ValueError(f"service.tenants: tenant name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
            for k in {*keys.api_keys, *keys.reward_keys} - {""}:
                if owner.setdefault(k, f"tenant {name!r}") != f"tenant {name!r}":
                    raise ValueError(f"a key of tenant {name!r} is also in {owner[k]}: a key belongs to one "
                                     "tenant, an admin key to none (keys are not shown)")
        return self


def is_loopback(host: str | None) -> bool:
    """Whether an HTTP server bound to ``host`` is reachable from this machine only:
    127.0.0.0/8, ::1 or ``localhost``. ``0.0.0.0``, ``::``, an empty or None host (every
    interface) and any other name or address are not."""
    if not host:
        return False
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(service: ServiceConfig, host: str | None) -> str | None:
    """Fail closed: refuse to serve on ``host`` (the address the HTTP servers actually bind)
    when it is not loopback and no key is configured, unless ``service.allow_unauthenticated``.

    Returns:
        None, or the warning to log at this start (exposed and open by explicit choice).
    Raises:
        ValueError: exposed with no keys and no ``allow_unauthenticated`` (a one-line message).
    """
    if service.has_keys or is_loopback(host):
        return None
    if not service.allow_unauthenticated:
        raise ValueError(
            f"refusing to serve on {host or 'every interface'} with no API keys: set SERVE_RFT_API_KEYS / "
            "SERVE_RFT_REWARD_KEYS / SERVE_RFT_ADMIN_KEYS / SERVE_RFT_TENANTS (or service.*_keys, "
            "service.tenants), bind 127.0.0.1, or set "
            "service.allow_unauthenticated=true to serve openly on purpose")
    return (f"SERVING WITHOUT AUTHENTICATION on {host or 'every interface'} "
            "(service.allow_unauthenticated=true): anyone who reaches this port may chat, post rewards, "
            "pin, roll back, drain and read every experience")
