"""A saved tokenizer loaded back: gptkit's own file (any kind) or a Hugging Face tokenizer.json."""

from __future__ import annotations

from pathlib import Path

from gptkit.errors import GptkitError
from gptkit.tensors import read_versioned_json
from gptkit.tokenizer.base import FORMAT, FORMAT_VERSION, GPTKIT_FILE, HF_FILE, KINDS, Tokenizer, TokenizerNotFound
from gptkit.tokenizer.bpe import BPETokenizer
from gptkit.tokenizer.simple import ByteTokenizer, CharTokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved in a directory (gptkit's files or a Hugging Face tokenizer.json), or in such a file."""
    path = Path(path)
    if path.is_dir():
        if (path / GPTKIT_FILE).is_file():
            return load_gptkit_file(path / GPTKIT_FILE)
        if (path / HF_FILE).is_file():
            return BPETokenizer.from_file(path / HF_FILE)
        raise TokenizerNotFound(f"{path} holds no tokenizer ({GPTKIT_FILE} or {HF_FILE})")
    if path.is_file():
        if path.name == GPTKIT_FILE:
            return load_gptkit_file(path)
        return BPETokenizer.from_file(path)
    raise TokenizerNotFound(f"tokenizer path {path} does not exist")


def tokenizer_or_none(path: str | Path) -> Tokenizer | None:
    """The tokenizer saved in a directory, or None when it holds none (a damaged one is still an error)."""
    try:
        return load_tokenizer(path)
    except TokenizerNotFound:
        return None


def load_gptkit_file(path: Path) -> Tokenizer:
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
