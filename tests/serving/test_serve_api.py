"""The API beyond completions and chat: tools on "auto", replies that may begin with the template's lead, the
Responses and Embeddings APIs, /metrics and /props, and the validation OpenAI's API does, through the official
openai client where it has the call."""

from __future__ import annotations

import base64
import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from gptkit.formats.modeldir import save_model_dir
from gptkit.serving.embeddings import embed
from gptkit.serving.server import ServeOptions, build_app
from gptkit.serving.tools import parse_calls
from gptkit.tokenizer import ByteTokenizer
from tests.decoding.test_structured import TOOLS, byte_model
from tests.serving.servers import live_server

MODEL = "api-served"
WEATHER = TOOLS[0]["function"]["parameters"]
CALL_START, TEXT_START, SPACE, NEWLINE = (str(ord(c)) for c in "{H \n")  # a byte tokenizer's ids are the bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_model_dir(byte_model(), tmp_path_factory.mktemp("api") / MODEL, tokenizer=ByteTokenizer())
    app = build_app(model_dir, ServeOptions(max_batch_size=4))
    with live_server(app) as url:
        yield url, app.state.gptkit


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, bias: dict[str, int] | None = None, **fields):
    fields.setdefault("max_tokens", 200)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], seed=1, logit_bias=bias, **fields
    )


# ---------------------------------------------------------------- tools on "auto"


def test_auto_lets_the_model_call_a_tool_or_answer(client):
    # The default tool_choice with tools is "auto". The model's first token decides: a `{` begins a call, which the
    # grammar then holds to the tool's schema; anything else is a plain reply. (logit_bias makes the model pick.)
    call = chat(client, {CALL_START: 100}, tools=TOOLS[:1]).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    for made in call.message.tool_calls:
        assert made.function.name == "get_weather"
        jsonschema.validate(json.loads(made.function.arguments), WEATHER)
    text = chat(client, {TEXT_START: 100}, tools=TOOLS[:1], max_tokens=5).choices[0]
    assert text.message.tool_calls is None and text.message.content == "HHHHH"


@pytest.mark.parametrize("bias", [{CALL_START: 100}, {TEXT_START: 30}, None])
def test_a_streamed_auto_reply_equals_the_whole_one(client, bias):
    fields = dict(tools=TOOLS, tool_choice="auto", max_tokens=120)
    whole = chat(client, bias, **fields).choices[0]
    events = list(chat(client, bias, stream=True, **fields))
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    calls = [c for d in deltas for c in (d.tool_calls or [])]
    streamed = {}
    for piece in calls:
        entry = streamed.setdefault(piece.index, {"name": piece.function.name, "arguments": ""})
        entry["arguments"] += piece.function.arguments or ""
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == [
        (c["name"], c["arguments"]) for c in streamed.values()
    ]
    assert events[-1].choices[0].finish_reason == whole.finish_reason


def test_parallel_calls_come_one_per_line_and_can_be_turned_off(client):
    # After a whole call the grammar allows a newline and another call: pushed towards the newline, the model
    # writes calls until max_tokens: the whole ones valid calls, the last (cut short) as text.
    many = chat(client, {NEWLINE: 100}, tools=TOOLS[:1], tool_choice="required", max_tokens=150).choices[0]
    assert len(many.message.tool_calls) >= 1 and many.finish_reason == "length"
    assert many.message.content.startswith('{"name"')
    for made in many.message.tool_calls:
        jsonschema.validate(json.loads(made.function.arguments), WEATHER)
    one = chat(client, {NEWLINE: 100}, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_calls_are_read_back_from_the_text_the_grammar_writes():
    text = '{"name": "f", "arguments": {"a": "}\\n"}}\n{"name": "g", "arguments": {"b": [1'
    first, second = parse_calls(" " + text)
    assert (first.name, first.arguments, first.complete) == ("f", '{"a": "}\\n"}', True)
    assert (second.name, second.arguments, second.complete) == ("g", '{"b": [1', False)
    assert parse_calls("  ") == [] and parse_calls(" Hello {") is None
    assert parse_calls('{"x": 1}') is None  # JSON, but not a call


# ---------------------------------------------------------------- the template's lead before JSON


def test_json_may_begin_with_the_space_the_default_template_replies_begin_with(client):
    # The default template writes "assistant: <reply>", so a model trained on it begins each reply with a space;
    # the grammar allows that one space before the JSON (and no more).
    schema = {
        "type": "object",
        "properties": {"c": {"enum": ["red", "blue"]}},
        "required": ["c"],
        "additionalProperties": False,
    }  # no free string: a space can only go before the JSON
    format_ = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    spaced = chat(client, {SPACE: 100}, response_format=format_).choices[0]
    assert spaced.message.content in (' {"c": "red"}', ' {"c": "blue"}') and spaced.finish_reason == "stop"
    call = chat(client, {SPACE: 100}, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False)
    assert call.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.choices[0].message.tool_calls[0].function.arguments), WEATHER)


# ---------------------------------------------------------------- /v1/responses


def test_responses_answers_text_through_the_openai_client(client):
    response = client.responses.create(
        model=MODEL, input="Hello", max_output_tokens=8, temperature=0, instructions="Be brief."
    )
    same = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert response.output_text == same.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == same.usage.prompt_tokens
    assert response.usage.output_tokens == same.usage.completion_tokens


