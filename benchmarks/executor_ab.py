"""A whole stack under two process environments, side by side in one run (``--ab``):

- ``executor``: vLLM-CPU's worker in the EngineCore process (``uni``:
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, serve_rft's default on CPU,
  `serve_rft.explorer.engine.vllm_engine.engine_env`) against vLLM's default worker process of
  its own (``mp``: ``=1``);
- ``omp_wait``: OpenMP's threads sleeping as soon as they wait (``passive``:
  ``OMP_WAIT_POLICY=PASSIVE``) against libgomp's default, which spins first (``unset``: the
  variable removed; GNU libgomp manual, "OMP_WAIT_POLICY" and "GOMP_SPINCOUNT").

Each round starts one `serve-rft up` per variant in turn (the order alternates between rounds):
the test stacks' settings (tests/support/stack.py: two replicas, the embedded model, its own
redis-server), then closed-loop users chat (n=2, 8 tokens) and reward for ``--duration`` seconds
(`tests.support.load.Users`), then SIGINT. Recorded per run: ``startup_seconds`` (the service's
own figure), chats answered per second and failed, median chat latency, policy versions published
during the load, and the CPU-seconds the stack's processes used during it (every process under
the `serve-rft up` keeper; psutil).

    .venv/bin/python benchmarks/executor_ab.py --rounds 2 --duration 60 \\
        --out benchmarks/results/executor_ab.json
    .venv/bin/python benchmarks/executor_ab.py --ab omp_wait --rounds 2 --duration 60 \\
        --out benchmarks/results/omp_wait_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.load import Users, get_status  # noqa: E402
from tests.support.stack import launch, stack_command, stop  # noqa: E402
from provenance import record  # noqa: E402

AB = {"executor": {"uni": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                    "mp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}},
      "omp_wait": {"unset": {"OMP_WAIT_POLICY": None}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}}
"""A/B name -> variant -> the environment the stack starts with (None: the variable removed)."""


def _tree_cpu_s(pid: int) -> float:
    """CPU-seconds (user + system) of the processes under ``pid`` now."""
    total = 0.0
    for p in psutil.Process(pid).children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_one(variant: str, env: dict[str, str | None], model: str, duration_s: float, users: int) -> dict:
    """One stack of ``variant`` (started with ``env``: a None value removes that variable) under
    ``users`` closed-loop users for ``duration_s`` seconds."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"executor-ab-{variant}-"))
    cmd = stack_command("", run_dir, "ab", [f"model.path={model}", "trainer.min_batch_size=4"])
    saved = {k: os.environ.pop(k) for k, v in env.items() if v is None and k in os.environ}
    try:
        proc, _, info = launch(cmd, run_dir / "up.log", env={k: v for k, v in env.items() if v is not None})
    finally:
        os.environ.update(saved)
    try:
        url = info["url"]
        time.sleep(5)
        v0, cpu0, t0 = get_status(url)["policy_version"], _tree_cpu_s(proc.pid), time.time()
        with Users(url, users=users) as u:
            time.sleep(duration_s)
        cpu1, t1 = _tree_cpu_s(proc.pid), time.time()
        v1 = get_status(url)["policy_version"]
        ok = [c for c in u.chats if c["ok"]]
        out = {"variant": variant, "startup_seconds": round(info["startup_seconds"], 1),
               "chats_ok": len(ok), "chats_failed": len(u.chats) - len(ok),
               "chats_per_s": round(len(ok) / (t1 - t0), 2),
               "chat_p50_s": round(statistics.median(c["end"] - c["t"] for c in ok), 3) if ok else None,
               "versions_published": v1 - v0, "stack_cpu_s": round(cpu1 - cpu0, 1), "load_s": round(t1 - t0, 1)}
    finally:
        exit_code = stop(proc)
    out["stop_exit"] = exit_code
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ab", choices=sorted(AB), default="executor")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--model", default="", help="a model directory (default: the embedded model)")
    ap.add_argument("--out", default="benchmarks/results/executor_ab.json")
    a = ap.parse_args()
    from serve_rft.config import ModelConfig
    from serve_rft.model.embedded import ensure_embedded_model, resolve_model_path

    model = str(resolve_model_path(a.model, ModelConfig().cache_dir) if a.model
                else ensure_embedded_model(ModelConfig().cache_dir))
    variants = AB[a.ab]
    runs = []
    for r in range(a.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for variant in order:
            runs.append({"round": r, **run_one(variant, variants[variant], model, a.duration, a.users)})
            print(json.dumps(runs[-1]), flush=True)
    summary = {v: {k: statistics.median(x[k] for x in runs if x["variant"] == v)
                   for k in ("startup_seconds", "chats_per_s", "chat_p50_s", "versions_published", "stack_cpu_s")}
               for v in variants}
    result = {**record(), "ab": a.ab, "env": variants, "model": Path(model).name,
              "users": a.users, "duration_s": a.duration, "median": summary, "runs": runs}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
