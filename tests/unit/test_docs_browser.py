"""The built docs site as a reader sees it: headless Chromium (Debian's ``chromium``, driven by
Playwright) opens it from a local server with every request off this server refused, and the
diagrams, figures, tables and the Swagger UI reference must render.

`test_diagrams_and_figures_render_offline` fails when Mermaid is not served with the site:
with ``extra_javascript`` in mkdocs.yml pointing at a file that is not there, the build's own
warning fails it (docs/hooks.py); with the entry removed, Material asks a CDN for Mermaid, the
request is refused here, and each diagram stays its source text, which the test reports per
page. Screenshots of every page opened go to the test's ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docs_site import build_site

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# how this machine runs Chromium headless (no sandbox as root; no background requests off the machine)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Material renders each diagram into a closed shadow root; opened here so the test can read the SVG
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attach.call(this, {...init, mode: "open"}); };
"""
DIAGRAMS = r"""() => ({
  raw: [...document.querySelectorAll("article pre")].map(p => p.textContent.trim())
         .filter(t => /^(flowchart|graph|sequenceDiagram|stateDiagram|classDiagram)\b/.test(t))
         .map(t => t.slice(0, 60)),
  rendered: [...document.querySelectorAll("div.mermaid")].map(d => {
    const svg = d.shadowRoot && d.shadowRoot.querySelector("svg");
    return svg ? {labels: svg.querySelectorAll("text, foreignObject").length, error: /Syntax error/.test(svg.textContent)}
               : null;
  }),
})"""
TABLES = r"""() => {
  const found = [];
  for (const table of document.querySelectorAll("article table")) {
    const wrap = table.closest(".md-typeset__scrollwrap") || table.parentElement;
    if (table.scrollWidth > wrap.clientWidth + 2)
      found.push(`a table ${table.scrollWidth}px wide in ${wrap.clientWidth}px`);
    for (const code of table.querySelectorAll("td:first-child code"))
      if (code.getClientRects().length > 1) found.push(`field name wrapped: ${code.textContent}`);
    for (const code of table.querySelectorAll("td:not(:last-child) code"))
      if (code.getClientRects().length > 1 && !/\s/.test(code.textContent))
        found.push(`code broken inside a word: ${code.textContent}`);
  }
  return found;
}"""
IMAGES = """async () => {
  const imgs = [...document.querySelectorAll("article img")];
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  return imgs.map(i => ({src: i.getAttribute("src"), width: i.naturalWidth}));
}"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as ``mkdocs build --strict`` writes it."""
    return build_site(tmp_path_factory.mktemp("docs") / "site")


@pytest.fixture(scope="module")
def base_url(site, tmp_path_factory):
    """``python -m http.server`` on a free loopback port serving the site; ended by its pid."""
    log = tmp_path_factory.mktemp("http") / "access.log"
    with open(log, "w") as err:
        server = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
                                   "--directory", str(site)], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 41235 (http://127.0.0.1:41235/) ..."
        port = re.search(r"port (\d+)", line)
        assert port, f"http.server said {line!r}"
        yield f"http://127.0.0.1:{port.group(1)}"
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless, driven by Playwright (no browser of Playwright's own)."""
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.exists(), "Debian's chromium is missing: run scripts/bootstrap.sh"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def _context(browser, base_url: str, off_site: list[str]):
    """A fresh browser context that refuses (and records in ``off_site``) every request off the site."""
    def only_this_site(route):
        if route.request.url.startswith(base_url + "/"):
            route.continue_()
        else:
            off_site.append(route.request.url)
            route.abort()

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(OPEN_SHADOW_ROOTS)
    context.route("**/*", only_this_site)
    return context


def _pages(site: Path) -> list[str]:
    """Paths of the home page and of every page with a diagram or a figure."""
    pages = ["index.html"]
    for html in sorted(site.rglob("index.html")):
        text = html.read_text()
        rel = html.relative_to(site).as_posix()
        if rel not in pages and ('class="mermaid"' in text or "<img" in text):
            pages.append(rel)
    return pages


def test_diagrams_and_figures_render_offline(site, base_url, browser, tmp_path):
    """Each page with a diagram: every diagram an SVG with its labels, none left as text; each
    page with figures: every image loaded (``naturalWidth > 0``); no request leaves the server."""
    pages = _pages(site)
    assert "performance/index.html" in pages, pages  # the figures' page
    off_site, problems, seen = [], [], {}
    context = _context(browser, base_url, off_site)
    page = context.new_page()
    for rel in pages:
        page.goto(f"{base_url}/{rel}", wait_until="load")
        expected = (site / rel).read_text().count('class="mermaid"')
        if expected:  # Material renders them after load: wait until each is a diagram
            try:
                page.wait_for_function(f"document.querySelectorAll('div.mermaid').length >= {expected}",
                                       timeout=15_000)
            except Exception:
                pass  # reported below with what the page shows
        diagrams = page.evaluate(DIAGRAMS)
        images = page.evaluate(IMAGES)
        page.screenshot(path=str(tmp_path / (rel.replace("/", "_") + ".png")), full_page=True)
        seen[rel] = {"diagrams": diagrams, "images": images}
        if diagrams["raw"]:
            problems.append(f"{rel}: diagram left as text: {diagrams['raw']}")
        if len(diagrams["rendered"]) < expected or not all(
                d and d["labels"] > 0 and not d["error"] for d in diagrams["rendered"]):
            problems.append(f"{rel}: {expected} diagrams, rendered {diagrams['rendered']}")
        problems += [f"{rel}: image not loaded: {i['src']}" for i in images if i["width"] <= 0]
    context.close()
    (tmp_path / "pages.json").write_text(json.dumps(seen, indent=1))
    problems += [f"refused a request off the site (it must work offline): {url}" for url in off_site]
    assert not problems, "\n".join(problems)
    assert seen["index.html"]["diagrams"]["rendered"], "the home page's diagram did not render"
    assert any(seen[rel]["images"] for rel in seen), "no figure found on the site"


def test_reference_tables_and_swagger_ui_render_offline(site, base_url, browser, tmp_path):
    """The reference pages: no field name in a table wraps (nor any code broken inside a word but
    in a description column), no table is wider than the page, and the HTTP API page's Swagger UI
    (its scripts served with the site) shows every route of the OpenAPI document."""
    doc = json.loads((ROOT / "docs" / "reference" / "openapi.json").read_text())
    routes = sum(len(methods) for methods in doc["paths"].values())
    off_site, problems = [], []
    context = _context(browser, base_url, off_site)
    page = context.new_page()
    for rel in ("reference/config/index.html", "reference/http/index.html", "api/chat/index.html"):
        page.goto(f"{base_url}/{rel}", wait_until="load")
        problems += [f"{rel}: {p}" for p in page.evaluate(TABLES)]
        if rel == "reference/http/index.html":
            frame = page.frame_locator("iframe.swagger-ui-iframe")
            try:
                frame.locator(".opblock").nth(routes - 1).wait_for(timeout=20_000)
            except Exception:
                pass  # counted below
            shown = frame.locator(".opblock").count()
            if shown != routes:
                problems.append(f"{rel}: Swagger UI shows {shown} routes of {routes}")
        page.screenshot(path=str(tmp_path / (rel.replace("/", "_") + ".png")), full_page=True)
    context.close()
    problems += [f"refused a request off the site (it must work offline): {url}" for url in off_site]
    assert not problems, "\n".join(problems)
