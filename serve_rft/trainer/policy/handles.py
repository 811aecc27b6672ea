"""The tensors behind a published version's handle, for a trainer that takes a version back
(``synchronizer.canary.on_reject=reset``, `serve_rft.trainer.policy.policy.PolicyTrainer.reset_to`),
and the check that a full state dict fits the model it is loaded into."""

from __future__ import annotations

from pathlib import Path


def handle_tensors(handle: dict) -> dict:
    """The tensors a published ``handle`` carries, by name: a CHECKPOINT folder's safetensors
    files, or the MEMORY buckets in Ray's object store (``ray.get``: safetensors bytes,
    `serve_rft.weights.memory.pack_bucket`; an adapter's bucket holds the adapter's tensors).

    Raises:
        ValueError: a handle of another method (NCCL moves tensors, it keeps none).
    """
    import ray
    from safetensors.torch import load_file

    if handle.get("method") == "checkpoint":
        files = sorted(Path(handle["path"]).glob("*.safetensors"))
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    if handle.get("method") == "memory":
        from serve_rft.weights.memory import unpack_bucket

        tensors = {}
        for ref in handle["buckets"]:
            got = ray.get(ref)
            tensors.update(got[0] if handle.get("adapter") else unpack_bucket(got))
        return tensors
    raise ValueError(f"cannot reset to a {handle.get('method')!r} handle")


def check_fits(missing: list[str], unexpected: list[str]) -> None:
    """Raise unless a full state dict loaded whole: keys ``missing`` from it (a tied
    ``lm_head.weight``, which checkpoints leave out, is fine) or ``unexpected`` by the model.

    Raises:
        ValueError: the tensors do not fit the model.
    """
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ValueError(f"the handle's tensors do not fit the model: missing "
                         f"{sorted(set(missing) - tied)[:5]}, unexpected {list(unexpected)[:5]}")
