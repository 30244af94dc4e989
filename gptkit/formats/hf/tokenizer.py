"""The tokenizer files of a Hugging Face export: what AutoTokenizer.from_pretrained needs to encode, decode and render
chats exactly as gptkit does.

tokenizer.json holds the whole pipeline; tokenizer_config.json the special-token names and the chat template, which
also goes to chat_template.jinja (transformers 4.50 on reads that file first; older versions read the JSON key). The
template is the one gptkit renders the model's chats with: the model's own, or gptkit's default written as Jinja
(gptkit.chat.DEFAULT_JINJA), as a GGUF export carries it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from gptkit.atomic import atomic_write_text
from gptkit.chat import CHAT_TEMPLATE_FILE, eos_text, template_from_config
from gptkit.errors import GptkitError
from gptkit.tokenizer import BYTE_LEVEL_SYMBOLS, Tokenizer

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class TokenizerExportError(GptkitError):
    """A tokenizer that cannot be written as a Hugging Face tokenizer.json; the message names why."""


def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """A `tokenizers` Tokenizer encoding and decoding exactly as the gptkit tokenizer does (on text it accepts).

    bpe tokenizers already are one. byte: GPT-2's byte-to-symbol map, one symbol per byte and no merges, so id =
    byte value. char: one vocabulary entry per character and no merges; the only difference is that a character
    outside the alphabet is dropped by `tokenizers` where gptkit raises an error.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = getattr(tokenizer, "kind", None)
    if kind == "bpe":
        return tokenizer.hf
    if kind == "byte":
        vocab = {symbol: b for b, symbol in BYTE_LEVEL_SYMBOLS.items()}
        hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
    elif kind == "char":
        hf = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(tokenizer.chars)}, merges=[]))
        hf.decoder = decoders.Fuse()
    else:
        raise TokenizerExportError(f"tokenizer kind {kind!r} cannot be written as a Hugging Face tokenizer.json")
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in specials])
    for text, wanted in specials:
        if hf.token_to_id(text) != wanted:
            raise TokenizerExportError(f"special token {text!r} would get id {hf.token_to_id(text)}, not {wanted}")
    return hf


def write_hf_tokenizer(tokenizer: Tokenizer, out: Path, base_config: dict[str, Any] | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja so that AutoTokenizer.from_pretrained(out)
    loads them; base_config is the model's own tokenizer_config.json (as gptkit.chat.read_tokenizer_config reads it)."""
    hf = hf_tokenizer(tokenizer)
    atomic_write_text(out / TOKENIZER_FILE, hf.to_str())
    config = hf_tokenizer_config(tokenizer, hf, base_config)
    atomic_write_text(out / CHAT_TEMPLATE_FILE, config["chat_template"])
    atomic_write_text(out / TOKENIZER_CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def hf_tokenizer_config(tokenizer: Tokenizer, hf: Any, base_config: dict[str, Any] | None) -> dict[str, Any]:
    """base_config completed for transformers: the generic fast tokenizer class, the chat template gptkit renders
    this model's chats with, and the bos/eos token names that template renders."""
    config = dict(base_config or {})
    # The tokenizer.json is the whole pipeline; the generic fast class applies it as written.
    config.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
    template = template_from_config(base_config, eos_text(tokenizer))
    config["chat_template"] = template.jinja
    if template.bos_token:  # the default template renders no bos_token: the model's own name for it stays
        _set_name(config, "bos_token", template.bos_token, hf)
    _set_name(config, "eos_token", template.eos_token, hf)
    if "eos_token" not in config and tokenizer.eos_id is not None:  # where text ends, for generation all the same
        config["eos_token"] = hf.id_to_token(tokenizer.eos_id)
    return config


def _set_name(config: dict[str, Any], key: str, name: str, hf: Any) -> None:
    """Name the template renders as key (transformers renders its tokenizer's) in config, where it is one token of
    hf; a name that is not would be added by transformers as a token the model has no embedding for."""
    if name and hf.token_to_id(name) is not None:
        config[key] = name
        return
    config.pop(key, None)
    if name:
        log.warning(
            "the chat template's %s %r is not a token of the tokenizer, so the Hugging Face export renders "
            "chats differently from gptkit there",
            key,
            name,
        )
