"""Settings of the experience store (Redis): retention, groups, bounds, durability."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from serve_rft.config.base import StrictSection


class BufferConfig(StrictSection):
    redis_url: str | None = Field(
        None, repr=False, description="Existing Redis to use. None: start an embedded redis-server."
    )  # repr=False: the URL may carry the password; a traceback's locals never show it
    key_prefix: str = Field("srft", description="Prefix of every Redis key of this service.")
    reward_timeout_s: float = Field(
        3600.0, gt=0, description="An experience with no reward after this long expires, s."
    )
    trained_ttl_s: float = Field(
        86400.0, gt=0, description="How long a trained experience stays readable, s."
    )
    reconnect_s: float = Field(
        30.0, gt=0, description="How long a Redis command is retried across a lost connection (a "
        "Redis restart) before it fails, s.")
    group_timeout_s: float = Field(
        60.0, gt=0, description="A group with >= 2 rewarded answers is trained this long after its "
        "first reward even if other members have no reward yet, s.")
    store_wait_s: float = Field(
        5.0, gt=0, description="How long a request waits for the store (a Redis restart, an outage). "
        "Past it a chat completion is answered anyway, not logged (counted: unlogged, reason "
        "store_unavailable), a reward gets 504 + Retry-After (nothing lost: retrying is safe) and "
        "/v1/status answers with store: unavailable. Such a completion's write is abandoned (not "
        "retried when Redis returns) once no completion of its LOG batch still waits; batched with "
        "completions still waiting, it may yet be written: then it exists once and is rewardable, "
        "though counted unlogged.")
    max_ready: int | None = Field(
        100_000, ge=1, description="Bound of the ready stream (rewarded experiences waiting for the "
        "trainer). Past it the oldest entries not yet delivered to the trainer are dropped (state "
        "backlog-dropped, counted): what nothing consumes (serve-only mode, a trainer slower than the "
        "traffic) cannot grow without bound. None: unbounded.")
    reward_range: tuple[float, float] = Field(
        (-1000.0, 1000.0), description="Rewards accepted, [low, high] inclusive; a reward outside it "
        "is refused with 422 (param reward, code reward_out_of_range) before anything is written. It "
        "bounds what one client can do to training and to the per-version reward sums canary verdicts "
        "compare.")
    max_conversation_turns: int = Field(
        256, ge=1, le=100_000, description="Assistant turns one conversation_id may have (per tenant). A "
        "request that would add one more is refused with 409 (param conversation_id, code "
        "conversation_full) before anything is generated; a conversation reward reads every turn, so "
        "this bounds what one reward request costs.")
    durability: Literal["everysec", "always"] = Field(
        "always", description="Embedded redis-server's AOF fsync (appendfsync): always = the AOF is "
        "written and fsynced before every answer, so an acknowledged reward or experience survives a "
        "kill -9 of redis-server and a crash of the machine (RPO 0); everysec = fsync once a second, "
        "and while a background fsync is slow Redis may answer before it has even written the AOF "
        "(it postpones the write up to 2 s), so an acknowledged write can be lost in a crash of the "
        "machine or of redis-server itself (RPO about 2 s). Cost of always: "
        "benchmarks/results/store_throughput_durability.json.")
    maxmemory_mb: int | None = Field(
        2048, ge=16, description="Embedded redis-server's maxmemory (MiB) with noeviction: when full, new "
        "experiences are served but not logged (counted: unlogged, reason store_full) and rewards get "
        "507 + Retry-After; nothing stored is evicted. None: unbounded.")

    @model_validator(mode="after")
    def _reward_range_ordered(self) -> "BufferConfig":
        low, high = self.reward_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"buffer.reward_range={list(self.reward_range)} must be two finite numbers "
                             "[low, high] with low < high")
        return self

    @model_validator(mode="after")
    def _no_reward_outlived(self) -> "BufferConfig":
        # A rewarded member is kept reward_timeout_s + trained_ttl_s (the REWARD script); its
        # group is released at the latest reward_timeout_s after the first reward, or
        # group_timeout_s after it: past both, the member's experience could expire first.
        if self.group_timeout_s > self.reward_timeout_s:
            raise ValueError(
                f"buffer.group_timeout_s={self.group_timeout_s} must not exceed buffer.reward_timeout_s="
                f"{self.reward_timeout_s}: a group could be held past the time its members' experiences "
                "are kept, and their accepted rewards would never be trained")
        return self
