"""Chat messages -> text: the tokenizer's own chat template if it ships one, else a plain default.

Serving renders a request's messages with it, and supervised fine-tuning renders its conversations with the same
template, so that a fine-tuned model sees the same text in training and in serving.

The default template (used when the model directory has no `chat_template`) is, for each message,

    <role>: <content>\n\n

with an assistant's content followed by the end-of-text token's text, and `assistant:` at the end to cue the
reply, e.g. `system: Be brief.\n\nuser: Hi\n\nassistant: Hello<|endoftext|>\n\nuser: Bye\n\nassistant:`. A reply
ends at the end-of-text token; the stop string `\n\nuser:` also ends one where a model writes the user's next turn.
Tools offered to the model come first, as `tools: <their JSON>\n\n`, and an assistant turn that called tools shows
each call as `{"name": ..., "arguments": {...}}` (the form a required tool call is constrained to).

Messages are dicts as Hugging Face's apply_chat_template takes them: role, content, and for tool use an assistant's
tool_calls (each {"type": "function", "function": {"name", "arguments" (a dict)}}) and a tool's tool_call_id.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from gptkit.errors import GptkitError
from gptkit.tokenizer import Tokenizer

TOKENIZER_CONFIG = "tokenizer_config.json"  # where Hugging Face tokenizers keep `chat_template`
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers (4.50 on) saves it instead
ROLES = ("system", "user", "assistant", "tool", "developer")
DEFAULT_STOP = ("\n\nuser:",)
WORKER_MEMORY_BYTES = 1 << 30  # address space a template worker may take ({{ 'x' * 10**10 }} fails, not the machine)
# The default template written as Jinja, for files that carry a template to other programs (GGUF for llama.cpp):
# it renders exactly what ChatTemplate.render does without a source (its newlines inside an expression, which
# Hugging Face's trim_blocks rendering keeps).
DEFAULT_JINJA = (
    "{% if tools %}tools: {{ tools | tojson }}{{ '\\n\\n' }}{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(GptkitError):
    """A chat template that cannot be read or rendered; the message names the problem."""


@dataclass(frozen=True)
class ChatTemplate:
    """How to turn messages into text: a Jinja source (Hugging Face style) or None for the default."""

    source: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def jinja(self) -> str:
        """The template as Jinja source (the default's own equivalent when there is no source)."""
        return self.source if self.source is not None else DEFAULT_JINJA

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings that end an assistant reply under this template."""
        return DEFAULT_STOP if self.source is None else ()

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_chars: int | None = None,
        max_seconds: float | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The text of these messages; with add_generation_prompt it ends where the assistant's reply begins.

        tools: the functions offered to the model (the template's `tools` variable, in OpenAI's form). A Jinja
        template producing more than max_chars characters, or still producing after max_seconds, is stopped with a
        ChatTemplateError (templates come with downloaded models)."""
        if self.source is None and not tools and not any(m.get("tool_calls") for m in messages):
            turns = "".join(
                f"{m['role']}: {m['content']}{self.eos_token if m['role'] == 'assistant' else ''}\n\n" for m in messages
            )
            return turns + ("assistant:" if add_generation_prompt else "")
        variables = dict(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if tools:  # left undefined otherwise, as transformers does (templates test `tools is defined`)
            variables["tools"] = tools
        return _render_jinja(self.jinja, variables, max_chars, max_seconds)

    def reply_spans(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the whole conversation's text, the character span of each assistant reply in it).

        A reply's span runs from where the prompt for it ends (the messages before it rendered with the
        generation prompt, as serving renders them) to where the conversation up to it ends, so it holds exactly
        what a model must write, the template's end-of-turn marks included.
        """
        text = self.render(messages, add_generation_prompt=False, tools=tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            through = self.render(messages[: i + 1], add_generation_prompt=False, tools=tools)
            if not (through.startswith(prompt) and text.startswith(through)):
                raise ChatTemplateError(
                    f"the chat template renders the conversation before assistant message {i + 1} differently "
                    "once the reply follows, so the reply's text cannot be found; train on every token instead"
                )
            spans.append((len(prompt), len(through)))
        return text, spans


REPLY_PROBE = "\x00"  # a reply no template changes, to find what a template writes before a reply


def reply_lead(render: Callable[[list[dict[str, Any]]], str]) -> str:
    """The whitespace a template writes between its generation prompt and a reply (the default template's space;
    "" for one whose replies begin right after it), found by rendering a conversation with and without a reply:
    render(messages) is the template's text of them ending with the generation prompt."""
    user = {"role": "user", "content": "1"}
    before, after = render([user]), render([user, {"role": "assistant", "content": REPLY_PROBE}])
    lead = after[len(before) :].partition(REPLY_PROBE)[0] if after.startswith(before) else ""
    return lead if lead.isspace() else ""


def read_tokenizer_config(model_dir: str | Path) -> dict[str, Any] | None:
    """model_dir's tokenizer_config.json (None without one), its `chat_template` taken from chat_template.jinja
    where that file is present (transformers then leaves it out of the JSON, and prefers the file)."""
    path, jinja = Path(model_dir) / TOKENIZER_CONFIG, Path(model_dir) / CHAT_TEMPLATE_FILE
    data: Any = None
    try:
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
        if jinja.is_file():
            data = {**(data if isinstance(data, dict) else {}), "chat_template": jinja.read_text(encoding="utf-8")}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ChatTemplateError(f"cannot read {getattr(err, 'filename', None) or path}: {err}") from None
    return data if isinstance(data, dict) else None


def load_chat_template(model_dir: str | Path, eos_token: str = "") -> ChatTemplate:
    """The chat template shipped with model_dir (chat_template.jinja or tokenizer_config.json), or the default
    (ending replies with eos_token, the tokenizer's end-of-text text) if there is none."""
    return template_from_config(read_tokenizer_config(model_dir), eos_token)


def template_from_config(data: dict[str, Any] | None, eos_token: str = "") -> ChatTemplate:
    """The chat template a tokenizer_config.json's content (data, as read_tokenizer_config gives it) names, or the
    default (ending replies with eos_token) if it names none."""
    if data is None:
        return ChatTemplate(eos_token=eos_token)
    source = data.get("chat_template")
    if isinstance(source, list):  # some tokenizers ship several named templates; "default" is the chat one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source.strip():
        return ChatTemplate(eos_token=eos_token)
    return ChatTemplate(source, _token_text(data.get("bos_token")), _token_text(data.get("eos_token")) or eos_token)


def eos_text(tokenizer: Tokenizer) -> str:
    """The text of a tokenizer's end-of-text token ("" when it has none)."""
    return tokenizer.decode([tokenizer.eos_id]) if tokenizer is not None and tokenizer.eos_id is not None else ""


def _token_text(token: object) -> str:
    """A special token as HF configs store it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _generation_tag() -> type:
    """A Jinja extension that renders {% generation %}...{% endgeneration %} as its body: the tag Hugging Face
    templates use to mark what the assistant writes (gptkit finds replies by rendering, see reply_spans)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True), lineno=lineno)

    return Generation


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _render_jinja(source: str, variables: dict[str, Any], max_chars: int | None, max_seconds: float | None) -> str:
    """Render a Hugging Face chat template in a sandbox, piece by piece, within the limits."""
    try:
        from jinja2 import BaseLoader, TemplateError, TemplateNotFound
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("this model's chat template needs jinja2: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template refused the messages: {message}")

    class NoFiles(BaseLoader):  # {% include %}, {% import %}, {% extends %}: a template reads no other file
        def get_source(self, environment: Any, template: str) -> Any:
            raise TemplateNotFound(f"{template} (a chat template must be self-contained: it cannot load files)")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag()], loader=NoFiles()
    )
    env.globals["raise_exception"] = raise_exception
    # What transformers gives templates besides Jinja's own: tojson keeping keys in order and text unescaped
    # (Jinja's sorts keys and escapes HTML), and strftime_now for templates that print today's date.
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    pieces, size = [], 0
    try:
        for piece in env.from_string(source).generate(**variables):
            pieces.append(piece)
            size += len(piece)
            if max_chars is not None and size > max_chars:
                raise ChatTemplateError(f"the chat template rendered more than {max_chars:,} characters; stopped")
            if deadline is not None and time.monotonic() > deadline:
                raise ChatTemplateError(f"the chat template took more than {max_seconds:g} s to render; stopped")
            if deadline is not None and len(pieces) % 256 == 0:  # a long render leaves the GIL to the server's
                time.sleep(0.005)  # other threads most of the time (an ordinary template renders few pieces)
    except TemplateError as err:
        raise ChatTemplateError(f"cannot render the chat template: {err}") from None
    except RecursionError:  # a macro calling itself without end
        raise ChatTemplateError("the chat template recursed without end (a macro calling itself?); stopped") from None
    return "".join(pieces)


def render_worker() -> None:
    """Render requests read as JSON lines from stdin, one JSON answer line each on stdout ({"text"} or {"error"}):
    the loop of a server's template worker process (gptkit.serving.templates starts and kills it)."""
    _limit_memory(WORKER_MEMORY_BYTES)
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            template = ChatTemplate(request["source"], request["bos_token"], request["eos_token"])
            answer = {
                "text": template.render(
                    request["messages"],
                    request["add_generation_prompt"],
                    max_chars=request["max_chars"],
                    tools=request["tools"],
                )
            }
        except ChatTemplateError as err:
            answer = {"error": str(err)}
        except MemoryError:
            answer = {"error": f"the chat template needed more than {WORKER_MEMORY_BYTES >> 20} MiB; stopped"}
        except Exception as err:  # the template's own runtime error (1 + 'a', a range too big): its request's answer
            answer = {"error": f"cannot render the chat template: {type(err).__name__}: {err}"}
        sys.stdout.buffer.write(json.dumps(answer).encode() + b"\n")
        sys.stdout.buffer.flush()


def _limit_memory(limit: int) -> None:
    """Cap this process's address space (where the platform allows), so a template cannot exhaust the machine."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # Windows has no resource module; some systems refuse RLIMIT_AS
        pass
