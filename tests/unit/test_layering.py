"""The package's import order: each runtime role imports only from the floors below it (no import
circle, no import running back up, function-local imports included). docs/architecture.md
(Floors) draws the same floors."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "serve_rft"

FLOORS = [
    {"config", "types", "names", "proc", "model", "demo"},  # ground: settings, records, names, prctl
    {"buffer", "observability", "weights"},         # the experience store, metrics, weight sync
    {"synchronizer"},                               # rollout state machine and its actor
    {"trainer"},                                    # the policy-gradient loop
    {"control"},                                    # creates the synchronizer and trainer actors
    {"explorer"},                                   # the replicas: OpenAI HTTP over vLLM
    {"service"},                                    # wiring: Ray, Serve, Redis, shutdown
    {"cli"},                                        # the command line
]


def _room(module: str) -> str:
    """``serve_rft.trainer.actor`` -> ``trainer``; ``serve_rft.cli`` -> ``cli``."""
    return module.split(".")[1]


def _files() -> dict[Path, str]:
    """Every module of the package (its bare ``__init__.py`` aside) -> its room."""
    return {p: _room("serve_rft." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
            for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"}


def _imports(path: Path) -> set[str]:
    """Every serve_rft module ``path`` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("serve_rft.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("serve_rft."):
                out.add(node.module)
            elif node.module == "serve_rft":
                out |= {f"serve_rft.{a.name}" for a in node.names}
    return out


def test_every_import_goes_to_the_same_or_a_lower_floor():
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    files = _files()
    rooms = set(files.values())
    assert rooms <= set(floor), f"rooms with no floor: {rooms - set(floor)}"
    upward = []
    for path, here in files.items():
        for target in _imports(path):
            there = _room(target)
            if floor[there] > floor[here]:
                upward.append(f"{path.relative_to(PACKAGE)} ({here}) imports {target} ({there})")
    assert not upward, "imports running back up:\n" + "\n".join(upward)
