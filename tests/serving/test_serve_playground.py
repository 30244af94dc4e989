"""The playground: its inspection routes over HTTP, and the page in real headless Chromium (type a prompt, press
Generate, see the streamed text, the attention, the logit lens and the induction heads)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import torch

from gptkit.observe.measures import chance_induction_score, induction_scores, logit_lens
from gptkit.serving.server import ServeOptions, build_app
from tests.serving.servers import live_server, make_model_dir

TEXT = "Hello there, general Kenobi"

CHROMIUM = "/usr/bin/chromium"  # Debian's package; the test set-up installs it, never a downloaded browser
# Root in a container needs --no-sandbox; the rest keep Chromium off the (closed) network.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


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


@contextmanager
def playground_page(url: str, model: str) -> Iterator[Any]:
    """The playground in headless Chromium, once it shows the served model's name."""
    with _need_browser()() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_function(f"document.getElementById('model-name').textContent.includes('{model}')")
            yield page
        finally:
            browser.close()


def test_playground_streams_text_probabilities_and_attention(tmp_path):
    _need_browser()
    model_dir = make_model_dir(tmp_path / "tiny-served")
    app = build_app(model_dir, ServeOptions())
    with live_server(app) as url:
        expected = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny-served", "prompt": "Hello there", "max_tokens": 24, "temperature": 0},
        ).json()
        expected_text = expected["choices"][0]["text"]
        with playground_page(url, "tiny-served") as page:
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
            # The tokens label the rows (left of the map) and the columns (above it): ink in both margins.
            ink = page.eval_on_selector(
                "#heatmap",
                """el => { const c = el.getContext('2d'), m = 48;
                const alpha = (x, y, w, h) => c.getImageData(x, y, w, h).data.filter((v, k) => k % 4 == 3)
                    .reduce((a, b) => a + b, 0);
                return [alpha(0, m, m, el.height - m), alpha(m, 0, el.width - m, m)]; }""",
            )
            assert page.eval_on_selector("#heatmap", "el => el.dataset.labelled") == "true" and min(ink) > 0
            assert page.locator("#layer option").count() == 2


def test_playground_chat_tab_keeps_the_conversation(tmp_path):
    _need_browser()
    model_dir = make_model_dir(tmp_path / "tiny-chat", block_size=256)  # room for the second turn's history
    app = build_app(model_dir, ServeOptions())

    def reply(url: str, messages: list[dict]) -> str:
        body = {"model": "tiny-chat", "messages": messages, "max_tokens": 12, "temperature": 0}
        return httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    with live_server(app) as url:
        with playground_page(url, "tiny-chat") as page:
            page.fill("#max_tokens", "12")
            page.fill("#temperature", "0")
            page.click("#tab-chat")
            page.fill("#chat-system", "Be brief.")
            history = [{"role": "system", "content": "Be brief."}]
            for turn, text in enumerate(["Hi there", "And then?"], start=1):
                page.fill("#chat-input", text)
                page.click("#chat-send")
                page.wait_for_function(
                    "['finish', 'error'].some(w => document.getElementById('chat-status').textContent.includes(w))"
                )
                assert "finish" in page.text_content("#chat-status")
                history.append({"role": "user", "content": text})
                expected = reply(url, history)  # the page must have sent the whole conversation so far
                shown = page.locator("#chat-log .msg.assistant").nth(turn - 1).text_content()
                assert shown == expected
                history.append({"role": "assistant", "content": expected})
            assert [m.text_content() for m in page.locator("#chat-log .msg.user").all()] == ["Hi there", "And then?"]
            page.click("#chat-new")
            assert page.locator("#chat-log .msg").count() == 0


