"""The docs site builds strictly, the README stays short, and no page carries project history.

`mkdocs build --strict` turns every warning (a broken link, a page missing from the nav, an
unknown anchor) into a failure; the committed OpenAPI document must equal what the app builds.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docs_site import build_site

ROOT = Path(__file__).resolve().parents[2]
README_MAX_BYTES = 12_288
# history wording: "commit 3f3248e", "at aeaf0be", "(5b094ad, ...)"; checksums in JSON are not prose
HASH_IN_PROSE = re.compile(r"\b(?:commit|commits|at|in|since|until)\s+`?[0-9a-f]{7,40}\b`?"
                           r"|\([0-9a-f]{7,12}[,)]")
HISTORY_WORDS = re.compile(r"\bthis session\b|\bthese sessions\b", re.IGNORECASE)


def _prose_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "deployments" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `mkdocs build --strict` writes it (offline: no plugin fetches anything)."""
    return build_site(tmp_path_factory.mktemp("docs") / "site")


def test_mkdocs_build_strict_succeeds(site):
    assert (site / "index.html").exists()
    config_page = (site / "reference" / "config" / "index.html").read_text()
    for field in ("reward_timeout_s", "sync_method", "max_staleness", "api_keys"):
        assert field in config_page, f"generated config reference lacks {field}"
    http_page = (site / "reference" / "http" / "index.html").read_text()
    for route in ("/v1/rewards", "/v1/chat/completions", "/v1/experiences/{completion_id}"):
        assert route in http_page, f"generated HTTP reference lacks {route}"


def test_readme_links_into_the_docs_resolve(site):
    """Every ``docs/...md#anchor`` link of README.md names a built page and an anchor on it."""
    missing = []
    for link in sorted(set(re.findall(r"\]\((docs/[^)]+)\)", (ROOT / "README.md").read_text()))):
        path, _, anchor = link.partition("#")
        rel = path[len("docs/"):-len(".md")]
        page = site / ("index.html" if rel == "index" else f"{rel}/index.html")
        if not page.exists() or (anchor and f'id="{anchor}"' not in page.read_text()):
            missing.append(link)
    assert not missing, f"README links without a page or anchor: {missing}"


def test_config_reference_never_shows_keys_from_the_environment(monkeypatch):
    """Defaults computed from the environment (API keys, tenants) are described, never called."""
    monkeypatch.setenv("SERVE_RFT_API_KEYS", "sk-marker-inference")
    monkeypatch.setenv("SERVE_RFT_ADMIN_KEYS", "sk-marker-admin")
    monkeypatch.setenv("SERVE_RFT_TENANTS", '{"t": {"api_keys": ["sk-marker-tenant"]}}')
    monkeypatch.syspath_prepend(str(ROOT / "docs"))
    import hooks

    page = hooks.config_reference()
    assert "api_keys" in page and "sk-marker" not in page


def test_readme_fits_the_budget():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, budget {README_MAX_BYTES}"


def test_no_commit_hash_or_session_wording_in_prose():
    found = []
    for path in _prose_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HASH_IN_PROSE.search(line) or HISTORY_WORDS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "history in prose:\n" + "\n".join(found)


def test_committed_openapi_document_is_what_the_app_builds():
    result = subprocess.run([sys.executable, "scripts/openapi_json.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def _site_openapi():
    """(the committed OpenAPI document, the site's examples, the site's copy built by docs/hooks.py)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    doc, examples = hooks._openapi()
    return doc, examples, hooks.site_openapi(doc, examples)


def test_http_examples_are_valid_requests():
    """Every request example of docs/reference/http_examples.yaml validates against its route's
    body schema in the committed OpenAPI document, names a route that exists, and every reward
    example parses with the service's own parser."""
    from jsonschema import Draft202012Validator

    from serve_rft.explorer.http.protocol import parse_reward_body

    doc, examples, _ = _site_openapi()
    checked = 0
    for path, methods in examples.items():
        for method, ours in methods.items():
            assert method in doc["paths"].get(path, {}), f"{method.upper()} {path} is not a route"
            for name, example in (ours.get("request") or {}).items():
                schema = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
                errors = [e.message for e in Draft202012Validator(
                    {**schema, "components": doc["components"]}).iter_errors(example["value"])]
                assert not errors, f"{path} example {name!r}: {errors[:3]}"
                if path == "/v1/rewards":
                    parse_reward_body(example["value"])
                checked += 1
    assert checked >= 15


def test_site_openapi_marks_every_refused_field():
    """The Swagger UI document marks each field the service refuses (deprecated, **Refused**
    first in its description) on both chat and completions, and nothing else."""
    from serve_rft.explorer.http.openai_request import REFUSED

    doc, _, site = _site_openapi()
    for path in ("/v1/chat/completions", "/v1/completions"):
        props = site["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        original = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        refused = {n for n, p in props.items() if (p.get("description") or "").startswith("**Refused**")}
        assert refused == set(REFUSED) & set(props), path
        assert all(props[n].get("deprecated") for n in refused), path
        assert {n for n, p in props.items() if p.get("deprecated")} - refused == \
            {n for n, p in original.items() if p.get("deprecated")}, path  # vLLM's own marks kept
        assert "400" in site["paths"][path]["post"]["responses"]


def test_python_reference_is_the_public_surface(site):
    """The Python reference shows the app builder, the rewards client and every config model with
    its fields (griffe-pydantic), and no internal module."""
    page = (site / "reference" / "python" / "index.html").read_text()
    for name in ("serve_rft.deploy.app_builder", "RewardClient", "load_config", "reward_timeout_s",
                 "sync_method", "max_staleness"):
        assert name in page, f"the Python reference lacks {name}"
    assert page.count("doc-label-pydantic-model") >= 16, "config models rendered without their fields"
    for internal in ("buffer", "trainer", "synchronizer", "weights", "explorer"):
        assert f'id="serve_rft.{internal}' not in page, f"the Python reference documents serve_rft.{internal}"
