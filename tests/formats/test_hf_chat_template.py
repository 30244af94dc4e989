"""`gptkit convert --to-hf` keeps the chat template: transformers renders and tokenizes a conversation exactly as
gptkit does, for a model on gptkit's default template and for one that ships its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import VARIANTS

from gptkit.chat import CHAT_TEMPLATE_FILE, DEFAULT_JINJA
from gptkit.cli import main as cli_main
from gptkit.config import ModelConfig
from gptkit.formats.hf.tokenizer import write_hf_tokenizer
from gptkit.formats.modeldir import save_model_dir
from gptkit.loading import chat_template
from gptkit.model import GPT
from gptkit.tokenizer import EOT, ByteTokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import AutoTokenizer  # noqa: E402

BOS, IM_START, IM_END = "<|startoftext|>", "<|im_start|>", "<|im_end|>"
# A template of the model's own, ending each turn with eos_token: its tokenizer_config.json names <|im_end|> as
# eos_token while the tokenizer's end of text is <|endoftext|>, so the export must keep the template's names.
OWN_TEMPLATE = (
    "{{ bos_token }}{% if tools %}" + IM_START + "tools\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}{{ c['function'] | tojson }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief, ünïcode ✓."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "And the weather?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"sky": "clear"}'},
]


def model_dir(path: Path, own_template: bool) -> Path:
    """A tiny gptkit model directory with a byte tokenizer; own_template adds a template as transformers (4.50 on)
    saves one: chat_template.jinja beside a tokenizer_config.json naming its special tokens."""
    tokenizer = ByteTokenizer([EOT, BOS, IM_START, IM_END])
    save_model_dir(
        GPT(ModelConfig(**dict(VARIANTS["gpt2"], vocab_size=tokenizer.vocab_size))), path, tokenizer=tokenizer
    )
    if own_template:
        (path / CHAT_TEMPLATE_FILE).write_text(OWN_TEMPLATE, encoding="utf-8")
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": IM_END}))
    return path


@pytest.mark.parametrize("own_template", [False, True], ids=["default-template", "own-template"])
def test_hf_export_renders_and_tokenizes_chats_as_gptkit(own_template, tmp_path) -> None:
    source = model_dir(tmp_path / "model", own_template)
    assert cli_main(["convert", "--to-hf", str(source), "--out", str(tmp_path / "hf")]) == 0
    tokenizer = ByteTokenizer([EOT, BOS, IM_START, IM_END])
    ours = chat_template(source, tokenizer)
    assert (ours.source is None) is not own_template  # each case exercises the template it names
    written = (tmp_path / "hf" / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    assert written == json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
    assert written == (OWN_TEMPLATE if own_template else DEFAULT_JINJA)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer.eos_token == ours.eos_token == (IM_END if own_template else EOT)
    for messages, tools in ((CONVERSATION, None), (TOOL_CONVERSATION, TOOLS)):
        text = ours.render(messages, add_generation_prompt=True, tools=tools)
        assert (
            hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True) == text
        )
        ids = hf_tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert ids == tokenizer.encode(text)
    # transformers before 4.50 reads tokenizer_config.json's key alone: it renders the same without the .jinja file.
    (tmp_path / "hf" / CHAT_TEMPLATE_FILE).unlink()
    older = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert older.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == ours.render(
        CONVERSATION, add_generation_prompt=True
    )


def test_a_template_eos_name_that_is_no_token_is_not_written_and_is_warned_of(tmp_path, caplog) -> None:
    tokenizer = ByteTokenizer()
    config = {"chat_template": OWN_TEMPLATE, "eos_token": "<|nope|>", "bos_token": "<|nope|>"}
    with caplog.at_level("WARNING", logger="gptkit.formats.hf.tokenizer"):
        write_hf_tokenizer(tokenizer, tmp_path, config)
    assert "eos_token '<|nope|>' is not a token" in caplog.text and "bos_token '<|nope|>'" in caplog.text
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    # transformers would have added <|nope|> as token 257, past the model's 257 embeddings
    assert len(hf_tokenizer) == tokenizer.vocab_size
    assert hf_tokenizer.eos_token == EOT and hf_tokenizer.bos_token is None