# ----- the inspection routes over HTTP -----


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live server of the tiny model: (base URL, the served model, its tokenizer)."""
    app = build_app(make_model_dir(tmp_path_factory.mktemp("playground") / "tiny-served"), ServeOptions())
    with live_server(app) as url:
        yield url, app.state.gptkit.engine.model, app.state.gptkit.tokenizer


def _lens(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/playground/lens", json=body, timeout=60)


def test_the_lens_ends_at_the_models_greedy_token_and_reads_every_layer(served):
    url, model, tokenizer = served
    r = _lens(url, text=TEXT, top=3)
    assert r.status_code == 200, r.text
    data = r.json()
    ids = tokenizer.encode(TEXT)
    with torch.no_grad():
        greedy = model(torch.tensor([ids]))[0].argmax(-1).tolist()
    lens = logit_lens(model, ids).exp()  # (n_layer + 1, T, vocab): the measure the route must show
    assert data["labels"] == ["embedding", "layer 0", "layer 1"]  # numbered from 0, as the attention view
    assert [row["position"] for row in data["positions"]] == list(range(len(ids)))
    for t, row in enumerate(data["positions"]):
        assert row["token"] == tokenizer.decode([ids[t]])
        assert len(row["layers"]) == model.config.n_layer + 1
        last = row["layers"][-1]
        assert last["top"][0][0] == row["prediction"] == tokenizer.decode([greedy[t]])
        assert last["prediction_p"] == last["top"][0][1]
        tops = [layer["top"][0][0] for layer in row["layers"]]
        assert row["decided_at"] == tops.index(row["prediction"])
        for k, layer in enumerate(row["layers"]):
            probs = [p for _, p in layer["top"]]
            assert len(probs) == 3 and probs == sorted(probs, reverse=True)
            assert all(0 <= p <= 1 for p in [*probs, layer["prediction_p"]])
            assert abs(probs[0] - float(lens[k, t].max())) < 1e-4
            assert layer["top"][0][0] == tokenizer.decode([int(lens[k, t].argmax())])
            assert abs(layer["prediction_p"] - float(lens[k, t, greedy[t]])) < 1e-4
    assert any(row["decided_at"] < model.config.n_layer for row in data["positions"])  # not always the last


def test_the_lens_at_one_position_and_past_the_block(served):
    url, model, tokenizer = served
    whole = _lens(url, text=TEXT).json()["positions"]
    one = _lens(url, text=TEXT, position=4).json()["positions"]
    assert one == [whole[4]]  # causal: the tokens after a position change nothing there
    long = "ab, " * 50  # 200 tokens: past the 96-token block, so the lens reads the last 96
    rows = _lens(url, text=long).json()["positions"]
    ids = tokenizer.encode(long)
    assert [row["position"] for row in rows] == list(range(len(ids) - 96, len(ids)))
    with torch.no_grad():
        greedy = int(model(torch.tensor([ids[-96:]]))[0, -1].argmax())
    assert rows[-1]["prediction"] == tokenizer.decode([greedy])
    early = _lens(url, text=long, position=10).json()["positions"]
    assert [row["position"] for row in early] == [10]


BAD_LENS = [
    ("empty text", {"text": ""}, "text"),
    ("text missing", {}, "text"),
    ("text beyond the context", {"text": "a" * (4 * 96 + 1)}, "text"),
    ("character outside the vocabulary", {"text": "caf\u00e9"}, "text"),
    ("position past the text", {"text": "abc", "position": 3}, "position"),
    ("negative position", {"text": "abc", "position": -1}, "position"),
    ("position a string", {"text": "abc", "position": "1"}, "position"),
    ("top 0", {"text": "abc", "top": 0}, "top"),
    ("top 4", {"text": "abc", "top": 4}, "top"),
]


@pytest.mark.parametrize("body, param", [c[1:] for c in BAD_LENS], ids=[c[0] for c in BAD_LENS])
def test_a_bad_lens_request_is_a_400_naming_the_field(served, body, param):
    r = _lens(served[0], **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_the_induction_route_gives_the_measures_scores_once_per_server(tmp_path, monkeypatch):
    import gptkit.serving.inspection as inspection

    runs = []
    real = inspection.induction_test
    monkeypatch.setattr(inspection, "induction_test", lambda model: runs.append(1) or real(model))
    app = build_app(make_model_dir(tmp_path / "tiny-served"), ServeOptions())
    model = app.state.gptkit.engine.model
    with live_server(app) as url:
        first = httpx.get(url + "/playground/induction", timeout=60)
        assert first.status_code == 200, first.text
        assert httpx.get(url + "/playground/induction", timeout=60).json() == first.json()
    data = first.json()
    assert runs == [1]  # the second request was answered from the cache
    config = model.config
    assert (data["layers"], data["heads"]) == (config.n_layer, config.n_head)
    assert len(data["scores"]) == config.n_layer and all(len(row) == config.n_head for row in data["scores"])
    expected = induction_scores(model)
    assert torch.allclose(torch.tensor(data["scores"]), expected, atol=1e-4)
    assert data["length"] == config.block_size // 2
    assert data["chance"] == pytest.approx(chance_induction_score(data["length"]), abs=1e-4)
    best = data["strongest"]
    assert expected[best["layer"], best["head"]] == expected.max()
    assert data["repeated_half_loss"] > 0 and data["first_half_loss"] > 0


def test_the_inspection_routes_need_the_api_key(tmp_path):
    app = build_app(make_model_dir(tmp_path / "tiny-served"), ServeOptions(api_key="sekrit"))
    with live_server(app) as url:
        key = {"Authorization": "Bearer sekrit"}
        for method, path, body in (
            ("POST", "/playground/lens", {"text": "abc"}),
            ("GET", "/playground/induction", None),
        ):
            assert httpx.request(method, url + path, json=body, timeout=60).status_code == 401
            assert httpx.request(method, url + path, json=body, headers=key, timeout=60).status_code == 200


def test_playground_shows_the_logit_lens_and_the_induction_heads(tmp_path):
    _need_browser()
    app = build_app(make_model_dir(tmp_path / "tiny-served"), ServeOptions())
    with live_server(app) as url:
        lens = httpx.post(url + "/playground/lens", json={"text": TEXT}, timeout=60).json()
        induction = httpx.get(url + "/playground/induction", timeout=60).json()
        with playground_page(url, "tiny-served") as page:
            page.fill("#prompt", TEXT)
            page.click("#tab-attention")
            page.wait_for_function("document.querySelectorAll('#lens-tokens .lens-tok').length > 0")
            tokens = page.locator("#lens-tokens .lens-tok")
            assert tokens.count() == len(lens["positions"]) == len(TEXT)
            for position in (3, 7):
                row = lens["positions"][position]
                tokens.nth(position).hover()
                assert page.locator("#lens-table tr.layer").count() == 3  # embedding, layer 0, layer 1
                decided = page.locator("#lens-table tr.decided")
                assert decided.count() == 1
                label = lens["labels"][row["decided_at"]]
                assert decided.locator("td").first.inner_text() == label
                assert page.inner_text("#lens-decided") == f"decided at {label}"
                assert f"predicts {json.dumps(row['prediction'])}" in page.inner_text("#lens-info")
            page.wait_for_function("document.querySelectorAll('#induction td.score').length > 0")
            cells = page.locator("#induction td.score")
            assert cells.count() == 2 * 4  # n_layer x n_head
            assert [float(c) for c in cells.all_inner_texts()] == pytest.approx(
                [s for row in induction["scores"] for s in row], abs=1e-3
            )
            best = induction["strongest"]
            assert f"layer {best['layer']} head {best['head']}" in page.inner_text("#induction-strongest")
            assert page.locator("#induction td.strongest").get_attribute("data-head") == str(best["head"])
            page.click('#induction td.score[data-layer="1"][data-head="3"]')  # shows that head's attention
            page.wait_for_function("document.getElementById('head').value === '3'")
            assert page.eval_on_selector("#layer", "el => el.value") == "1"


def test_the_attention_view_of_a_text_longer_than_the_context_shows_its_last_block(tmp_path):
    # A 96-token context and 150 characters (a token each): the map, the lens and the induction panel all load,
    # over the same last 96 tokens, and the page throws nothing.
    _need_browser()
    app = build_app(make_model_dir(tmp_path / "tiny-served", block_size=96), ServeOptions())
    text = (TEXT + " ") * 5 + "x" * (150 - 5 * (len(TEXT) + 1))
    with live_server(app) as url:
        mapped = httpx.post(url + "/playground/attention", json={"text": text, "layer": 1}, timeout=60).json()
        assert mapped["offset"] == 150 - 96 and "".join(mapped["tokens"]) == text[-96:]
        assert len(mapped["attention"]) == len(mapped["probs"]) == 96
        with playground_page(url, "tiny-served") as page:
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.fill("#prompt", text)
            page.click("#tab-attention")
            page.wait_for_function("document.querySelectorAll('#induction td.score').length > 0")
            assert page.eval_on_selector("#heatmap", "el => el.dataset.drawn") == "96"
            assert page.locator("#lens-tokens .lens-tok").count() == 96
            assert "the last 96 tokens" in page.inner_text("#heatmap-info") and "54 before" in page.inner_text(
                "#heatmap-info"
            )
            box = page.locator("#heatmap").bounding_box()
            scale = box["width"] / page.eval_on_selector("#heatmap", "el => el.width")
            cell = (page.eval_on_selector("#heatmap", "el => el.width") - 48) // 96
            page.mouse.move(box["x"] + (48 + 4.5 * cell) * scale, box["y"] + (48 + 10.5 * cell) * scale)
            assert page.inner_text("#heatmap-info").startswith(f"query 10 {json.dumps(text[-96:][10])} → key 4 ")
            assert errors == []
