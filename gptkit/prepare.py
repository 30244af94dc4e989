"""`gptkit prepare`: text, JSONL, CSV, Parquet (plain or compressed; see gptkit.inputs) in; train.bin, val.bin,
the tokenizer and meta.json out.

The input is streamed: it is read in chunks, cut into pieces at places where cutting cannot change the
encoding, encoded a batch of pieces at a time (on every core for BPE) and appended to one token file, so memory
stays flat however large the corpus. Documents (each text file, each JSONL line, CSV or Parquet row) are
separated by the end-of-text token. The last val_fraction of the token stream is then moved to val.bin.

The new data set is written into a staging directory beside the output directory, meta.json last, and swapped
in only when complete (gptkit.atomic.replace_dir: one atomic exchange of the two directories where the system
has one), so a failure or a kill at any instant leaves the previous data set usable; files of the user's in the
output directory stay there. The next run finishes a swap a kill interrupted and deletes what killed runs left.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.atomic import atomic_write_text, replace_dir, staging_dir, sweep_staging
from gptkit.errors import GptkitError, InputError
from gptkit.inputs import READ_CHUNK, Piece, Reader, resolve_inputs
from gptkit.tokenizer import (
    EOT,
    GPTKIT_FILE,
    HF_FILE,
    KINDS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    TokenizerNotFound,
    UnknownCharacter,
    newline_cuts,
    load_tokenizer,
)

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpora" / "tinyshakespeare.txt"
META_FORMAT = "gptkit-data"
META_VERSION = 1
PIECE_CHARS = 1 << 14  # target size of one piece handed to the encoder (small enough to spread over cores)
BATCH_CHARS = 1 << 20  # characters encoded per batch: bounds the encoder's working memory
FORCE_CUT_CHARS = 1 << 23  # a document with no safe cut point this long is cut anyway (and counted in meta)


def _flag(help: str, metavar: str | None = None) -> dict[str, Any]:
    """Field metadata from which gptkit.cli.flags generates a flag."""
    return {"help": help, "metavar": metavar}


@dataclass
class PrepareConfig:
    """Options of `gptkit prepare`; the CLI flags are generated from these fields."""

    out: str = field(metadata=_flag("the data directory to write (created if missing)", "DATA_DIR"))
    inputs: list[str] = field(
        default_factory=list,
        metadata=_flag("a file (text, .jsonl, .csv, .tsv, .parquet; also .gz, .xz, .bz2 or .zst compressed) or a "
                       "directory of them (searched recursively); repeatable (default: the bundled tiny shakespeare)",
                       "PATH") | {"flag": "--input", "repeatable": True},
    )  # fmt: skip
    tokenizer: str = field(
        default="char",
        metadata=_flag("char, byte, bpe (trained on the input) or a directory holding a tokenizer", "char|byte|bpe|DIR"),
    )
    vocab_size: int = field(default=4096, metadata=_flag("vocabulary size of a trained bpe tokenizer", "N"))
    val_fraction: float = field(
        default=0.1, metadata=_flag("share of the token stream, at its end, kept for validation", "F")
    )
    glob: str | None = field(
        default=None, metadata=_flag("file name pattern inside input directories (default: every text file)", "PATTERN")
    )
    text_field: str = field(
        default="text", metadata=_flag("the JSONL field, or the CSV, TSV or Parquet column, that holds the text", "NAME")
    )
    errors: str = field(
        default="strict",
        metadata=_flag("invalid UTF-8: strict (stop, naming file and offset) or replace (U+FFFD)")
        | {"choices": ["strict", "replace"]},
    )

    def validate(self) -> None:
        """Raise InputError for an option no run could use."""
        if not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.errors not in ("strict", "replace"):
            raise InputError(f"--errors must be strict or replace, got {self.errors!r}")
        if self.vocab_size < 1:
            raise InputError(f"--vocab-size must be positive, got {self.vocab_size}")


# ---------------------------------------------------------------- pieces and encoding


CutFn = Callable[[str, int], "list[int] | None"]


class _Cutter:
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


def _encode_stream(tokenizer: Tokenizer, pieces: Iterable[Piece], separator: int | None) -> Iterator[np.ndarray]:
    """Token arrays for the pieces, BATCH_CHARS of text per array, with the separator between documents."""
    batch: list[Piece] = []
    size = 0
    first = True
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_CHARS:
            yield _encode_batch(tokenizer, batch, separator, first)
            first, batch, size = False, [], 0
    if batch:
        yield _encode_batch(tokenizer, batch, separator, first)


def _encode_batch(tokenizer: Tokenizer, batch: list[Piece], separator: int | None, first: bool) -> np.ndarray:
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


# ---------------------------------------------------------------- tokenizer choice


def _train_pass(
    name: str, config: PrepareConfig, reader: Reader, progress: bool, total: int
) -> Tokenizer:
    """Build the tokenizer named by --tokenizer, training it on the input when it is char or bpe."""
    if name == "byte":
        return ByteTokenizer()
    if name not in KINDS:
        path = Path(name)
        if not path.exists():
            raise InputError(f"--tokenizer must be char, byte, bpe or a directory holding a tokenizer; {name} does not exist")
        try:
            return load_tokenizer(path)
        except TokenizerNotFound as err:
            raise InputError(f"--tokenizer {name}: {err}") from None
    with _progress_bar(total, f"training {name}", progress) as bar:
        reader.on_bytes = bar.update
        if name == "char":
            seen: set[str] = set()
            for piece in reader:
                seen.update(piece.text)
            if not seen:
                raise _no_text(reader.files)
            tokenizer = CharTokenizer(sorted(seen))
            if reader.documents > 1:  # several documents need the end-of-text separator
                tokenizer = CharTokenizer(tokenizer.chars, [EOT])
            return tokenizer
        texts = (p.text for p in _Cutter(newline_cuts)(reader))
        return BPETokenizer.train(texts, config.vocab_size)


def _no_text(files: list[Path]) -> InputError:
    names = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return InputError(f"the input holds no text ({names})")


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not enabled,
                mininterval=0.5, dynamic_ncols=True)  # fmt: skip


# ---------------------------------------------------------------- output


def _token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _split_tail(stage: Path, dtype: str, total: int, val_fraction: float, lengths: np.ndarray) -> tuple[int, int, int]:
    """Move the tail of stage/train.bin (the whole token stream) into val.bin; returns (train, val, val_bytes)."""
    train = int(total * (1.0 - val_fraction))  # as nanoGPT: the first 90% of the stream trains
    itemsize = np.dtype(dtype).itemsize
    val_bytes = 0
    with open(stage / "train.bin", "rb+") as src, open(stage / "val.bin", "wb") as dst:
        src.seek(train * itemsize)
        while chunk := src.read(READ_CHUNK // 4 * itemsize):
            dst.write(chunk)
            val_bytes += int(lengths[np.frombuffer(chunk, dtype=dtype)].sum())
        src.truncate(train * itemsize)
        for f in (src, dst):
            f.flush()
            os.fsync(f.fileno())
    return train, total - train, val_bytes


# The files a data set is made of; anything else found in an output directory is the user's and stays there.
# (gptkit.data's META_FILE and SPLIT_FILES, spelled out: importing that module would import torch.)
META_FILE = "meta.json"
DATA_FILES = {META_FILE, "train.bin", "val.bin", GPTKIT_FILE, HF_FILE}


def _owned(out: Path) -> Callable[[str], bool]:
    """Whether a name in out belongs to its data set: a file prepare writes (its meta.json lists them) or a
    temporary an older prepare left."""
    names = set(DATA_FILES)
    try:
        listed = json.loads((out / META_FILE).read_text(encoding="utf-8")).get("files", [])
        names.update(n for n in listed if isinstance(n, str))
    except (OSError, ValueError, AttributeError):
        pass
    return lambda name: name in names or (name.startswith(".") and name.endswith(".tmp"))


def _sweep(out: Path) -> None:
    """Remove what killed runs left: staging directories, and the temporary files of older gptkit versions."""
    sweep_staging(out)
    if out.is_dir():
        owned = _owned(out)
        for path in out.glob(".*.tmp"):
            if path.is_file() and owned(path.name) and any(path.name.startswith(f".{n}.") for n in (*DATA_FILES, "tokens")):
                path.unlink(missing_ok=True)


def prepare(config: PrepareConfig, progress: bool = False) -> dict[str, Any]:
    """Tokenize the configured inputs into config.out; returns the meta.json written there.

    The new data set is built in a staging directory and swapped in only once complete (see the module's
    docstring), so a failure or a kill at any point leaves the previous one usable.
    """
    config.validate()
    started = time.perf_counter()
    files = resolve_inputs(config.inputs or [str(DEFAULT_CORPUS)], config.glob)
    total_input = sum(p.stat().st_size for p in files)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    out = out.resolve()  # a symlinked data directory is replaced where it lives
    _sweep(out)

    reader = Reader(files, config.errors, config.text_field)
    tokenizer = _train_pass(config.tokenizer, config, reader, progress, total_input)
    if config.tokenizer == "bpe" and tokenizer.vocab_size < config.vocab_size:
        logger.warning("the corpus allowed only %d BPE tokens (asked for %d)", tokenizer.vocab_size, config.vocab_size)
    try:
        stage = staging_dir(out)
    except OSError as err:
        raise GptkitError(f"cannot create the data directory {config.out}: {err.strerror or err}") from None
    try:
        meta = _write_data_set(stage, files, reader, tokenizer, config, progress, total_input, started)
    except OSError as err:  # a full disk, say: the previous data set was never touched
        raise GptkitError(f"cannot write the new data set beside {config.out}: {err.strerror or err}; "
                          "the previous data set there is unchanged") from None  # fmt: skip
    finally:
        if not (stage / META_FILE).is_file():
            shutil.rmtree(stage, ignore_errors=True)
    try:
        replace_dir(stage, out, _owned(out), META_FILE)
    except OSError as err:
        raise GptkitError(f"cannot put the new data set in place in {config.out}: {err.strerror or err}; "
                          "run gptkit prepare again") from None  # fmt: skip
    return meta


def _write_data_set(stage: Path, files: list[Path], reader: Reader, tokenizer: Tokenizer, config: PrepareConfig,
                    progress: bool, total_input: int, started: float) -> dict[str, Any]:  # fmt: skip
    """Encode the input into stage: train.bin, val.bin, the tokenizer, and meta.json last; returns the meta."""
    dtype = _token_dtype(tokenizer.vocab_size)
    cutter = _Cutter(tokenizer.cut_points)
    total_tokens = 0
    text_bytes = 0
    with open(stage / "train.bin", "wb") as sink, _progress_bar(total_input, "encoding", progress) as bar:
        reader.on_bytes = bar.update

        def counted(pieces: Iterable[Piece]) -> Iterator[Piece]:
            nonlocal text_bytes
            for piece in pieces:
                text_bytes += len(piece.text.encode("utf-8"))
                yield piece

        for ids in _encode_stream(tokenizer, counted(cutter(reader)), tokenizer.eos_id):
            sink.write(ids.astype(dtype))
            total_tokens += len(ids)
    if total_tokens == 0:
        raise _no_text(files)
    train, val, val_bytes = _split_tail(stage, dtype, total_tokens, config.val_fraction,
                                        tokenizer.token_byte_lengths())  # fmt: skip
    tokenizer.save(stage)
    meta = {
        "format": META_FORMAT,
        "format_version": META_VERSION,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "train_tokens": train,
        "val_tokens": val,
        "train_bytes": text_bytes - val_bytes,
        "val_bytes": val_bytes,
        "tokenizer": tokenizer.kind,
        "eos_id": tokenizer.eos_id,
        "separator": EOT if tokenizer.eos_id is not None and reader.documents > 1 else None,
        "documents": reader.documents,
        "val_fraction": config.val_fraction,
        "errors": config.errors,
        "forced_cuts": cutter.forced,
        "inputs": reader.inputs,
        "files": sorted([*os.listdir(stage), META_FILE]),
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 3),
    }
    atomic_write_text(stage / META_FILE, json.dumps(meta, indent=2) + "\n")
    return meta
