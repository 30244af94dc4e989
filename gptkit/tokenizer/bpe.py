"""Byte-level BPE, and any Hugging Face tokenizer.json, through the `tokenizers` library."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.atomic import atomic_write_text
from gptkit.errors import GptkitError, InputError
from gptkit.tokenizer.base import EOT, HF_FILE, Tokenizer, newline_cuts


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
