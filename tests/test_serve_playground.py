"""The playground page in real headless Chromium: type a prompt, press Generate, see the streamed text."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from gptkit.serving.server import ServeOptions, build_app
from test_serve_helpers import live_server, make_model_dir

CHROMIUM = "/usr/bin/chromium"  # Debian's package; the test set-up installs it, never a downloaded browser
# Root in a container needs --no-sandbox; the rest keep Chromium off the (closed) network.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def _need_browser():
    """Playwright and Chromium, or a skip outside CI (in CI a missing browser is a failure)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = sync_playwright is None or not shutil.which(CHROMIUM)
    if missing:
        if os.environ.get("CI"):
            pytest.fail("the browser test needs `pip install playwright` and `apt-get install chromium`")
        pytest.skip("playwright or /usr/bin/chromium is not installed")
    return sync_playwright


def test_playground_streams_text_probabilities_and_attention(tmp_path):
    sync_playwright = _need_browser()
    model_dir = make_model_dir(tmp_path / "tiny-served")
    app = build_app(model_dir, ServeOptions())
    with live_server(app) as url:
        expected = httpx.post(url + "/v1/completions", json={"model": "tiny-served", "prompt": "Hello there",
                                                             "max_tokens": 24, "temperature": 0}).json()  # fmt: skip
        expected_text = expected["choices"][0]["text"]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page()
                page.goto(url + "/")
                page.wait_for_function("document.getElementById('model-name').textContent.includes('tiny-served')")
                page.fill("#prompt", "Hello there")
                page.fill("#max_tokens", "24")
                page.fill("#temperature", "0")
                page.click("#generate")
                page.wait_for_function("document.getElementById('status').textContent.includes('finish')")
                assert page.inner_text("#output-prompt") == "Hello there"
                generated = page.eval_on_selector("#output-generated", "el => el.textContent")
                assert generated == expected_text and generated
                shaded = page.locator("#output-generated .tok")
                assert shaded.count() == len(expected_text) or expected["choices"][0]["finish_reason"] == "stop"
                shaded.first.click()
                assert "p = " in page.inner_text("#token-info")
                page.click("#tab-attention")
                page.wait_for_function("document.getElementById('heatmap').dataset.drawn")
                drawn = int(page.eval_on_selector("#heatmap", "el => el.dataset.drawn"))
                assert drawn == len("Hello there") + len(generated)
                assert page.locator("#layer option").count() == 2
            finally:
                browser.close()
