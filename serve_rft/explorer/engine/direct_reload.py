"""Load a policy version straight into vLLM-CPU's packed linear layers (runs in the worker).

On CPU, vLLM packs each linear layer's weight into a oneDNN matmul handle at load and drops the
weight tensor (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, vLLM's
``model_executor/layers/utils.py``). Its layer-wise reload (``model_loader/reload/layerwise.py``)
therefore allocates each layer again, copies the checkpoint's tensors in, packs the result (a
second copy) and copies it back. Here a linear layer is packed straight from the safetensors
file's mapped bytes, so each of its weights is read once, by the pack:

- a layer stored whole (``o_proj``, ``down_proj``) is a view of the file;
- a fused layer (``qkv_proj`` from ``q/k/v_proj``, ``gate_up_proj`` from ``gate/up_proj``, vLLM's
  ``hf_to_vllm_mapper.orig_to_new_stacked``) is one view too when its shards lie next to each
  other in the file in the fused order (MEMORY's buckets: `serve_rft.weights.memory.pack_bucket`;
  a folder written by transformers sorts tensors by name, so ``gate`` precedes ``up`` but ``k``
  precedes ``q``), otherwise its shards are gathered into one buffer first (a layer split across
  two buckets waits for the rest in that buffer).

Every other parameter (norms, biases, embeddings) is written in place by its own vLLM weight
loader, and each such module's vLLM post-load processing runs again at the end (an LM head is
re-packed). A load that fails half way leaves every layer usable (old or new values), unlike the
layer-wise reload, which keeps unfinished layers on the meta device until it is finalized.

Used only where this holds: CPU without zentorch, one worker, eager mode, no quantization, and a
model whose checkpoint names vLLM maps with a ``WeightsMapper`` of single shards
(`unsupported_reason`); elsewhere, and once a name did not resolve (`UnknownTensor`), the worker
keeps vLLM's layer-wise reload (`serve_rft.explorer.engine.worker_ext`).
Figures: docs/performance.md, "Sync cost per method".
"""

from __future__ import annotations

import mmap

import torch

from serve_rft.weights.safetensors_file import entry, map_file, view

class UnknownTensor(ValueError):
    """A checkpoint tensor names no module or parameter of the model as this loader maps names
    (vLLM's own loader may know more of the model's names: the worker then keeps to it)."""


QKV_SHARDS = {"q": 0, "k": 1, "v": 2}
"""vLLM's ``QKVParallelLinear`` shard ids, in the order of its ``output_sizes``."""


