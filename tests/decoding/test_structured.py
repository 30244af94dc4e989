"""Structured outputs and tool calls: JSON-schema-constrained decoding (llguidance), in Python, the CLI and the
server (the official openai client's parse and tool calls)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch

from gptkit.chat import DEFAULT_JINJA, ChatTemplate
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.decoding.api import complete, generate, generate_ids, grammar_for
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.grammar import Grammar, SchemaError
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.errors import ConfigError
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.serving.server import ServeOptions, build_app
from gptkit.tokenizer import ByteTokenizer, CharTokenizer
from tests.finetune.test_finetune import chatml_dir
from tests.serving.servers import live_server

MODEL = "json-served"
# Schemas whose strings, arrays and numbers are bounded: a random model ends a free string only by chance.
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["x"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["ok", "none"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "lives"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "dog"}},
                "required": ["kind"],
                "additionalProperties": False,
            },
        ]
    },
    {
        "$defs": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"}},
        "type": "object",
        "properties": {"id": {"$ref": "#/$defs/id"}},
        "required": ["id"],
        "additionalProperties": False,
    },
]


def complete_text(model: GPT, tokenizer, schema: str) -> list:
    params = SamplingParams(json_schema=schema, max_new_tokens=30, seed=0)
    grammar = grammar_for(model, tokenizer, params)
    return complete(
        model, [tokenizer.encode("1")], params, tokenizer.eos_ids, tokenizer.decode, grammar=grammar
    ).completions[0]


def byte_model(block_size: int = 512, device: torch.device | str = "cpu") -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=257, block_size=block_size, n_layer=2, n_head=4, n_embd=32)).eval().to(device)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model_dir(byte_model(), tmp_path_factory.mktemp("json") / MODEL, tokenizer=ByteTokenizer())


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_reply_is_valid_against_its_schema(index, device):
    model, tokenizer, schema = byte_model(device=device), ByteTokenizer(), SCHEMAS[index]
    texts = generate(model, tokenizer, "x", json_schema=schema, max_new_tokens=400, num_samples=4, seed=index)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_mode_gives_an_object_and_greedy_decoding_follows_the_mask(device):
    model, tokenizer = byte_model(device=device), ByteTokenizer()
    free = generate(model, tokenizer, "x", max_new_tokens=20, temperature=0)
    assert not free.startswith("{")  # unconstrained, this model writes no JSON
    greedy = generate(model, tokenizer, "x", json_schema='{"type": "object"}', max_new_tokens=20, temperature=0)
    assert greedy.startswith('{"')  # the argmax among what may follow "{": a key, or "}"
    # A bias composes with the mask: "}" made likely closes the object at once, and the grammar then ends it.
    closed = generate_ids(
        model,
        [120],
        tokenizer=tokenizer,
        json_schema='{"type": "object"}',
        max_new_tokens=20,
        temperature=0,
        logit_bias={ord("}"): 100},
    )
    assert closed == [ord("{"), ord("}")]


def test_the_mask_allows_exactly_what_the_grammar_allows_next():
    tokenizer = ByteTokenizer()
    constraint = Grammar(
        tokenizer,
        '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": '
        '["n"], "additionalProperties": false}',
        300,
    ).start()
    allowed = lambda: {i for i, v in enumerate(constraint.mask(torch.zeros(300)).tolist()) if v == 0}  # noqa: E731
    assert allowed() == {ord("{")}
    for byte in b'{"n": ':
        constraint.advance(byte)
    assert allowed() == set(b"-0123456789")  # ids 257..299 (padding past the tokenizer) never
    for byte in b"12":
        constraint.advance(byte)
    assert allowed() == set(b"0123456789}")  # the end-of-text token (256) only once the object is closed
    constraint.advance(ord("}"))
    assert constraint.complete


def test_a_tokenizer_that_cannot_write_the_json_is_refused_or_cut_short():
    no_brace = CharTokenizer.train(["abc"])
    with pytest.raises(SchemaError, match="no token that can begin JSON"):
        Grammar(no_brace, '{"type": "object"}', no_brace.vocab_size)
    with pytest.raises(SchemaError, match="no token that can begin JSON"):  # the key "q" cannot be written
        Grammar(
            no_q := CharTokenizer.train(['{}":, 0123456789a']),
            '{"type": "object", "properties": {"q": {}}, "required": ["q"]}',
            no_q.vocab_size,
        )
    # Found only at "q", after the first key's value: the reply ends there, cut short ("length"), not "complete".
    model = GPT(ModelConfig(vocab_size=no_q.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    [completion] = complete_text(
        model,
        no_q,
        '{"type": "object", "properties": {"a": {"type": "integer"}, "q": '
        '{"type": "integer"}}, "required": ["a", "q"], '
        '"additionalProperties": false}',
    )
    assert completion.finish_reason == "length" and no_q.decode(completion.ids).endswith(",")


def test_constrained_and_free_requests_share_a_batch(device):
    model, tokenizer = byte_model(device=device), ByteTokenizer()
    schema = json.dumps(SCHEMAS[4])
    alone = generate_ids(model, [120, 121], max_new_tokens=12, temperature=0)
    engine = BatchEngine(model, 2, 512)
    free = Request([120, 121], SamplingParams(max_new_tokens=12, temperature=0), tokenizer.eos_ids)
    constrained = Request(
        [120],
        SamplingParams(max_new_tokens=100, temperature=0, json_schema=schema),
        tokenizer.eos_ids,
        constraint=Grammar(tokenizer, schema, 257).start(),
    )
    engine.add([free, constrained])
    while engine.rows:
        engine.step()
    assert free.generated == alone
    assert constrained.finish_reason == "eos"  # complete: ended by the grammar, not by max_new_tokens
    jsonschema.validate(json.loads(tokenizer.decode(constrained.generated)), SCHEMAS[4])


def test_a_tokenizer_without_an_end_token_still_ends_at_the_closing_brace():
    tokenizer = CharTokenizer.train(['{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz-.'])
    assert tokenizer.eos_ids == ()
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=256, n_layer=1, n_head=2, n_embd=16))
    text = generate(model.eval(), tokenizer, "a", json_schema=SCHEMAS[1], max_new_tokens=200, seed=0)
    jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_bad_schemas_and_unsupported_combinations_are_clear_errors():
    with pytest.raises(ConfigError, match="json_schema: the JSON schema is not valid JSON"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(SchemaError, match="/nope"):
        Grammar(ByteTokenizer(), '{"$ref": "#/nope"}', 257)
    with pytest.raises(ConfigError, match="beam search"):
        SamplingParams(json_schema="{}", num_beams=2)
    with pytest.raises(ConfigError, match="needs the tokenizer"):
        generate_ids(byte_model(), [1, 2], json_schema="{}")


def test_cli_generate_with_a_json_schema_file(model_dir, tmp_path, capsys):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[6]))
    code = main(
        [
            "generate",
            str(model_dir),
            "--prompt",
            "x",
            "--json-schema",
            str(schema_file),
            "--seed",
            "1",
            "--max-new-tokens",
            "300",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(report["samples"][0]["text"] if "samples" in report else report["text"]), SCHEMAS[6])
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(model_dir), "--json-schema", str(tmp_path / "missing.json")])
    assert exit_.value.code == 2
    assert "cannot read the JSON schema file" in capsys.readouterr().err


def nested_schema_text(levels: int) -> str:
    """A schema of objects nested `levels` deep (2 * levels JSON levels), written as text: too deep for json.dumps."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"integer"}' + '},"required":["a"]}' * levels


