"""Supervised examples: JSONL rows in the formats TRL users have -> token ids and the tokens trained on.

A file's format is read from the keys of its first row (every row must then have them):
    messages            {"messages": [{"role": ..., "content": ...}, ...]}       a conversation
    prompt_completion   {"prompt": ..., "completion": ...}                       strings, or lists of messages
    alpaca              {"instruction": ..., "input": optional, "output": ...}   one user turn, one reply
    text                {"text": ...}                                            trained on every token
    preference          {"prompt": ..., "chosen": ..., "rejected": ...}          two completions of one prompt
                        (strings or message lists; without "prompt", the messages chosen and rejected share)
    labelled            {"text": ..., "label": ...}                              a text and its class
    prompt              {"prompt": ..., any other fields}                        a prompt to generate from (RL):
                        a string or messages ending with a user turn, no "completion", "chosen" or "rejected";
                        also {"messages": [...]} whose last message is a user turn

Conversations (messages, prompt/completion message lists, alpaca rows as a user turn and an assistant turn) are
rendered with the model's chat template (gptkit.chat), as `gptkit serve` renders a chat request. By default only
what a model must write is trained on: each assistant reply (its text as far as the first end-of-text id, that id
included; one is appended where the template writes none) and a completion. Text before a reply is encoded on
its own, as the server encodes a prompt, so the reply's first token is the one a served model must choose.
Prompt/completion strings are plain text (no template): the prompt gets the tokens the tokenizer puts around an
input (Llama's <s>), as a completions request does, and the completion the end-of-text id. A preference row is
two prompt/completion examples, chosen and rejected, trained on their completions. A labelled text is encoded as
a prompt is (no end-of-text id: the class is read at its last token), every token trained for the auxiliary
language-modelling loss. A prompt row is not trained on: it is what reinforcement learning samples completions
of, its string encoded as a completions request encodes one, its conversation rendered with the generation prompt
and encoded as a chat request is (gptkit.serving.chat), so the policy sees what the served model will.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gptkit.chat import ROLES, ChatTemplate, ChatTemplateError
from gptkit.data_kinds import DATA_KINDS, ROW_FORMATS, format_of
from gptkit.data_kinds import row_format as row_format_spec
from gptkit.errors import InputError
from gptkit.tokenizer import Tokenizer

LossOn = Literal["completion", "all"]
ANSWERED = ("completion", "chosen", "rejected")  # a row with any of these holds its answers: not a prompt row


@dataclass
class Example:
    """One example's token ids (uint32) and, per token, whether the loss trains the model to predict it."""

    ids: np.ndarray
    trained: np.ndarray  # bool, the length of ids

    @property
    def targets(self) -> int:
        """How many tokens are trained on (a first token has no context, so it never is)."""
        return int(self.trained[1:].sum())


def row_format(record: Any) -> str | None:
    """The format a JSON row's keys say it is in (gptkit.data_kinds.ROW_FORMATS), or None."""
    return format_of(record)


def is_prompt_row(record: Any) -> bool:
    """Whether a row is a prompt to generate from: "messages" ending with a user turn, or a "prompt" (a string, or
    messages ending with a user turn) without "completion", "chosen" or "rejected"."""
    if not isinstance(record, dict) or any(key in record for key in ANSWERED):
        return False
    if "messages" in record:  # as row_format: messages first
        return _ends_with_user(record["messages"])
    return isinstance(record.get("prompt"), str) or _ends_with_user(record.get("prompt"))


def _ends_with_user(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "user"
    )


