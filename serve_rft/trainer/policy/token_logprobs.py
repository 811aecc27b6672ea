"""The trainer's logprobs of sampled tokens, all in this module: `response_logprobs` (what the
loss, the KL reference, the probe `trainer_probe` and the logprob-agreement check use) and the
two paths under it, which give the same values and gradients (tests/unit/test_algorithm.py):

- chunked (the default): the decoder alone, then the LM head applied to the response positions
  only, in chunks of tokens, with a backward that recomputes each chunk's softmax
  (`chunked_token_logprobs`), without a full ``[B, L, V]`` logits tensor;
- full: ``model(...).logits.float()``, then per-token log-softmax (`_response_logprobs_full`):
  any causal LM, and the reference the chunked path is tested against.

Both apply vLLM's sampler processing: logits / T, then the nucleus mask of
`serve_rft.trainer.policy.nucleus` renormalised.

Shapes: ``B`` experiences, ``T`` response tokens (right-padded), ``L`` prompt + response tokens,
``N`` response tokens of a batch (packed), ``H`` hidden size, ``V`` vocabulary, ``c`` tokens per
chunk. Memory of the chunked path: forward and backward hold one chunk's ``[c, V]`` fp32 logits
(and their few element-wise temporaries) at a time; what autograd keeps between them is the
packed ``[N, H]`` hidden states, ``[N]`` vectors and, for tokens sampled with top_p < 1, their
nucleus masks as bits (``V / 8`` bytes a token), not ``[N, V]`` floats.

Numerics (the same as the full path): the logits are the LM head's matmul in the dtype the head
would run in (under autocast the autocast dtype, e.g. bf16 operands with fp32 accumulation,
rounded to bf16 like ``lm_head``'s own output; else the weight's dtype), then cast to fp32;
temperature, nucleus mask, log-sum-exp and entropy are fp32. Rounding the logits to bf16 under
bf16 autocast is deliberate: it is what the full path and a vLLM replica serving the model in
bf16 compute, and the matmul runs on bf16 tensor cores (an fp32 head matmul over 151,936 words
costs about as much as the rest of a 0.5B model).
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch

from serve_rft.trainer.policy.nucleus import nucleus_keep
from serve_rft.weights.verify import probe_ids

PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
"""``config.model_type`` of causal LMs whose ``forward`` is exactly ``lm_head(decoder(...))``
(no logit scaling or soft-capping; checked in transformers 5.x). Others take the full path."""

NUCLEUS_ROWS = 256
"""Rows sorted at once for the nucleus mask (a sort holds ``[rows, V]`` fp32 + int64)."""


SHARDED_HEAD = "serve_rft_head_logprobs"
"""The method `install_sharded_head` puts on an FSDP2-sharded model: `decoder_head_logprobs` run
as one of the root's forwards, so its parameters (embeddings, final norm, head) are gathered."""


