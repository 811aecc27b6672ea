"""How much of the gap to plain vLLM is the Ray Serve proxy hop (a lead for closing it)?

Starts ``serve-rft up --mode serve`` (one replica) with Ray Serve's direct ingress on
(``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``): the proxy still answers on the service port, and the
replica itself listens on ``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`` (30000). Runs the same
streaming load (`vs_vllm.run_load`) through the proxy and straight to the replica, alternating,
``--rounds`` times per concurrency level. Not a product path: with several replicas nothing
routes across the replicas' ports, and drain-aware routing lives in the proxy. This probe led to
``service.ingress=haproxy`` (serve_rft/service/ingress.py), which is now the default.

    .venv/bin/python benchmarks/direct_ingress_probe.py [--levels 1 16] [--rounds 2] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_vllm import stop, wait_http  # noqa: E402
from vs_vllm import run_load, start_ours  # noqa: E402
from provenance import command, machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/direct_ingress_probe.json")
    a = ap.parse_args()
    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"  # inherited by serve-rft up and its Ray
    port = int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "30000"))
    work = Path(tempfile.mkdtemp(prefix="srft-direct-"))
    proc, proxy_url = start_ours(work / "run", work / "ours.log", ingress="proxy")
    direct_url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_http(f"{direct_url}/health", proc, timeout_s=60)
        asyncio.run(run_load(proxy_url, max(a.levels), 5.0, a.max_tokens))
        for r in range(a.rounds):
            for level in a.levels:
                for path, url in (("proxy", proxy_url), ("direct", direct_url)):
                    res = asyncio.run(run_load(url, level, a.duration, a.max_tokens))
                    rows.append({"round": r, "concurrency": level, "path": path, **res})
                    print(json.dumps({"round": r, "concurrency": level, "path": path,
                                      "tokens_per_s": round(res["output_tokens_per_s"], 1),
                                      "errors": res["errors"]}), flush=True)
    finally:
        stop(proc)
    out = {"command": command(), "args": vars(a), "machine": machine(), "runs": rows}
    Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
