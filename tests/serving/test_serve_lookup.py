"""Prompt lookup in `gptkit serve`: per request and as the server's default, greedy text equal to decoding without
it (one request and several at once), its counters on /metrics, and clear refusals."""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from helpers import confident_char_model_dir

from gptkit.decoding.api import generate
from gptkit.loading import load
from gptkit.serving.server import ServeOptions, build_app

MODEL = "lookup-served"
# Each prompt repeats itself, so that its own tokens hold matches from the first step on.
PROMPTS = ["abc abd abc abd abc ", "the cat, the cat, the ", "1 2 3 1 2 3 1 2 ", "hello hello hel"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return confident_char_model_dir(tmp_path_factory.mktemp("lookup") / MODEL, block_size=128)


@pytest.fixture(scope="module")
def plain(model_dir) -> dict[str, str]:
    """Each prompt's greedy text without lookup (gptkit.generate: the same batch engine the server runs)."""
    model, tokenizer = load(model_dir)
    return {p: generate(model, tokenizer, p, max_new_tokens=40, temperature=0) for p in PROMPTS}


def counters(client: TestClient) -> dict[str, int]:
    text = client.get("/metrics").text
    names = ("draft_tokens", "accepted_tokens", "verify_passes")
    return {n: int(re.search(rf"^gptkit_speculative_{n}_total (\d+)$", text, re.M).group(1)) for n in names}


def complete(client: TestClient, prompt: str, **extra) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_lookup_server_answers_as_without_it_alone_and_together(model_dir, plain):
    with TestClient(
        build_app(model_dir, ServeOptions(lookup=True, lookup_k=4, max_batch_size=4)), base_url="http://127.0.0.1"
    ) as client:
        assert complete(client, PROMPTS[2]) == plain[PROMPTS[2]]
        after_one = counters(client)
        assert after_one["accepted_tokens"] > 0 and after_one["draft_tokens"] >= after_one["accepted_tokens"]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda p: complete(client, p), PROMPTS))
        assert texts == [plain[p] for p in PROMPTS]
        assert counters(client)["accepted_tokens"] > after_one["accepted_tokens"]
        before = counters(client)
        assert complete(client, PROMPTS[1], lookup=False) == plain[PROMPTS[1]]  # a request may turn it off
        assert counters(client) == before


def test_a_request_asks_for_lookup_on_a_server_without_it(model_dir, plain):
    with TestClient(build_app(model_dir, ServeOptions(max_batch_size=2)), base_url="http://127.0.0.1") as client:
        assert complete(client, PROMPTS[2]) == plain[PROMPTS[2]]
        assert counters(client)["draft_tokens"] == 0
        assert complete(client, PROMPTS[2], lookup={"k": 3, "ngram": 2}) == plain[PROMPTS[2]]
        assert counters(client)["accepted_tokens"] > 0
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 20}
        response = client.post("/v1/chat/completions", json={**chat, "temperature": 0, "lookup": True})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "lookup, names",
    [({"k": 0}, "k"), ({"kk": 2}, "kk"), ({"k": 99}, "k <= 8"), ("yes", "lookup")],
)
def test_bad_lookup_settings_are_refused_naming_them(model_dir, lookup, names):
    with TestClient(build_app(model_dir, ServeOptions(max_batch_size=1)), base_url="http://127.0.0.1") as client:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "lookup": lookup}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400 and names in response.text
