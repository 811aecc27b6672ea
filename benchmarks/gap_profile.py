"""Where the gap to plain vLLM comes from : CPU seconds per process of each server under
the same load, and the cost of the behaviour logprobs our replica asks vLLM for.

1. For serve_rft (``serve-rft up --mode serve``, one replica) and vLLM's own server: run the
   `vs_vllm.run_load` load at ``--concurrency`` for ``--duration`` s and sum each process's CPU
   seconds (psutil, the server's whole process tree), grouped by role (vLLM engine core / worker,
   Ray Serve replica, Ray Serve proxy or HAProxy (``--ingress``), API server, Ray system processes, redis-server), per
   1,000 output tokens; and the front-end process's (our replica's, vLLM's API server's) CPU by
   thread, its busiest first.
2. One `AsyncLLM` in this process, no HTTP: output tokens/s with ``logprobs=0`` (what every
   serve_rft request computes) and without.
3. With ``--py-spy`` (needs ``.venv/bin/pip install py-spy``; not a project dependency): a
   py-spy profile of each server's front-end process (our Serve replica, vLLM's API server)
   during its load run (``--gil``: only the thread holding the GIL is sampled, so the shares are
   of its Python CPU, not of waits), each sample owned by the innermost frame of a package that
   names its cost (`OWNERS`), and the process's CPU per 1,000 tokens split by those shares.

With ``--logprobs`` the load asks for the sampled tokens' logprobs (the same work on both sides).

    .venv/bin/python benchmarks/gap_profile.py [--concurrency 16] [--duration 20] [--py-spy]
        [--logprobs] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_vllm import start_vllm, stop  # noqa: E402
from vs_vllm import run_load, start_ours  # noqa: E402
from provenance import command, machine  # noqa: E402


def _role(p: psutil.Process) -> str:
    try:
        name = " ".join(p.cmdline())[:200] or p.name()
    except psutil.Error:
        return "gone"
    for key, role in (("VLLM::Worker", "vllm worker"), ("VLLM::EngineCor", "vllm engine core"),
                      ("ServeReplica", "ray serve replica (+ AsyncLLM front end)"),
                      ("ProxyActor", "ray serve proxy"), ("HAProxyManager", "ray serve haproxy manager"),
                      ("haproxy", "haproxy"), ("ServeController", "ray serve controller"),
                      ("redis-server", "redis-server"), ("api_server", "vllm api server (+ AsyncLLM front end)"),
                      ("raylet", "ray system"), ("gcs_server", "ray system"), ("ray::", "ray other actors"),
                      ("serve_rft.cli", "serve-rft up driver")):
        if key in name:
            return role
    return "other"


def _cpu(root: psutil.Process) -> dict[int, tuple[str, float]]:
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (_role(p), t.user + t.system)
        except psutil.Error:
            pass
    return out


# Who owns a sample: the innermost frame from one of these packages (path fragment -> owner).
# Frames of generic libraries (asyncio, pydantic, json, msgpack, zmq, logging, threading) are
# passed over, so their time counts for the code that called them.
OWNERS = (("ray/util/metrics", "Ray metrics API (Metric._record)"),
          ("vllm/v1/metrics/", "vLLM engine metrics (stat loggers)"),
          ("serve_rft/", "serve_rft (routes, engine tap, experience log)"),
          ("vllm/v1/engine/", "vLLM output processing (detokenize, logprobs)"),
          ("vllm/tokenizers/", "vLLM output processing (detokenize, logprobs)"),
          ("transformers/", "vLLM output processing (detokenize, logprobs)"),
          ("vllm/", "vLLM OpenAI serving classes (render, parse, chunks)"),
          ("uvicorn/", "uvicorn (HTTP parsing and socket writes)"),
          ("ray/serve/", "Ray Serve (direct ingress: its ASGI wrapper, request bookkeeping)"),
          ("starlette/", "Starlette / FastAPI"), ("fastapi/", "Starlette / FastAPI"))
OTHER = "asyncio and other"


def pyspy_shares(raw_path: Path) -> dict:
    """Shares of the samples in a py-spy ``record --gil --format raw`` file (only the thread
    holding the GIL is sampled: Python CPU, not waits) by owner (`OWNERS`: the innermost frame
    that names one), the rest as `OTHER`."""
    counts: dict[str, int] = defaultdict(int)
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        owner = next((o for f in reversed(stack.split(";")) for key, o in OWNERS if key in f), OTHER)
        counts[owner] += int(n)
    names = list(dict.fromkeys([o for _, o in OWNERS] + [OTHER]))
    return {"samples": total, **{o: counts[o] / total if total else 0.0 for o in names}}


def _front_end(root: psutil.Process) -> psutil.Process:
    """The process that runs the HTTP server and vLLM's serving classes: our Serve replica or
    vLLM's API server (the root itself).

    Raises:
        RuntimeError: neither is found under ``root``.
    """
    replica = next((p for p in root.children(recursive=True) if _role(p).startswith("ray serve replica")), None)
    if replica is not None:
        return replica
    if _role(root).startswith("vllm api server"):
        return root
    raise RuntimeError(f"no Serve replica or vLLM API server under pid {root.pid}")


def thread_cpu(proc: psutil.Process) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each thread of ``proc`` so far: thread id -> (name, seconds).
    The name is ``/proc/PID/task/TID/comm`` (``main`` for the main thread): Python threads inherit
    the name of the thread that started them, native ones (Ray's core worker, gRPC, ZeroMQ) set
    their own."""
    out = {}
    for t in proc.threads():
        try:
            name = "main" if t.id == proc.pid else Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            continue
        out[t.id] = (name, t.user_time + t.system_time)
    return out


