"""Tool-call replies a client can use and send back: a call cut short by max_tokens comes back as text with
finish_reason "length" (never a call named ''), streamed as it is returned whole, and every assistant message the
server writes (text, calls, calls with a cut one after them) is accepted back in the next request, over the chat,
Responses and Messages APIs."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from gptkit.config import ModelConfig
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.serving.server import ServeOptions, build_app
from gptkit.serving.tools import ToolCalls
from gptkit.tokenizer import ByteTokenizer

MODEL = "tool-replies"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
WHOLE = ' {"name": "get_weather", "arguments": {"city": "Paris"}}'
NEWLINE = str(ord("\n"))  # a byte model's token for "\n", which begins a second call


@pytest.mark.parametrize(
    "text",
    [' {"na', ' {"name": "get_weather", "argu', ' {"name": "get_weather", "arguments": {"city": "Pa', " "],
    ids=["before the name", "before the arguments", "inside the arguments", "only the lead"],
)
def test_a_call_cut_short_comes_back_as_text_with_length(text):
    message, reason = ToolCalls({"get_weather": CITY}).message(text, "length")
    assert message == {"role": "assistant", "content": text} and reason == "length"


def test_whole_calls_come_back_as_calls_and_a_cut_one_after_them_as_text():
    shape = ToolCalls({"get_weather": CITY})
    message, reason = shape.message(WHOLE, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    cut = '{"name": "get_weather", "arguments": {"ci'
    message, reason = shape.message(WHOLE + "\n" + cut, "length")
    assert reason == "length" and message["content"] == cut and len(message["tool_calls"]) == 1


@pytest.mark.parametrize("text", [WHOLE, WHOLE + '\n{"name": "get_weather", "argu', ' {"name": "get_w'])
def test_a_streamed_reply_adds_up_to_the_whole_one(text):
    shape = ToolCalls({"get_weather": CITY})
    stream, content, calls, reason = shape.stream(), "", [], None
    for i, piece in enumerate(text):  # one character a chunk, the engine's finish reason on the last
        delta, reason = stream.delta(piece, "length" if i == len(text) - 1 else None)
        content += delta.get("content") or ""
        calls += delta.get("tool_calls", [])
        for call in delta.get("tool_calls", []):
            assert call["function"]["name"] == "get_weather"  # a call is announced whole, never half
            json.loads(call["function"]["arguments"])
    whole, whole_reason = shape.message(text, "length")
    assert reason == whole_reason and content == (whole["content"] or "")
    assert [c["function"] for c in calls] == [c["function"] for c in whole.get("tool_calls") or []]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=257, block_size=512, n_layer=2, n_head=4, n_embd=32)).eval()
    directory = save_model_dir(model, tmp_path_factory.mktemp("tools") / MODEL, tokenizer=ByteTokenizer())
    with TestClient(build_app(directory, ServeOptions(max_batch_size=4)), base_url="http://localhost") as client:
        yield client


def _chat(client: TestClient, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "seed": 4}
    reply = client.post("/v1/chat/completions", json=body | fields)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _streamed(client: TestClient, **fields) -> tuple[dict, str]:
    """A streamed chat reply put together as a client does: its message and finish reason."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "seed": 4}
    reply = client.post("/v1/chat/completions", json=body | fields | {"stream": True})
    assert reply.status_code == 200, reply.text
    message, reason = {"role": "assistant", "content": None}, None
    for line in reply.text.splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        delta, reason = choice["delta"], choice["finish_reason"] or reason
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls") or []:
            message.setdefault("tool_calls", []).append({k: call[k] for k in ("id", "type", "function")})
    return message, reason


def _every_kind(client: TestClient) -> dict[str, dict]:
    """Each kind of assistant message the server writes, by name: text, a call, a call cut short, and (the default
    parallel_tool_calls, a model pushed to begin a second call) whole calls with a cut one after them."""
    one = _chat(client, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    length = one["usage"]["completion_tokens"]
    kinds = {
        "text": _chat(client, tool_choice="none", max_tokens=8),
        "a call": one,
        "a call cut short": _chat(client, tool_choice="required", max_tokens=length - 6),
        "calls, then a cut one": _chat(
            client, tool_choice="required", max_tokens=length + 12, logit_bias={NEWLINE: 30}
        ),
    }
    out = {name: reply["choices"][0] | {"usage": reply["usage"]} for name, reply in kinds.items()}
    for name, fields in [
        ("streamed, cut short", {"max_tokens": length - 6}),
        ("streamed, calls then a cut one", {"max_tokens": length + 12, "logit_bias": {NEWLINE: 30}}),
    ]:
        message, reason = _streamed(client, tool_choice="required", **fields)
        out[name] = {"message": message, "finish_reason": reason}
    return out


def test_every_assistant_message_the_server_writes_is_accepted_back(client):
    kinds = _every_kind(client)
    assert kinds["a call"]["finish_reason"] == "tool_calls"
    for name in ("a call cut short", "streamed, cut short"):
        message = kinds[name]["message"]
        assert kinds[name]["finish_reason"] == "length" and not message.get("tool_calls"), name
        assert message["content"].lstrip().startswith('{"name": "get_w'), name  # the cut call, as text
    for name in ("calls, then a cut one", "streamed, calls then a cut one"):
        message = kinds[name]["message"]
        assert kinds[name]["finish_reason"] == "length" and len(message["tool_calls"]) == 1, name
        assert message["content"].startswith('{"name"'), name
    assert kinds["streamed, cut short"]["message"] == kinds["a call cut short"]["message"]
    for name, choice in kinds.items():
        message = choice["message"]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "21"} for c in message.get("tool_calls") or []]
        messages = [{"role": "user", "content": "Weather?"}, message, *results, {"role": "user", "content": "And?"}]
        _chat(client, messages=messages, tool_choice="none", max_tokens=2)  # asserts the 200


def test_a_responses_reply_cut_short_is_accepted_back_as_input(client):
    body = {"model": MODEL, "tools": [{"type": "function", **TOOLS[0]["function"]}], "tool_choice": "required"}
    ask = [{"role": "user", "content": "Weather?"}]
    reply = client.post("/v1/responses", json=body | {"input": ask, "max_output_tokens": 30})
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert reply.json()["status"] == "incomplete" and [item["type"] for item in output] == ["message"]
    assert output[0]["content"][0]["text"].lstrip().startswith('{"name"')  # the cut call, as text
    again = client.post(
        "/v1/responses", json=body | {"input": ask + output, "tool_choice": "none", "max_output_tokens": 2}
    )
    assert again.status_code == 200, again.text


def test_a_messages_reply_cut_short_is_accepted_back(client):
    tool = {"name": "get_weather", "input_schema": CITY}
    body = {"model": MODEL, "tools": [tool], "tool_choice": {"type": "any"}}
    ask = [{"role": "user", "content": "Weather?"}]
    reply = client.post("/v1/messages", json=body | {"messages": ask, "max_tokens": 30})
    assert reply.status_code == 200, reply.text
    assert reply.json()["stop_reason"] == "max_tokens"
    assert [block["type"] for block in reply.json()["content"]] == ["text"]  # no tool_use block named ''
    messages = ask + [{"role": "assistant", "content": reply.json()["content"]}, {"role": "user", "content": "And?"}]
    again = client.post(
        "/v1/messages", json=body | {"messages": messages, "tool_choice": {"type": "none"}, "max_tokens": 2}
    )
    assert again.status_code == 200, again.text
