"""A text stream into token ids: pieces regrouped where a cut cannot change the encoding, encoded a batch at a
time, and the tokenizer --tokenizer names (trained on the input for char and bpe)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptkit.errors import InputError
from gptkit.formats.gguf import gguf_tokenizer, is_gguf_file
from gptkit.prepare.inputs import Reader
from gptkit.prepare.options import PrepareConfig
from gptkit.prepare.readers import Piece
from gptkit.tokenizer import (
    EOT,
    KINDS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    TokenizerNotFound,
    UnknownCharacter,
    load_tokenizer,
    newline_cuts,
)

PIECE_CHARS = 1 << 14  # target size of one piece handed to the encoder (small enough to spread over cores)


BATCH_CHARS = 1 << 20  # characters encoded per batch: bounds the encoder's working memory


FORCE_CUT_CHARS = 1 << 23  # a document with no safe cut point this long is cut anyway (and counted in meta)


CutFn = Callable[[str, int], "list[int] | None"]


class Cutter:
    """Regroups the reader's pieces into ones of about PIECE_CHARS, cut only where `cut` allows."""

    def __init__(self, cut: CutFn) -> None:
        self.cut = cut
        self.forced = 0  # cuts made where no safe place was found (meta.json reports them)

    def __call__(self, pieces: Iterable[Piece]) -> Iterator[Piece]:
        pending: Piece | None = None
        for piece in pieces:
            if piece.starts_document:
                if pending is not None:
                    yield from self._split(pending, final=True)
                pending = piece
            elif pending is not None:
                pending = Piece(pending.text + piece.text, pending.starts_document, pending.source, pending.offset)
            if pending is not None and len(pending.text) >= BATCH_CHARS:
                *done, pending = self._split(pending, final=False)
                yield from done
        if pending is not None:
            yield from self._split(pending, final=True)

    def _split(self, piece: Piece, final: bool) -> list[Piece]:
        """piece cut into parts; unless final, the last part is the unfinished tail to keep accumulating."""
        text = piece.text
        points = self.cut(text, PIECE_CHARS) or []
        if not points and not final and len(text) >= FORCE_CUT_CHARS:
            # No safe place in a very long stretch: cut anyway (at a newline if there is one) rather than hold
            # an unbounded amount of text.
            newline = text.rfind("\n", 0, len(text) - 1)
            points = [newline + 1 if newline > 0 else len(text) // 2]
            self.forced += 1
        bounds = [0, *points, len(text)]
        return [
            Piece(text[a:b], piece.starts_document and j == 0, piece.source, piece.offset + a)
            for j, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]


def encode_stream(tokenizer: Tokenizer, pieces: Iterable[Piece], separator: int | None) -> Iterator[np.ndarray]:
    """Token arrays for the pieces, BATCH_CHARS of text per array, with the separator between documents."""
    batch: list[Piece] = []
    size = 0
    first = True
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_CHARS:
            yield encode_batch(tokenizer, batch, separator, first)
            first, batch, size = False, [], 0
    if batch:
        yield encode_batch(tokenizer, batch, separator, first)


def encode_batch(tokenizer: Tokenizer, batch: list[Piece], separator: int | None, first: bool) -> np.ndarray:
    try:
        arrays = tokenizer.encode_arrays([p.text for p in batch])
    except InputError:
        _locate_error(tokenizer, batch)
        raise
    parts = []
    for j, (piece, ids) in enumerate(zip(batch, arrays)):
        if piece.starts_document and separator is not None and not (first and j == 0):
            parts.append(np.array([separator], dtype=np.uint32))
        parts.append(ids)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def _locate_error(tokenizer: Tokenizer, batch: list[Piece]) -> None:
    """Re-raise an encoding error naming the input (file, or file and line) and the character's offset in it."""
    for piece in batch:
        try:
            tokenizer.encode_arrays([piece.text])
        except UnknownCharacter as err:
            char = err.character
            raise InputError(
                f"{piece.source}: character {char!r} (U+{ord(char):04X}) at character offset "
                f"{piece.offset + err.position} is not in the {tokenizer.kind} tokenizer's vocabulary; "
                "prepare with a tokenizer trained on this input (--tokenizer char or bpe) or with --tokenizer byte"
            ) from None


def tokenizer_for(name: str, config: PrepareConfig, reader: Reader, progress: bool, total: int) -> Tokenizer:
    """Build the tokenizer named by --tokenizer, training it on the input when it is char or bpe."""
    if name == "byte":
        return ByteTokenizer()
    if name not in KINDS:
        path = Path(name)
        if not path.exists():
            raise InputError(
                f"--tokenizer must be char, byte, bpe or a directory holding a tokenizer; {name} does not exist"
            )
        try:
            return gguf_tokenizer(path) if is_gguf_file(path) else load_tokenizer(path)
        except TokenizerNotFound as err:
            raise InputError(f"--tokenizer {name}: {err}") from None
    with progress_bar(total, f"training {name}", progress) as bar:
        reader.on_bytes = bar.update
        if name == "char":
            seen: set[str] = set()
            for piece in reader:
                seen.update(piece.text)
            if not seen:
                raise no_text(reader.files)
            tokenizer = CharTokenizer(sorted(seen))
            if reader.documents > 1:  # several documents need the end-of-text separator
                tokenizer = CharTokenizer(tokenizer.chars, [EOT])
            return tokenizer
        texts = (p.text for p in Cutter(newline_cuts)(reader))
        return BPETokenizer.train(texts, config.vocab_size)


def no_text(files: list[Path]) -> InputError:
    names = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return InputError(f"the input holds no text ({names})")


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not enabled,
        mininterval=0.5,
        dynamic_ncols=True,
    )


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
