"""Request bodies of the OpenAI API as gptkit serves them, and its error object.

Fields that gptkit has a SamplingParams default for are None here when absent, so that SamplingParams alone
declares the defaults. Other fields of OpenAI's API are accepted only where they cannot change the output
(refused_field says which and why); a field the API does not have is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# A flag that OpenAI's API lets clients send as null (the official client does): null means false.
NullableFlag = Annotated[bool, BeforeValidator(lambda value: False if value is None else value)]


# Fields of OpenAI's API that never change the output: accepted and ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Fields of OpenAI's API that gptkit does not implement, accepted only when null or at a value that means "unused".
UNUSED_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "modalities": (["text"],),
    "prediction": (),
    "audio": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
}


class _Request(BaseModel):
    # strict: "5" is not an integer and 1 is not a string; extra: kept, for refused_field to judge.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # OpenAI: absent means any JSON
    strict: bool | None = None


class LookupSettings(_Request):
    """gptkit's extension: how a request speculates by prompt lookup (gptkit.decoding.lookup)."""

    model_config = ConfigDict(strict=True, extra="forbid")  # a misspelt setting is refused, not ignored

    k: int | None = Field(default=None, ge=1)  # tokens proposed per check (default and most: the server's --lookup-k)
    ngram: int | None = Field(default=None, ge=1)  # the longest match looked for (default: --lookup-ngram)


def _lookup_value(value: Any) -> Any:
    """The lookup field's three forms, each misfit refused in words naming the field or the setting."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, dict):
        raise ValueError(f'lookup is {_json_type(value)}; it must be true, false or {{"k": K, "ngram": N}}')
    unknown = sorted(set(value) - {"k", "ngram"})
    if unknown:
        raise ValueError(f"lookup has no setting {unknown[0]!r}; its settings are k and ngram")
    return value


# The `lookup` field of every generating endpoint (chat, completions, Responses, Messages): true, false or settings;
# None (absent) means the server's --lookup.
LookupField = Annotated[bool | LookupSettings | None, BeforeValidator(_lookup_value)]


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class DecodingFields(_Request):
    """The decoding fields every generating endpoint takes (OpenAI's names, plus top_k, min_p, repetition_penalty
    and gptkit's lookup)."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range (the CLI allows more)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stream: NullableFlag = False
    lookup: LookupField = None


class SamplingFields(DecodingFields):
    """The decoding fields shared by the completions and chat endpoints."""

    max_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None


def refused_field(body: SamplingFields) -> tuple[str, str] | None:
    """The first field of a request that gptkit would have to ignore while it changes the output, and why."""
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name == "best_of":
            if value is None or value == (body.n or 1):
                continue
            return name, f"best_of {value!r} is not supported: gptkit returns every sample it draws (best_of = n)"
        if name in UNUSED_VALUES:
            if value is None or value in UNUSED_VALUES[name]:
                continue
            return name, f"{name} is not supported by gptkit; leave it out"
        return name, f"unknown field {name!r}: it is not part of OpenAI's API for this endpoint"
    return None


def _texts_or_ids(field: str) -> BeforeValidator:
    """A validator for a field holding text or token ids in one of OpenAI's four forms; anything else is refused
    naming the first element that is wrong (pydantic's own message names a union alternative instead)."""
    forms = "a string, a list of strings, a list of token ids, or a list of lists of token ids"

    def check(value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"{field} is {_json_type(value)}; it must be {forms}")
        for i, item in enumerate(value):
            if isinstance(item, list):
                bad = next((j for j, t in enumerate(item) if not _is_int(t)), None)
                if bad is not None:
                    raise ValueError(f"{field}[{i}][{bad}] is {_json_type(item[bad])}; token ids are integers")
            elif not (isinstance(item, str) or _is_int(item)):
                raise ValueError(f"{field}[{i}] is {_json_type(item)}; {field} must be {forms}")
        kinds = {type(item).__name__ for item in value}
        if len(kinds) > 1:
            raise ValueError(f"{field} mixes {' and '.join(sorted(kinds))}; it must be {forms}")
        return value

    return BeforeValidator(check)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return names.get(type(value), type(value).__name__)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], _texts_or_ids("prompt")]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: NullableFlag = False


class EmbeddingRequest(_Request):
    """POST /v1/embeddings."""

    model: str
    input: Annotated[str | list[str] | list[int] | list[list[int]], _texts_or_ids("input")]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"]
    function: FunctionCall


def _text_parts_only(value: Any) -> Any:
    """Content parts other than text (images, audio, files) refused by name: gptkit serves text models."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content[{i}] is a {kind!r} part: gptkit serves text-only models, so only text parts are supported"
                )
    return value


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # Only an assistant turn may come without content (OpenAI's: one that made tool calls).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        """The message's text, with content parts joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: a function without arguments
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # OpenAI's default: several calls may come (one per line)
    max_completion_tokens: int | None = None
    logprobs: NullableFlag = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class ResponsesRequest(DecodingFields):
    """POST /v1/responses (stateless: the client sends the whole conversation in `input`). Items of `input`, tools
    and text.format are read by gptkit.serving.responses, which names the item that is wrong."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    # What the decoding settings of the other endpoints have and this one does not.
    n: None = None
    stop: None = None
    logit_bias: None = None
    response_format: None = None


# Fields of the Responses API that never change the output here: accepted and ignored. `store` (whose default is
# true) asks OpenAI to keep the response for previous_response_id; this server keeps nothing and says so in the
# answer (store: false). `reasoning` configures models that think before answering; gptkit's do not.
RESPONSES_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "include",
        "reasoning",
        "stream_options",
    }
)
RESPONSES_UNUSED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "prompt": (),
    "conversation": (),
}


class AttentionRequest(_Request):
    """POST /playground/attention: one layer's attention (one head, or the mean over heads) over a text."""

    text: str
    layer: int = Field(default=0, ge=0)
    head: int | None = Field(default=None, ge=0)


class LensRequest(_Request):
    """POST /playground/lens: the logit lens at each position of a text (or at one position)."""

    text: str
    position: int | None = Field(default=None, ge=0)  # a token index of the text; absent: every position
    top: int = Field(default=1, ge=1, le=3)  # top tokens per layer (few: the answer has one row per layer)


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's form, which lm-evaluation-harness's remote tokenizer speaks): a text's token ids."""

    prompt: str
    add_special_tokens: bool = True  # the tokens the tokenizer puts around every input (a Llama tokenizer's <s>)


class LoadAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's form): serve the LoRA directory at lora_path as model lora_name."""

    lora_name: str
    lora_path: str


class UnloadAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter: stop serving adapter lora_name."""

    lora_name: str


class DetokenizeRequest(_Request):
    """POST /detokenize: the text of token ids."""

    tokens: list[int]


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# The Messages API's error type for each HTTP status gptkit answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an answer with this HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