def unsupported_reason(model: torch.nn.Module, enforce_eager: bool) -> str | None:
    """Why `DirectReload` cannot load into ``model`` here, or None when it can.

    Args:
        model: the worker's vLLM model.
        enforce_eager: the engine's ``enforce_eager`` (compiled graphs may hold the old
            handles, so only eager mode qualifies).
    """
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not on CPU (vLLM's weights are plain tensors there)"
    if not enforce_eager:
        return "not in eager mode"
    if current_platform.is_zen_cpu():  # zentorch may keep the weight tensor itself (unpacked)
        return "zentorch GEMM"
    if get_tensor_model_parallel_world_size() != 1:
        return "tensor-parallel"
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None or not hasattr(mapper, "_map_name_with_shard"):
        return "the model has no weights mapper"
    if any(isinstance(shard, (list, tuple)) for _, shard in getattr(mapper, "orig_to_new_stacked", {}).values()):
        return "a checkpoint tensor loads into several shards"
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and not isinstance(
                method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return f"{name} is quantized ({type(method).__name__})"
    return None


class DirectReload:
    """One policy update of ``model`` (module docstring), file by file; not thread-safe.

    Args:
        model: the worker's vLLM model (`unsupported_reason` returned None for it).
        tied_head: the model ties its LM head to the embedding (``lm_head.*`` tensors are
            skipped, as vLLM's loader skips them).
        repacked_by_caller: a module whose post-load processing the caller runs itself (the
            embedding of a tied head: its re-pack is the head's), skipped in `finish`.
    """

    def __init__(self, model: torch.nn.Module, tied_head: bool, repacked_by_caller: torch.nn.Module | None = None):
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.models.utils import AutoWeightsLoader

        self.model = model
        # the model's names, and the stale rotary tensors vLLM's own loader drops
        self.mapper = model.hf_to_vllm_mapper | AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER
        self.tied_head = tied_head
        self.skip_processing = {id(repacked_by_caller)} if repacked_by_caller is not None else set()
        self.packed = {id(m): m for m in model.modules()
                       if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)}
        self.pending: dict[int, tuple[torch.Tensor, set[int], str]] = {}
        """A fused layer's gathered shards: ``[out, in]`` buffer, shard indices in it, vLLM name."""
        self.touched: dict[int, torch.nn.Module] = {}
        self.loaded: set[str] = set()
        self.gathered: set[str] = set()
        """Fused layers whose parts were copied into one buffer (not one view of a file)."""

    def load_file(self, path: str) -> int:
        """Load every tensor of one safetensors file (checkpoint names).

        Returns:
            The number of tensors in the file.
        Raises:
            UnknownTensor: a tensor has no parameter in the model (as this loader maps names).
            ValueError: a tensor has the wrong shape, or the file a malformed header.
            OSError: the file cannot be read.
        """
        header, data_start, mapping = map_file(path)  # unmapped when the last view of it is gone
        try:
            return self._load_mapped(header, data_start, mapping)
        finally:  # also when a loader failed half way: nothing may keep pointing into the file
            self._own_memory(mapping)

    def _load_mapped(self, header: dict, data_start: int, mapping: mmap.mmap) -> int:
        groups: dict[int, list[tuple[int | None, int, int, torch.Tensor, str]]] = {}
        for name, meta in header.items():
            if self.tied_head and name.startswith("lm_head."):
                continue
            mapped = self.mapper._map_name_with_shard(name)
            if mapped is None:  # vLLM ignores this tensor
                continue
            vname, shard = mapped
            module, pname = self._resolve(vname, name)
            key = id(module)
            tensor, start, end = entry(mapping, data_start, name, meta)
            if key in self.packed and pname == "weight":
                index = None if shard is None else QKV_SHARDS.get(shard, -1) if isinstance(shard, str) else int(shard)
                groups.setdefault(key, []).append((index, start, end, tensor, vname))
                continue
            self._load_in_place(module, pname, vname, tensor, shard)
        for key, shards in groups.items():
            self._load_packed(self.packed[key], shards, mapping)
        return len(header)

    def _own_memory(self, mapping: mmap.mmap) -> None:
        """Give any parameter or buffer that a vLLM loader left pointing into the file a copy of
        its own: nothing of the model may change when the file is rewritten or removed (the
        replica reuses its staging files, `serve_rft.weights.memory`)."""
        base = view(mapping, 0, torch.uint8, [len(mapping)], len(mapping)).data_ptr()
        end = base + len(mapping)
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.numel() and base <= t.untyped_storage().data_ptr() < end:
                t.data = t.data.clone()

    def finish(self) -> set[str]:
        """Re-run vLLM's post-load processing of the modules loaded in place.

        Returns:
            The vLLM names of the parameters that received values.
        Raises:
            RuntimeError: a fused layer got only some of its shards.
        """
        if self.pending:
            names = sorted(name for _, _, name in self.pending.values())
            raise RuntimeError(f"fused layers missing shards: {names[:5]}")
        for module in self.touched.values():
            module.quant_method.process_weights_after_loading(module)
        return self.loaded

    def _resolve(self, vname: str, name: str) -> tuple[torch.nn.Module, str]:
        from vllm.lora.layers import BaseLayerWithLoRA

        module_name, _, pname = vname.rpartition(".")
        try:
            module = self.model.get_submodule(module_name)
        except AttributeError:
            raise UnknownTensor(f"checkpoint tensor {name!r}: the model has no module {module_name!r}") from None
        if isinstance(module, BaseLayerWithLoRA):
            module = module.base_layer
        if not hasattr(module, pname):
            raise UnknownTensor(f"checkpoint tensor {name!r}: the model has no parameter {vname!r}")
        return module, pname

    def _load_in_place(self, module: torch.nn.Module, pname: str, vname: str, tensor: torch.Tensor, shard) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        param = getattr(module, pname)
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except AssertionError as e:  # vLLM's loaders assert shapes
            raise ValueError(f"{vname}: tensor of shape {tuple(tensor.shape)} does not fit: {e}") from None
        self.loaded.add(vname)
        method = getattr(module, "quant_method", None)
        if (method is not None and id(module) not in self.packed and id(module) not in self.skip_processing
                and hasattr(method, "process_weights_after_loading")):
            self.touched[id(module)] = module

    def _load_packed(self, layer: torch.nn.Module, shards: list, mapping: mmap.mmap) -> None:
        """Pack one linear layer from ``shards`` (``(index, start, end, view, vLLM name)``; index
        None: the whole weight), or gather a fused layer's shards until all have arrived."""
        out, cols = _out_in(layer)
        vname = shards[0][4]
        if shards[0][0] is None:
            self._pack(layer, shards[0][3], vname)
            return
        sizes = list(getattr(layer, "output_sizes", [out]))
        for index, _, _, tensor, _ in shards:
            if not 0 <= index < len(sizes) or tuple(tensor.shape) != (sizes[index], cols):
                raise ValueError(f"{vname}: shard {index} of shape {tuple(tensor.shape)}, "
                                 f"expected {(sizes[index] if 0 <= index < len(sizes) else '?', cols)}")
        ordered = sorted(shards, key=lambda s: s[1])
        if (id(layer) not in self.pending and [s[0] for s in ordered] == list(range(len(sizes)))
                and all(a[2] == b[1] for a, b in zip(ordered, ordered[1:]))
                and len({s[3].dtype for s in ordered}) == 1):
            first = ordered[0]
            self._pack(layer, view(mapping, first[1], first[3].dtype, [out, cols], ordered[-1][2] - first[1]), vname)
            return
        dtype = layer.weight.dtype
        buf, have, _ = self.pending.setdefault(id(layer), (torch.empty(out, cols, dtype=dtype), set(), vname))
        for index, _, _, tensor, _ in shards:
            row = sum(sizes[:index])
            buf[row:row + sizes[index]].copy_(tensor)
            have.add(index)
        self.gathered.add(vname)
        if len(have) == len(sizes):
            del self.pending[id(layer)]
            self._pack(layer, buf, vname)

    def _pack(self, layer: torch.nn.Module, weight: torch.Tensor, vname: str) -> None:
        """Give ``layer`` the ``[out, in]`` weight and let vLLM pack it (its handle owns a copy)."""
        expected = _out_in(layer)
        if tuple(weight.shape) != expected:
            raise ValueError(f"{vname}: shape {tuple(weight.shape)}, expected {expected}")
        dtype = layer.weight.dtype
        if weight.dtype != dtype:
            weight = weight.to(dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        # (vLLM's plain-linear fallback keeps the tensor itself: `_own_memory` copies it off the file)
        layer.quant_method.process_weights_after_loading(layer)
        self.loaded.add(vname)


def _out_in(layer: torch.nn.Module) -> tuple[int, int]:
    """A linear layer's ``[out, in]`` weight shape on this (only) worker."""
    return (getattr(layer, "output_size_per_partition", None) or layer.output_size,
            getattr(layer, "input_size_per_partition", None) or layer.input_size)
