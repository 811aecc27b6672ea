"""Sample the machine's CPU use beside a run: every ``period`` seconds, append one line
``UNIX_TIME BUSY`` (the busy fraction of all cores since the last sample, from ``/proc/stat``)
to FILE, until killed; with ``--summary`` read FILE instead and print the median and mean busy
fraction of the samples from ``--since`` to ``--until`` (UNIX times; default: all).

    python3 scripts/cpu_busy.py /tmp/cpu.txt &          # beside `bash .ci/run`
    python3 scripts/cpu_busy.py /tmp/cpu.txt --summary --since 1795706078 --until 1795707813

Linux only (``/proc/stat``: user nice system idle iowait ... jiffies; busy = 1 - (idle + iowait)
/ total)."""

from __future__ import annotations

import argparse
import statistics
import time


def _jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def sample(path: str, period_s: float) -> None:
    """Append a sample to ``path`` every ``period_s`` seconds, forever."""
    last = _jiffies()
    with open(path, "a") as out:
        while True:
            time.sleep(period_s)
            now = _jiffies()
            total, idle = now[0] - last[0], now[1] - last[1]
            out.write(f"{time.time():.0f} {1 - idle / max(1, total):.2f}\n")
            out.flush()
            last = now


def summary(path: str, since: float = 0.0, until: float = float("inf")) -> str:
    """Median and mean busy fraction of the samples taken from ``since`` to ``until``."""
    busy = [float(b) for t, b in (line.split() for line in open(path)) if since <= float(t) <= until]
    return f"{len(busy)} samples: busy median {statistics.median(busy):.2f}, mean {statistics.fmean(busy):.2f}"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--period", type=float, default=10.0)
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--since", type=float, default=0.0)
    ap.add_argument("--until", type=float, default=float("inf"))
    a = ap.parse_args()
    print(summary(a.file, a.since, a.until)) if a.summary else sample(a.file, a.period)
