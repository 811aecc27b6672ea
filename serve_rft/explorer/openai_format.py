"""vLLM outputs -> OpenAI chat JSON (full responses and stream chunks).

Pure functions over vLLM's `CompletionOutput` fields (``token_ids``, ``logprobs``,
``weight_versions``), so they are unit-testable with plain objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any



def fingerprint(version: int) -> str:
    """``system_fingerprint`` naming the policy version, e.g. ``policy-v3``."""
    return f"policy-v{version}"


@dataclass
class ChoiceAccumulator:
    """Token ids, sampled-token logprobs and OpenAI logprob entries of one choice, in order.

    ``pinned``: every token comes from the version the request started on (adapter-only LoRA
    sync: a request keeps its adapter), so vLLM's per-token weight-version spans are ignored.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    content_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    version_spans: list[tuple[int, int, int]] | None = None
    pinned: bool = False

    def add(self, out, top_logprobs: int | None) -> list[dict[str, Any]]:
        """Append a (delta or final) vLLM `CompletionOutput`; returns its OpenAI logprob entries.

        Raises:
            ValueError: vLLM returned no logprob for a sampled token (logprobs not requested).
        """
        new_ids = list(out.token_ids)
        entries: list[dict[str, Any]] = []
        positions = list(out.logprobs) if out.logprobs is not None else []
        if len(positions) != len(new_ids):
            raise ValueError(f"{len(new_ids)} tokens but {len(positions)} logprob positions")
        for tok, pos in zip(new_ids, positions):
            sampled = pos[tok]
            self.logprobs.append(float(sampled.logprob))
            entries.append(_logprob_entry(tok, sampled, pos, top_logprobs or 0))
        self.token_ids.extend(new_ids)
        self.text += out.text
        self.content_logprobs.extend(entries)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
        if out.weight_versions and not self.pinned:
            self.version_spans = [(int(s.version), s.start, s.end) for s in out.weight_versions]
        return entries

    def spans(self, fallback_version: int) -> list[tuple[int, int, int]]:
        """Per-token policy-version spans; all tokens at ``fallback_version`` if vLLM gave none."""
        if self.version_spans:
            return self.version_spans
        return [(fallback_version, 0, len(self.token_ids))]


def _token_text(tok_id: int, lp) -> str:
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else f"<{tok_id}>"


def _logprob_entry(tok_id: int, sampled, pos, k: int) -> dict[str, Any]:
    text = _token_text(tok_id, sampled)
    entry: dict[str, Any] = {"token": text, "logprob": float(sampled.logprob),
                             "bytes": list(text.encode("utf-8")), "top_logprobs": []}
    if k > 0:
        ranked = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        for tid, lp in [kv for kv in ranked if kv[1].rank is not None and kv[1].rank <= k][:k]:
            t = _token_text(tid, lp)
            entry["top_logprobs"].append({"token": t, "logprob": float(lp.logprob),
                                          "bytes": list(t.encode("utf-8"))})
    return entry


def finish_reason(reason: str | None) -> str | None:
    """vLLM finish reasons are OpenAI's (``stop``, ``length``); abort maps to ``stop``."""
    if reason is None:
        return None
    return reason if reason in ("stop", "length", "tool_calls", "content_filter") else "stop"


def chat_response(cid: str, model: str, created: int, version: int, choices: list[ChoiceAccumulator],
                  prompt_tokens: int, want_logprobs: bool) -> dict[str, Any]:
    """A ``chat.completion`` object, shaped like vLLM's own server's (OpenAI's fields, null where
    unused, plus vLLM's ``stop_reason`` / ``token_ids`` / ``reasoning``; checked against vLLM by
    tests/integration/conformance.py)."""
    out_choices = []
    for c in sorted(choices, key=lambda c: c.index):
        out_choices.append({
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None, "annotations": None,
                        "audio": None, "function_call": None, "reasoning": None},
            "logprobs": {"content": c.content_logprobs} if want_logprobs else None,
            "finish_reason": finish_reason(c.finish_reason),
            "stop_reason": c.stop_reason,
            "token_ids": None,
        })
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": fingerprint(version), "choices": out_choices, "service_tier": None,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "prompt_tokens_details": None, "completion_tokens_details": None},
    }


def stream_choice(index: int, delta: dict[str, Any], logprobs: dict | None = None,
                  finish: str | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
    """One choice of a ``chat.completion.chunk`` (vLLM's stream choice fields)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason, "token_ids": None}


def chunk(cid: str, model: str, created: int, version: int, choices: list[dict[str, Any]],
          usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk`` object."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": model, "system_fingerprint": fingerprint(version),
                            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body

