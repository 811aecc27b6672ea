"""A tiny random causal LM and a fixed set of rollouts for the tests of the chunked logprob path
(`serve_rft/trainer/policy/token_logprobs.py`) against the full-logits path, unsharded
(tests/unit/test_algorithm.py) and sharded (tests/unit/test_sharding.py)."""

from __future__ import annotations

import torch

# Five rollouts: prompts of 1 to 5 tokens, responses of 0 to 6 tokens (one empty); ids in [1, 97).
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [3, 3], [7, 1, 2, 9]]
RESPONSES = [[10, 11, 12, 13], [], [20, 21], [30, 31, 32, 33, 34, 35], [40, 41, 42]]
TEMPS = [0.0, 0.7, 1.3, 0.7, 1.3]  # per rollout's sampling temperature: greedy (T = 1), colder, hotter
TOP_PS = [1.0, 0.9, 0.5, 0.9, 0.5]  # per rollout's nucleus top_p


def tiny_causal_lm(kind: str):
    """A tiny random causal LM (seeded: ``torch.manual_seed(0)``): vocabulary 97, hidden 32,
    2 layers, 4 attention heads, 2 key/value heads, float32. The head is scaled up (x8) so the
    distributions are peaked and the nucleus masks drop words.

    Args:
        kind: ``qwen2`` (untied head), ``llama_tied`` (the head is the input embedding), or
            ``lora`` (a peft LoRA adapter, r 4, with random B on an untied Qwen2).

    Returns:
        a ``transformers`` causal LM (a ``peft`` model for ``lora``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    arch = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama_tied":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **arch)).float()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **arch)).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    if kind == "lora":
        import peft  # a dependency of the project (trainer.lora)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        model = peft.get_peft_model(model, lora)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model
