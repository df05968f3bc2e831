"""The book's site, built from this session's runs of the chapters and read in a real browser.

``make site`` (``dmlbook.book.static_site``) builds every chapter with its outputs and plots, the
glossary, the guides, the API reference and a search into one folder. This test builds it the
way the suite's runs leave it (issue 37: "each chapter executed once"): it runs after every other
test has been handed out (marker ``after_chapters``), waits for the chapters the session runs to
be kept (``tests/support/nbrecord.py``, and the tests that run a chapter in JupyterLab, the hub or a
learner's copy), builds into a temporary folder with every Sphinx warning an error, then checks

* every internal link and anchor of every page, over the whole site, and each chapter's link to
  its notebook for download;
* that each chapter page shows as many figures as its executed notebook holds, and that the
  chapters' glossary links land on a term;
* in Debian's headless Chromium, served from 127.0.0.1: every page loads with no console error
  and the browser asks nothing of any other host; the search finds "ring all-reduce", "bubble"
  and "ZeRO" on the chapters that teach them;
* and it leaves screenshots of the landing page and of a chapter.

Marked ``browser`` for the Chromium part; without Chromium or Playwright it is skipped.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import importlib.util
import os
import shutil
import threading
import time
import urllib.parse
from pathlib import Path

import nbformat
import nbrecord
import pytest

from dmlbook.book import executed
from dmlbook.book import static_site as site

CHROMIUM = os.environ.get("DMLBOOK_CHROMIUM") or shutil.which("chromium")
# Chromium as the browser test starts it (test_browser.py).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
# How long to wait for the other workers' runs of chapters: a bound for a run that hangs (a run
# that ends, passed or failed, says so: nbrecord.finished), not a speed claim.
WAIT_S = 600
# Each word the issue names, and the chapter that teaches it (it must be among the first hits).
SEARCHES = {
    "ring all-reduce": "02_parameter_server_and_allreduce",
    "bubble": "06_pipeline_input_and_layer_split",
    "ZeRO": "09b_zero_sharding",
}
TOP_HITS = 3

pytestmark = [
    pytest.mark.after_chapters,
    pytest.mark.browser,
    pytest.mark.timeout(WAIT_S + 900),
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt install chromium"),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="no Playwright: pip install playwright",
    ),
]


class Page(html.parser.HTMLParser):
    """What the link check needs of one HTML file: its ids, its links, its output images."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.output_images = 0
        self._in_output: list[int] = []  # depth of each open cell_output div
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag not in ("img", "link", "meta", "br", "hr", "input", "source"):
            self._depth += 1
        for name in ("id", "name"):
            if a.get(name) and (name == "id" or tag == "a"):
                self.ids.add(a[name])
        for name in ("href", "src"):
            if a.get(name):
                self.links.append(a[name])
        if tag == "div" and "cell_output" in (a.get("class") or "").split():
            self._in_output.append(self._depth)
        if tag == "img" and self._in_output:
            self.output_images += 1

    def handle_endtag(self, tag):
        if tag not in ("img", "link", "meta", "br", "hr", "input", "source"):
            if self._in_output and self._in_output[-1] == self._depth:
                self._in_output.pop()
            self._depth -= 1