class ExampleEncoder:
    """Turns rows into Examples with one tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, loss_on: LossOn = "completion") -> None:
        if tokenizer.eos_id is None:
            raise InputError(
                f"supervised examples end each reply with the end-of-text token, and this {tokenizer.kind} "
                "tokenizer has none; prepare with --tokenizer byte, bpe or a model directory"
            )
        self.tokenizer = tokenizer
        self.template = template
        self.loss_on = loss_on
        self.ends = set(tokenizer.eos_ids)

    def encode(self, record: Any, fmt: str, where: str) -> Example:
        """The Example of one row in format fmt; where ("file line N") names it in errors."""
        example = self._encode(record, fmt, where)
        if not example.targets:
            raise InputError(f"{where} has no trained token: nothing follows its first token to learn")
        return example

    def encode_row(self, record: Any, fmt: str, where: str) -> tuple[list[Example], str | None]:
        """The examples one row in format fmt makes (a preference pair makes two) and its label (formats with one)."""
        if fmt == "preference":
            return list(self.encode_pair(record, where)), None
        if fmt == "prompt":
            ids = self.encode_prompt(record, where)[1]
            return [Example(ids, np.zeros(len(ids), dtype=bool))], None
        spec = ROW_FORMATS[fmt]
        if row_format(record) != fmt:
            raise InputError(f"{where} is not a {fmt} row like the file's first row ({spec.hint})")
        label = _label(record, spec.label, DATA_KINDS[spec.kind].label_names, where) if spec.label else None
        if fmt == "labelled":
            return [self.encode_labelled(record, where)], label
        return [self.encode(record, spec.encoded_as or fmt, where)], label

    def encode_prompt(self, record: Any, where: str) -> tuple[str, np.ndarray]:
        """A prompt row's text as the model sees it and its ids: a string as a completions request encodes it, a
        conversation rendered with the generation prompt and encoded as a chat request is."""
        if not is_prompt_row(record):
            raise InputError(f"{where} is not a prompt row like the file's first row ({_keys_hint('prompt')})")
        key = "messages" if "messages" in record else "prompt"
        if isinstance(record[key], str):
            text, ids = record[key], self.tokenizer.encode_prompt(record[key])
        else:
            try:
                text = self.template.render(_messages(record[key], where, key), add_generation_prompt=True)
            except ChatTemplateError as err:
                raise InputError(f"{where}: {err}") from None
            ids = self.tokenizer.encode(text)
        if not ids:
            raise InputError(f"{where}: the prompt is empty; a model generates from at least one token")
        return text, np.asarray(ids, dtype=np.uint32)

    def encode_pair(self, record: Any, where: str) -> tuple[Example, Example]:
        """(chosen, rejected) of a preference row: the prompt with each completion."""
        if row_format(record) != "preference":
            raise InputError(f"{where} is not a preference row like the file's first row ({_keys_hint('preference')})")
        prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
        if prompt is None:  # TRL's implicit prompt: the messages both conversations begin with
            chosen, rejected = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
            shared = next(
                (i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected))
            )
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            if not prompt or not chosen or not rejected:
                raise InputError(
                    f'{where}: without a "prompt", "chosen" and "rejected" must be conversations '
                    "that share their first messages and differ after them"
                )
        if self.loss_on == "all":
            raise InputError("preference pairs are scored on their completions; prepare them without --loss-on all")
        return (
            self.encode({"prompt": prompt, "completion": chosen}, "prompt_completion", where),
            self.encode({"prompt": prompt, "completion": rejected}, "prompt_completion", where),
        )

    def encode_labelled(self, record: Any, where: str) -> Example:
        """A labelled text's example: encoded as a prompt, every token trained."""
        text = _string(record, "text", where)
        ids = np.asarray(self.tokenizer.encode_prompt(text), dtype=np.uint32)
        if len(ids) == 0:
            raise InputError(f"{where}: the text is empty; a class is read at the text's last token")
        return Example(ids, np.ones(len(ids), dtype=bool))

    def _encode(self, record: Any, fmt: str, where: str) -> Example:
        if fmt == "text":
            text = _string(record, "text", where)
            return self._example([(self._ids(text, prompt=True), True), (self._end(), True)])
        if fmt == "prompt_completion":
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                return self._example(
                    [(self._ids(prompt, prompt=True), False), (self._ids(completion) + self._end(), True)]
                )
            if isinstance(prompt, list) and isinstance(completion, list):
                context = _messages(prompt, where, "prompt")
                return self._conversation(context + _messages(completion, where, "completion"), len(context), where)
            raise InputError(f'{where}: "prompt" and "completion" must both be strings or both lists of messages')
        if fmt == "alpaca":
            instruction, extra = _string(record, "instruction", where), record.get("input") or ""
            if not isinstance(extra, str):
                raise InputError(f'{where}: "input" must be a string')
            user = instruction + ("\n\n" + extra if extra else "")
            messages = [
                {"role": "user", "content": user},
                {"role": "assistant", "content": _string(record, "output", where)},
            ]
            return self._conversation(messages, 0, where)
        return self._conversation(_messages(record["messages"], where, "messages"), 0, where, _tools(record, where))

    def _conversation(
        self, messages: list[dict[str, Any]], first_trained: int, where: str, tools: list[dict[str, Any]] | None = None
    ) -> Example:
        """The rendered messages (with the row's tools offered, as a chat request offers them); replies from message
        index first_trained on are trained (all with loss_on all): an assistant turn that calls tools is trained on
        its calls, as the template writes them."""
        try:
            text, spans = self.template.reply_spans(messages, tools)
        except ChatTemplateError as err:
            raise InputError(f"{where}: {err}") from None
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        trained_spans = [span for i, span in zip(replies, spans) if i >= first_trained]
        if not trained_spans and self.loss_on == "completion":
            raise InputError(f"{where} has no trained token: it holds no assistant reply to train on")
        parts, cursor = [], 0
        for start, end in trained_spans:
            parts.append((self._ids(text[cursor:start]), False))
            parts += self._reply(text[start:end])
            cursor = end
        parts.append((self._ids(text[cursor:]), False))
        return self._example(parts)

    def _reply(self, text: str) -> list[tuple[list[int], bool]]:
        """A reply's ids, trained as far as its first end-of-text id (what the template writes after it is
        context); the end id appended, trained, when the text has none."""
        ids = self._ids(text)
        end = next((j for j, t in enumerate(ids) if t in self.ends), None)
        if end is None:
            return [(ids + self._end(), True)]
        return [(ids[: end + 1], True), (ids[end + 1 :], False)]

    def _example(self, parts: list[tuple[list[int], bool]]) -> Example:
        ids = np.fromiter((t for part, _ in parts for t in part), dtype=np.uint32)
        trained = np.fromiter((flag or self.loss_on == "all" for part, flag in parts for _ in part), dtype=bool)
        return Example(ids, trained)

    def _ids(self, text: str, prompt: bool = False) -> list[int]:
        if not text:
            return self.tokenizer.encode_prompt("") if prompt else []
        return self.tokenizer.encode_prompt(text) if prompt else self.tokenizer.encode(text)

    def _end(self) -> list[int]:
        return [self.tokenizer.eos_id]


