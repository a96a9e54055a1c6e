"""Screenshots of the built site in headless Chromium, and a check that search answers in both languages.

    python -m doctools.screenshots [--site site] [--out site/_artifacts] [PAGE ...]

Serves ``--site`` on a free localhost port, opens each page (default: the getting-started page in English and in
Chinese) in Debian's Chromium through Playwright, and writes a full-page PNG per page and language to ``--out``.
Then it types a query into the search box of each language and fails unless results are listed. Exit status 0:
every screenshot was written and every search answered; 2: Chromium or Playwright is missing (the message says
how to install them: ``bash tests/browser/INSTALL.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

CHROMIUM_PATH = "/usr/bin/chromium"
# The networking flags keep Chromium quiet on a closed network (as tests/browser/jlab.py launches it).
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage")

# page path in the site -> file stem of its screenshot
DEFAULT_PAGES = ("getting_started/",)
# language prefix in the site -> a query whose results must include pages of that language
SEARCHES = {"": "distributed data parallel", "zh/": "进程组"}


def missing() -> str | None:
    """Why screenshots cannot be taken here, or None."""
    if not os.path.exists(CHROMIUM_PATH):
        return f"{CHROMIUM_PATH} is missing"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing"
    return None


@contextlib.contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serve ``site`` on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def take(site: Path, out: Path, pages: tuple[str, ...] = DEFAULT_PAGES, width: int = 1280) -> list[Path]:
    """Screenshot each page in English and Chinese; check search in both. Returns the PNG paths."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with serve(site) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM_PATH, headless=True, args=list(CHROMIUM_ARGS))
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            for path in pages:
                for prefix, lang in (("", "en"), ("zh/", "zh")):
                    page.goto(base + prefix + path, wait_until="networkidle")
                    switch = page.locator(".md-select a[hreflang]")
                    if switch.count() < 2:
                        raise RuntimeError(f"{prefix + path}: no language switch on the page")
                    png = out / f"{path.strip('/').replace('/', '_') or 'index'}.{lang}.png"
                    page.screenshot(path=str(png), full_page=True)
                    written.append(png)
            for prefix, query in SEARCHES.items():
                page.goto(base + prefix + pages[0], wait_until="networkidle")
                box = page.locator(".md-search__input")
                box.click()
                box.fill(query)  # an input method's composed text arrives whole, like this
                page.keyboard.press("End")  # the search box reacts to key events
                page.wait_for_selector(".md-search-result__item", timeout=15_000)
                hrefs = page.eval_on_selector_all(".md-search-result__item a", "els => els.map(e => e.href)")
                in_language = [h for h in hrefs if ("/zh/" in h) == (prefix == "zh/")]
                if not in_language:
                    raise RuntimeError(f"search for {query!r} on {prefix or 'en/'} found no page in that language: "
                                       f"{hrefs[:5]}")
                png = out / f"search.{'zh' if prefix else 'en'}.png"
                page.screenshot(path=str(png))
                written.append(png)
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default="site", help="the built site (default: site)")
    ap.add_argument("--out", default="site/_artifacts", help="folder for the PNG files (default: site/_artifacts)")
    ap.add_argument("pages", nargs="*", default=list(DEFAULT_PAGES), help="page paths in the site")
    args = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"screenshots skipped: {why} (bash tests/browser/INSTALL.sh installs Chromium and Playwright)",
              file=sys.stderr)
        return 2
    for png in take(Path(args.site), Path(args.out), tuple(args.pages)):
        print(f"screenshot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
