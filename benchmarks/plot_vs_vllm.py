"""Plot and tabulate a `benchmarks/vs_vllm.py` result: the ratio of output tokens/s (ours / vLLM)
against concurrency with its bootstrap 95 % interval as whiskers, streaming and non-streaming,
one panel per work (logprobs asked on both sides, or none), and the TTFT p50 difference (ms)
below; the goals of the comparison as dashed lines (0.97 with logprobs, 0.90 without, +5 ms).
Prints the Markdown tables of the Performance page (ratios, CPU per 1,000 output tokens per
process class, idle CPU, what else ran).

    .venv/bin/python benchmarks/plot_vs_vllm.py [benchmarks/results/vs_vllm.json] [--png docs/assets/vs_vllm.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GOAL_RATIO = {"logprobs": 0.97, "plain": 0.90}
GOAL_TTFT_MS = 5.0
MODES = {"stream": "streaming", "non_stream": "non-streaming"}
COLORS = {"stream": "tab:orange", "non_stream": "tab:blue"}
CLASS_NAMES = {"front_end": "front end", "engine": "engine", "logging": "logging (Redis)",
               "ray_system": "Ray system", "other": "other"}


def cells(res: dict) -> dict[str, dict[str, list[tuple[int, dict]]]]:
    """``results`` keys ``work/mode/cN`` -> work -> mode -> [(N, summary)] sorted by N."""
    out: dict[str, dict[str, list[tuple[int, dict]]]] = {}
    for key, v in res["results"].items():
        work, mode, c = key.split("/")
        out.setdefault(work, {}).setdefault(mode, []).append((int(c[1:]), v))
    for modes in out.values():
        for rows in modes.values():
            rows.sort(key=lambda r: r[0])
    return out


def plot(res: dict, png: Path) -> None:
    """Write the figure (module docstring) to ``png`` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_work = cells(res)
    works = [w for w in ("logprobs", "plain") if w in by_work]
    fig, axes = plt.subplots(2, len(works), figsize=(5.2 * len(works), 7), squeeze=False, sharex=True)
    for j, work in enumerate(works):
        top, bottom = axes[0][j], axes[1][j]
        for k, (mode, rows) in enumerate(sorted(by_work[work].items())):
            shift = 1.04 if k else 0.96  # side by side whiskers at one level
            for ax, key in ((top, "output_tokens_per_s_ratio"), (bottom, "ttft_p50_diff_ms")):
                pts = [(c * shift, v[key]) for c, v in rows if v.get(key, {}).get("median") is not None]
                if not pts:
                    continue
                xs, meds = [p[0] for p in pts], [p[1]["median"] for p in pts]
                err = [[m - p[1]["ci95"][0] for m, p in zip(meds, pts)], [p[1]["ci95"][1] - m for m, p in zip(meds, pts)]]
                ax.errorbar(xs, meds, yerr=err, marker="o", capsize=4, label=MODES.get(mode, mode),
                            color=COLORS.get(mode))
        top.axhline(GOAL_RATIO.get(work, 1.0), ls="--", color="grey", lw=1, label=f"goal {GOAL_RATIO.get(work, 1.0)}")
        top.axhline(1.0, color="black", lw=0.6)
        top.set_title(f"vLLM asked for {'the same logprobs' if work == 'logprobs' else 'no logprobs'}")
        top.set_ylabel("output tokens/s, ours / vLLM (median, 95 % CI)")
        bottom.axhline(GOAL_TTFT_MS, ls="--", color="grey", lw=1, label=f"goal +{GOAL_TTFT_MS:g} ms")
        bottom.axhline(0.0, color="black", lw=0.6)
        bottom.set_ylabel("TTFT p50, ours - vLLM (ms, streaming)")
        bottom.set_xlabel("concurrent requests")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    levels = sorted({c for modes in by_work.values() for rows in modes.values() for c, _ in rows})
    for ax in axes[1]:
        ax.set_xticks(levels, [str(c) for c in levels])
    fig.suptitle(f"serve_rft (one replica, logging on) against vLLM's OpenAI server, "
                 f"{res['machine']['cpus_logical']} CPU cores", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def _ci(d: dict, fmt: str = "{:.2f}") -> str:
    if not d or d.get("median") is None:
        return "-"
    lo, hi = d["ci95"]
    return f"**{fmt.format(d['median'])}** ({fmt.format(lo)} to {fmt.format(hi)})"


def tables(res: dict) -> str:
    """The Markdown tables of the Performance page for one result."""
    lines = [("| vLLM asked for | requests | concurrency | output tokens/s ours / vLLM | ratio (95 % CI) "
              "| TTFT p50 ours / vLLM | TTFT p50 difference, ms (95 % CI) | failed |"), "|---|---|---|---|---|---|---|---|"]
    by_work = cells(res)
    for work, modes in by_work.items():
        for mode, rows in sorted(modes.items(), key=lambda kv: kv[0] != "stream"):
            for c, v in rows:
                o, b = v["ours"], v["vllm"]
                ttft = (f"{1000 * o['ttft_p50_s']:.1f} / {1000 * b['ttft_p50_s']:.1f} ms"
                        if "ttft_p50_s" in o and mode == "stream" else "-")
                lines.append(f"| {'logprobs' if work == 'logprobs' else 'none'} | {MODES[mode]} | {c} "
                             f"| {o['output_tokens_per_s']:,.0f} / {b['output_tokens_per_s']:,.0f} "
                             f"| {_ci(v['output_tokens_per_s_ratio'])} | {ttft} "
                             f"| {_ci(v.get('ttft_p50_diff_ms', {}), '{:+.1f}')} "
                             f"| {v['errors']['ours']} / {v['errors']['vllm']} |")
    lines += ["", ("| vLLM asked for | requests | concurrency | ours: front end / engine / logging / Ray system / other "
                   "| ours total | vLLM: API server / engine | vLLM total | ours front end + logging / vLLM API server (95 % CI) |"),
              "|---|---|---|---|---|---|---|---|"]
    for work, modes in by_work.items():
        for mode, rows in sorted(modes.items(), key=lambda kv: kv[0] != "stream"):
            for c, v in rows:
                o, b = v["cpu_s_per_1k_tokens"]["ours"], v["cpu_s_per_1k_tokens"]["vllm"]
                lines.append(f"| {'logprobs' if work == 'logprobs' else 'none'} | {MODES[mode]} | {c} "
                             f"| {' / '.join(f'{o[k]:.2f}' for k in CLASS_NAMES)} | {sum(o.values()):.2f} "
                             f"| {b['front_end']:.2f} / {b['engine']:.2f} | {sum(b.values()):.2f} "
                             f"| {_ci(v['front_end_plus_logging_to_vllm_front_end'])} |")
    lines += ["", "| process class | ours, idle before / after (CPU-s per s) | vLLM, idle before / after |",
              "|---|---|---|"]
    idle = [res[k] for k in ("idle_before", "idle_after") if k in res]
    for cls, name in CLASS_NAMES.items():
        ours = " / ".join(f"{w['cpu_s_per_s']['ours'][cls]:.3f}" for w in idle)
        theirs = " / ".join(f"{w['cpu_s_per_s']['vllm'][cls]:.3f}" for w in idle)
        lines.append(f"| {name} | {ours} | {theirs} |")
    if "whole_run" in res:
        w = res["whole_run"]
        lines += ["", f"Whole run: {w['seconds']:.0f} s, machine busy {w['machine_busy_cpu_s']:.0f} CPU-s; "
                  f"ours {sum(w['trees']['ours']['by_class'].values()):.0f}, vLLM "
                  f"{sum(w['trees']['vllm']['by_class'].values()):.0f}, load generator "
                  f"{w['load_generator_cpu_s']:.0f}, everything else {w['other_cpu_s']:.1f} CPU-s; "
                  f"busiest others: " + "; ".join(f"{p['cmd'][:60]} {p['cpu_s']:.1f}" for p in w["top_other"][:5])]
    loads = [r[s]["cpu"]["loadavg_1m"] for v in res["results"].values() for r in v["runs"] for s in ("ours", "vllm")]
    lines.append(f"1-minute load average at the end of each run: {min(loads):.2f}-{max(loads):.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="?", default="benchmarks/results/vs_vllm.json")
    ap.add_argument("--png", default="docs/assets/vs_vllm.png")
    a = ap.parse_args()
    res = json.loads(Path(a.json).read_text())
    plot(res, Path(a.png))
    print(tables(res))


if __name__ == "__main__":
    main()