def fit(
    example: Example, max_length: int, overlong: Literal["truncate", "drop"], needs_targets: bool = True
) -> Example | None:
    """The example cut to max_length tokens (truncate) or None (drop, or, where it needs_targets, nothing trained
    left after the cut: a labelled text is read for its label and needs none)."""
    if len(example.ids) <= max_length:
        return example
    if overlong == "drop":
        return None
    cut = Example(example.ids[:max_length], example.trained[:max_length])
    return cut if cut.targets or not needs_targets else None


def _keys_hint(fmt: str) -> str:
    return row_format_spec(fmt).hint


def _label(record: dict[str, Any], key: str, names: tuple[str, ...] | None, where: str) -> str:
    """A row's label as a string: true or false where the kind's labels are those (KTO's), else a class name (a
    string, or an integer)."""
    label = record[key]
    if names is not None:
        if not isinstance(label, bool):
            raise InputError(f'{where}: "{key}" must be true or false, got {json_type(label)}')
        return "true" if label else "false"
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise InputError(f'{where}: "{key}" must be a string (or an integer), got {json_type(label)}')
    return str(label)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _string(record: dict[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise InputError(f'{where}: "{key}" must be a string, got {type(value).__name__}')
    return value


def _tools(record: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """A messages row's "tools" (OpenAI's function tools, which the template renders as a request's)."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise InputError(
            f"{where}: 'tools' must be a list of function tools as a chat request sends them: "
            '[{"type": "function", "function": {"name": ..., "parameters": {...}}}, ...]'
        )
    return tools


def _tool_calls(message: dict[str, Any], where: str, n: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as a template reads them (arguments as an object: OpenAI's JSON text is
    parsed)."""
    calls = message["tool_calls"]
    out = []
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InputError(
                f"{where}: message {n}'s tool_calls must be a list of calls as OpenAI writes them: "
                '[{"type": "function", "function": {"name": ..., "arguments": ...}}, ...]'
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise InputError(
                    f"{where}: message {n}: a tool call's arguments must be JSON, got {arguments[:40]!r}"
                ) from None
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return out


def _messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    """A list of {"role", "content"} messages with known roles, content as a string or a list of text parts; an
    assistant's "tool_calls" (its content may then be null) and a tool's "tool_call_id" kept."""
    if not isinstance(value, list) or not value:
        raise InputError(f'{where}: "{key}" must be a non-empty list of messages')
    messages = []
    for n, message in enumerate(value, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InputError(f'{where}: message {n} of "{key}" must be an object with a "role"')
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise InputError(f"{where}: message {n} has unknown role {role!r}; roles are {', '.join(ROLES)}")
        if isinstance(content, list):  # OpenAI's content parts: the text parts joined, as the server reads them
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise InputError(f'{where}: message {n}\'s content parts must be {{"type": "text", "text": ...}}')
            content = "".join(p["text"] for p in content)
        calls = role == "assistant" and message.get("tool_calls") is not None
        if not isinstance(content, str) and not (calls and content is None):
            raise InputError(f'{where}: message {n} ({role}) needs a string "content"')
        entry: dict[str, Any] = {"role": role, "content": content}
        if calls:
            entry["tool_calls"] = _tool_calls(message, where, n)
        if role == "tool" and message.get("tool_call_id") is not None:
            entry["tool_call_id"] = str(message["tool_call_id"])
        messages.append(entry)
    return messages
