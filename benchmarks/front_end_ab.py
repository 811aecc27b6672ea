"""serve_rft against itself: two run configs side by side, CPU per output token of each front end.

Starts two ``serve-rft up --mode serve`` stacks (one replica each, `vs_vllm.start_ours`): A with
the ``--a`` overrides and the ``--a-env`` environment (``VAR=value``: read by the Ray cluster the
stack starts, e.g. Ray Serve's ``RAY_SERVE_HAPROXY_NBTHREAD``), B with ``--b`` and ``--b-env``
(none: the defaults). Both stay up while the
runs alternate between them in pairs (A then B in even rounds, B then A in odd ones), so the
machine's drift and the idle stack's own spin fall on both alike. Each run is `vs_vllm.measure`:
the `vs_vllm.run_load` load (chat, logprobs asked, ``--max-tokens``) at ``--concurrency`` for
``--duration`` s while `proc_cpu.Sampler` snapshots every process.

Per pair: B / A of output tokens/s and of front-end CPU seconds per 1,000 output tokens (HAProxy +
the Serve replica process: our HTTP server, vLLM's serving classes, the engine tap, logging), with
the median and a percentile-bootstrap 95 % interval over the pairs (`vs_vllm.bootstrap_median`).

    .venv/bin/python benchmarks/front_end_ab.py --a explorer.user_code_loop_thread=true \\
        [--b ...] [--a-env VAR=value ...] [--b-env ...] [--concurrency 16] [--rounds 5] \\
        [--duration 15] [--non-stream] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_vllm import stop  # noqa: E402
from vs_vllm import bootstrap_median, measure, run_load, start_ours  # noqa: E402
from provenance import command, machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="*", default=[], help="run-config overrides of stack A (section.field=value)")
    ap.add_argument("--b", nargs="*", default=[], help="run-config overrides of stack B (none: the defaults)")
    ap.add_argument("--a-env", nargs="*", default=[], help="environment of stack A's processes (VAR=value)")
    ap.add_argument("--b-env", nargs="*", default=[], help="environment of stack B's processes (VAR=value)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="A-B pairs")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of load per run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--non-stream", action="store_true", help="non-streaming requests (default: streaming)")
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between process snapshots")
    ap.add_argument("--out", default="benchmarks/results/front_end_ab.json")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    envs = {}
    for side, given in (("A", a.a_env), ("B", a.b_env)):
        if any("=" not in p or not p.split("=", 1)[0] for p in given):
            ap.error(f"--{side.lower()}-env takes VAR=value")
        envs[side] = dict(p.split("=", 1) for p in given)
    stream = not a.non_stream
    work = Path(tempfile.mkdtemp(prefix="srft-fe-ab-"))
    procs, urls = {}, {}
    with contextlib.ExitStack() as up:  # every stack ends by its process group, even if one stop fails
        for side, sets in (("A", a.a), ("B", a.b)):
            procs[side], urls[side] = start_ours(work / side, work / f"{side}.log", overrides=tuple(sets),
                                                 env=envs[side])
            up.callback(stop, procs[side])
        for url in urls.values():  # warm-up
            asyncio.run(run_load(url, a.concurrency, 4.0, a.max_tokens, stream, True))
        roots = {side: p.pid for side, p in procs.items()}
        pairs = []
        for r in range(a.rounds):
            runs = {}
            for side in (("A", "B") if r % 2 == 0 else ("B", "A")):
                runs[side] = measure(urls[side], side, roots, a.concurrency, a, stream, True)
                if not runs[side]["output_tokens"]:
                    raise RuntimeError(f"stack {side} answered no token in round {r}: {runs[side]['error_samples']}")
                c = runs[side]["cpu_s_per_1k_tokens"]
                print(json.dumps({"round": r, "side": side, "tok_s": round(runs[side]["output_tokens_per_s"], 1),
                                  "front_end_cpu_s_per_1k": round(c["front_end"], 4),
                                  "errors": runs[side]["errors"]}), flush=True)
            pairs.append(runs)

    def per_side(figure):
        return {s: statistics.median(figure(p[s]) for p in pairs) for s in ("A", "B")}

    fe = [p["B"]["cpu_s_per_1k_tokens"]["front_end"] / p["A"]["cpu_s_per_1k_tokens"]["front_end"] for p in pairs]
    tok = [p["B"]["output_tokens_per_s"] / p["A"]["output_tokens_per_s"] for p in pairs]
    out = {"command": command(),
           "args": vars(a), "machine": machine(),
           "output_tokens_per_s": per_side(lambda run: run["output_tokens_per_s"]),
           "front_end_cpu_s_per_1k_tokens": per_side(lambda run: run["cpu_s_per_1k_tokens"]["front_end"]),
           "b_over_a": {"output_tokens_per_s": bootstrap_median(tok), "front_end_cpu_s_per_1k_tokens": bootstrap_median(fe)},
           "errors": {s: sum(p[s]["errors"] for p in pairs) for s in ("A", "B")},
           "pairs": pairs}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("output_tokens_per_s", "front_end_cpu_s_per_1k_tokens", "b_over_a", "errors")},
                     indent=1))


if __name__ == "__main__":
    main()
