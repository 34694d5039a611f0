"""The live page at /, in a real browser (Debian's chromium driven by playwright) against a real
server with an API key: chat streams and stops, hostile text stays text, conversations persist,
the engine's steps and KV blocks are drawn from /engine/events, and the page fits 360 px."""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import openai
import pytest
from conftest import ServerProcess, metric
from playwright.sync_api import expect, sync_playwright

KEY = "page-test-key"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--api-key", KEY, "--served-model-name", "default") as process:
        yield process


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context()
    page = context.new_page()
    page.problems = []
    # A fetch refused for want of a key is how the page learns it needs one; nothing else fails.
    page.on(
        "console",
        lambda m: m.type == "error" and "401" not in m.text and page.problems.append(m.text),
    )
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    page.goto(server.base_url + "/")
    expect(page.locator("#key-form")).to_be_visible()  # every data path needs the key
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")
    expect(page.locator("#model-name")).to_have_text("default")
    expect(page.locator("#feed-status")).to_have_text("live")
    yield page
    context.close()


def _settings(page, temperature: str, max_tokens: str) -> None:
    page.click("#settings summary")
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)


def _stored(page) -> dict:
    return page.evaluate("JSON.parse(localStorage.getItem('pagedserve-conversations'))")


def test_the_page_and_its_files_carry_a_policy_that_runs_only_their_own_script(server):
    page = httpx.get(server.base_url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "unsafe-inline" not in policy
    assert '<script src="/ui/app.js"' in page.text and "<script>" not in page.text
    assert (
        httpx.get(server.base_url + "/ui/app.js")
        .headers["content-type"]
        .startswith("text/javascript")
    )
    assert httpx.get(server.base_url + "/ui/secrets.txt").status_code == 404
    # Without the key nothing but the page's own files answers.
    for path in ("/engine/events", "/v1/models", "/tokenize"):
        assert httpx.get(server.base_url + path).status_code == 401
    assert httpx.post(server.base_url + "/v1/chat/completions", json={}).status_code == 401


def test_a_chat_streams_the_answer_the_api_gives_and_persists(page, server):
    _settings(page, "0", "16")
    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")  # the keyboard sends
    answer = page.locator("#messages li.assistant .stats")
    expect(answer).to_contain_text("TTFT", timeout=60_000)
    expect(answer).to_contain_text("tokens/s")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    expected = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, top_p=1, max_tokens=16,
    ).choices[0].message.content  # fmt: skip
    chat = next(iter(_stored(page)["chats"].values()))
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert chat["messages"][1]["content"] == expected
    page.reload()  # the key stays for the tab's session, the conversation in localStorage
    expect(page.locator("#model-name")).to_have_text("default")
    expect(page.locator("#messages li")).to_have_count(2)
    page.click("#new-conversation")
    expect(page.locator("#conversations option")).to_have_count(2)
    page.click("#delete-conversation")
    expect(page.locator("#conversations option")).to_have_count(1)
    assert page.problems == []


def test_user_and_model_text_is_never_html(page):
    _settings(page, "0", "4")
    hostile = (
        '<img src=x onerror="window.pwned=1"> **bold** <script>window.pwned=2</script> '
        "`<b>code</b>`"
    )
    page.fill("#prompt", hostile)
    page.click("#send")
    expect(page.locator("#messages li.assistant .stats")).to_contain_text("TTFT", timeout=60_000)
    user = page.locator("#messages li.user")
    expect(user.locator("strong")).to_have_text("bold")
    expect(user.locator("code")).to_have_text("<b>code</b>")
    assert page.locator("#messages img, #messages script, #messages b").count() == 0
    assert page.evaluate("window.pwned") is None
    assert "<img src=x" in user.inner_text()


def test_stop_aborts_the_request_on_the_server(page, server):
    _settings(page, "0.8", "3000")
    page.fill("#prompt", "Write a very long story about a lighthouse keeper.")
    page.click("#send")
    expect(page.locator("#stop")).to_be_enabled()
    # Some of the answer has arrived (the page's policy forbids evaluating strings, so no
    # wait_for_function).
    expect(page.locator("#messages li.assistant .content")).to_have_text(
        re.compile(r".{20}", re.DOTALL), timeout=60_000
    )
    page.click("#stop")
    expect(page.locator("#messages li.assistant .stats")).to_contain_text("stopped")
    # Left alone, 3000 tokens would hold a seat for over a minute; stopped, the seat is freed.
    deadline = time.monotonic() + 15
    while (
        metric(server.base_url, "pagedserve:num_requests_running") and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert metric(server.base_url, "pagedserve:num_requests_running") == 0
    generated = metric(server.base_url, "pagedserve:generation_tokens_total")
    time.sleep(1)
    assert metric(server.base_url, "pagedserve:generation_tokens_total") == generated


def test_a_burst_fills_seats_step_by_step_and_the_block_map(page, server):
    page.fill("#burst-size", "16")
    page.click("#burst button")
    expect(page.locator("#burst-status")).to_have_text("16 of 16 answered", timeout=120_000)
    assert int(page.locator("#stat-seats").inner_text()) >= 2
    assert int(page.locator("#stat-step").inner_text()) > 0
    # At rest, the page's counts are /metrics' own.
    expect(page.locator("#stat-running")).to_have_text("0")
    expect(page.locator("#stat-waiting")).to_have_text("0")
    kv = page.locator("#kv-counts").inner_text()
    used, shared, cached, free = (int(n) for n in re.findall(r"\d+", kv))
    usage = metric(server.base_url, "pagedserve:kv_cache_usage_perc")
    assert used + shared == round(usage * (used + shared + cached + free)) == 0
    assert cached > 0  # the burst's prompts stay findable
    hits = metric(server.base_url, "pagedserve:prefix_cache_hits_total")
    queries = metric(server.base_url, "pagedserve:prefix_cache_queries_total")
    expect(page.locator("#stat-hits")).to_have_text(f"{100 * hits / queries:.1f}%")
    expect(page.locator("#kv-counts")).to_contain_text("used")
    expect(page.locator("#latency tr")).to_have_count(3)
    expect(page.locator("#latency tr").first).to_contain_text("ms")
    # The canvases were drawn: some pixel of each is not the background.
    drawn = page.evaluate(
        """() => ['seats', 'blocks'].map((id) => {
            const c = document.getElementById(id);
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            for (let i = 3; i < d.length; i += 4) if (d[i] > 0) return true;
            return false;
        })"""
    )
    assert drawn == [True, True]
    assert page.problems == []


def test_the_page_fits_360_pixels_and_has_a_dark_scheme(browser, server):
    context = browser.new_context(viewport={"width": 360, "height": 740})
    page = context.new_page()
    page.goto(server.base_url + "/")
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
    light = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.emulate_media(color_scheme="dark")
    dark = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert light != dark
    context.close()


def test_the_event_stream_sends_snapshots_with_the_key(server):
    with httpx.stream(
        "GET", server.base_url + "/engine/events", headers={"Authorization": f"Bearer {KEY}"}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        line = next(line for line in response.iter_lines() if line.startswith("data:"))
    snapshot = json.loads(line.removeprefix("data:"))
    assert set(snapshot) >= {"steps", "running", "waiting", "kv", "blocks", "latency_ms"}
    assert len(snapshot["blocks"]) == sum(snapshot["kv"].values())
