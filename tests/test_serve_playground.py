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


def test_playground_chat_tab_keeps_the_conversation(tmp_path):
    sync_playwright = _need_browser()
    model_dir = make_model_dir(tmp_path / "tiny-chat", block_size=256)  # room for the second turn's history
    app = build_app(model_dir, ServeOptions())

    def reply(url: str, messages: list[dict]) -> str:
        body = {"model": "tiny-chat", "messages": messages, "max_tokens": 12, "temperature": 0}
        return httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    with live_server(app) as url:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page()
                page.goto(url + "/")
                page.wait_for_function("document.getElementById('model-name').textContent.includes('tiny-chat')")
                page.fill("#max_tokens", "12")
                page.fill("#temperature", "0")
                page.click("#tab-chat")
                page.fill("#chat-system", "Be brief.")
                history = [{"role": "system", "content": "Be brief."}]
                for turn, text in enumerate(["Hi there", "And then?"], start=1):
                    page.fill("#chat-input", text)
                    page.click("#chat-send")
                    page.wait_for_function("['finish', 'error'].some(w => "
                                           "document.getElementById('chat-status').textContent.includes(w))")
                    assert "finish" in page.text_content("#chat-status")
                    history.append({"role": "user", "content": text})
                    expected = reply(url, history)  # the page must have sent the whole conversation so far
                    shown = page.locator("#chat-log .msg.assistant").nth(turn - 1).text_content()
                    assert shown == expected
                    history.append({"role": "assistant", "content": expected})
                assert [m.text_content() for m in page.locator("#chat-log .msg.user").all()] == ["Hi there", "And then?"]
                page.click("#chat-new")
                assert page.locator("#chat-log .msg").count() == 0
            finally:
                browser.close()
