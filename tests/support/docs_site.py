"""The docs site as ``mkdocs build --strict`` writes it (tests/unit/test_docs.py and
test_docs_browser.py build it, each into its own temporary folder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_site(out: Path) -> Path:
    """Build the site into ``out`` (offline: no plugin fetches anything) and return ``out``.

    Raises:
        AssertionError: the build failed or warned (``strict``), with mkdocs' output.
    """
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    return out
