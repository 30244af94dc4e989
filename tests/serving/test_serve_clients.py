"""Real client libraries against `gptkit serve`, each left at its defaults (tool_choice included: "auto" once tools
are given): openai-python, LangChain's ChatOpenAI and OpenAIEmbeddings, and LiteLLM. The served model is a random
byte model; where a test needs it to choose a call or text, logit_bias on the reply's first byte makes it choose
(the Responses API, which has no logit_bias, gets a second model whose output bias makes it call). LangChain and
LiteLLM are optional: their tests are skipped where they are not installed."""

from __future__ import annotations

import json
import os
from functools import partial
from types import SimpleNamespace
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from gptkit.chat import ChatTemplate
from gptkit.config import ModelConfig
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.serving.embeddings import embed
from gptkit.serving.server import ServeOptions, build_app
from gptkit.tokenizer import ByteTokenizer
from tests.decoding.test_structured import TOOLS, byte_model
from tests.serving.servers import live_server

# LiteLLM fetches a price list from the internet when imported unless told to use the copy it ships (the tests
# reach nothing but this machine).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

MODEL = "clients-served"
WEATHER_TOOL = TOOLS[0]  # get_weather(city: at most 12 characters, unit: "c" or "f")
WEATHER = WEATHER_TOOL["function"]["parameters"]
CALL, TEXT, CLOSE, END = 123, 72, 125, 256  # byte ids of "{" (a call begins), "H" (text begins), "}"; end of text
# One call: "{" outweighs the end of the reply, which then comes as soon as the call is whole (a random model would
# as often write a newline and another call: parallel calls are allowed by default).
ONE_CALL = {CALL: 100, END: 50}
EOS = "<|endoftext|>"  # the byte tokenizer's end-of-text text, which the default template ends replies with


class Colour(BaseModel):
    colour: Literal["red", "blue"]


