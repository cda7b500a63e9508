"""The dashboard in a real browser: headless Chromium (the system's) driven by Playwright, against a real
`inferd serve` process with a tiny model behind --api-key.

The page must load without console errors, a prompt sent from the playground must stream text, and the KV
grid and the batch view must change while it runs and go back to idle after. Screenshots are written to the
test's tmp dir (kept by pytest) as artefacts; set INFERD_DASHBOARD_SHOT=path to also write one there (how
docs/images/dashboard.png is made).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.gateway.procs import start_replica, wait_http

CHROMIUM = "/usr/bin/chromium"
KEY = "browser-key"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def replica(tiny_models, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("dashboard-browser")
    # a small cache, so the playground's blocks are visible cells in the grid
    proc = start_replica(tiny_models["llama"], log_dir, "--api-key", KEY, "--num-blocks", "1024")
    try:
        wait_http(proc, "/health", timeout=90)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM) or Path(CHROMIUM).exists(), "Debian's chromium package is needed"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


# The most blocks in use and batch rows the page ever showed, recorded on every change of the DOM. Read once
# after a wait, they raced the run: on a fast CPU the playground's five requests could finish between the
# wait for blocks in use and the read, and the test saw 0 (it failed CI once so).
WATCH_PEAKS = """() => {
  window.peaks = {kvUsed: 0, batchRows: 0};
  const look = () => {
    const p = window.peaks;
    p.kvUsed = Math.max(p.kvUsed, Number(document.getElementById('kv-used').textContent));
    p.batchRows = Math.max(p.batchRows, document.querySelectorAll('#batch-table tbody tr').length);
  };
  new MutationObserver(look).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def _kv_used(page) -> int:
    return int(page.inner_text("#kv-used"))


def test_playground_streams_and_the_views_follow_it(replica, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1150})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{replica.url}/dashboard?key={KEY}")
    page.wait_for_function("window.dashboard.hello !== null && window.dashboard.kv !== null", timeout=20_000)
    assert page.inner_text("#conn") == "live"
    assert page.inner_text("#kv-total") == "1024"
    assert _kv_used(page) == 0
    page.screenshot(path=str(tmp_path / "dashboard-idle.png"), full_page=True)
    steps_before = page.evaluate("window.dashboard.stepsSeen")

    page.fill("#p-prompt", "Paged attention stores keys and values in fixed-size blocks. " * 6)
    page.fill("#p-max", "300")
    page.fill("#p-copies", "5")
    page.fill("#p-temp", "0.8")
    # seeded: unseeded, copy 0 of the tiny model (384 tokens, random weights) now and then sampled EOS within
    # its first 20 tokens, and the wait below timed out. A seeded request's tokens depend on its seed and
    # position only: seed 4 runs all 300 tokens in fp32 and bf16 (seed 2 stops after 23, seed 22 after 8)
    page.fill("#p-seed", "4")
    page.evaluate(WATCH_PEAKS)
    page.click("#p-send")
    # while it runs: text streams in, the batch view shows the playground's requests, their blocks fill the grid
    page.wait_for_function("Number(document.getElementById('p-tokens').textContent) >= 20", timeout=60_000)
    page.wait_for_function("window.peaks.kvUsed > 0 && window.peaks.batchRows > 0", timeout=20_000)
    assert page.inner_text("#p-id").startswith("cmpl-")
    assert len(page.inner_text("#p-out")) > len("Paged attention stores keys and values in fixed-size blocks. ") * 6
    assert page.inner_text("#p-ttft").endswith(("ms", "s"))
    assert page.evaluate("window.dashboard.stepsSeen") > steps_before
    page.screenshot(path=str(tmp_path / "dashboard-running.png"), full_page=True)
    shot = os.environ.get("INFERD_DASHBOARD_SHOT")
    if shot:
        page.wait_for_timeout(1500)  # a few more steps and a chart point or two
        page.screenshot(path=shot, full_page=True)

    # after: done, nobody owns a block, the batch view says idle
    page.wait_for_function("document.getElementById('p-status').textContent === 'done'", timeout=120_000)
    page.wait_for_function("Number(document.getElementById('kv-used').textContent) === 0", timeout=20_000)
    page.wait_for_function("document.getElementById('step-line').dataset.idle === '1'", timeout=20_000)
    assert int(page.inner_text("#kv-cached")) > 0  # the prompt's full blocks stay cached for the next one
    # the first copy's timeline, from its usage.timing: queue, prefill and decode, as wide as their shares
    page.wait_for_function("document.querySelectorAll('#p-timeline .tl-bar span').length === 3", timeout=10_000)
    timeline = page.inner_text("#p-timeline")
    assert all(part in timeline for part in ("queue", "prefill", "chunk(s)", "decode", "step(s)", "TTFT"))
    segments = "[...document.querySelectorAll('#p-timeline .tl-bar span')]"
    widths = page.evaluate(segments + ".map(s => parseFloat(s.style.width))")
    assert 99 <= sum(widths) <= 100.01 and widths[1] > 0 and widths[2] > 0
    assert page.locator("#batch-table tbody tr").count() == 0
    peaks = page.evaluate("window.peaks")
    assert peaks["kvUsed"] > 0 and peaks["batchRows"] >= 1, peaks
    page.screenshot(path=str(tmp_path / "dashboard-after.png"), full_page=True)
    assert errors == []
    print(f"screenshots in {tmp_path}")


def test_without_the_key_the_page_says_so(replica, browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{replica.url}/dashboard")
    page.wait_for_function("document.getElementById('conn').textContent.includes('API key')", timeout=20_000)
    assert errors == []


def test_the_batch_view_names_each_rows_lora_adapter(tiny_models, browser, tmp_path):
    """A request under a LoRA adapter shows the adapter's name on its row, as text (a name is never markup)."""
    import threading

    import httpx

    from tests.engine.lora_adapters import make_adapter

    name = "sql<b>x</b>"
    adapter = make_adapter(tiny_models["llama"], tmp_path / "sql")
    proc = start_replica(tiny_models["llama"], tmp_path, "--api-key", KEY, "--lora-modules", f"{name}={adapter}")
    try:
        wait_http(proc, "/health", timeout=90)
        page = browser.new_page()
        page.goto(f"{proc.url}/dashboard?key={KEY}")
        page.wait_for_function("window.dashboard.hello !== null", timeout=20_000)
        page.evaluate("""() => {
          window.seen = [];
          new MutationObserver(() => document.querySelectorAll('#batch-table .adapter')
            .forEach(e => window.seen.push(e.textContent))).observe(document.body, {subtree: true, childList: true});
        }""")
        body = {"model": name, "prompt": "The quick brown fox " * 8, "max_tokens": 200, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        sent = threading.Thread(target=lambda: httpx.post(f"{proc.url}/v1/completions", json=body, headers=headers,
                                                          timeout=120))  # fmt: skip
        sent.start()
        page.wait_for_function("window.seen.length > 0", timeout=60_000)
        sent.join(120)
        assert set(page.evaluate("window.seen")) == {name}
        assert page.locator("#batch-table b").count() == 0  # the name was not rendered as markup
    finally:
        proc.stop()