@functools.cache
def read_page(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def pages(root: Path) -> list[Path]:
    """The site's pages (``_static/`` holds the theme's template fragments, not pages)."""
    return sorted(p for p in root.rglob("*.html") if "_static" not in p.relative_to(root).parts)


def broken_links(root: Path) -> list[str]:
    """Every internal link of every page whose file or anchor does not exist."""
    root = root.resolve()
    broken = []
    for path in pages(root):
        for link in read_page(path).links:
            parts = urllib.parse.urlsplit(link)
            if parts.scheme or link.startswith("//"):  # http(s), mailto, data: not internal
                continue
            target = (
                (path.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else path
            )
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(root)}: {link}"
            if not target.is_relative_to(root) or not target.exists():
                broken.append(f"{where} (no file)")
            elif parts.fragment and target.suffix == ".html":
                if urllib.parse.unquote(parts.fragment) not in read_page(target).ids:
                    broken.append(f"{where} (no anchor)")
    return broken


def figures(notebook: nbformat.NotebookNode) -> int:
    return sum(
        any(mime.startswith("image/") for mime in out.get("data", {}))
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )


def wait_for_the_runs(session) -> list[str]:
    """Wait until every chapter this session runs has ended (kept in the cache, or failed: the
    build then runs it again and shows why); the ones not kept."""
    expected = [p for p in site.chapter_paths() if p.name in nbrecord.kept_runs(session.items)]
    deadline = time.monotonic() + WAIT_S
    while True:
        if all(executed.entry(p).exists() or nbrecord.finished(p.name) for p in expected):
            return [p.stem for p in expected if not executed.entry(p).exists()]
        missing = [p.stem for p in expected if not executed.entry(p).exists()]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(1)


@pytest.fixture
def served(tmp_path):
    """A static server for a folder on 127.0.0.1 (a free port the kernel picks); its base URL."""
    root = tmp_path / "site"
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_the_site_builds_from_the_sessions_runs_and_reads_in_a_browser(request, served, artifacts):
    root, base = served
    waited = time.monotonic()
    missing = wait_for_the_runs(request.session)
    waited = time.monotonic() - waited
    built = site.build(root)
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    print(
        f"site: waited {waited:.0f} s for the chapters' runs (missing then: {missing}), built in "
        f"{built.seconds:.0f} s (ran now: {built.ran_now}), {size / 1e6:.1f} MB"
    )

    every = pages(root)
    assert broken_links(root) == []

    for path in site.chapter_paths():
        page = root / "chapters" / f"{path.stem}.html"
        notebook = nbformat.read(root / "_sources" / "chapters" / path.name, as_version=4)
        assert read_page(page).output_images == figures(notebook), path.stem
        assert f"../_sources/chapters/{path.name}" in read_page(page).links, "no download link"
        glossary = [link for link in read_page(page).links if "glossary.html#" in link]
        assert glossary, f"{path.stem} links no term to the glossary"
    drawn = {p.stem: figures(nbformat.read(root / "_sources/chapters" / p.name, as_version=4))
             for p in site.chapter_paths()}  # fmt: skip
    assert sum(drawn.values()) >= 40 and min(drawn.values()) >= 1, drawn

    from playwright import sync_api

    problems: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("response", lambda r: r.status < 400 or problems.append(f"{r.status}: {r.url}"))
        page.on(
            "request",
            lambda r: (
                r.url.startswith((base, "data:", "blob:"))
                or problems.append(f"request outside: {r.url}")
            ),
        )
        for path in every:
            url = f"{base}/{path.relative_to(root).as_posix()}"
            response = page.goto(url, wait_until="load")
            assert response is not None and response.ok, url
            assert problems == [], f"{url}: {problems}"

        for query, chapter in SEARCHES.items():
            page.goto(f"{base}/search.html?q={urllib.parse.quote(query)}")
            page.wait_for_selector("#search-results .search-summary", timeout=30_000)
            hits = page.eval_on_selector_all(
                "#search-results ul.search li a", "links => links.map(a => a.getAttribute('href'))"
            )
            chapters = [h.split("?")[0].split("#")[0] for h in hits if "chapters/" in h]
            assert any(chapter in h for h in chapters[:TOP_HITS]), (query, chapters)

        # a chapter's link to the glossary lands on its term's heading
        page.goto(f"{base}/chapters/09b_zero_sharding.html")
        page.locator("a[href*='glossary.html#']").first.click()
        page.wait_for_load_state("load")
        fragment = urllib.parse.unquote(urllib.parse.urlsplit(page.url).fragment)
        assert page.locator(f"[id='{fragment}']").count() == 1, page.url

        page.goto(f"{base}/index.html")
        landing = artifacts("site-landing.png")
        page.screenshot(path=str(landing))
        page.goto(f"{base}/chapters/06_pipeline_input_and_layer_split.html")
        page.locator(".cell_output img").first.scroll_into_view_if_needed()
        chapter = artifacts("site-chapter06.png")
        page.screenshot(path=str(chapter))
        browser.close()
    assert problems == []
    print(f"{len(every)} pages; screenshots: {landing}, {chapter}")
