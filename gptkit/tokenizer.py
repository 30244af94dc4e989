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

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.atomic import atomic_write_text
from gptkit.errors import GptkitError, InputError
from gptkit.tensors import read_versioned_json

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

        atomic_write_text(Path(directory) / GPTKIT_FILE, json.dumps({**self._header(), **body}, ensure_ascii=False))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _special_pattern(special_tokens: dict[str, int]) -> re.Pattern[str] | None:
    """A regex matching any special token's text, longest first (None when there are none)."""
    if not special_tokens:
        return None
    alternatives = sorted(special_tokens, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")


def _split_specials(text: str, pattern: re.Pattern[str] | None) -> list[str]:
    """text split into ordinary segments and special-token texts (odd indices are specials)."""
    if pattern is None:
        return [text]
    return pattern.split(text)


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
        self._specials = _special_pattern(self.special_tokens)
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
        for j, segment in enumerate(_split_specials(text, self._specials)):
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
        self._specials = _special_pattern(self.special_tokens)
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
        for j, segment in enumerate(_split_specials(text, self._specials)):
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


def _byte_level_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet, byte -> symbol (Radford et al. 2019, encoder.py bytes_to_unicode): printable
    Latin-1 bytes are their own symbol, the other bytes take the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(0x100 + n) for n, b in enumerate(others)}


BYTE_LEVEL_SYMBOLS = _byte_level_symbols()
_BYTE_OF_SYMBOL = {symbol: b for b, symbol in BYTE_LEVEL_SYMBOLS.items()}


class BPETokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer: trained byte-level BPE, or any loaded tokenizer.json."""

    kind = "bpe"

    def __init__(self, hf: Any, eos_token: str | None = None) -> None:
        from tokenizers import pre_tokenizers

        self.hf = hf
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in sorted(added.items()) if t.special}
        eos = eos_token if eos_token is not None else EOT
        self.eos_id = hf.token_to_id(eos)
        self._plain: Any = None  # a copy that encodes special-token text as text, made on first use
        pre = hf.pre_tokenizer
        # GPT-2's pre-tokenizer regex never joins a newline with the non-space character after it, so text may be
        # cut there; other pipelines (normalisers, prefix spaces, other regexes) are encoded whole.
        self._byte_level = (
            isinstance(pre, pre_tokenizers.ByteLevel)
            and pre.use_regex
            and not pre.add_prefix_space
            and hf.normalizer is None
            and all("\n" not in t.content for t in added.values())
        )

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, specials: Sequence[str] = (EOT,), length: int | None = None
    ) -> BPETokenizer:
        """Train byte-level BPE (GPT-2's pre-tokenizer, all 256 bytes in the alphabet) on texts."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        minimum = 256 + len(specials)
        if vocab_size < minimum:
            raise InputError(
                f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least {minimum} "
                f"(256 bytes + {len(specials)} special token{'s' if len(specials) != 1 else ''})"
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer, length=length)
        return cls(hf)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a Hugging Face tokenizer.json (its eos token from a tokenizer_config.json beside it if present)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable or malformed files
            raise GptkitError(f"cannot load {path} as a Hugging Face tokenizer: {err}") from None
        eos = None  # the tokenizer_config.json's eos_token wins over <|endoftext|> (a chat model's <|im_end|>)
        config = path.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                data = json.loads(config.read_text())
            except (OSError, ValueError):
                data = None
            value = data.get("eos_token") if isinstance(data, dict) else None
            eos = value.get("content") if isinstance(value, dict) else value
        return cls(hf, eos if isinstance(eos, str) and hf.token_to_id(eos) is not None else None)

    def encode(self, text: str) -> list[int]:
        """The ids of text."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids of text with the tokenizer.json's post-processor applied (e.g. a leading <s>)."""
        return self.hf.encode(text, add_special_tokens=True).ids

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode documents in parallel on every core (the tokenizers library's own thread pool)."""
        if self._plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            # A separate copy, so that encode() of the shared tokenizer is never affected (e.g. in a server).
            plain = HFTokenizer.from_str(self.hf.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        encodings = self._plain.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.array(e.ids, dtype=np.uint32) for e in encodings]

    def cut_points(self, text: str, every: int) -> list[int] | None:
        """Cuts after a newline followed by a non-space character (byte-level BPE only)."""
        return newline_cuts(text, every) if self._byte_level else None

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids, special tokens included."""
        ids = list(ids)
        self._check_ids(ids)
        return self.hf.decode(ids, skip_special_tokens=False)

    def vocabulary(self) -> tuple[Any, ...]:
        """Every token's text by id, added tokens included."""
        return self.kind, tuple(sorted(self.hf.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1]))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's bytes: read from its symbols in a byte-level vocabulary (or a <0xNN> byte-fallback
        token), else its decoded text."""
        from tokenizers import decoders

        self._check_ids([token_id])
        token = self.hf.id_to_token(token_id)
        if token is not None and token_id not in self.special_tokens.values():
            if isinstance(self.hf.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_SYMBOL for c in token):
                return bytes(_BYTE_OF_SYMBOL[c] for c in token)
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                return bytes([int(token[3:5], 16)])
        return super().token_bytes(token_id)

    def token_byte_lengths(self) -> np.ndarray:
        """Bytes per id: exact for byte-level vocabularies (one symbol per byte), else via decode."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        specials = set(self.special_tokens.values())
        for i in range(self.vocab_size):
            if i in specials:
                continue
            token = self.hf.id_to_token(i)
            if token is None:
                continue
            lengths[i] = len(token) if self._byte_level else len(self.hf.decode([i]).encode("utf-8"))
        return lengths

    def save(self, directory: Path) -> None:
        """Write tokenizer.json (Hugging Face format) and gptkit_tokenizer.json pointing at it."""

        atomic_write_text(Path(directory) / HF_FILE, self.hf.to_str())
        eos = None
        if self.eos_id is not None:
            eos = self.hf.id_to_token(self.eos_id)
        self._write_gptkit_file(directory, {"file": HF_FILE, "eos_token": eos})


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved in a directory (gptkit's files or a Hugging Face tokenizer.json), or in such a file."""
    path = Path(path)
    if path.is_dir():
        if (path / GPTKIT_FILE).is_file():
            return _load_gptkit_file(path / GPTKIT_FILE)
        if (path / HF_FILE).is_file():
            return BPETokenizer.from_file(path / HF_FILE)
        raise TokenizerNotFound(f"{path} holds no tokenizer ({GPTKIT_FILE} or {HF_FILE})")
    if path.is_file():
        if path.name == GPTKIT_FILE:
            return _load_gptkit_file(path)
        return BPETokenizer.from_file(path)
    raise TokenizerNotFound(f"tokenizer path {path} does not exist")


def tokenizer_or_none(path: str | Path) -> Tokenizer | None:
    """The tokenizer saved in a directory, or None when it holds none (a damaged one is still an error)."""
    try:
        return load_tokenizer(path)
    except TokenizerNotFound:
        return None


def _load_gptkit_file(path: Path) -> Tokenizer:
    data = read_versioned_json(path, FORMAT, FORMAT_VERSION, "gptkit tokenizer file")
    kind = data.get("kind")
    try:
        if kind == "char":
            return CharTokenizer(list(data["chars"]), data.get("specials", []))
        if kind == "byte":
            return ByteTokenizer(data.get("specials", []))
        if kind == "bpe":
            hf_path = path.parent / data.get("file", HF_FILE)
            tokenizer = BPETokenizer.from_file(hf_path)
            eos = data.get("eos_token")
            return BPETokenizer(tokenizer.hf, eos) if eos else tokenizer
    except (KeyError, TypeError) as err:
        raise GptkitError(f"{path} is malformed: {err}") from None
    raise GptkitError(f"{path} has unknown tokenizer kind {kind!r} (expected one of {', '.join(KINDS)})")
