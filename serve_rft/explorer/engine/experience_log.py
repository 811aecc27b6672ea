"""Completions -> experiences in the store: what a replica logs of every answer it served.

One `Experience` per choice (prompt and response token ids, behaviour logprobs, per-token
policy versions, group, timing, sampling), written before the response ends. A completion the
store cannot take (full past ``buffer.maxmemory_mb``, or away longer than
``buffer.store_wait_s``) is still served and counted as unlogged with its reason; ``store:
false`` (OpenAI's "do not keep my data") is served and never logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from serve_rft.buffer.records import StoreFull, client_group
from serve_rft.buffer.store import ExperienceStore
from serve_rft.observability.explorer_metrics import ExplorerMetrics
from serve_rft.types import Experience, SamplingInfo

log = logging.getLogger("serve_rft.explorer")


@dataclass
class Sampled:
    """What one choice sampled: token ids, their behaviour logprobs, per-token policy-version
    spans (vLLM's weight-version labels), the finish reason.

    ``pinned``: every token comes from the version the request started on (adapter-only LoRA
    sync: a request keeps its adapter), so vLLM's version spans are ignored.
    """

    index: int
    pinned: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    version_spans: list[tuple[int, int, int]] | None = None

    def add(self, out, replace: bool = False) -> None:
        """Take a vLLM `CompletionOutput`: a delta (appended), or with ``replace`` everything so
        far (vLLM's cumulative output kind).

        Raises:
            ValueError: vLLM returned no logprob for a sampled token.
        """
        ids = list(out.token_ids)
        lps = _sampled_logprobs(ids, out.logprobs)
        if replace:
            self.token_ids, self.logprobs = ids, lps
        else:
            self.token_ids.extend(ids)
            self.logprobs.extend(lps)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        if out.weight_versions and not self.pinned:
            self.version_spans = [(int(s.version), s.start, s.end) for s in out.weight_versions]

    def spans(self, fallback_version: int) -> list[tuple[int, int, int]]:
        """Per-token policy-version spans; all tokens at ``fallback_version`` if vLLM gave none."""
        if self.version_spans:
            return self.version_spans
        return [(fallback_version, 0, len(self.token_ids))]


def _sampled_logprobs(ids: list[int], logprobs) -> list[float]:
    """The logprob of each sampled token in ``ids`` from vLLM's per-position logprobs: a list of
    ``{token id: Logprob}`` or a `vllm.logprobs.FlatLogprobs` (``flat_logprobs``), whose first
    entry at each position is the sampled token (vLLM's sampler puts it first).

    Raises:
        ValueError: not one position per token, or no logprob for a sampled token.
    """
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:
        positions = list(logprobs) if logprobs is not None else []
        if len(positions) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(positions)} logprob positions")
        try:
            return [float(pos[tok].logprob) for tok, pos in zip(ids, positions)]
        except (KeyError, TypeError) as e:
            raise ValueError(f"vLLM returned no logprob for a sampled token: {e!r}") from e
    if len(starts) != len(ids):
        raise ValueError(f"{len(ids)} tokens but {len(starts)} logprob positions")
    flat_ids, ends = logprobs.token_ids, logprobs.end_indices
    if any(e <= s or flat_ids[s] != tok for tok, s, e in zip(ids, starts, ends)):
        raise ValueError("vLLM returned no logprob for a sampled token")
    return [float(logprobs.logprobs[s]) for s in starts]


def build_experiences(cid: str, replica_id: str, prompt_ids: list[int], choices: list[Sampled],
                      sampling: SamplingInfo, created_at: float, fallback_version: int,
                      group_id: str | None = None, user: str | None = None,
                      metadata: dict[str, str] | None = None) -> list[Experience]:
    """One `Experience` per choice; the group is ``group_id`` (a client's) or the request itself
    (the completion id). ``created_at``: unix seconds the request arrived; ``fallback_version``:
    the policy version of tokens vLLM reported no version span for."""
    now = time.time()
    return [
        Experience(
            completion_id=cid, choice_index=c.index, group_id=group_id or cid, replica_id=replica_id,
            prompt_token_ids=prompt_ids, response_token_ids=c.token_ids,
            behaviour_logprobs=c.logprobs, token_versions=c.spans(fallback_version),
            sampling=sampling, finish_reason=c.finish_reason,
            created_at=created_at, finished_at=now, user=user, metadata=metadata,
        )
        for c in sorted(choices, key=lambda c: c.index)
    ]


class ExperienceLog:
    """A replica's writer of experiences. ``logged`` counts what reached the store (a replica's
    explorer step is ``logged // synchronizer.explorer_step_experiences``)."""

    def __init__(self, store: ExperienceStore, replica_id: str, metrics: ExplorerMetrics, store_wait_s: float):
        self.store, self.replica_id, self.metrics, self.store_wait_s = store, replica_id, metrics, store_wait_s
        self.logged = 0

    async def log(self, req, cid: str, prompt_ids: list[int], choices: list[Sampled],
                  sampling: SamplingInfo, version: int) -> int:
        """Log one answer's choices; never raises for the store's sake.

        Args:
            req: the request's ``store``, ``group_id``, ``group_size``, ``conversation_id``,
                ``created_at``, ``user``, ``metadata``, ``tenant`` and ``owner`` (a
                `serve_rft.explorer.engine.engine_tap.RequestContext`).
            cid: the response's id (what rewards name).
            prompt_ids: the token ids the engine consumed.
            version: the policy version of tokens without a version span.
        Returns:
            Experiences logged (0: ``store: false``, or the store full or away: counted unlogged).
        """
        prompt_n, completion_n = len(prompt_ids), sum(len(c.token_ids) for c in choices)
        if req.store is False:
            self.metrics.served(prompt_n, completion_n, 0, unlogged=len(choices))
            return 0
        # a client's group never collides with a completion id nor with another key's group
        group = client_group(req.tenant, req.group_id, req.owner) if req.group_id else None
        exps = build_experiences(cid, self.replica_id, prompt_ids, choices, sampling, req.created_at, version, group,
                                 req.user, req.metadata)
        try:
            await asyncio.wait_for(self.store.log_experiences(exps, group_size=req.group_size if group else None,
                                                              conversation_id=req.conversation_id,
                                                              tenant=req.tenant, owner=req.owner),
                                   self.store_wait_s)
        except (StoreFull, asyncio.TimeoutError, RedisError) as e:
            # the user is served, the loss counted (a timed-out completion batched with others
            # still waiting may yet land: `LogBatcher`; a full batcher refuses with a RedisError)
            reason = "store_full" if isinstance(e, StoreFull) else "store_unavailable"
            self.metrics.served(prompt_n, completion_n, 0, unlogged=len(exps), reason=reason)
            log.warning("experience store %s: completion %s served, not logged", reason, cid)
            return 0
        self.logged += len(exps)
        self.metrics.served(prompt_n, completion_n, len(exps))
        return len(exps)
