"""The tokenizer interface every kind implements, its file names and errors, and helpers over any kind."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.atomic import atomic_write_text
from gptkit.errors import GptkitError, InputError

EOT = "<|endoftext|>"
GPTKIT_FILE = "gptkit_tokenizer.json"
HF_FILE = "tokenizer.json"
FORMAT = "gptkit-tokenizer"
FORMAT_VERSION = 1
KINDS = ("char", "byte", "bpe")


class TokenizerNotFound(GptkitError):
    """A path that holds no tokenizer files."""


class UnknownCharacter(InputError):
    """A character the tokenizer cannot encode; `position` is its index in the encoded text."""

    def __init__(self, message: str, character: str, position: int) -> None:
        super().__init__(message)
        self.character = character
        self.position = position


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set kind, vocab_size, eos_id and special_tokens."""

    kind: str
    vocab_size: int
    eos_id: int | None
    special_tokens: dict[str, int]
    _more_eos_ids: tuple[int, ...] = ()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a generated text: eos_id, then those a model's config adds (e.g. end of turn)."""
        first = () if self.eos_id is None else (self.eos_id,)
        return first + tuple(i for i in self._more_eos_ids if i != self.eos_id)

    def add_eos_ids(self, ids: Iterable[int]) -> None:
        """Also end generated texts at these ids (a model's own list, such as Llama 3's end-of-turn token)."""
        ids = list(ids)
        self._check_ids(ids)
        self._more_eos_ids = tuple(dict.fromkeys([*self._more_eos_ids, *ids]))

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The token ids of text (special-token text becomes the special id)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids; an incomplete UTF-8 sequence decodes to U+FFFD."""

    def encode_prompt(self, text: str) -> list[int]:
        """The ids of a prompt to generate from: encode(text) plus any tokens the tokenizer puts around every
        input (a Llama tokenizer's <s>), as Hugging Face's tokenizer(text) gives them."""
        return self.encode(text)

    def prompt_bos_id(self) -> int | None:
        """The id encode_prompt puts before every prompt (a Llama tokenizer's <s>), or None."""
        with_prompt, plain = self.encode_prompt("a"), self.encode("a")
        return with_prompt[0] if len(with_prompt) > len(plain) else None

    @abstractmethod
    def vocabulary(self) -> tuple[Any, ...]:
        """What each id stands for, comparable between tokenizers: equal ones encode text the same way."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one id stands for, also when they are part of a character (a special: its text)."""
        return self.decode([token_id]).encode("utf-8")

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write this tokenizer's files into an existing directory (atomically, file by file)."""

    @abstractmethod
    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (0 for special tokens); used for bits per byte."""

    @abstractmethod
    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode documents into uint32 arrays, in parallel where the tokenizer can, as plain text.

        Unlike encode(), special-token text inside a document stays text: a file that happens to contain
        "<|endoftext|>" must not be split in two (prepare inserts the real separator itself).
        """

    def cut_points(self, text: str, every: int) -> list[int] | None:
        """Positions, about `every` characters apart, where text may be cut without changing its encoding.

        Each point p satisfies 0 < p < len(text) and stays safe whatever text is later appended; None means that
        no position is known to be safe (the text must be encoded whole).
        """
        return list(range(every, len(text), every))

    def _check_ids(self, ids: Sequence[int]) -> None:
        for i, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise InputError(
                    f"token id {token} at position {i} is outside the {self.kind} tokenizer's vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )

    def _header(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": self.kind}

    def _write_gptkit_file(self, directory: Path, body: dict[str, Any]) -> None:
        """gptkit_tokenizer.json in directory: the format header and this kind's body."""
        atomic_write_text(Path(directory) / GPTKIT_FILE, json.dumps({**self._header(), **body}, ensure_ascii=False))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def special_pattern(special_tokens: dict[str, int]) -> re.Pattern[str] | None:
    """A regex matching any special token's text, longest first (None when there are none)."""
    if not special_tokens:
        return None
    alternatives = sorted(special_tokens, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")


def split_specials(text: str, pattern: re.Pattern[str] | None) -> list[str]:
    """text split into ordinary segments and special-token texts (odd indices are specials)."""
    if pattern is None:
        return [text]
    return pattern.split(text)


def check_same_tokenizer(data: Tokenizer, model: Tokenizer, data_name: str, model_name: str) -> None:
    """An InputError unless data's tokens mean what model's do (same kind, same id for every token)."""
    if data.vocabulary() != model.vocabulary():
        raise InputError(
            f"{data_name} was encoded with a different tokenizer ({data.kind}, {data.vocab_size} ids) than "
            f"{model_name} ({model.kind}, {model.vocab_size} ids); prepare the data with --tokenizer {model_name}"
        )


def newline_cuts(text: str, every: int) -> list[int]:
    """Positions just after a newline between two non-space characters, about `every` apart.

    GPT-2's pre-tokenizer ends every whitespace run before a non-space character, and no other pattern of it
    matches a newline, so such a newline is a piece of its own, in the whole text as at the end of the part
    before the cut: byte-level BPE encodes the two sides exactly as the whole. (A longer run, as in \\r\\n, is
    one piece at the end of a text but splits before its last character inside one.) Python's \\s counts a few
    more characters as space than the Rust regex does, which only removes candidate cuts.
    """
    cuts, start = [], every
    pattern = re.compile(r"(?<=\S)\n(?=\S)")
    while start < len(text):
        match = pattern.search(text, start - 1)
        if match is None:
            break
        cuts.append(match.end())
        start = match.end() + every
    return cuts
