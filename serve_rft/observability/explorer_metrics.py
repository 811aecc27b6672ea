"""Explorer replica metrics: requests, latency, tokens, experiences, rewards.

Owned by each `ExplorerReplica`; exported through Ray's metrics API (Ray's Prometheus endpoint,
names prefixed ``ray_``). Tags are low-cardinality: the replica id (a handful), the route
(chat / chat_stream / rewards), the HTTP status, the token kind, the quota scope and limit (never
the API key or its hash). The store's experience counts are the synchronizer's
(`serve_rft.observability.store_metrics`): every replica reads the same store. The policy
version is not a tag (it grows without bound): it is the `serve_rft_replica_policy_version` gauge
(`serve_rft.observability.sync_metrics`), and each response carries it in a header.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Histogram

from serve_rft.observability.held import Gauge

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class ExplorerMetrics:
    """Counters and histograms of one replica (all tagged with its id)."""

    def __init__(self, replica_id: str):
        self.tags = {"replica": replica_id}
        self.requests = Counter("serve_rft_requests_total", description="HTTP requests answered.",
                                tag_keys=("replica", "route", "status"))
        self.latency = Histogram("serve_rft_request_seconds", description="End-to-end request latency, s.",
                                 boundaries=LATENCY_BUCKETS, tag_keys=("replica", "route"))
        self.ttft = Histogram("serve_rft_time_to_first_token_seconds",
                              description="Streaming: request arrival to the first content chunk, s.",
                              boundaries=LATENCY_BUCKETS, tag_keys=("replica",))
        self.tokens = Counter("serve_rft_tokens_total", description="Prompt and completion tokens served.",
                              tag_keys=("replica", "kind"))
        self.logged = Counter("serve_rft_experiences_logged_total",
                              description="Experiences written to the store.", tag_keys=("replica",))
        self.unlogged = Counter("serve_rft_experiences_unlogged_total",
                                description="Choices served and not logged, by reason (store_false: the "
                                "client's store=false; store_full: Redis past maxmemory; "
                                "store_unavailable: Redis away longer than buffer.store_wait_s).",
                                tag_keys=("replica", "reason"))
        self.rewards = Counter("serve_rft_rewards_total", description="Rewards posted, by result.",
                               tag_keys=("replica", "result"))
        self.tenant_bytes = Gauge("serve_rft_tenant_stored_bytes",
                                  description="Bytes each tenant's experiences, completion records and "
                                  "reward infos keep in the store (serve_rft.buffer.ledger; each replica "
                                  "reports the same store: aggregate with max by (tenant)).",
                                  tag_keys=("replica", "tenant"))
        self.throttled = Counter("serve_rft_throttled_total",
                                 description="Requests refused by a per-key quota (429, or 413 for a "
                                 "body over the byte burst), by scope (inference / rewards / admin) "
                                 "and limit (requests / bytes; busy: no quota connection free in time; "
                                 "key_in_flight / tenant_in_flight / key_tokens / tenant_tokens: what a "
                                 "request costs; tenant_storage: the tenant's stored bytes).",
                                 tag_keys=("replica", "scope", "limit"))
        self.quota_unchecked = Counter("serve_rft_quota_unchecked_total",
                                       description="Requests not checked against the shared buckets "
                                       "because Redis was unreachable or slow: held to the replica's "
                                       "in-memory share of the quota instead, by scope.",
                                       tag_keys=("replica", "scope"))

    def request(self, route: str, status: int, seconds: float) -> None:
        """One HTTP request answered on ``route`` with ``status`` after ``seconds`` (latency
        observed for answers below 400)."""
        self.requests.inc(tags={**self.tags, "route": route, "status": str(status)})
        if status < 400:
            self.latency.observe(seconds, tags={**self.tags, "route": route})

    def quota(self, scope: str, limit: str | None) -> None:
        """A quota refusal on ``scope`` by ``limit`` (requests / bytes / busy); None: a request
        decided by the replica's share (Redis away)."""
        if limit is None:
            self.quota_unchecked.inc(tags={**self.tags, "scope": scope})
        else:
            self.throttled.inc(tags={**self.tags, "scope": scope, "limit": limit})

    def first_token(self, seconds: float) -> None:
        """A stream's time to its first content chunk, s."""
        self.ttft.observe(seconds, tags=self.tags)

    def served(self, prompt_tokens: int, completion_tokens: int, experiences: int, unlogged: int = 0,
               reason: str = "store_false") -> None:
        """Tokens of one completion; ``experiences`` logged, ``unlogged`` served and not logged
        (``reason``: store_false, or store_full under backpressure)."""
        if unlogged:
            self.unlogged.inc(unlogged, tags={**self.tags, "reason": reason})
        self.tokens.inc(prompt_tokens, tags={**self.tags, "kind": "prompt"})
        if completion_tokens:
            self.tokens.inc(completion_tokens, tags={**self.tags, "kind": "completion"})
        if experiences:
            self.logged.inc(experiences, tags=self.tags)

    def reward_results(self, results: list[dict]) -> None:
        """Count each reward's result (``status``: recorded / duplicate / refused ...)."""
        for r in results:
            self.rewards.inc(tags={**self.tags, "result": str(r.get("status", "unknown"))})

    def stored_bytes(self, tenants: dict) -> None:
        """Set the stored-bytes gauge from `serve_rft.buffer.store.ExperienceStore.tenant_bytes`
        (a tenant that keeps nothing is reported 0)."""
        for tenant, kept in tenants.items():
            self.tenant_bytes.set(float(kept.bytes), tags={**self.tags, "tenant": tenant})
