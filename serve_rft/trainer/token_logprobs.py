"""The trainer's logprobs of sampled tokens without a full ``[B, L, V]`` logits tensor: the LM
head applied to the response positions only, in chunks of tokens, with a backward that
recomputes each chunk's softmax (`serve_rft.trainer.algorithm.response_logprobs` calls it).

Shapes: ``N`` response tokens of a batch (packed), ``H`` hidden size, ``V`` vocabulary, ``c``
tokens per chunk. Memory: forward and backward hold one chunk's ``[c, V]`` fp32 logits (and
their few element-wise temporaries) at a time; what autograd keeps between them is the packed
``[N, H]`` hidden states, ``[N]`` vectors and, for tokens sampled with top_p < 1, their
nucleus masks as bits (``V / 8`` bytes a token), not ``[N, V]`` floats.

Numerics (the same as the full path, ``model(...).logits.float()`` then per-token log-softmax):
the logits are the LM head's matmul in the dtype the head would run in (under autocast the
autocast dtype, e.g. bf16 operands with fp32 accumulation, rounded to bf16 like ``lm_head``'s
own output; else the weight's dtype), then cast to fp32; temperature, nucleus mask,
log-sum-exp and entropy are fp32. Rounding the logits to bf16 under bf16 autocast is
deliberate: it is what the full path and a vLLM replica serving the model in bf16 compute,
and the matmul runs on bf16 tensor cores (an fp32 head matmul over 151,936 words costs about
as much as the rest of a 0.5B model).
"""

from __future__ import annotations

import torch

PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
"""``config.model_type`` of causal LMs whose ``forward`` is exactly ``lm_head(decoder(...))``
(no logit scaling or soft-capping; checked in transformers 5.x). Others take the full path."""

NUCLEUS_ROWS = 256
"""Rows sorted at once for the nucleus mask (a sort holds ``[rows, V]`` fp32 + int64)."""