def test_a_streamed_response_ends_with_the_whole_one(client):
    request = dict(model=MODEL, input=[{"role": "user", "content": "Hi"}], max_output_tokens=12, temperature=0)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_calls_functions_and_reads_their_results(client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    first = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    history = ["Weather in Paris?", call, {"type": "function_call_output", "call_id": call.call_id, "output": "21"}]
    history[0] = {"role": "user", "content": history[0]}
    final = client.responses.create(model=MODEL, input=history, tools=[tool], tool_choice="none", max_output_tokens=4)
    assert final.output[0].type == "message" and final.usage.input_tokens > first.usage.input_tokens
    streamed = list(
        client.responses.create(
            model=MODEL,
            input="Weather?",
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert (
        len(done) == 1 and "".join(e.delta for e in streamed if e.type.endswith("arguments.delta")) == done[0].arguments
    )


def test_responses_structured_output_parses(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="A digit?",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ],
)
def test_what_responses_cannot_honour_is_a_400_naming_the_field(server, fields, param):
    reply = httpx.post(f"{server[0]}/v1/responses", json={"model": MODEL, "input": "x", **fields})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


# ---------------------------------------------------------------- /v1/embeddings


def test_embeddings_are_the_mean_pooled_final_states_in_both_encodings(client, server):
    model = server[1].engine.model
    texts = ["Hello there", "x"]
    got = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    floats = httpx.post(
        f"{server[0]}/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "float"}
    ).json()
    for i, text in enumerate(texts):
        ids = ByteTokenizer().encode(text)
        with torch.no_grad():
            want = torch.nn.functional.normalize(model.hidden(torch.tensor([ids]))[0].mean(0), dim=0)
        torch.testing.assert_close(torch.tensor(got.data[i].embedding), want, rtol=0, atol=1e-6)  # float32 bytes
        assert floats["data"][i]["embedding"] == pytest.approx(want.tolist(), abs=1e-6)
    assert got.usage.prompt_tokens == sum(len(ByteTokenizer().encode(t)) for t in texts)
    raw = httpx.post(f"{server[0]}/v1/embeddings", json={"model": MODEL, "input": "x", "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (model.config.n_embd,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-6


def test_similar_texts_embed_closer_than_unrelated_ones_on_a_trained_model():
    from tests.decoding.test_quantize import trained

    model, tokenizer, _ = trained.__wrapped__()
    lines = [
        "First Citizen: We are accounted poor citizens.",
        "MENENIUS: Where go you with bats and clubs?",
        "ROMEO: What light through yonder window breaks?",
        "RICHARD: Now is the winter of our discontent.",
    ]
    edited = [
        "First Citizen: We are counted poor citizens.",
        "MENENIUS: Where go you with sticks and clubs?",
        "ROMEO: What light through yonder door breaks?",
        "RICHARD: Now is the summer of our discontent.",
    ]
    lines_, edited_ = (
        [torch.tensor(embed(model, tokenizer.encode(t), "mean")) for t in texts] for texts in (lines, edited)
    )
    similarity = torch.stack(edited_) @ torch.stack(lines_).T  # (edited, lines): cosines (unit vectors)
    # Each edited line is closest to the line it was edited from (measured: 0.997 and above on the diagonal,
    # at most 0.987 elsewhere, on this 150-step character model).
    assert similarity.argmax(dim=1).tolist() == [0, 1, 2, 3], similarity


def test_an_embedding_input_past_the_context_is_refused(server):
    reply = httpx.post(f"{server[0]}/v1/embeddings", json={"model": MODEL, "input": "a" * 600})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    assert "embeds at most 512" in reply.json()["error"]["message"]


# ---------------------------------------------------------------- /metrics and /props


def _sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_requests_tokens_and_latencies(client, server):
    before = httpx.get(f"{server[0]}/metrics")
    assert before.headers["content-type"].startswith("text/plain; version=0.0.4")
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=7, temperature=0)
    httpx.post(f"{server[0]}/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": 5})
    after = httpx.get(f"{server[0]}/metrics").text
    route = '{route="/v1/completions",status="200"}'
    assert _sample(after, "gptkit_requests_total", route) == _sample(before.text, "gptkit_requests_total", route) + 1
    refused = '{route="/v1/completions",status="400"}'
    assert (
        _sample(after, "gptkit_requests_total", refused) == _sample(before.text, "gptkit_requests_total", refused) + 1
    )
    for name, grew in (
        ("gptkit_generation_tokens_total", reply.usage.completion_tokens),
        ("gptkit_prompt_tokens_total", reply.usage.prompt_tokens),
        ("gptkit_time_to_first_token_seconds_count", 1),
        ("gptkit_time_per_output_token_seconds_count", 1),
    ):
        assert _sample(after, name) == _sample(before.text, name) + grew, name
    assert "# TYPE gptkit_time_to_first_token_seconds histogram" in after
    assert _sample(after, "gptkit_requests_waiting") == 0


def test_props_give_the_context_and_the_template(server):
    props = httpx.get(f"{server[0]}/props").json()
    assert props["context_length"] == 512 and props["chat_template_is_default"] is True
    assert props["chat_template"].startswith("{% if tools %}") and props["vocab_size"] == 257


# ---------------------------------------------------------------- validation as OpenAI's API does it


@pytest.mark.parametrize(
    "path, body, param, says",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "needs logprobs",
        ),
        ("/v1/completions", {"prompt": [[1, None, 3]]}, "prompt", "prompt[0][1] is null"),
        ("/v1/completions", {"prompt": [1, None]}, "prompt", "prompt[1] is null"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
            "messages.0.content",
            "'image_url' part",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
            "temperature",
            "less than or equal to 2",
        ),
        (
            "/v1/completions",
            {"prompt": "a" * 2048, "max_tokens": 1, "echo": True},
            "prompt",
            "fills this server's context",
        ),
    ],
)
def test_validation_gaps_are_400s_naming_the_field(server, path, body, param, says):
    reply = httpx.post(server[0] + path, json={"model": MODEL, **body})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and says in error["message"], reply.text