class Weather(BaseModel):
    """Weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_model_dir(byte_model(), tmp_path_factory.mktemp("clients") / MODEL, tokenizer=ByteTokenizer())
    app = build_app(model_dir, ServeOptions(max_batch_size=4))
    with live_server(app) as url:
        yield url + "/v1", app.state.gptkit


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


def prompt_tokens(messages: list[dict], tools: list[dict] | None = None) -> int:
    """How many tokens the default template makes of messages (a byte model's tokens are the text's bytes)."""
    return len(ByteTokenizer().encode(ChatTemplate(eos_token=EOS).render(messages, tools=tools)))


def strings(bias: dict[int, int]) -> dict[str, int]:
    """logit_bias as openai-python types it (token ids as strings)."""
    return {str(token): value for token, value in bias.items()}


def check_weather_call(name: str, arguments: dict) -> None:
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER)


# ---------------------------------------------------------------- openai-python


def test_openai_chat_and_completions_answer_alike(client):
    question = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=question, max_tokens=8, temperature=0)
    text = ChatTemplate(eos_token=EOS).render(question)
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text and chat.usage.prompt_tokens == len(text)


def test_openai_tool_round_trip_on_default_tool_choice(client):
    # The assistant message the client returned goes back into the history as the client's own object (it
    # serialises its fields, refusal and annotations among them), followed by the tool's result.
    history: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER_TOOL], max_tokens=200, temperature=0, logit_bias=strings(ONE_CALL)
    )
    reply = first.choices[0]
    assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
    call = reply.message.tool_calls[0]
    check_weather_call(call.function.name, json.loads(call.function.arguments))
    history += [reply.message, {"role": "tool", "tool_call_id": call.id, "content": "21"}]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER_TOOL], max_tokens=5, temperature=0, logit_bias={str(TEXT): 100}
    )
    assert final.choices[0].message.content == "HHHHH" and final.choices[0].message.tool_calls is None
    rendered = [
        history[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        history[2],
    ]
    assert final.usage.prompt_tokens == prompt_tokens(rendered, [WEATHER_TOOL])


def test_openai_parse_reads_structured_replies_and_strict_tools(client):
    colour = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "A colour?"}], response_format=Colour, max_tokens=40
    )
    assert isinstance(colour.choices[0].message.parsed, Colour)
    tool = openai.pydantic_function_tool(Weather)  # strict: the client parses the arguments into Weather
    called = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[tool],
        max_tokens=200,
        logit_bias=strings(ONE_CALL),
    )
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)


def caller_model() -> GPT:
    """A random byte model that calls tools: its output bias favours "{" (a call begins) over the end of text, and
    the end over everything else, so that it writes one call, its strings filled with "{", and stops."""
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(
            vocab_size=257, block_size=512, n_layer=2, n_head=4, n_embd=32, tie_embeddings=False, lm_head_bias=True
        )
    )
    with torch.no_grad():
        model.lm_head.bias[CALL], model.lm_head.bias[END] = 100.0, 50.0
    return model.eval()


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    model_dir = save_model_dir(caller_model(), tmp_path_factory.mktemp("caller") / MODEL, tokenizer=ByteTokenizer())
    with live_server(build_app(model_dir, ServeOptions())) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_responses_on_default_tool_choice(client, caller):
    # The Responses API has no logit_bias: a model that calls tools calls one, the random model answers in text.
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
    called = caller.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool], max_output_tokens=200)
    [call] = called.output
    assert call.type == "function_call" and called.status == "completed"
    check_weather_call(call.name, json.loads(call.arguments))
    answered = client.responses.create(model=MODEL, input="Hi", tools=[tool], max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL], max_tokens=8, temperature=0
    )
    assert answered.output[0].type == "message" and answered.output_text == chat.choices[0].message.content
    assert (
        answered.usage.input_tokens
        == chat.usage.prompt_tokens
        == prompt_tokens([{"role": "user", "content": "Hi"}], [WEATHER_TOOL])
    )
    parsed = client.responses.parse(model=MODEL, input="A colour?", text_format=Colour, max_output_tokens=40)
    assert isinstance(parsed.output_parsed, Colour)


def test_openai_embeddings_decode_to_the_models_vectors(client, server):
    model, tokenizer = server[1].engine.model, ByteTokenizer()
    got = client.embeddings.create(model=MODEL, input=["Hello there", "x"])  # the client asks for base64
    for item, text in zip(got.data, ["Hello there", "x"]):
        # The same float32 numbers: base64 carries them bit for bit.
        assert item.embedding == embed(model, tokenizer.encode(text), "mean")


# ---------------------------------------------------------------- LangChain


@pytest.fixture(scope="module")
def langchain(url):
    lc = pytest.importorskip("langchain_openai")

    def chat(max_tokens: int, logit_bias: dict[int, int] | None = None, temperature: float | None = None):
        return lc.ChatOpenAI(
            model=MODEL,
            base_url=url,
            api_key="unused",
            max_retries=0,
            max_tokens=max_tokens,
            logit_bias=logit_bias,
            temperature=temperature,
        )

    return chat


def test_langchain_invoke_and_stream_agree(langchain):
    llm = langchain(temperature=0, max_tokens=12)
    whole = llm.invoke("Hello")
    pieces = list(llm.stream("Hello"))
    assert "".join(p.content for p in pieces) == whole.content and len(whole.content) > 0
    assert whole.usage_metadata["output_tokens"] == 12 and whole.response_metadata["finish_reason"] == "length"


def test_langchain_bind_tools_calls_or_answers_on_default_tool_choice(langchain):
    from langchain_core.messages import HumanMessage, ToolMessage

    question = HumanMessage("Weather in Paris?")
    called = langchain(max_tokens=200, logit_bias=ONE_CALL).bind_tools([WEATHER_TOOL]).invoke([question])
    assert called.invalid_tool_calls == [] and len(called.tool_calls) == 1
    check_weather_call(called.tool_calls[0]["name"], called.tool_calls[0]["args"])
    answered = langchain(max_tokens=5, logit_bias={TEXT: 100}).bind_tools([WEATHER_TOOL])
    assert answered.invoke([question]).content == "HHHHH"
    after = answered.invoke([question, called, ToolMessage("21", tool_call_id=called.tool_calls[0]["id"])])
    assert after.content == "HHHHH" and after.tool_calls == []
    streamed = list(langchain(max_tokens=200, logit_bias=ONE_CALL).bind_tools([WEATHER_TOOL]).stream([question]))
    whole = streamed[0]
    for chunk in streamed[1:]:
        whole += chunk
    assert len(whole.tool_calls) == 1
    check_weather_call(whole.tool_calls[0]["name"], whole.tool_calls[0]["args"])


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_by_schema(langchain, method):
    # "}" pushed: the city fills with it to its 12 characters, and the object closes once "unit" is written. (Not
    # strict, LangChain's function schema allows more keys, which a random model otherwise goes on writing.)
    structured = langchain(max_tokens=200, logit_bias={CLOSE: 100}).with_structured_output(Weather, method=method)
    weather = structured.invoke("Weather in Paris?")
    assert isinstance(weather, Weather) and weather.city == "}" * 12


def test_langchain_structured_output_in_json_mode(langchain):
    # json_mode asks only for an object; "}" pushed makes it the smallest one.
    schema = {"title": "anything", "type": "object"}
    structured = langchain(max_tokens=20, logit_bias={CLOSE: 100}).with_structured_output(
        schema, method="json_mode", include_raw=True
    )
    result = structured.invoke("An object?")
    assert result["parsing_error"] is None and result["parsed"] == json.loads(result["raw"].content) == {}


def test_langchain_embeddings_are_the_servers(url, client):
    lc = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: by default LangChain tokenizes texts with OpenAI's tiktoken encodings
    # (downloaded on first use) and sends their token ids, which mean nothing to another model's vocabulary.
    embeddings = lc.OpenAIEmbeddings(
        model=MODEL, base_url=url, api_key="unused", max_retries=0, check_embedding_ctx_length=False
    )
    texts = ["Hello there", "x"]
    want = [d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data]
    assert embeddings.embed_documents(texts) == want and embeddings.embed_query("x") == want[1]


# ---------------------------------------------------------------- LiteLLM


# LiteLLM's import makes pydantic warn about its own typed dicts (ReadOnly items): nothing about gptkit.
quiet_import = pytest.mark.filterwarnings("ignore:.*ReadOnly. qualifier:UserWarning")


@pytest.fixture(scope="module")
def litellm(url) -> SimpleNamespace:
    """LiteLLM's completion and embedding pointed at the server (its "openai/" models: an OpenAI-compatible API)."""
    lite = pytest.importorskip("litellm")
    model = f"openai/{MODEL}"
    return SimpleNamespace(
        completion=partial(lite.completion, model=model, api_base=url, api_key="unused"),
        embedding=partial(lite.embedding, model=model, api_base=url, api_key="unused"),
    )


@quiet_import
def test_litellm_completion_and_embedding(litellm, client):
    messages = [{"role": "user", "content": "Hello"}]
    reply = litellm.completion(messages=messages, max_tokens=8, temperature=0)
    same = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == same.choices[0].message.content
    vectors = litellm.embedding(input=["Hello there"])
    want = client.embeddings.create(model=MODEL, input=["Hello there"], encoding_format="float").data[0].embedding
    assert vectors.data[0]["embedding"] == want  # float32 numbers, bit for bit whichever encoding carried them


@quiet_import
def test_litellm_tools_on_default_tool_choice(litellm):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = litellm.completion(messages=messages, tools=[WEATHER_TOOL], max_tokens=200, logit_bias=strings(ONE_CALL))
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    check_weather_call(call.function.name, json.loads(call.function.arguments))
    text = litellm.completion(messages=messages, tools=[WEATHER_TOOL], max_tokens=5, logit_bias={str(TEXT): 100})
    assert text.choices[0].message.content == "HHHHH" and not text.choices[0].message.tool_calls
