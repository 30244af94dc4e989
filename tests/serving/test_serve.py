"""`gptkit serve`: a live server on loopback driven by the official openai client and by raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from gptkit.chat import ChatTemplate, ChatTemplateError, load_chat_template
from gptkit.decoding.request import Request, visible_end
from gptkit.decoding.sampling import SamplingParams
from gptkit.loading import load
from gptkit.serving.server import ServeOptions, build_app
from tests.serving.servers import live_server, make_model_dir

MODEL = "tiny-served"
PROMPTS = ["Hello", "The cat sat", "abc", "Once upon a time", "x", "1, 2, 3,", "What is it?", "Zebra\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("serve") / MODEL)


@pytest.fixture(scope="module")
def reference(model_dir):
    model, tokenizer = load(model_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def server(model_dir):
    app = build_app(model_dir, ServeOptions(max_batch_size=8, max_queue=256, max_body_bytes=64 * 1024))
    with live_server(app) as url:
        yield url, app.state.gptkit


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server[0], timeout=30) as http:
        yield http


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy_reference(reference, prompt: str, max_tokens: int) -> tuple[str, str]:
    """Greedy continuation computed without the server or a cache: (text up to EOS, finish reason)."""
    model, tokenizer = reference
    ids = tokenizer.encode(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if token == tokenizer.eos_id:
                return tokenizer.decode(out), "stop"
            out.append(token)
    return tokenizer.decode(out), "length"


def test_completion_matches_uncached_greedy(client, reference):
    for prompt in PROMPTS[:4]:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        text, reason = greedy_reference(reference, prompt, 12)
        assert response.choices[0].text == text
        assert response.choices[0].finish_reason == reason
        assert response.usage.prompt_tokens == len(prompt)
        assert response.object == "text_completion" and response.model == MODEL


def test_a_server_on_the_device_answers_each_request_as_the_model_does(model_dir, reference, device):
    """Requests decoded together on --device (a GPU where the tests are asked to use one) get their own greedy text."""
    app = build_app(model_dir, ServeOptions(device=device.type, max_batch_size=4))
    assert app.state.gptkit.engine.batch.device.type == device.type
    with live_server(app) as url:
        own = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(prompt: str) -> str:
            return own.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(ask, PROMPTS))
        assert texts == [greedy_reference(reference, prompt, 10)[0] for prompt in PROMPTS]
        chunks = own.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in chunks) == texts[3]


def test_a_server_with_int4_weights_and_an_int8_cache_answers_as_the_python_api_does(model_dir):
    from gptkit.decoding.api import generate
    from gptkit.quantization import quantization_method, quantize

    app = build_app(model_dir, ServeOptions(quantize="int4", kv_cache="int8", max_batch_size=2))
    engine = app.state.gptkit.engine
    assert engine.batch.cache.kv_dtype == torch.int8 and quantization_method(engine.model) == "int4"
    model, tokenizer = load(model_dir)
    model = quantize(model, "int4")
    with live_server(app) as url:
        own = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in PROMPTS[:3]:
            text = own.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
            assert text == generate(model, tokenizer, prompt, max_new_tokens=8, temperature=0, kv_cache="int8")
    with pytest.raises(Exception, match="kv_cache must be one of int8"):
        build_app(model_dir, ServeOptions(kv_cache="fp8"))
    with pytest.raises(Exception, match="--quantize must be one of int8, int4"):
        build_app(model_dir, ServeOptions(quantize="int3"))


def test_streaming_equals_non_streaming_and_ends_with_done(server, client):
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0, stream=True))
    assert len(pieces) > 1
    assert "".join(p.choices[0].text for p in pieces) == full.choices[0].text
    assert pieces[-1].choices[0].finish_reason == full.choices[0].finish_reason
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_stop_string_cuts_the_output(client, reference):
    text, _ = greedy_reference(reference, "The cat sat", 30)
    stop = text[6:8]  # a stop string known to occur; the output must end just before its first occurrence
    expected = text[: text.index(stop)]
    response = client.completions.create(model=MODEL, prompt="The cat sat", max_tokens=30, temperature=0, stop=[stop])
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="The cat sat", max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(p.choices[0].text for p in streamed) == expected


def test_n_choices_seeded_and_prompt_lists(client):
    kwargs = dict(model=MODEL, prompt="Once upon", max_tokens=10, temperature=1.0, seed=7)
    many = client.completions.create(n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.text for c in many.choices}) > 1  # different seeds, different samples
    again = client.completions.create(n=3, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    # Choice i is drawn with seed + i.
    second = client.completions.create(**{**kwargs, "seed": 8})
    assert second.choices[0].text == many.choices[1].text
    both = client.completions.create(model=MODEL, prompt=["abc", "Hello"], max_tokens=6, temperature=0, n=2)
    assert len(both.choices) == 4
    assert both.choices[0].text == both.choices[1].text != both.choices[2].text == both.choices[3].text


def test_largest_seed_wraps_around_for_later_choices(client):
    kwargs = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0)
    two = client.completions.create(n=2, seed=2**64 - 1, **kwargs)
    assert two.choices[1].text == client.completions.create(seed=0, **kwargs).choices[0].text


def test_usage_counts_each_prompt_once_however_many_choices(client):
    response = client.completions.create(model=MODEL, prompt=["abc", "Hello"], max_tokens=3, n=3, seed=0)
    assert response.usage.prompt_tokens == len("abc") + len("Hello")
    assert response.usage.completion_tokens == 6 * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2)
    assert chat.usage.prompt_tokens == len(ChatTemplate().render([{"role": "user", "content": "Hi"}]))


def test_null_flags_are_false(http):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": None, "echo": None, "logprobs": None}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": None,
        "logprobs": None,
    }
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_logprobs_cover_the_text_up_to_the_stop_string(client, reference):
    text, _ = greedy_reference(reference, "The cat sat", 30)
    stop = text[6:8]
    kwargs = dict(model=MODEL, prompt="The cat sat", max_tokens=30, temperature=0, stop=[stop])
    choice = client.completions.create(logprobs=1, **kwargs).choices[0]
    assert choice.finish_reason == "stop" and "".join(choice.logprobs.tokens) == choice.text
    streamed = list(client.completions.create(logprobs=1, stream=True, **kwargs))
    assert "".join(t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens) == choice.text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=30,
        temperature=0,
        stop=[stop],
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(bytes(t.bytes) == t.token.encode() for t in content)


def test_non_streaming_client_that_leaves_mid_generation_frees_its_row(server, monkeypatch):
    engine = server[1].engine
    decode = engine._decode

    def slow_decode():  # 95 tokens now take about 5 s, and they flow without a pause
        time.sleep(0.05)
        decode()

    monkeypatch.setattr(engine, "_decode", slow_decode)
    before = engine.cancelled
    body = {"model": MODEL, "prompt": "a", "max_tokens": 95, "temperature": 1.0, "seed": 1}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server[0] + "/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 3
    while engine.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.cancelled == before + 1
    assert httpx.get(server[0] + "/health").json()["active"] == 0


def test_logprobs_match_the_model(client, reference):
    model, tokenizer = reference
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    ids = tokenizer.encode("Hello") + [tokenizer.encode(t)[0] for t in lp.tokens]
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0].log_softmax(-1)
    for i, token in enumerate(lp.tokens):
        position = len("Hello") - 1 + i
        assert lp.token_logprobs[i] == pytest.approx(float(expected[position, ids[position + 1]]), abs=1e-4)
        assert len(lp.top_logprobs[i]) == 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(expected[position].max()), abs=1e-4)
    assert lp.text_offset[0] == len("Hello")
    # A sampled token outside the top ones is listed beside them, as OpenAI lists it.
    sampled = (
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=2.0, seed=1, logprobs=1)
        .choices[0]
        .logprobs
    )
    assert all(
        t in top and top[t] == lp_t
        for t, lp_t, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs)
    )
    assert {len(top) for top in sampled.top_logprobs} == {1, 2}  # some tokens were not the most likely


def test_echo_with_zero_max_tokens_scores_the_prompt(client, reference):
    model, tokenizer = reference
    text = "The cat sat on the mat."
    response = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=0)
    choice = response.choices[0]
    assert choice.text == text
    ids = tokenizer.encode(text)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids]))[0].log_softmax(-1)
    expected = [None] + [float(logprobs[t - 1, ids[t]]) for t in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-4)
    assert choice.logprobs.tokens == list(text)
    assert response.usage.completion_tokens == 0


def test_scoring_past_a_learned_position_models_context_is_a_400_naming_the_prompt(http, reference):
    """lm-eval scores (context + continuation) with echo and logprobs: it must learn the window to respect, and a
    prompt past it must be a client error it can see, not a 500 it retries."""
    block = reference[0].config.block_size
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["context_length"] == block and card["max_context"] == 4 * block
    text = "abcdefghij" * (block // 10 + 2)  # block + 20 characters: scorable by nobody, generatable
    score = {"model": MODEL, "echo": True, "logprobs": 0, "max_tokens": 0}
    too_long = http.post("/v1/completions", json={**score, "prompt": text})
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["param"] == "prompt"
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert f"at most {block + 1}" in too_long.json()["error"]["message"]
    # block + 1 tokens score whole: the last one's prediction is never needed (lm-eval's hf backend scores so)
    fits = http.post("/v1/completions", json={**score, "prompt": text[-block - 1 :], "logprobs": 0})
    assert fits.status_code == 200
    scored = fits.json()["choices"][0]["logprobs"]["token_logprobs"]
    model, tokenizer = reference
    ids = tokenizer.encode(text[-block - 1 :])
    with torch.no_grad():
        logprobs = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)
    assert len(scored) == block + 1 and scored[0] is None
    assert scored[1:] == pytest.approx([float(logprobs[t - 1, ids[t]]) for t in range(1, len(ids))], abs=1e-4)
    generated = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 3})
    assert generated.status_code == 200  # a generation slides its window past block_size


def test_the_tokenizer_endpoints_speak_vllms_form(http, reference):
    """lm-evaluation-harness's remote tokenizer (local-completions' default when these answer) reads them."""
    _, tokenizer = reference
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.decode([tokenizer.eos_id]) and info["model_max_length"] == 96
    ids = http.post("/tokenize", json={"prompt": "The cat", "add_special_tokens": False}).json()["tokens"]
    assert ids == tokenizer.encode("The cat")
    assert http.post("/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"] == [tokenizer.eos_id]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "The cat"
    bad = http.post("/detokenize", json={"tokens": [tokenizer.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = http.post("/tokenize", json={"prompt": "\u4e2d"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "prompt"


def test_chat_uses_the_default_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = ChatTemplate().render(messages)
    assert prompt == "system: Be brief.\n\nuser: Hi there\n\nassistant:"
    expected, _ = greedy_reference(reference, prompt, 10)
    expected = expected.split("\n\nuser:")[0]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(prompt)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True, logprobs=True, top_logprobs=2
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed_tokens = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(streamed_tokens).startswith(expected)


def test_a_chat_template_saved_by_transformers_comes_through_convert(tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from gptkit.cli import main
    from tests.finetune.test_finetune import chatml_dir

    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    tokenizer = AutoTokenizer.from_pretrained(chatml_dir(tmp_path / "tokenizer"))
    tokenizer.save_pretrained(hf_dir)  # transformers 5 writes the template to chat_template.jinja
    assert (hf_dir / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((hf_dir / "tokenizer_config.json").read_text())
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=16,
        n_layer=1,
        n_head=2,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(hf_dir)
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(out)]) == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for directory in (hf_dir, out):  # served from the Hugging Face directory or from the import
        assert load_chat_template(directory).render(messages) == want


def test_a_template_rendering_too_long_or_too_much_is_stopped():
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{{ j % 2 }}{% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": "Hi"}]
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="took more than 0.2 s to render"):
        slow.render(messages, max_seconds=0.2)
    assert time.monotonic() - started < 30  # stopped, not run to its 10 billion steps
    with pytest.raises(ChatTemplateError, match="more than 1,000 characters"):
        slow.render(messages, max_chars=1000)
    assert ChatTemplate("{{ messages[0].content }}").render(messages, max_chars=2, max_seconds=1.0) == "Hi"


def test_chat_template_from_tokenizer_config(tmp_path):
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    loaded = load_chat_template(tmp_path)
    assert loaded.render([{"role": "user", "content": "Hi"}]) == "<user>Hi</s><assistant>"
    assert loaded.stop == ()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no') }}"}))
    with pytest.raises(Exception, match="no"):
        load_chat_template(tmp_path).render([{"role": "user", "content": "Hi"}])


def test_32_concurrent_clients_get_their_single_request_answers(server, client):
    state = server[1]
    cases = [(PROMPTS[i % len(PROMPTS)], 4 + 5 * (i % 3)) for i in range(32 * 4)]  # 24 distinct requests
    singles = {}
    for prompt, max_tokens in sorted(set(cases)):
        singles[prompt, max_tokens] = (
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text
        )

    def worker(worker_id: int) -> list[bool]:
        own = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
        results = []
        for j in range(4):
            prompt, max_tokens = cases[worker_id * 4 + j]
            stream = (worker_id + j) % 2 == 0
            kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
            if stream:
                text = "".join(c.choices[0].text for c in own.completions.create(stream=True, **kwargs))
            else:
                text = own.completions.create(**kwargs).choices[0].text
            results.append(text == singles[prompt, max_tokens])
        return results

    state.engine.max_rows_seen = 0
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outcomes = [ok for oks in pool.map(worker, range(32)) for ok in oks]
    assert len(outcomes) == 128 and all(outcomes)
    assert state.engine.max_rows_seen > 1  # requests really were decoded together


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny-served", "prompt": "Hel', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("prompt missing", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("max_tokens a string", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    (
        "temperature a string",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "temperature": "hot"},
        400,
        "temperature",
    ),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    (
        "max_tokens beyond context",
        "/v1/completions",
        {"model": MODEL, "prompt": "abc", "max_tokens": 4 * 96 - 2},
        400,
        "max_tokens",
    ),
    (
        "prompt longer than context",
        "/v1/completions",
        {"model": MODEL, "prompt": "a" * (4 * 96 + 1), "max_tokens": 1},
        400,
        "prompt",
    ),
    ("token id outside vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 9999]}, 400, "prompt"),
    ("character outside vocabulary", "/v1/completions", {"model": MODEL, "prompt": "caf\u00e9"}, 400, "prompt"),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
    ("top_p above 1", "/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("n zero", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ("n beyond capacity", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 10_000}, 400, "n"),
    ("logprobs above 20", "/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("seed beyond 64 bits", "/v1/completions", {"model": MODEL, "prompt": "a", "seed": 2**64}, 400, "seed"),
    (
        "infinite temperature",
        "/v1/completions",
        b'{"model": "tiny-served", "prompt": "a", "temperature": Infinity}',
        400,
        "temperature",
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("chat without messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "chat role unknown",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "x", "content": "a"}]},
        400,
        "messages.0.role",
    ),
    (
        "chat user message without content",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user"}]},
        400,
        "messages.0",
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "a"}]},
        404,
        "model",
    ),
    (
        "tiny repetition_penalty",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "repetition_penalty": 1e-300},
        400,
        "repetition_penalty",
    ),
    (
        "logit_bias key not an id",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "logit_bias": {"a": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias id outside vocabulary",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias above 100",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "logit_bias": {"5": 101}},
        400,
        "logit_bias",
    ),
    (
        "frequency_penalty above 2",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "frequency_penalty": 2.5},
        400,
        "frequency_penalty",
    ),
    (
        "garbage presence_penalty",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "presence_penalty": "garbage"},
        400,
        "presence_penalty",
    ),
    ("best_of above n", "/v1/completions", {"model": MODEL, "prompt": "a", "best_of": 3}, 400, "best_of"),
    ("suffix", "/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "end"}, 400, "suffix"),
    (
        "json mode, a tokenizer without '{'",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "tools the tokenizer cannot write",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        400,
        "messages",
    ),
    ("unknown field", "/v1/completions", {"model": MODEL, "prompt": "a", "ignore_eos": True}, 400, "ignore_eos"),
    ("oversized body", "/v1/completions", {"model": MODEL, "prompt": "a" * 70_000}, 413, None),
    ("unknown route", "/v1/engines", {}, 404, None),
]


@pytest.mark.parametrize("name, path, body, status, param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_4xx_error_object_and_server_stays_up(http, client, name, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    # greedy: a sampled reply may end at the end-of-text token by chance (a "stop" that says nothing of the server)
    after = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert after.choices[0].finish_reason == "length"


def test_an_empty_body_is_named(http):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = http.post(path, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "no body" in r.json()["error"]["message"], r.text


def test_chunked_oversized_body_is_refused(server):
    def chunks():
        for _ in range(100):
            yield b" " * 1024

    r = httpx.post(server[0] + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["max_batch_size"] == 8


def test_disconnect_mid_stream_frees_the_slot(server):
    state = server[1]
    before = state.engine.cancelled
    body = {"model": MODEL, "prompt": "a", "max_tokens": 95, "temperature": 1.0, "seed": 1, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=30) as r:
        next(r.iter_lines())  # the first token arrived: the request holds a batch row now
    deadline = time.monotonic() + 10
    while state.engine.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.engine.cancelled == before + 1
    assert httpx.get(server[0] + "/health").json()["active"] == 0


def test_full_queue_answers_503_with_retry_after(model_dir):
    app = build_app(model_dir, ServeOptions(max_batch_size=1, max_queue=1))
    engine = app.state.gptkit.engine  # not started (no lifespan): nothing leaves the queue
    params = SamplingParams(max_new_tokens=1)
    engine.submit([(Request([1], params), lambda chunk: None), (Request([1], params), lambda chunk: None)])
    r = TestClient(app, base_url="http://localhost").post(
        "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}
    )
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_busy"


def test_streamed_text_holds_back_what_may_start_a_stop_string():
    assert visible_end("hello wor", ("world",)) == 6
    assert visible_end("hello", ("xyz",)) == 5
    assert visible_end("ab\ufffd", ()) == 2
    # A stop string ending in a multi-byte character: its start must not leak while the character is incomplete.
    assert visible_end("say caf\ufffd", ("café",)) == 4


def test_cli_binds_loopback_and_requires_the_api_key(model_dir):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gptkit",
            "serve",
            str(model_dir),
            "--port",
            "0",
            "--api-key",
            "sekrit",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            match = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", line)
            url = match.group(1) if match else None
        assert url is not None and url.startswith("http://127.0.0.1:")
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="a", max_tokens=3).usage.completion_tokens == 3
        assert httpx.get(url + "/").status_code == 200  # the playground page itself is public
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_engine_rows_join_at_the_next_step_and_leave_when_done(reference):
    """Drive the scheduler step by step: rows join, leave and move (compaction) without changing any output."""
    from gptkit.serving.engine import Engine

    model, tokenizer = reference
    engine = Engine(model, tokenizer, max_batch_size=2, max_queue=4)  # not started: the test calls _step itself
    outputs: dict[str, list[str]] = {"a": [], "b": [], "c": []}

    def submit(name: str, prompt: str, max_tokens: int) -> None:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
        request = Request(tokenizer.encode(prompt), params, tokenizer.eos_ids, tokenizer.decode)
        engine.submit([(request, lambda chunk: outputs[name].append(chunk.text))])

    def step() -> None:
        engine._step()

    submit("a", "Hello", 3)
    step()  # a joins (prefill picks its first token) and decodes its second in the same step
    assert len(engine.active) == 1
    submit("b", "Once upon a time", 12)
    step()  # b joins at the next step: a and b decode together
    assert len(engine.active) == 1 and engine.max_rows_seen == 2  # a finished at 3 tokens and left
    submit("c", "abc", 5)
    while engine.active or engine.waiting:
        step()
    for name, prompt, max_tokens in (("a", "Hello", 3), ("b", "Once upon a time", 12), ("c", "abc", 5)):
        text, reason = greedy_reference(reference, prompt, max_tokens)
        assert "".join(outputs[name]) == text, name


def test_chat_uses_the_model_dirs_own_template(model_dir, reference, tmp_path):
    import shutil

    templated = Path(shutil.copytree(model_dir, tmp_path / MODEL))
    template = "{% for m in messages %}{{ m.role[0] | upper }}: {{ m.content }}\n{% endfor %}A:"
    (templated / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with TestClient(build_app(templated, ServeOptions()), base_url="http://localhost") as test_client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
        r = test_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    expected, _ = greedy_reference(reference, "U: Hi\nA:", 6)
    assert r.json()["choices"][0]["message"]["content"] == expected
    assert r.json()["usage"]["prompt_tokens"] == len("U: Hi\nA:")


def test_a_failing_model_call_fails_that_request_only(server, http, monkeypatch):
    engine = server[1].engine

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine.model, "forward", broken)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_foreign_host_is_refused_while_the_server_binds_loopback(server, model_dir):
    url = server[0]
    refused = httpx.get(url + "/v1/models", headers={"Host": "attacker.example:8000"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "host_not_allowed"
    assert "--allowed-host attacker.example" in refused.json()["error"]["message"]
    assert httpx.get(url + "/", headers={"Host": "attacker.example"}).status_code == 403  # the playground too
    for host in ("localhost:8000", "127.0.0.1", "127.0.0.2:80", "[::1]:8000", "app.localhost"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host
    with TestClient(build_app(model_dir, ServeOptions(allowed_host=("box.lan",))), base_url="http://box.lan") as c:
        assert c.get("/v1/models").status_code == 200
    # Bound to every interface, the server is meant to be reached by other names (guard it with --api-key).
    with TestClient(build_app(model_dir, ServeOptions(host="0.0.0.0")), base_url="http://attacker.example") as c:
        assert c.get("/v1/models").status_code == 200


@pytest.mark.parametrize("name", ["", " "])
def test_an_empty_allowed_host_is_refused_in_one_line(name, tmp_path, capsys):
    """An empty name would serve requests whose Host header is empty, which the guard exists to refuse."""
    from gptkit.cli import main
    from gptkit.errors import GptkitError

    assert main(["serve", str(tmp_path), "--allowed-host", "box.lan", name]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gptkit serve: error: --allowed-host {name!r} names no host: give a host name such as mybox.lan (loopback "
        "names need no flag)"
    ]
    with pytest.raises(GptkitError, match="names no host"):
        ServeOptions(allowed_host=(name,))


def test_fields_that_change_nothing_are_accepted(http):
    plain = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    want = http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
    unused = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "best_of": 1,
        "suffix": None,
        "response_format": None,
    }
    r = http.post("/v1/completions", json={**plain, **unused})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "parallel_tool_calls": True,
    }
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def whole_response(sock: socket.socket) -> bytes:
    """One HTTP response read off a socket: its head, then as many body bytes as its Content-Length says."""
    response = b""
    while b"\r\n\r\n" not in response or len(response.partition(b"\r\n\r\n")[2]) < int(
        re.search(rb"content-length: (\d+)", response.lower()).group(1)
    ):
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed after {response!r}")
        response += chunk
    return response


def test_a_half_sent_request_is_closed_after_the_head_timeout(model_dir):
    app = build_app(model_dir, ServeOptions(head_timeout=1.0, max_connections=4))
    with live_server(app, ServeOptions(head_timeout=1.0, max_connections=4)) as url:
        port = int(url.rsplit(":", 1)[1])
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        stalled[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head never ends
        stalled[2].sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )  # the body never ends
        for s in stalled:
            s.settimeout(10)
        started = time.monotonic()
        assert [s.recv(1024) for s in stalled] == [b"", b"", b""]  # closed by the server, with nothing sent
        assert 0.5 < time.monotonic() - started < 8
        for s in stalled:
            s.close()
        # A kept-alive connection that sends nothing after its response is closed after the same deadline.
        idle = socket.create_connection(("127.0.0.1", port))
        idle.settimeout(10)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert whole_response(idle).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        assert idle.recv(1024) == b""
        assert 0.5 < time.monotonic() - answered < 8
        idle.close()
        # A body that keeps moving is not cut, however long it takes; a request begun late in a kept-alive
        # connection's idle time gets its own window.
        body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1}).encode().ljust(60)
        slow = socket.create_connection(("127.0.0.1", port))
        slow.settimeout(10)
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        for start in range(0, len(body), 10):  # 6 pieces 0.4 s apart: 2.4 s in all, against a 1 s deadline
            time.sleep(0.4)
            slow.sendall(body[start : start + 10])
        assert whole_response(slow).startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # most of the idle window gone
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        slow.sendall(head[:10])
        time.sleep(0.5)  # the head completes 1.3 s after the last response: inside its own window
        slow.sendall(head[10:])
        assert whole_response(slow).startswith(b"HTTP/1.1 200")
        slow.close()
        # A whole request is unaffected, also on a kept-alive connection after the deadline has passed.
        with httpx.Client(base_url=url) as http:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 200
            time.sleep(1.5)
            assert http.post("/v1/completions", json=body).status_code == 200
        # Beyond max_connections open connections a request is answered 503.
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            assert httpx.post(url + "/v1/completions", json=body).status_code == 503
        finally:
            for s in held:
                s.close()


def test_a_pathological_template_stops_with_an_error_and_others_are_answered(model_dir, tmp_path):
    import shutil
    import threading

    templated = Path(shutil.copytree(model_dir, tmp_path / MODEL))
    template = (
        "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{{ j % 2 }}{% endfor %}{% endfor %}"
        "{% elif messages[0].content == 'huge' %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"
        "{% elif messages[0].content == 'include' %}{% include 'other.jinja' %}"
        "{% elif messages[0].content == 'recurse' %}{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(1) }}"
        "{% else %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:{% endif %}"
    )
    (templated / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))

    def chat(content: str) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)

    def complete() -> float:
        started = time.monotonic()
        body = {"model": MODEL, "prompt": "a", "max_tokens": 20}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        return time.monotonic() - started

    app = build_app(templated, ServeOptions())
    with live_server(app) as url:
        assert chat("hello").status_code == 200
        alone = min(complete() for _ in range(3))
        looping: list[httpx.Response] = []

        def run_loop() -> None:
            started = time.monotonic()
            looping.append(chat("loop"))
            looping[-1].elapsed_s = time.monotonic() - started  # type: ignore[attr-defined]

        threads = [threading.Thread(target=run_loop) for _ in range(3)]  # more loops than worker processes
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        other = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=60)
        for thread in threads:
            thread.join()
        assert other.status_code == 200  # answered, not stalled behind the loops
        for answer in looping:
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
            assert "chat template" in answer.json()["error"]["message"]
        assert min(a.elapsed_s for a in looping) < 9  # the documented 5 s deadline, not twice it
        # The looping renders were stopped for real: no worker is left busy, and completions are back to speed
        # (a loop left spinning in the server's process slowed a 20-token completion 50-fold).
        workers = app.state.gptkit.templates
        assert workers.started == workers.idle.qsize() <= 2
        assert min(complete() for _ in range(3)) < 5 * alone + 0.2
        recurse = chat("recurse")
        assert recurse.status_code == 400 and "recursed" in recurse.json()["error"]["message"]
        huge = chat("huge")
        assert huge.status_code == 400 and "more than 4,194,304 characters" in huge.json()["error"]["message"]
        include = chat("include")
        assert include.status_code == 400 and "cannot load files" in include.json()["error"]["message"]
        assert chat("hello").status_code == 200


def test_logit_bias_forces_and_bans_tokens(http, reference):
    _, tokenizer = reference
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6}
    z = tokenizer.encode("z")[0]
    forced = http.post("/v1/completions", json={**body, "logit_bias": {str(z): 100}, "seed": 3}).json()
    assert forced["choices"][0]["text"] == "z" * 6
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    first = tokenizer.encode(greedy[0])[0]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
    banned = http.post("/v1/completions", json={**body, "temperature": 0, "logit_bias": {str(first): -100}}).json()
    assert greedy[0] not in banned["choices"][0]["text"]
    chat_forced = http.post("/v1/chat/completions", json={**chat, "logit_bias": {str(z): 100}}).json()
    assert chat_forced["choices"][0]["message"]["content"] == "z" * 6


@pytest.mark.parametrize("size", [1, 2])
def test_a_template_worker_killed_while_idle_is_replaced_before_a_request_uses_it(size, caplog):
    import signal

    from gptkit.serving.templates import TemplateWorkers

    workers = TemplateWorkers(ChatTemplate("{{ messages[0].content }}!"), 5.0, size=size)
    try:
        workers.warm()
        idle = workers.idle.queue[0]
        os.kill(idle.process.pid, signal.SIGKILL)
        idle.process.wait()  # dead, as after a kill from outside (wait() here only makes the test deterministic)
        with caplog.at_level(logging.WARNING, logger="gptkit.serve"):
            assert workers.render([{"role": "user", "content": "hi"}], None, 1000) == "hi!"
        assert "had ended while idle" in caplog.text
        assert workers.started == workers.idle.qsize() == 1 and workers.idle.queue[0] is not idle
    finally:
        workers.close()


def test_template_workers_answer_a_templates_runtime_error_and_keep_their_places():
    from gptkit.serving.templates import TemplateWorkers

    workers = TemplateWorkers(ChatTemplate("{% if messages[0].content == 'bad' %}{{ 1 + 'a' }}{% endif %}ok"), 5.0)
    try:
        for _ in range(3):  # more than the pool's processes: a failing render must not cost a place
            with pytest.raises(ChatTemplateError, match="TypeError"):  # the template's own error, not a dead worker
                workers.render([{"role": "user", "content": "bad"}], None, 1000)
        with pytest.raises(TypeError):  # a request that cannot even be sent: the worker is retired, not lost
            workers.render([{"role": "user", "content": object()}], None, 1000)
        assert workers.render([{"role": "user", "content": "fine"}], None, 1000) == "ok"
        assert workers.started == workers.idle.qsize() == 1  # one process served all of it
    finally:
        workers.close()
    assert workers.started == 0
    with pytest.raises(ChatTemplateError, match="shutting down"):
        workers.render([{"role": "user", "content": "fine"}], None, 1000)


def test_serve_loads_the_model_on_the_thread_that_then_decodes(model_dir, monkeypatch):
    # One thread does all of the model's work: a second thread running OpenMP code gives the process a second OpenMP
    # pool, and then libgomp's barriers sleep (the fused step decoded a third slower; engine.py says more).
    import threading

    from gptkit.serving import server as server_module

    loaded_on = []

    def recording_build_app(path: Path, options: ServeOptions) -> object:
        loaded_on.append(threading.current_thread())
        return build_app(path, options)

    monkeypatch.setattr(server_module, "build_app", recording_build_app)
    app = server_module._load_on_engine_thread(model_dir, ServeOptions(max_batch_size=2), torch.get_num_threads())
    engine = app.state.gptkit.engine
    assert loaded_on == [engine.thread] and engine.thread is not threading.main_thread() and engine.running
    before = set(threading.enumerate())
    with TestClient(app, base_url="http://localhost") as test_client:  # its start-up finds the loop running
        assert not [t for t in set(threading.enumerate()) - before if t.name == "gptkit-engine"]
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        answer = test_client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
    assert not engine.thread.is_alive()  # the app's shutdown ended the loop, and with it the thread


def test_serve_reports_a_bad_option_from_the_loading_thread_in_one_line(model_dir):
    from gptkit.errors import GptkitError
    from gptkit.serving.server import _load_on_engine_thread

    with pytest.raises(GptkitError, match="--dtype must be one of"):
        _load_on_engine_thread(model_dir, ServeOptions(dtype="float8"), torch.get_num_threads())
