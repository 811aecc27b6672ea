"""The published results say how they were made and carry nothing of the machine's file system.

Every file under ``benchmarks/results/`` is free of machine paths (``/tmp/``, ``/work/``,
``/home/``, ``/root/``, this checkout's own path) and of git ids (7 to 40 hex digits with a letter
and a digit, as a short or full commit hash is written), as the docs are
(tests/unit/test_docs.py). Every JSON result records `provenance.REQUIRED` (the command that
reproduces it, the machine, the code version and the date, as `benchmarks/provenance.py`'s
``record()`` writes them).

Each result's command runs a committed script that writes that very file, and every result the
README or the docs cite is in ``benchmarks/results/``.

Shown to fail: a result with ``"model": "/root/.cache/..."``, a command with ``--before ef2d263``,
a regenerated result without ``"date"``, a command with ``--out /elsewhere/x.json`` or a docs
citation of a missing result each fail one test below.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import REQUIRED  # noqa: E402

MACHINE_PATH = re.compile("|".join([r"/tmp/", r"/work/", r"/home/", r"/root/", r"/Users/",
                                    re.escape(str(ROOT))]))
# a git id as written: 7-40 hex digits, at least one letter and one digit, not part of a longer
# word or number (a float's digits, a SHA-256 digest of 64 digits and words like "deadline" pass)
GIT_ID = re.compile(r"(?<![0-9A-Za-z_.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")

def _files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def _jsons() -> list[Path]:
    return [p for p in _files() if p.suffix == ".json"]


def _strings(value, where: str = ""):
    """Every string of a JSON value, keys included, with where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{where}/{key} (key)", key
            yield from _strings(item, f"{where}/{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value


def test_no_machine_path_in_any_result_file():
    found = [f"{p.relative_to(RESULTS)}: {m.group(0)!r}" for p in _files()
             for m in MACHINE_PATH.finditer(p.read_bytes().decode("latin-1"))]
    assert not found, "machine paths in benchmarks/results/:\n" + "\n".join(found)


def test_no_git_id_in_any_result():
    found = [f"{p.name}{where}: {text[:120]!r}" for p in _jsons()
             for where, text in _strings(json.loads(p.read_text())) if GIT_ID.search(text)]
    assert not found, "git ids in benchmarks/results/ (name the code by its version):\n" + "\n".join(found)


def test_results_record_their_provenance():
    missing = {}
    for path in _jsons():
        result = json.loads(path.read_text())
        lacks = [f for f in REQUIRED if f not in result]
        if not lacks:
            if not result["command"].startswith((".venv/bin/python benchmarks/", ".venv/bin/python scripts/",
                                                 "python3 scripts/suite_time.py")):  # run before the venv exists
                lacks.append("command from the repository root")
            if not {"cpus_logical", "cpu_model", "load_average_1min"} <= set(result["machine"]):
                lacks.append("machine as provenance.machine() gives it")
            if set(result["code_version"]) != {"serve_rft", "source_sha256"}:
                lacks.append("code_version as provenance.code_version() gives it")
            if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["date"]):
                lacks.append("date as YYYY-MM-DD")
        if lacks:
            missing[path.name] = lacks
    assert not missing, f"results without their provenance: {missing}"


def test_each_recorded_command_runs_a_committed_script_that_writes_this_result():
    """A result's command reproduces this file: its script is in the repository, and its
    ``--out`` names the file, or (no ``--out``) the script's own default output names it.
    Shown to fail with a result whose command writes elsewhere (``--out /tmp/x.json`` or a
    results file renamed after its run)."""
    import shlex

    wrong = {}
    for path in _jsons():
        argv = shlex.split(json.loads(path.read_text())["command"])
        scripts = [a for a in argv if a.endswith(".py")]
        if not scripts or not (ROOT / scripts[0]).is_file():
            wrong[path.name] = f"no committed script in {argv}"
            continue
        outs = [b for a, b in zip(argv, argv[1:]) if a == "--out"] + [a[6:] for a in argv if a.startswith("--out=")]
        rel = str(path.relative_to(ROOT))
        if outs and outs[-1] != rel:
            wrong[path.name] = f"--out {outs[-1]}"
        elif not outs and path.name not in (ROOT / scripts[0]).read_text():
            wrong[path.name] = f"{scripts[0]} does not write it by default"
    assert not wrong, f"results whose command does not write them: {wrong}"


def test_every_result_the_docs_cite_exists():
    """A figure's source named in the README or the docs (``benchmarks/results/...``) is a file;
    a family written as a pattern (``trainer_throughput_qwen05b_cpu_{impl}_fp32.json``, ``[_lora16]``
    optional) names at least one. Shown to fail with a citation of a result that is not there."""
    cited = {m.group(0) for f in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
             for m in re.finditer(r"benchmarks/results/[^\s)`'\"]*\.(?:json|png|csv)", f.read_text())}
    absent = [c for c in sorted(cited)
              if not list(ROOT.glob(re.sub(r"\*+", "*", re.sub(r"\{[^}]*\}|\[[^\]]*\]", "*", c))))]
    assert len(cited) > 20 and not absent, f"cited in the docs, not in benchmarks/results/: {absent}"


def test_the_patterns_catch_what_they_are_for():
    assert MACHINE_PATH.search('"model": "/root/.cache/serve_rft/embedded-qwen2-v2"')
    assert MACHINE_PATH.search(f"--out {ROOT}/x.json")
    assert GIT_ID.search("benchmarks/log_ab.py --before ef2d263")
    assert GIT_ID.search("at 3f3248e0c2b5a1f4d9e8c7b6a5f4e3d2c1b0a9f8.")
    for fine in ("0.00182", "1.76837158203125e-05", "deadline", "embedded-qwen2-v2", "a" * 64,
                 "9fdf93f6d402ce572ef02c4ea4f5f203327790341a4ec88f3f26179479b72541"):
        assert not GIT_ID.search(fine), fine
