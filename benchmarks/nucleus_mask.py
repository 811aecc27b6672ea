"""Time the trainer's nucleus (top-p) mask: vLLM's full sort (`top_p_keep`) against the top-k
path with a full-sort fallback (`nucleus_keep`), on ``[rows, vocab]`` fp32 logits of Qwen2's
vocabulary size (151,936 words).

Two kinds of rows: *peaked* (``randn * 10``: a nucleus of a few words at top_p 0.9, like a trained
model's next-token distribution) and *flat* (``randn * 1``: a nucleus of most of the vocabulary,
like a random-init model's, where every row falls back to the full sort). Both results are
checked equal before timing.

    .venv/bin/python benchmarks/nucleus_mask.py --out benchmarks/results/nucleus_mask_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import record  # noqa: E402  (benchmarks/, the script's folder)


def main(argv: list[str] | None = None) -> None:
    import torch

    from serve_rft.trainer.policy.nucleus import NUCLEUS_TOPK, nucleus_keep, top_p_keep

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="tokens per call (NUCLEUS_ROWS in the trainer)")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for kind, scale in (("peaked", 10.0), ("flat", 1.0)):
        logits = (torch.randn(args.rows, args.vocab, generator=g) * scale).to(args.device)
        ps = torch.full((args.rows,), args.top_p, device=args.device)
        exact = top_p_keep(logits, ps)
        assert torch.equal(nucleus_keep(logits, ps), exact), kind
        row = {"kind": kind, "nucleus_words_mean": float(exact.sum(-1).float().mean())}
        for name, fn in (("full_sort", top_p_keep), ("topk_then_fallback", nucleus_keep)):
            times = []
            for _ in range(args.repeats):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(logits, ps)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            row[f"{name}_s"] = round(statistics.median(times), 4)
        row["speedup"] = round(row["full_sort_s"] / row["topk_then_fallback_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            **record(None if argv is None else [__file__, *argv]),
            "device": args.device, "threads": args.threads, "rows": args.rows, "vocab": args.vocab,
            "top_p": args.top_p, "topk": NUCLEUS_TOPK, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
