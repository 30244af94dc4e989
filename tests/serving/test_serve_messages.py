"""Anthropic's Messages API on `gptkit serve`, driven by the `anthropic` client: text, streaming events, stop
reasons, a tool round trip, token counting, refusals in Anthropic's error shape, and the x-api-key header. The
served model is a random byte model; the chat endpoint answers the same conversation for comparison."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gptkit.formats.modeldir import save_model_dir
from gptkit.serving.messages_schema import MessagesRequest, parse, to_chat
from gptkit.serving.server import ServeOptions, build_app
from gptkit.tokenizer import ByteTokenizer
from tests.decoding.test_structured import byte_model
from tests.serving.servers import live_server
from tests.serving.test_serve_clients import WEATHER_TOOL, check_weather_call, prompt_tokens

anthropic = pytest.importorskip("anthropic")

MODEL = "messages-served"
KEY = "secret-key"
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
CALL_BLOCK = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}
RESULT_BLOCK = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no network", "is_error": True}
FINISH = {"length": "max_tokens", "stop": "end_turn"}  # the chat endpoint's finish reasons, in Anthropic's names


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_model_dir(byte_model(), tmp_path_factory.mktemp("messages") / MODEL, tokenizer=ByteTokenizer())
    with live_server(build_app(model_dir, ServeOptions(api_key=KEY))) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_text_reply_is_the_chat_endpoints(client, chat):
    reply = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body={"temperature": 0},
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert "".join(block.text for block in reply.content) == expected.choices[0].message.content
    assert reply.stop_reason == FINISH[expected.choices[0].finish_reason] and reply.stop_sequence is None
    assert reply.usage.input_tokens == expected.usage.prompt_tokens == prompt_tokens(messages)
    assert reply.usage.output_tokens == expected.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages[1:])
    assert counted.input_tokens == reply.usage.input_tokens


def test_stream_events_in_order_and_agree_with_the_whole_reply(client):
    request = {
        "model": MODEL,
        "max_tokens": 12,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": "Hi"}],
    }
    whole = client.messages.create(**request)
    events = list(client.messages.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    middle = kinds[1:-2]
    assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
    assert set(middle[1:-1]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens


def test_stop_sequence_ends_the_reply_and_is_named(client):
    request = {"model": MODEL, "extra_body": {"temperature": 0}, "messages": [{"role": "user", "content": "Hi"}]}
    full = client.messages.create(**request, max_tokens=30).content[0].text
    stop = next(c for c in full[3:] if c != "\ufffd")  # a character the reply writes (not a byte split mid-character)
    cut = client.messages.create(**request, max_tokens=30, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(block.text for block in cut.content) == full[: full.index(stop)]
    streamed = list(client.messages.create(**request, max_tokens=30, stop_sequences=[stop], stream=True))
    assert streamed[-2].delta.stop_reason == "stop_sequence" and streamed[-2].delta.stop_sequence == stop


def test_tool_round_trip(client):
    question = {"role": "user", "content": "Weather in Paris?"}
    called = client.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[question],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    [call] = called.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and called.stop_reason == "tool_use"
    check_weather_call(call.name, call.input)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C"}]}
    turns = [question, {"role": "assistant", "content": [c.model_dump() for c in called.content]}]
    turns.append({"role": "user", "content": [result]})
    answer = client.messages.create(
        model=MODEL, max_tokens=5, messages=turns, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert [block.type for block in answer.content] in (["text"], [])
    # The conversation is rendered as the chat endpoint renders its OpenAI form.
    openai_form = [
        question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    assert answer.usage.input_tokens == prompt_tokens(openai_form, [WEATHER_TOOL])


def test_streamed_tool_call_is_the_whole_ones(client):
    request = {
        "model": MODEL,
        "max_tokens": 200,
        "extra_body": {"temperature": 0},
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Weather?"}],
        "tool_choice": {"type": "any"},
    }
    whole = client.messages.create(**request)
    events = list(client.messages.create(**request, stream=True))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [block.type for block in starts] == ["tool_use"] * len(whole.content)
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(pieces) == whole.content[0].input  # one call (the random model stops after it)
    assert events[-2].delta.stop_reason == "tool_use" == whole.stop_reason
    with client.messages.stream(**request) as stream:  # the client's own accumulation of the events
        final = stream.get_final_message()
    assert [block.model_dump() for block in final.content] == [
        {**block.model_dump(), "id": final.content[0].id} for block in whole.content
    ]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"best_of": 2}, "best_of"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]}, "messages"),
    ],
)
def test_refusals_name_the_field_in_anthropics_error_shape(server, change, field):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **change}
    answer = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]


def test_unknown_model_and_missing_max_tokens(client, server):
    with pytest.raises(anthropic.NotFoundError) as found:
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert found.value.body["error"]["type"] == "not_found_error"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    answer = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert answer.status_code == 400 and "max_tokens" in answer.json()["error"]["message"]


def test_the_api_key_is_taken_from_x_api_key(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    refused = httpx.post(server + "/v1/messages", json=body, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=60).status_code == 401
    assert httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60).status_code == 200


def test_blocks_become_chat_messages_in_order():
    # No server: the conversion alone. A user turn's text and tool results keep their order; is_error shows.
    request = parse(
        MessagesRequest,
        {
            "model": "m",
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, CALL_BLOCK]},
                {"role": "user", "content": [RESULT_BLOCK, {"type": "text", "text": "And now?"}]},
            ],
        },
    )
    chat = to_chat(request)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief." and chat.messages[2].content == "Checking."
    assert json.loads(chat.messages[2].tool_calls[0].function.arguments) == CALL_BLOCK["input"]
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "Error: no network"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