def lm_parts(model) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """``(decoder, head weight [V, H])`` of a transformers causal LM, or of the model a peft
    adapter (LoRA and the like, injected in place) wraps; None when the model does not have
    that plain structure (another architecture, a head with a bias or an adapter of its own, a
    peft prompt-learning model whose forward adds virtual tokens): the caller takes the full
    path then. Tied embeddings need nothing special: the head's weight is the embedding
    parameter itself, and autograd adds both gradients into it. An FSDP2-sharded model
    (`serve_rft.trainer.sharding.fsdp`) gives None too: its root parameters are gathered only inside
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
    """``[len(rows), V]`` bool: `serve_rft.trainer.policy.nucleus.top_p_keep` of ``z``'s ``rows``, the sampled token kept;
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
    weight's dtype; skipped when the head is frozen, as with LoRA). With ``with_entropy`` the
    entropy ``H = lse - sum_v p_v z_v`` is differentiable too: ``dH/dz_v = -p_v (log p_v + H)``
    (0 on masked words), added to ``grad_z`` as ``g_ent * dH/dz``."""

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
        ctx.save_for_backward(hidden, weight, tokens, temp, lse, ent)
        ctx.chunk, ctx.dtype, ctx.rows, ctx.packed = chunk, dtype, rows, packed
        ctx.set_materialize_grads(False)  # an output no loss used gets None: no entropy work
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tokens, temp, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
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
                if g_ent is None:
                    grad = z.sub_(lse[s:e].unsqueeze(1)).exp_().mul_(-g.unsqueeze(1))  # -g * softmax
                else:  # also g_ent * -p (log p + H); masked words: p = 0, log p = -inf, term 0
                    logp = z.sub_(lse[s:e].unsqueeze(1))
                    p = logp.exp()
                    dh = logp.add_(ent[s:e].unsqueeze(1)).mul_(p).masked_fill_(p == 0, 0.0)
                    grad = p.mul_(-g.unsqueeze(1)).sub_(dh.mul_(g_ent[s:e].float().unsqueeze(1)))
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
    sampler processing (logits / T, then the nucleus mask of `serve_rft.trainer.policy.nucleus.top_p_keep` renormalised).

    Args:
        hidden: ``[N, H]`` final hidden states of the positions that predict ``tokens``.
        weight: ``[V, H]`` the LM head's weight (its matmul runs in `_head_dtype`).
        tokens: ``[N]`` long, the sampled tokens (always kept by the nucleus mask).
        temperatures: ``[N]`` fp32, > 0 (greedy requests: 1).
        top_ps: ``[N]`` fp32 in (0, 1]; rows with 1 get no mask (and no sort).
        chunk_tokens: tokens per chunk (``[chunk_tokens, V]`` fp32 is the largest buffer).
        with_entropy: also the entropy (nats) of each tempered, masked distribution.
    Returns:
        (``[N]`` fp32 logprobs with grad to ``hidden`` and ``weight``, ``[N]`` fp32 entropy,
        with grad to both when ``with_entropy``, else zeros).
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


def _padded_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``[B, L]`` right-padded prompt+response ids, their ``[B, L]`` attention mask (built on
    the host, one copy each to ``device``), and ``T`` (the longest response, at least 1)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(len(s) for s in seqs)
    T = max(max((len(r) for r in responses), default=0), 1)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    return ids.to(device), attn.to(device), T


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]],
                      temperatures: list[float], pad_id: int = 0, with_entropy: bool = False,
                      top_ps: list[float] | None = None, *, chunk_tokens: int = 1024,
                      impl: Literal["chunked", "full"] = "chunked", entropy_grad: bool = False):
    """Logprobs of the response tokens under ``model``, as vLLM's ``processed_logprobs``.

    Runs ``[B, L]`` right-padded prompt+response ids through the model, and per response token
    takes ``log_softmax`` of the position before it after vLLM's sampler processing, in vLLM's
    order: logits / T (T = the request's temperature; greedy requests use 1), then the top-p
    mask (`serve_rft.trainer.policy.nucleus.top_p_keep`, computed by `nucleus_keep`) renormalised. The
    sampled token is always kept: at the weights that
    sampled it, it was in the nucleus, so this changes nothing there, and on later weights it
    keeps its logprob finite (its exact truncated value would be -inf).

    ``impl="chunked"`` (the default) runs the decoder alone and the LM head on the response
    positions only, ``chunk_tokens`` at a time, with a backward that recomputes each chunk
    (`chunked_token_logprobs`); a model without the plain decoder + linear head
    structure (`lm_parts`) takes ``impl="full"``: ``[B, L, V]`` fp32 logits.
    Both give the same values and gradients (tests/unit/test_algorithm.py).

    Returns:
        (``[B, T]`` logprobs, ``[B, T]`` float mask of real response tokens), and with
        ``with_entropy`` a third ``[B, T]``: the entropy (nats) of each position's tempered
        distribution, with grad if ``entropy_grad`` (the entropy bonus, ``trainer.entropy_coef``).
    Raises:
        ValueError: a non-empty response after an empty prompt (no position predicts its
            first token).
    """
    if any(r and not p for p, r in zip(prompts, responses)):
        raise ValueError("a response needs at least one prompt token before it")
    run = getattr(model, SHARDED_HEAD, None) if impl == "chunked" else None  # FSDP2: gathers the root
    if run is None:
        parts = lm_parts(model) if impl == "chunked" else None
        if parts is None:
            return _response_logprobs_full(model, prompts, responses, temperatures, pad_id, with_entropy, top_ps,
                                           entropy_grad)
        run = partial(decoder_head_logprobs, *parts)
    device = next(model.parameters()).device
    ids, attn, T = _padded_batch(prompts, responses, pad_id, device)
    rows, pos, cols, toks, temps, tps = [], [], [], [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        rows += [i] * len(r)
        pos += range(len(p) - 1, len(p) - 1 + len(r))  # position t predicts token t + 1
        cols += range(len(r))
        toks += r
        temps += [temperatures[i] if temperatures[i] > 1e-5 else 1.0] * len(r)
        tps += [top_ps[i] if top_ps is not None else 1.0] * len(r)
    out = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    mask, ent = torch.zeros_like(out), torch.zeros_like(out)
    if not toks:  # no response token: one position at weight 0, so the forward and backward still run
        # (a sharded rank must make the collectives its peers make; one process needs a loss with a graph)
        lp, _ = run(ids, attn, torch.zeros((4, 1), dtype=torch.long, device=device),
                    torch.ones((2, 1), dtype=torch.float32, device=device), chunk_tokens, False)
        out = out + 0.0 * lp.sum()
        return (out, mask, ent) if with_entropy else (out, mask)
    index = torch.tensor([rows, pos, cols, toks], dtype=torch.long).to(device)
    scalars = torch.tensor([temps, tps], dtype=torch.float32).to(device)
    lp, e = run(ids, attn, index, scalars, chunk_tokens, with_entropy)
    e = e if entropy_grad else e.detach()
    where = (index[0], index[2])
    out = out.index_put(where, lp)
    mask = mask.index_put_(where, torch.ones_like(lp))
    return (out, mask, ent.index_put(where, e)) if with_entropy else (out, mask)


def _response_logprobs_full(model, prompts, responses, temperatures, pad_id=0, with_entropy=False,
                            top_ps=None, entropy_grad=False):
    """`response_logprobs` from the full ``[B, L, V]`` fp32 logits of ``model(...)``: any
    causal LM; the reference the chunked path is tested against."""
    from serve_rft.trainer.algorithms.losses import token_entropy

    device = next(model.parameters()).device
    ids, attn, T = _padded_batch(prompts, responses, pad_id, device)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    out = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    if not any(responses):  # keep the graph (`response_logprobs`, the chunked path's empty case)
        out = out + 0.0 * logits[:, :1, :1].sum()
    mask = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    ent = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not r:
            continue
        temp = temperatures[i] if temperatures[i] > 1e-5 else 1.0
        # logits at position t predict token t+1: response token j sits at len(p)+j.
        step_logits = logits[i, len(p) - 1 : len(p) - 1 + len(r)] / temp
        tok = torch.tensor(r, dtype=torch.long, device=device)
        top_p = top_ps[i] if top_ps is not None else 1.0
        if top_p < 1.0:
            with torch.no_grad():
                keep = nucleus_keep(step_logits.detach(), top_p)
                keep[torch.arange(len(r), device=device), tok] = True
            step_logits = step_logits.masked_fill(~keep, float("-inf"))
        lp = torch.log_softmax(step_logits, dim=-1)
        out[i, : len(r)] = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
        mask[i, : len(r)] = 1.0
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent[i, : len(r)] = token_entropy(step_logits)
    return (out, mask, ent) if with_entropy else (out, mask)


def trainer_probe(model, version: int) -> dict[str, list]:
    """The probe a handle carries: ``{"token_ids", "logprobs"}`` of ``model`` (a transformers or
    peft model, as published) at temperature 1.

    ``logprobs[t] = log_softmax(logits[t])[token_ids[t + 1]]`` for t < n - 1 (the prompt
    logprobs vLLM returns), computed by `response_logprobs`; the ids are
    `serve_rft.weights.verify.probe_ids`, which the replica's check uses too.
    """
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = probe_ids(min(vocab, getattr(model.config, "vocab_size", vocab)), version)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            lp, _ = response_logprobs(model, [ids[:1]], [ids[1:]], [1.0], pad_id=0)
    finally:
        model.train(was_training)
    return {"token_ids": ids, "logprobs": [float(x) for x in lp[0, : len(ids) - 1].float().cpu()]}
