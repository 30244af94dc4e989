"""Supervised rows that use tools: the row's tools offered in the prompt and each assistant call trained, rendered
exactly as `gptkit serve` renders a chat request with the same tools and history."""

from __future__ import annotations

import json

import pytest

from gptkit.chat import ChatTemplate
from gptkit.errors import InputError
from gptkit.prepare.rows import ExampleEncoder
from gptkit.serving.schemas import ChatMessage
from gptkit.serving.tools import template_message
from gptkit.tokenizer import ByteTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}
ROW = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "What is 2 times 3?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "6"},
        {"role": "assistant", "content": "It is 6."},
    ],
}


def test_a_tool_using_conversation_trains_its_calls_as_the_server_renders_them():
    tokenizer = ByteTokenizer()
    template = ChatTemplate(eos_token=tokenizer.decode([tokenizer.eos_id]))
    example = ExampleEncoder(tokenizer, template).encode(ROW, "messages", "row")
    # What the server renders for the same history (the request's messages through the same template).
    history = [template_message(ChatMessage.model_validate(m), i) for i, m in enumerate(ROW["messages"])]
    served = template.render(history, add_generation_prompt=False, tools=TOOLS)
    assert tokenizer.decode(example.ids.tolist()) == served
    trained = tokenizer.decode([int(t) for t, keep in zip(example.ids, example.trained) if keep])
    eos = tokenizer.decode([tokenizer.eos_id])
    # The call as the default template writes it (the form a tool_choice grammar holds a reply to), and the answer.
    assert trained == f' {{"name": "calculator", "arguments": {{"expression": "2*3"}}}}{eos} It is 6.{eos}'
    assert json.loads(served.split("assistant: ")[1].split(eos)[0])["arguments"] == {"expression": "2*3"}


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda row: row["messages"][1].update(tool_calls=[{"function": {"arguments": "{}"}}]), "tool_calls must be"),
        (lambda row: row["messages"][1]["tool_calls"][0]["function"].update(arguments="{oops"), "must be JSON"),
        (lambda row: row.update(tools=[{"name": "calculator"}]), "'tools' must be a list of function tools"),
        (lambda row: row["messages"][0].update(content=None), 'needs a string "content"'),
    ],
)
def test_a_malformed_tool_row_is_one_line_naming_the_row(change, says):
    row = json.loads(json.dumps(ROW))
    change(row)
    tokenizer = ByteTokenizer()
    with pytest.raises(InputError, match="row") as err:
        ExampleEncoder(tokenizer, ChatTemplate(eos_token="<|endoftext|>")).encode(row, "messages", "row")
    assert says in str(err.value)
