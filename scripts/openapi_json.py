"""Write the service's OpenAPI document to docs/reference/openapi.json.

The document is what a replica serves at ``/openapi.json``: `serve_rft.explorer.http.openapi.build_openapi`
of the FastAPI app in `serve_rft.explorer.http.app` after ``serve.ingress(app)(ExplorerReplica)``, as
`serve_rft.service.app` binds it (Ray Serve turns the replica's methods into the app's routes). Building it imports vLLM (its request models are the chat and completion bodies), so the
docs build reads the committed file; ``tests/unit/test_docs.py`` fails when the file differs from
what the app builds.

Usage: ``.venv/bin/python scripts/openapi_json.py [--check]`` (``--check``: exit 1 if the file is stale).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "docs" / "reference" / "openapi.json"


def build() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the replica's app (imports vLLM: seconds)."""
    from ray import serve

    from serve_rft.explorer.http.openapi import build_openapi
    from serve_rft.explorer.replica import ExplorerReplica, app

    serve.ingress(app)(ExplorerReplica)
    return build_openapi(app)


def render(doc: dict[str, Any]) -> str:
    """``doc`` as the committed text: sorted keys, two-space indent, a final newline."""
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> int:
    """Write (or with ``--check`` compare) docs/reference/openapi.json; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = parser.parse_args()
    text = render(build())
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run scripts/openapi_json.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
