"""Chat messages -> one prompt string: the tokenizer's own chat template if it ships one, else a plain default.

The default template (used when the model directory has no `chat_template`) is, for each message,

    <role>: <content>\n\n

followed by `assistant:` to cue the reply, e.g. `system: Be brief.\n\nuser: Hi\n\nassistant:`. Its stop string
`\n\nuser:` ends the reply where the model starts to write the user's next turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gptkit.errors import GptkitError

TOKENIZER_CONFIG = "tokenizer_config.json"  # where Hugging Face tokenizers keep `chat_template`
ROLES = ("system", "user", "assistant", "tool", "developer")
DEFAULT_STOP = ("\n\nuser:",)


class ChatTemplateError(GptkitError):
    """A chat template that cannot be read or rendered; the message names the problem."""


@dataclass(frozen=True)
class ChatTemplate:
    """How to turn messages into a prompt: a Jinja source (Hugging Face style) or None for the default."""

    source: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings that end an assistant reply under this template."""
        return DEFAULT_STOP if self.source is None else ()

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for these messages, ending where the assistant's reply begins."""
        if self.source is None:
            turns = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)
            return turns + "assistant:"
        return _render_jinja(self.source, messages, self.bos_token, self.eos_token)


def load_chat_template(model_dir: str | Path) -> ChatTemplate:
    """The chat template shipped in model_dir's tokenizer_config.json, or the plain default if there is none."""
    path = Path(model_dir) / TOKENIZER_CONFIG
    if not path.is_file():
        return ChatTemplate()
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ChatTemplateError(f"cannot read {path}: {err}") from None
    source = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(source, list):  # some tokenizers ship several named templates; "default" is the chat one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source.strip():
        return ChatTemplate()
    return ChatTemplate(source, _token_text(data.get("bos_token")), _token_text(data.get("eos_token")))


def _token_text(token: object) -> str:
    """A special token as HF configs store it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _render_jinja(source: str, messages: list[dict[str, str]], bos: str, eos: str) -> str:
    """Render a Hugging Face chat template in a sandbox (templates come with downloaded models)."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("this model's chat template needs jinja2: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(source)
        return template.render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except TemplateError as err:
        raise ChatTemplateError(f"cannot render the chat template: {err}") from None
