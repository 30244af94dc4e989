"""The two tokenizers of a fixed alphabet: char (one id per character seen) and byte (one id per byte)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.errors import InputError
from gptkit.tokenizer.base import (
    EOT,
    Tokenizer,
    UnknownCharacter,
    special_pattern,
    split_specials,
)


class CharTokenizer(Tokenizer):
    """One id per character of a fixed alphabet, then the special tokens."""

    kind = "char"

    def __init__(self, chars: Sequence[str], specials: Sequence[str] = ()) -> None:
        if any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise InputError("a char tokenizer's vocabulary must be distinct single characters")
        if not chars:
            raise InputError("a char tokenizer needs at least one character (is the training text empty?)")
        self.chars = list(chars)
        self.special_tokens = {s: len(self.chars) + i for i, s in enumerate(specials)}
        self.vocab_size = len(self.chars) + len(self.special_tokens)
        self.eos_id = self.special_tokens.get(EOT)
        self._itos = self.chars + list(self.special_tokens)
        self._stoi = {c: i for i, c in enumerate(self.chars)}
        self._specials = special_pattern(self.special_tokens)
        # Code point -> id so that encoding a large text is one vectorised lookup; the last entry (-1) stands for
        # every code point above the largest known one, and -1 marks unknown characters.
        self._table = np.full(max(ord(c) for c in self.chars) + 2, -1, dtype=np.int32)
        self._table[[ord(c) for c in self.chars]] = np.arange(len(self.chars))

    @classmethod
    def train(cls, texts: Iterable[str], specials: Sequence[str] = ()) -> CharTokenizer:
        """The sorted set of characters in texts, followed by specials (e.g. [EOT] for several documents)."""
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls(sorted(seen), specials)

    def _encode_segment(self, text: str, offset: int) -> np.ndarray:
        points = np.minimum(
            np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32), len(self._table) - 1
        )
        ids = self._table[points]
        if (ids < 0).any():
            i = int(np.argmax(ids < 0))
            raise UnknownCharacter(
                f"character {text[i]!r} (U+{ord(text[i]):04X}) at position {offset + i} is not in the char "
                f"tokenizer's vocabulary of {len(self.chars)} characters (use a tokenizer trained on text that "
                "holds it, or a byte or bpe tokenizer)",
                text[i],
                offset + i,
            )
        return ids

    def _encode_array(self, text: str) -> np.ndarray:
        parts, offset = [], 0
        for j, segment in enumerate(split_specials(text, self._specials)):
            if j % 2:
                parts.append(np.array([self.special_tokens[segment]], dtype=np.int32))
            elif segment:
                parts.append(self._encode_segment(segment, offset))
            offset += len(segment)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def encode(self, text: str) -> list[int]:
        """The ids of text; an unknown character raises InputError naming it and its position."""
        return self._encode_array(text).tolist()

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode documents (special-token text as plain characters) into uint32 arrays."""
        return [self._encode_segment(text, 0).astype(np.uint32) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The characters (and special-token texts) of ids."""
        self._check_ids(ids)
        return "".join(self._itos[i] for i in ids)

    def vocabulary(self) -> tuple[Any, ...]:
        """The alphabet and the specials."""
        return self.kind, tuple(self.chars), tuple(self.special_tokens.items())

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 length of each character, 0 for specials."""
        lengths = [len(c.encode("utf-8", "surrogatepass")) for c in self.chars] + [0] * len(self.special_tokens)
        return np.array(lengths, dtype=np.int64)

    def save(self, directory: Path) -> None:
        """Write gptkit_tokenizer.json with the alphabet and specials."""
        self._write_gptkit_file(directory, {"chars": "".join(self.chars), "specials": list(self.special_tokens)})


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text; specials follow from 256."""

    kind = "byte"

    def __init__(self, specials: Sequence[str] = (EOT,)) -> None:
        self.special_tokens = {s: 256 + i for i, s in enumerate(specials)}
        self.vocab_size = 256 + len(self.special_tokens)
        self.eos_id = self.special_tokens.get(EOT)
        self._specials = special_pattern(self.special_tokens)
        self._special_text = {i: s for s, i in self.special_tokens.items()}

    @staticmethod
    def _encode_segment(text: str, offset: int) -> np.ndarray:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise UnknownCharacter(
                f"character U+{ord(text[err.start]):04X} at position {offset + err.start} cannot be encoded as "
                "UTF-8 (a lone surrogate)",
                text[err.start],
                offset + err.start,
            ) from None
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint32)

    def _encode_array(self, text: str) -> np.ndarray:
        parts, offset = [], 0
        for j, segment in enumerate(split_specials(text, self._specials)):
            if j % 2:
                parts.append(np.array([self.special_tokens[segment]], dtype=np.uint32))
            elif segment:
                parts.append(self._encode_segment(segment, offset))
            offset += len(segment)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of text as ids (special-token text becomes the special id)."""
        return self._encode_array(text).tolist()

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode documents (special-token text as plain bytes) into uint32 arrays."""
        return [self._encode_segment(text, 0) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The UTF-8 text of the byte ids; invalid sequences become U+FFFD."""
        self._check_ids(ids)
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
            else:
                out.append(run.decode("utf-8", "replace"))
                out.append(self._special_text[i])
                run = bytearray()
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def vocabulary(self) -> tuple[Any, ...]:
        """The specials (ids 0..255 are always the bytes)."""
        return self.kind, tuple(self.special_tokens.items())

    def token_bytes(self, token_id: int) -> bytes:
        """The byte itself (a special: its text)."""
        self._check_ids([token_id])
        return bytes([token_id]) if token_id < 256 else self._special_text[token_id].encode("utf-8")

    def token_byte_lengths(self) -> np.ndarray:
        """1 for every byte, 0 for specials."""
        return np.array([1] * 256 + [0] * len(self.special_tokens), dtype=np.int64)

    def save(self, directory: Path) -> None:
        """Write gptkit_tokenizer.json with the specials."""
        self._write_gptkit_file(directory, {"specials": list(self.special_tokens)})
