"""A replica's weight swap on a real vLLM engine: checksums refuse a corrupt version before any
drain, the probe refuses weights that are not the published ones and restores the previous
version, a good version is served, and no prefix-cache block computed under one version is
reused under another. The synchronizer is a recording stand-in (a fake inside a test)."""

from __future__ import annotations

import asyncio

import pytest

from serve_rft.service.ray_start import init_local_ray
from tests.support.weights import perturbed

pytestmark = pytest.mark.integration


class _Call:
    def __init__(self, log, name, result=None):
        self.log, self.name, self.result = log, name, result

    async def _run(self, *args):
        self.log.append((self.name, args))
        return self.result

    def remote(self, *args):
        return self._run(*args)


class _RecordingSync:
    """Answers the calls `WeightSwap._apply` makes and records them."""

    def __init__(self):
        self.log: list = []
        self.renew = _Call(self.log, "renew", True)
        self.synced = _Call(self.log, "synced")
        self.failed = _Call(self.log, "failed")


async def _cached_tokens(engine, prompt, rid):
    from vllm import SamplingParams

    async for ro in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), rid):
        pass
    return ro.num_cached_tokens


def test_swap_verifies_before_serving_and_never_reuses_another_versions_cache(embedded_model, tmp_path):
    import ray

    from serve_rft.config import Config, SynchronizerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.explorer.weight_swap import WeightSwap
    from serve_rft.weights import CheckpointMethod
    from serve_rft.trainer.policy.token_logprobs import trainer_probe
    from serve_rft.types import SyncOrder

    cfg = Config(synchronizer=SynchronizerConfig(verify_tolerance=0.01))
    init_local_ray(ray.init, num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        async def go():
            engine = await ExplorerEngine.create(str(embedded_model), cfg.explorer)
            sync = _RecordingSync()
            swap = WeightSwap("r0", None, engine, sync, cfg, str(embedded_model), lambda: 0)
            ck = CheckpointMethod(tmp_path / "ck")
            ck.prepare()
            out = {}
            try:
                prompt = [(7 * i) % 900 + 3 for i in range(300)]
                out["cold"] = await _cached_tokens(engine, prompt, "a")
                out["warm"] = await _cached_tokens(engine, prompt, "b")

                # 1. a good version: loaded, probe agrees, served. ``keep`` keeps vLLM's cache
                # across the pause (``wait`` clears it): only the version salt stops the reuse
                m1 = perturbed(embedded_model, 1)
                h1 = ck.send(m1, 1)
                h1["probe"] = trainer_probe(m1, 1)
                await swap._apply(SyncOrder(version=1, handle=h1, drain_mode="keep"))
                out["v1"] = (engine.policy_version, sync.log[-1][0], swap.last_sync["probe_max_diff"])
                out["after_sync"] = await _cached_tokens(engine, prompt, "c")
                out["after_sync_warm"] = await _cached_tokens(engine, prompt, "d")

                # 2. a corrupt folder (one byte flipped): refused before any drain or pause
                m2 = perturbed(embedded_model, 2)
                h2 = ck.send(m2, 2)
                h2["probe"] = trainer_probe(m2, 2)
                f = tmp_path / "ck" / "v000002" / "model.safetensors"
                raw = bytearray(f.read_bytes())
                raw[-5] ^= 0xFF
                f.write_bytes(bytes(raw))
                paused = []
                real_pause = engine.pause

                async def pause(mode):
                    paused.append(mode)
                    return await real_pause(mode)

                engine.pause = pause
                await swap._apply(SyncOrder(version=2, handle=h2, drain_mode="wait"))
                out["corrupt"] = (engine.policy_version, sync.log[-1][0], "checksum" in sync.log[-1][1][2], paused[:])

                # 3. loaded but not the published weights (the probe of other weights): restored
                m3 = perturbed(embedded_model, 3)
                h3 = ck.send(m3, 3)
                h3["probe"] = trainer_probe(perturbed(embedded_model, 4), 3)
                await swap._apply(SyncOrder(version=3, handle=h3, drain_mode="wait"))
                probe_v1 = await engine.probe_logprobs(h1["probe"]["token_ids"])
                out["mismatch"] = (engine.policy_version, sync.log[-1][0], "verification" in sync.log[-1][1][2],
                                   max(abs(a - b) for a, b in zip(probe_v1, h1["probe"]["logprobs"])))
                out["gate_open"] = swap.gate.is_set() and not swap.draining
                return out
            finally:
                engine.shutdown()

        out = asyncio.run(go())
    finally:
        ray.shutdown()
    assert out["cold"] == 0 and out["warm"] > 0, out  # the prefix cache works ...
    assert out["v1"][:2] == (1, "synced") and out["v1"][2] < 1e-4, out
    assert out["after_sync"] == 0 and out["after_sync_warm"] > 0, out  # ... but never across versions
    assert out["corrupt"] == (1, "failed", True, []), out  # no pause: the corrupt bytes cost no capacity
    assert out["mismatch"][:3] == (1, "failed", True) and out["mismatch"][3] < 1e-4, out  # v1 restored
    assert out["gate_open"], out
