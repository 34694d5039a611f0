"""Screenshots of the live page for README and docs: a fresh server, a chat answer, a burst of 24
requests, then the page at 1280 px (light) and 360 px (dark).

    .venv/bin/python scripts/page_screenshot.py

writes docs/img/page.png and docs/img/page-narrow-dark.png (needs Debian's chromium)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from pagedserve.server.process import LocalServer  # noqa: E402


def main() -> None:
    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with LocalServer([]) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(server.base_url + "/")
        expect(page.locator("#feed-status")).to_have_text("live")
        page.fill("#prompt", "In two sentences, what is a paged KV cache?")
        page.press("#prompt", "Enter")
        expect(page.locator("#messages li.assistant .stats")).to_contain_text(
            "TTFT", timeout=120_000
        )
        page.fill("#burst-size", "24")
        page.click("#burst button")
        page.wait_for_timeout(2500)  # mid-burst: seats filling and refilled
        page.screenshot(path=str(out / "page.png"))
        expect(page.locator("#burst-status")).to_have_text("24 of 24 answered", timeout=180_000)
        narrow = browser.new_page(viewport={"width": 360, "height": 780}, color_scheme="dark")
        narrow.goto(server.base_url + "/")
        expect(narrow.locator("#feed-status")).to_have_text("live")
        narrow.screenshot(path=str(out / "page-narrow-dark.png"), full_page=False)
        browser.close()
    print(out)


if __name__ == "__main__":
    main()
