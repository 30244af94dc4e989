"""The request field `lookup` on the Messages and Responses APIs, as on chat completions: greedy text with it equal to
without, the setting reaching the engine (the drafted-token counter on /metrics moves only when a request asks), and
a bad value refused in each API's error shape naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from helpers import confident_char_model_dir

from gptkit.serving.server import ServeOptions, build_app

MODEL = "lookup-apis"
PROMPT = "the cat, the cat, the cat, the "  # repeats itself: matches from the first step on


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return confident_char_model_dir(tmp_path_factory.mktemp("lookup-apis") / MODEL, block_size=256)


def drafted(client: TestClient) -> int:
    """Tokens proposed by prompt lookup so far."""
    return int(re.search(r"^gptkit_speculative_draft_tokens_total (\d+)$", client.get("/metrics").text, re.M).group(1))


def message_text(client: TestClient, **extra) -> str:
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]}
    response = client.post("/v1/messages", json=body | extra)
    assert response.status_code == 200, response.text
    return response.json()["content"][0]["text"]


def response_text(client: TestClient, **extra) -> str:
    body = {"model": MODEL, "max_output_tokens": 24, "temperature": 0, "input": PROMPT}
    response = client.post("/v1/responses", json=body | extra)
    assert response.status_code == 200, response.text
    return response.json()["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("ask", [message_text, response_text], ids=["messages", "responses"])
def test_a_request_turns_lookup_on_and_its_text_stays_the_same(model_dir, ask):
    with TestClient(build_app(model_dir, ServeOptions(max_batch_size=1)), base_url="http://127.0.0.1") as client:
        plain = ask(client)
        assert drafted(client) == 0  # the server's default is off
        assert ask(client, lookup=True) == plain
        after_true = drafted(client)
        assert after_true > 0
        assert ask(client, lookup={"k": 2, "ngram": 1}) == plain
        assert drafted(client) > after_true


@pytest.mark.parametrize("ask", [message_text, response_text], ids=["messages", "responses"])
def test_a_request_turns_the_servers_lookup_off(model_dir, ask):
    with TestClient(
        build_app(model_dir, ServeOptions(lookup=True, lookup_k=4, max_batch_size=1)), base_url="http://127.0.0.1"
    ) as client:
        speculated = ask(client)
        before = drafted(client)
        assert before > 0  # the server's default is on
        assert ask(client, lookup=False) == speculated
        assert drafted(client) == before


@pytest.mark.parametrize("lookup, words", [("yes", "lookup is a string"), ({"kk": 2}, "'kk'"), ({"k": 99}, "k <= 8")])
def test_a_bad_lookup_is_refused_in_each_apis_error_shape(model_dir, lookup, words):
    with TestClient(build_app(model_dir, ServeOptions(max_batch_size=1)), base_url="http://127.0.0.1") as client:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "abc"}], "lookup": lookup}
        response = client.post("/v1/messages", json=body)
        assert response.status_code == 400
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert "lookup" in error["error"]["message"] and words in error["error"]["message"]

        body = {"model": MODEL, "max_output_tokens": 4, "input": "abc", "lookup": lookup}
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "lookup" and words in error["message"]
