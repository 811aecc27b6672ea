"""Summarize a test-suite timeline: per worker and test module, when it started and ended (s
from the run's first phase), its set-up / call / tear-down seconds and its number of tests;
then when the run ended. The timeline is what ``SERVE_RFT_TEST_TIMELINE=FILE`` makes each
pytest worker write (tests/conftest.py); the unit tests count as one module, ``unit``.

    SERVE_RFT_TEST_TIMELINE=/tmp/timeline.jsonl .venv/bin/python -m pytest -q tests
    python3 scripts/suite_timeline.py /tmp/timeline.jsonl
"""

from __future__ import annotations

import json
import sys


def summarize(lines: list[str]) -> list[str]:
    """One line per (worker, module), ordered by start, then ``end <seconds>``."""
    rows = [json.loads(line) for line in lines if line.strip()]
    t0 = min(r["start"] for r in rows)
    mods: dict[tuple[str, str], dict] = {}
    for r in sorted(rows, key=lambda r: r["start"]):
        path = r["nodeid"].split("::")[0]
        mod = "unit" if "/unit/" in path else path.rsplit("/", 1)[-1].removesuffix(".py")
        m = mods.setdefault((r["worker"], mod), {"start": r["start"], "stop": r["stop"], "setup": 0.0,
                                                 "call": 0.0, "teardown": 0.0, "n": 0})
        m["stop"] = max(m["stop"], r["stop"])
        m[r["when"]] += r["stop"] - r["start"]
        m["n"] += r["when"] == "call"
    out = [f"{w} {mod:32s} {m['start'] - t0:7.0f} {m['stop'] - t0:7.0f}  set-up {m['setup']:5.0f}  "
           f"call {m['call']:5.0f}  tear-down {m['teardown']:4.0f}  tests {m['n']}"
           for (w, mod), m in sorted(mods.items(), key=lambda kv: kv[1]["start"])]
    return out + [f"end {max(r['stop'] for r in rows) - t0:.0f}"]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(summarize(f.readlines())))
