"""The package's import order: each part imports only from its own floor or the floors below it
(no import circle, no import running back up, function-local imports included); the three runtime
roles (explorer, trainer, synchronizer) stand side by side on one floor and none imports another:
the control plane and the service wire them. Inside the explorer, its engine part never imports
its HTTP part and neither imports the deployment that composes them. docs/architecture.md (Floors)
draws the same floors."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "serve_rft"

FLOORS = [
    {"config", "types", "names", "proc", "model", "demo", "client"},  # ground: settings, records, names, prctl, the rewards client
    {"buffer", "observability", "weights"},         # the experience store, metrics, weight sync
    {"explorer", "trainer", "synchronizer"},        # the runtime roles, side by side (ROLES)
    {"control"},                                    # creates the synchronizer and trainer actors
    {"service", "deploy"},                          # wiring: Ray, Serve, Redis, shutdown; Serve's entry points
    {"cli"},                                        # the command line
]


ROLES = {"explorer", "trainer", "synchronizer"}
"""The replicas (OpenAI HTTP over vLLM), the policy-gradient loop, the rollout state machine."""


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


def test_no_runtime_role_imports_another():
    across = [f"{path.relative_to(PACKAGE)} ({here}) imports {target}"
              for path, here in _files().items() if here in ROLES
              for target in _imports(path) if _room(target) in ROLES - {here}]
    assert not across, "a runtime role imports another (wire them in control/service):\n" + "\n".join(across)


# Inside the explorer: the engine part under the HTTP part under the deployment that composes them.
EXPLORER = PACKAGE / "explorer"
EXPLORER_PARTS = ["engine", "http", "deployment"]  # bottom to top; deployment: the modules directly
# under explorer/ (replica.py composes the parts; weight_swap.py, router.py)
WEB_FRAMEWORKS = ("fastapi", "starlette")


def _part(module: str) -> str:
    """``serve_rft.explorer.http.auth`` and ``serve_rft.explorer.http`` -> ``http``;
    ``serve_rft.explorer.replica`` -> ``deployment``."""
    parts = module.split(".")
    nested = len(parts) > 3 or len(parts) == 3 and (EXPLORER / parts[2]).is_dir()
    return parts[2] if nested else "deployment"


def _explorer_imports(path: Path) -> tuple[set[str], set[str]]:
    """(the serve_rft.explorer modules ``path`` imports, the top-level names of all it imports),
    at module level or inside functions. ``from serve_rft.explorer.http import auth`` counts as
    ``serve_rft.explorer.http.auth``."""
    inner, top = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        top |= {n.split(".")[0] for n in names}
        for name in names:
            if name.startswith("serve_rft.explorer.") and _is_module(name):
                inner.add(name)
    return inner, top


def _is_module(name: str) -> bool:
    """Whether dotted ``name`` is a module or package of the source tree (not a class in one)."""
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def test_explorer_engine_never_imports_http_and_neither_part_imports_the_deployment():
    rank = {part: i for i, part in enumerate(EXPLORER_PARTS)}
    files = {p: _part("serve_rft." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
             for p in EXPLORER.rglob("*.py") if p.name != "__init__.py"}
    assert set(files.values()) == set(EXPLORER_PARTS), files
    upward, web = [], []
    for path, here in files.items():
        inner, top = _explorer_imports(path)
        for target in inner:
            there = _part(target)
            if there not in rank or rank[there] > rank[here]:
                upward.append(f"{path.relative_to(PACKAGE)} ({here}) imports {target} ({there})")
        if here == "engine" and top & set(WEB_FRAMEWORKS):
            web.append(f"{path.relative_to(PACKAGE)} imports {sorted(top & set(WEB_FRAMEWORKS))}")
    assert not upward, "explorer imports running back up:\n" + "\n".join(upward)
    assert not web, "the engine part knows no HTTP framework:\n" + "\n".join(web)