@pytest.mark.parametrize("levels", [60, 2000])  # past the limit; past Python's recursion limit too
def test_a_schema_nested_too_deep_is_refused_in_one_line_by_the_cli_and_the_api(levels, model_dir, tmp_path, capsys):
    schema_file = tmp_path / "deep.json"
    schema_file.write_text(nested_schema_text(levels))
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(model_dir), "--prompt", "x", "--json-schema", str(schema_file)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "more than 100 levels deep" in err, err
    with pytest.raises(ConfigError, match="more than 100 levels deep"):
        SamplingParams(json_schema=nested_schema_text(levels))
    deep: dict = {"type": "integer"}
    for _ in range(levels):  # a dict, as Python callers give it
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ConfigError, match="more than 100 levels deep"):
        generate(byte_model(), ByteTokenizer(), "x", json_schema=deep, max_new_tokens=2)
    with pytest.raises(SchemaError, match="more than 100 levels deep"):
        Grammar(ByteTokenizer(), nested_schema_text(levels), 257)
    assert SamplingParams(json_schema=nested_schema_text(49)).json_schema  # 99 levels: taken


# ---------------------------------------------------------------- the chat template's tools


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]
TOOL_TEMPLATE = (
    "{% if tools is defined %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for call in m.tool_calls %}"
    "<call>{{ call.function.name }} {{ call.function.arguments | tojson }}</call>{% endfor %}"
    "{% elif m.role == 'tool' %}<result id={{ m.tool_call_id }}>{{ m.content }}</result>"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_TURNS = [
    {"role": "user", "content": "Weather in Paris, in °C?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21"},
]


def test_tools_and_tool_turns_render_as_transformers_renders_them(tmp_path):
    from transformers import AutoTokenizer

    directory = chatml_dir(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(directory)
    want = hf.apply_chat_template(
        CALL_TURNS, tools=TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert "°C" in want and '"maxLength": 12' in want  # transformers' tojson: keys in order, text unescaped
    assert ChatTemplate(TOOL_TEMPLATE).render(CALL_TURNS, tools=TOOLS) == want


def test_the_default_template_shows_tools_and_calls_as_the_jinja_form_does():
    python, jinja = ChatTemplate(eos_token="<|endoftext|>"), ChatTemplate(DEFAULT_JINJA, eos_token="<|endoftext|>")
    text = python.render(CALL_TURNS, tools=TOOLS)
    assert text == jinja.render(CALL_TURNS, tools=TOOLS)
    assert text.startswith('tools: [{"type": "function"')
    assert 'assistant: {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}<|endoftext|>' in text
    assert text.endswith("tool: 21\n\nassistant:")


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def server(model_dir):
    app = build_app(model_dir, ServeOptions(max_batch_size=4))
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    colours: list[typing.Literal["red", "green"]] = pydantic.Field(max_length=3)


def test_the_openai_client_parse_gets_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Who?"}], response_format=Person, max_tokens=300, seed=2
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_response_format_on_both_endpoints_validates(server, endpoint):
    schema = SCHEMAS[8]
    body = {
        "model": MODEL,
        "max_tokens": 300,
        "n": 3,
        "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
    }
    if endpoint == "chat":
        reply = httpx.post(
            f"{server}/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": "A pet?"}]}
        )
        texts = [c["message"]["content"] for c in reply.json()["choices"]]
    else:
        reply = httpx.post(f"{server}/v1/completions", json=body | {"prompt": "A pet:"})
        texts = [c["text"] for c in reply.json()["choices"]]
    assert reply.status_code == 200, reply.text
    assert len(texts) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    json_mode = httpx.post(
        f"{server}/v1/chat/completions",
        json=body
        | {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
            "n": 1,
            "temperature": 0,
            "logit_bias": {str(ord("}")): 100},
        },
    )
    assert json_mode.json()["choices"][0]["message"]["content"] == "{}"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    reply = httpx.post(
        f"{server}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_server_refuses_a_schema_nested_too_deep_with_the_same_check(server):
    body = (
        '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
        '"json_schema", "json_schema": {"name": "deep", "schema": %s}}}'
    ) % (MODEL, nested_schema_text(60))
    reply = httpx.post(f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "more than 100 levels deep" in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["param"] == "response_format"  # the request's field, not SamplingParams'


def _arguments_valid(call) -> dict:
    schema = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


def test_a_required_tool_call_round_trips_through_the_openai_client(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=3,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _arguments_valid(call)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5, seed=3
    )
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str) and final.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_streamed_tool_call_equals_the_whole_one(client, choice):
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=200,
        seed=4,
    )
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    events = list(client.chat.completions.create(**request, stream=True))
    deltas = [d for e in events if e.choices for d in (e.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == whole.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert events[-1].choices[0].finish_reason == "tool_calls"
    assert len(deltas) == 1  # a call is sent once written whole: one cut short by max_tokens is never half-sent
    _arguments_valid(whole)


class Place(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # no free extra keys: a random model ends them by chance
    city: str = pydantic.Field(max_length=8)
    unit: typing.Literal["c", "f"]


class Trip(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    start: Place
    end: Place


NESTED_TOOLS = [
    {"type": "function", "function": {"name": "plan_trip", "parameters": Trip.model_json_schema()}},
    TOOLS[0],
]  # pydantic writes the nested model under $defs, referred to by "#/$defs/Place"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "plan_trip"}}])
def test_a_tool_whose_parameters_have_defs_is_called_with_valid_arguments(client, choice):
    assert "$defs" in NESTED_TOOLS[0]["function"]["parameters"]
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Go"}],
            tools=NESTED_TOOLS,
            tool_choice=choice,
            max_tokens=300,
            seed=seed,
            parallel_tool_calls=False,
        )
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        [call] = choice_.message.tool_calls
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in NESTED_TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        if call.function.name == "plan_trip":
            Trip.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_cut_short_by_max_tokens_comes_back_as_text(client, stream):
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS[:1],
        tool_choice="required",
        parallel_tool_calls=False,
        seed=4,
    )
    reply = client.chat.completions.create(**request, max_tokens=200)
    assert reply.choices[0].finish_reason == "tool_calls"
    cut = reply.usage.completion_tokens - 6  # a byte model: 6 bytes short of the end is inside the arguments
    if stream:
        events = list(client.chat.completions.create(**request, max_tokens=cut, stream=True))
        assert not [d for e in events if e.choices for d in (e.choices[0].delta.tool_calls or [])]
        assert events[-1].choices[0].finish_reason == "length"
        text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    else:
        choice = client.chat.completions.create(**request, max_tokens=cut).choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        text = choice.message.content
    assert text.lstrip().startswith('{"name": "get_weather", "arguments": {')  # the call as far as written, as text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_references_are_rebased_and_data_values_kept_as_written():
    from gptkit.serving.tools import _rebased

    schema = {
        "type": "object",
        "properties": {"$ref": {"$ref": "#/$defs/A"}, "a": {"$ref": "#"}},
        "const": {"$ref": "#/x"},
        "enum": [{"$ref": "#/y"}],
        "default": {"$ref": "#/z"},
    }
    out = _rebased(schema, "#/$defs/tool0")
    assert out["properties"] == {"$ref": {"$ref": "#/$defs/tool0/$defs/A"}, "a": {"$ref": "#/$defs/tool0"}}
    assert (out["const"], out["enum"], out["default"]) == (schema["const"], schema["enum"], schema["default"])