def busiest_threads(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                    tokens: float, top: int = 6) -> list[dict]:
    """The ``top`` threads by CPU seconds between two `thread_cpu` snapshots, per 1,000 of
    ``tokens``, and the rest summed."""
    used = sorted(((t - before.get(tid, (name, 0.0))[1], name) for tid, (name, t) in after.items()), reverse=True)
    rows = [{"thread": name, "cpu_s_per_1k_tokens": 1000 * s / tokens} for s, name in used[:top]]
    rows.append({"thread": f"the other {max(0, len(used) - top)}",
                 "cpu_s_per_1k_tokens": 1000 * sum(s for s, _ in used[top:]) / tokens})
    return rows


def cpu_split(url: str, root_pid: int, concurrency: int, duration: float, max_tokens: int,
              py_spy_out: Path | None = None, logprobs: bool = False) -> dict:
    """CPU seconds per role during one load run (``logprobs``: the load asks for the sampled
    tokens' logprobs), and per 1,000 output tokens; the front-end process's (`_front_end`) CPU and
    busiest threads (`busiest_threads`); with ``py_spy_out`` also a py-spy profile of the
    front-end process (`pyspy_shares`) and its CPU per 1,000 tokens split by those shares."""
    import shutil
    import subprocess

    root = psutil.Process(root_pid)
    front = _front_end(root)
    threads_before = thread_cpu(front)
    front_before = sum(front.cpu_times()[:2])
    before = _cpu(root)
    spy = None
    if py_spy_out is not None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        spy = subprocess.Popen([exe, "record", "--gil", "-d", str(int(duration) - 2), "-r", "50", "-f", "raw",
                                "-o", str(py_spy_out), "-p", str(front.pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load = asyncio.run(run_load(url, concurrency, duration, max_tokens, logprobs=logprobs))
    after = _cpu(root)
    threads_after = thread_cpu(front)
    front_cpu = sum(front.cpu_times()[:2]) - front_before
    profile = None
    if spy is not None:
        spy.wait(timeout=60)
        profile = pyspy_shares(py_spy_out)
    by_role: dict[str, float] = defaultdict(float)
    for pid, (role, t) in after.items():
        by_role[role] += t - before.get(pid, (role, 0.0))[1]
    tokens = load["output_tokens_per_s"] * load["seconds"]
    return {"output_tokens_per_s": load["output_tokens_per_s"], "seconds": load["seconds"],
            "cpu_s_by_role": dict(sorted(by_role.items(), key=lambda kv: -kv[1])),
            "cpu_s_per_1k_tokens": {k: 1000 * v / tokens for k, v in by_role.items()},
            "cpu_s_per_1k_tokens_total": 1000 * sum(by_role.values()) / tokens,
            "front_end_process_cpu_s_per_1k_tokens": 1000 * front_cpu / tokens,
            "front_end_threads": busiest_threads(threads_before, threads_after, tokens),
            **({"front_end_py_spy_shares": profile,
                "front_end_cpu_s_per_1k_tokens_by_owner": {
                    o: 1000 * front_cpu / tokens * v for o, v in profile.items() if o != "samples"}}
               if profile is not None else {})}


async def engine_logprob_cost(model: str, seconds: float = 8.0) -> dict:
    """One request at a time on an in-process engine: tokens/s with and without logprobs=0."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine

    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a story about the sea."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    engine = await ExplorerEngine.create(model, ExplorerConfig())
    out: dict[str, list[float]] = {"logprobs_0": [], "no_logprobs": []}
    try:
        for _ in range(2):
            for key, lp in (("logprobs_0", 0), ("no_logprobs", None)):
                sp = SamplingParams(temperature=1.0, max_tokens=64, logprobs=lp,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
                toks, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    async for ro in engine.generate(prompt, sp, uuid.uuid4().hex):
                        pass
                    toks += len(ro.outputs[0].token_ids)
                out[key].append(toks / (time.perf_counter() - t0))
    finally:
        engine.shutdown()
    return {k: max(v) for k, v in out.items()}


def main() -> None:
    from serve_rft.buffer.redis_server import free_port
    from serve_rft.config import ModelConfig
    from serve_rft.model.embedded import ensure_embedded_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--py-spy", action="store_true",
                    help="also profile each server's front-end process (pip install py-spy)")
    ap.add_argument("--logprobs", action="store_true", help="the load asks for the sampled tokens' logprobs")
    ap.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                    help="our front door (service.ingress)")
    ap.add_argument("--out", default="benchmarks/results/gap_profile.json")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # the in-process engine: as in a 1-CPU Ray replica
    model = str(ensure_embedded_model(ModelConfig().cache_dir))
    work = Path(tempfile.mkdtemp(prefix="srft-gap-"))
    res: dict = {}
    proc, url = start_ours(work / "run", work / "ours.log", a.ingress)
    try:
        asyncio.run(run_load(url, a.concurrency, 5.0, a.max_tokens, logprobs=a.logprobs))
        res["serve_rft"] = cpu_split(url, proc.pid, a.concurrency, a.duration, a.max_tokens,
                                     work / "replica.pyspy.txt" if a.py_spy else None, a.logprobs)
    finally:
        stop(proc)
    proc, url = start_vllm(model, free_port(), work / "vllm.log")
    try:
        asyncio.run(run_load(url, a.concurrency, 5.0, a.max_tokens, logprobs=a.logprobs))
        res["vllm"] = cpu_split(url, proc.pid, a.concurrency, a.duration, a.max_tokens,
                                work / "vllm.pyspy.txt" if a.py_spy else None, a.logprobs)
    finally:
        stop(proc)
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        res["in_process_engine_c1_tokens_per_s"] = asyncio.run(engine_logprob_cost(model))
    finally:
        ray.shutdown()
    out = {"command": command(), "args": vars(a), "machine": machine(), **res}
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
