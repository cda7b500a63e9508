"""Make docs/images/dashboard.png: `inferd serve` with the default model under a small load, a playground
prompt streaming, photographed by headless Chromium (Debian's `chromium`, driven by Playwright).

Six clients send completions that share a system prompt (so prefix blocks are shared and hit) while the
page watches; after `--warm` seconds the playground sends its own prompt and the page is photographed once
it has streamed 25 tokens.

    .venv/bin/python scripts/dashboard_screenshot.py                 # starts the server itself
    .venv/bin/python scripts/dashboard_screenshot.py --url http://127.0.0.1:8000   # an already running one
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SYSTEM = (
    "You are a helpful assistant for a serving system. Answer briefly and precisely, in plain words, "
    "and never invent facts that you do not know. "
) * 3
QUESTIONS = [
    "What is paged attention?",
    "Why batch requests?",
    "What is a KV cache?",
    "Explain prefill.",
    "What is decode?",
    "Why chunk long prompts?",
    "What is preemption?",
    "What is a token budget?",
]


def load(url: str, i: int, stop: threading.Event) -> None:
    with httpx.Client(timeout=600) as c:
        k = i
        while not stop.is_set():
            k += 3
            body = {
                "prompt": SYSTEM + QUESTIONS[k % len(QUESTIONS)],
                "max_tokens": 40 + 15 * (k % 5),
                "temperature": 0.8,
            }
            try:
                c.post(url + "/v1/completions", json=body)
            except httpx.HTTPError:
                time.sleep(1)


def wait_ready(url: str, server: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="an inferd server already running (default: start one)")
    ap.add_argument("--port", type=int, default=18716)
    ap.add_argument("--warm", type=float, default=60.0, help="seconds of load before the playground prompt")
    ap.add_argument("--out", default=str(REPO / "docs" / "images" / "dashboard.png"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    server = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "serve", "--port", str(args.port)]
        argv += ["--num-blocks", "768", "--max-model-len", "1024", "--max-num-seqs", "12"]
        server = subprocess.Popen(argv, cwd=REPO)
    stop = threading.Event()
    try:
        wait_ready(url, server, 1800)  # the first start may build the native attention kernel
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1150})
            page.goto(url + "/dashboard")
            for i in range(6):
                threading.Thread(target=load, args=(url, i, stop), daemon=True).start()
            time.sleep(args.warm)
            page.fill("#p-prompt", "The three most important ideas behind fast LLM serving are")
            page.fill("#p-max", "80")
            page.click("#p-send")
            page.wait_for_function("Number(document.getElementById('p-tokens').textContent) >= 25", timeout=600_000)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        print(f"wrote {args.out}")
    finally:
        stop.set()
        if server is not None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