def top_p_keep(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Which tokens nucleus sampling keeps, exactly as vLLM's sampler decides it
    (``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch``): sort ascending, drop
    the tokens whose cumulative probability is ``<= 1 - top_p``, always keep the most likely.

    Args:
        logits: ``[T, V]`` temperature-scaled logits.
        top_p: one value for every row, or ``[T]`` fp32 per row (vLLM's form: ``1 - p`` is
            then computed in fp32, as vLLM does).
    Returns:
        ``[T, V]`` bool, True = kept.
    """
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    threshold = (1 - top_p).unsqueeze(-1) if isinstance(top_p, torch.Tensor) else 1 - top_p
    drop_sorted = cum <= threshold
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
    return ~drop


SHARDED_HEAD = "serve_rft_head_logprobs"
"""The method `install_sharded_head` puts on an FSDP2-sharded model: `decoder_head_logprobs` run
as one of the root's forwards, so its parameters (embeddings, final norm, head) are gathered."""


NUCLEUS_TOPK = 1024
"""Words `nucleus_keep` looks at before it falls back to a full sort of a row."""


def nucleus_keep(logits: torch.Tensor, top_p: float | torch.Tensor, k: int = NUCLEUS_TOPK) -> torch.Tensor:
    """`top_p_keep` without sorting the vocabulary where the nucleus lies within the ``k`` most
    likely words (nearly always at top_p <= 0.99: sampled distributions are peaked).

    vLLM's rule drops a word when the ascending cumulative probability up to it is ``<= 1 - p``.
    For the ``k`` most likely words that cumulative is (the probability of every word outside
    them) + (the ascending cumulative within them): a ``topk`` and a ``[rows, k]`` cumsum. When
    the least likely of the ``k`` is dropped, every word outside them is too (their cumulatives
    are smaller); rows where it is kept are sorted in full (`top_p_keep`). The result equals
    `top_p_keep` up to float rounding of the cumulative sums: a word whose cumulative lies within
    ~1e-6 of ``1 - p`` may fall on the other side (tests/unit/test_losses.py).

    Args:
        logits: ``[T, V]`` temperature-scaled logits.
        top_p: one value, or ``[T]`` fp32 per row.
        k: words looked at per row before the fallback.
    Returns:
        ``[T, V]`` bool, True = kept.
    """
    t, v = logits.shape
    k = min(k, v)
    probs = logits.float().softmax(dim=-1)
    top, idx = probs.topk(k, dim=-1)  # descending
    asc = top.flip(-1)
    tail = (probs.sum(-1) - top.sum(-1)).clamp_min(0.0)
    cum = asc.cumsum(-1) + tail.unsqueeze(-1)
    threshold = (1 - top_p).unsqueeze(-1) if isinstance(top_p, torch.Tensor) else 1 - top_p
    drop_asc = cum <= threshold
    drop_asc[:, -1] = False  # the most likely word is always kept
    keep = torch.zeros((t, v), dtype=torch.bool, device=logits.device)
    keep.scatter_(-1, idx, ~drop_asc.flip(-1))
    wide = ~drop_asc[:, 0]  # the k-th word is kept: the nucleus may reach beyond the k
    if k < v and bool(wide.any()):
        rows = wide.nonzero().squeeze(1)
        tp = top_p.index_select(0, rows) if isinstance(top_p, torch.Tensor) else top_p
        keep[rows] = top_p_keep(logits.index_select(0, rows), tp)
    return keep


def lm_parts(model) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """``(decoder, head weight [V, H])`` of a transformers causal LM, or of the model a peft
    adapter (LoRA and the like, injected in place) wraps; None when the model does not have
    that plain structure (another architecture, a head with a bias or an adapter of its own, a
    peft prompt-learning model whose forward adds virtual tokens): the caller takes the full
    path then. Tied embeddings need nothing special: the head's weight is the embedding
    parameter itself, and autograd adds both gradients into it. An FSDP2-sharded model
    (`serve_rft.trainer.sharding`) gives None too: its root parameters are gathered only inside
    one of its forwards; it runs the chunked path through its `SHARDED_HEAD` method."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return None
    return _plain_parts(model)


def _plain_parts(model) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """`lm_parts` without the sharding check (inside a sharded model's forward)."""
    base = model
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        cfg = getattr(model, "active_peft_config", None)
        if cfg is None or getattr(cfg, "is_prompt_learning", False):
            return None
        base = model.get_base_model()
    if getattr(getattr(base, "config", None), "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    try:
        head, decoder = base.get_output_embeddings(), base.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if type(head) is not torch.nn.Linear or head.bias is not None or decoder is None or decoder is base:
        return None
    return decoder, head.weight


def _head_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``lm_head`` would run its matmul in here: the autocast dtype if autocast is on
    for the weight's device, else the weight's own."""
    dev = weight.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype


def _tempered(h: torch.Tensor, w: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """``[c, V]`` fp32 ``(h @ w.T).float() / temp`` (the matmul in ``h``'s and ``w``'s dtype)."""
    return (h @ w.t()).float().div_(temp.unsqueeze(1))


def _nucleus(z: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[len(rows), V]`` bool: `top_p_keep` of ``z``'s ``rows``, the sampled token kept;
    sorted `NUCLEUS_ROWS` rows at a time."""
    keeps = []
    for k in range(0, len(rows), NUCLEUS_ROWS):
        r = rows[k:k + NUCLEUS_ROWS]
        keep = nucleus_keep(z.index_select(0, r), top_p.index_select(0, r))
        keep[torch.arange(len(r), device=z.device), tokens.index_select(0, r)] = True
        keeps.append(keep)
    return torch.cat(keeps)


def _mask_(z: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """-inf in place outside ``keep`` (``[len(rows), V]``) on ``z``'s ``rows``."""
    z.index_copy_(0, rows, z.index_select(0, rows).masked_fill_(~keep, float("-inf")))


def _pack(keep: torch.Tensor) -> torch.Tensor:
    """``[r, V]`` bool -> ``[r, ceil(V / 8)]`` uint8, 8 words a byte (bit ``j`` = word ``8i + j``)."""
    r, v = keep.shape
    if v % 8:
        keep = torch.cat([keep, keep.new_zeros(r, 8 - v % 8)], 1)
    bits = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=keep.device)
    return (keep.view(r, -1, 8).to(torch.uint8) * bits).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, v: int) -> torch.Tensor:
    """`_pack`'s inverse: ``[r, V]`` bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(packed.shape[0], -1)[:, :v].bool()


class _ChunkedLogprobs(torch.autograd.Function):
    """``logprob[n] = z[n, tok[n]] - logsumexp(z[n])`` over chunks, ``z`` the tempered logits
    with the nucleus mask. Backward per chunk, recomputing ``z`` (the matmul again; the nucleus
    masks the forward found are kept bit-packed, ``N_top_p * V / 8`` bytes, not sorted again):
    ``grad_z = g * (onehot(tok) - softmax(z))`` (log-softmax's gradient; masked words have
    softmax 0), ``grad_logits = grad_z / T``, ``grad_h = grad_logits @ W``,
    ``grad_W += grad_logits.T @ h`` (the latter two in the head's matmul dtype, as autograd
    through autocast's ``linear`` computes them; ``grad_W`` accumulates over chunks in the
    weight's dtype; skipped when the head is frozen, as with LoRA)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temp, top_p, chunk, dtype, with_entropy):
        n = hidden.shape[0]
        nucleus = (top_p < 1).nonzero().squeeze(1).tolist()  # one host sync per call
        per_chunk: list[list[int]] = [[] for _ in range(0, n, chunk)]
        for i in nucleus:
            per_chunk[i // chunk].append(i % chunk)
        rows = [torch.tensor(r, dtype=torch.long, device=hidden.device) if r else None for r in per_chunk]
        packed: list[torch.Tensor | None] = []
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.zeros_like(lp)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for k, s in enumerate(range(0, n, chunk)):
                e = min(s + chunk, n)
                z = _tempered(hidden[s:e].to(dtype), w, temp[s:e])
                if rows[k] is not None:
                    keep = _nucleus(z, rows[k], top_p[s:e], tokens[s:e])
                    _mask_(z, rows[k], keep)
                    packed.append(_pack(keep))
                else:
                    packed.append(None)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                lp[s:e] = z.gather(1, tokens[s:e].unsqueeze(1)).squeeze(1) - lse[s:e]
                if with_entropy:  # H = -sum p log p = lse - sum p z over kept words (masked: p = 0)
                    p = (z - lse[s:e].unsqueeze(1)).exp_()
                    if rows[k] is not None:
                        z = z.masked_fill_(p == 0, 0.0)
                    ent[s:e] = lse[s:e] - p.mul_(z).sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, temp, lse)
        ctx.chunk, ctx.dtype, ctx.rows, ctx.packed = chunk, dtype, rows, packed
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tokens, temp, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, chunk, dtype, v = hidden.shape[0], ctx.chunk, ctx.dtype, weight.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for k, s in enumerate(range(0, n, chunk)):
                e = min(s + chunk, n)
                h = hidden[s:e].to(dtype)
                z = _tempered(h, w, temp[s:e])
                if ctx.rows[k] is not None:
                    _mask_(z, ctx.rows[k], _unpack(ctx.packed[k], v))
                g = g_lp[s:e].float()
                grad = z.sub_(lse[s:e].unsqueeze(1)).exp_().mul_(-g.unsqueeze(1))  # -g * softmax
                grad[torch.arange(e - s, device=grad.device), tokens[s:e]] += g
                grad = grad.div_(temp[s:e].unsqueeze(1)).to(dtype)  # d/d logits of logits / T
                if need_h:
                    grad_h[s:e] = (grad @ w).to(hidden.dtype)
                if need_w:
                    grad_w += grad.t() @ h
        return grad_h, grad_w, None, None, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                           temperatures: torch.Tensor, top_ps: torch.Tensor, chunk_tokens: int = 1024,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``tokens`` under the head ``weight`` applied to ``hidden``, after vLLM's
    sampler processing (logits / T, then the nucleus mask of `top_p_keep` renormalised).

    Args:
        hidden: ``[N, H]`` final hidden states of the positions that predict ``tokens``.
        weight: ``[V, H]`` the LM head's weight (its matmul runs in `_head_dtype`).
        tokens: ``[N]`` long, the sampled tokens (always kept by the nucleus mask).
        temperatures: ``[N]`` fp32, > 0 (greedy requests: 1).
        top_ps: ``[N]`` fp32 in (0, 1]; rows with 1 get no mask (and no sort).
        chunk_tokens: tokens per chunk (``[chunk_tokens, V]`` fp32 is the largest buffer).
        with_entropy: also the entropy (nats) of each tempered, masked distribution.
    Returns:
        (``[N]`` fp32 logprobs with grad to ``hidden`` and ``weight``, ``[N]`` fp32 entropy
        without grad, zeros unless ``with_entropy``).
    Raises:
        ValueError: ``chunk_tokens < 1``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    return _ChunkedLogprobs.apply(hidden, weight, tokens, temperatures.float(), top_ps.float(),
                                  int(chunk_tokens), _head_dtype(weight), bool(with_entropy))


def decoder_head_logprobs(decoder: torch.nn.Module, weight: torch.Tensor, ids: torch.Tensor, attn: torch.Tensor,
                          index: torch.Tensor, scalars: torch.Tensor, chunk_tokens: int, with_entropy: bool):
    """The decoder over ``[B, L]`` ``ids`` / ``attn``, then `chunked_token_logprobs` of the ``N``
    response positions ``index`` (``[4, N]``: row, position, column, token) with ``scalars``
    (``[2, N]``: temperature, top_p). Returns ``([N] logprobs, [N] entropy or None)``."""
    hidden = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    return chunked_token_logprobs(hidden[index[0], index[1]], weight, index[3], scalars[0], scalars[1],
                                  chunk_tokens, with_entropy)


def install_sharded_head(model) -> bool:
    """Give an FSDP2-sharded causal LM the chunked logprob path: a `SHARDED_HEAD` method running
    `decoder_head_logprobs` on the model's own decoder and head, registered as a forward of the
    root (``register_fsdp_forward_method``), so the root's parameters are all-gathered for it
    and their gradients reduce-scattered after its backward, as for ``forward``.

    Returns:
        False when the model lacks the plain decoder + head structure (`lm_parts`): it keeps the
        full path.
    """
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    if _plain_parts(model) is None:
        return False

    def head_logprobs(self, ids, attn, index, scalars, chunk_tokens, with_entropy):
        decoder, weight = _plain_parts(self)  # gathered now
        return decoder_head_logprobs(decoder, weight, ids, attn, index, scalars, chunk_tokens, with_entropy)

    setattr(model, SHARDED_HEAD, types.MethodType(head_logprobs, model))
    register_fsdp_forward_method(model, SHARDED_HEAD)
    return True
