"""Tokenizers: char, byte and byte-level BPE behind one interface, saved beside a model or data set.

Files a tokenizer writes into a directory:
    gptkit_tokenizer.json   always: {"format": "gptkit-tokenizer", "kind": ..., ...}; char and byte keep their
                            whole vocabulary here, bpe points at tokenizer.json
    tokenizer.json          bpe only, in the Hugging Face `tokenizers` format
A directory holding only a Hugging Face tokenizer.json (e.g. GPT-2's) loads as a bpe tokenizer.

Special tokens are written as their text by decode(), and encode() turns their text back into their id, so
decode(encode(s)) == s for every kind. encode_arrays() (bulk data) keeps special-token text as plain text.
"""

from __future__ import annotations

from gptkit.tokenizer.base import (
    EOT,
    FORMAT,
    FORMAT_VERSION,
    GPTKIT_FILE,
    HF_FILE,
    KINDS,
    Tokenizer,
    TokenizerNotFound,
    UnknownCharacter,
    check_same_tokenizer,
    newline_cuts,
)
from gptkit.tokenizer.bpe import BYTE_LEVEL_SYMBOLS, BPETokenizer
from gptkit.tokenizer.files import load_tokenizer, tokenizer_or_none
from gptkit.tokenizer.simple import ByteTokenizer, CharTokenizer

__all__ = [
    "BPETokenizer",
    "BYTE_LEVEL_SYMBOLS",
    "ByteTokenizer",
    "CharTokenizer",
    "EOT",
    "FORMAT",
    "FORMAT_VERSION",
    "GPTKIT_FILE",
    "HF_FILE",
    "KINDS",
    "Tokenizer",
    "TokenizerNotFound",
    "UnknownCharacter",
    "check_same_tokenizer",
    "load_tokenizer",
    "newline_cuts",
    "tokenizer_or_none",
]
