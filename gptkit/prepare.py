"""`gptkit prepare`: text files, directories and JSONL in; train.bin, val.bin, the tokenizer and meta.json out.

The input is streamed: it is read in chunks, cut into pieces at places where cutting cannot change the
encoding, encoded a batch of pieces at a time (on every core for BPE) and appended to one temporary token
file, so memory stays flat however large the corpus. Documents (each text file, each JSONL line) are
separated by the end-of-text token. At the end the last val_fraction of the token stream is copied to val.bin,
the temporary file is truncated and renamed to train.bin, and meta.json is written last: a directory without
meta.json is incomplete, and an existing meta.json is removed before the first new token file replaces an old
one, so that an interrupted run never leaves new token files described by old metadata.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.atomic import atomic_write, atomic_write_text, fsync_dir
from gptkit.chat import TOKENIZER_CONFIG, ChatTemplate, eos_text, load_chat_template
from gptkit.data import EXAMPLE_FILES
from gptkit.errors import GptkitError, InputError
from gptkit.finetune.examples import SUPERVISED, ExampleEncoder, fit, row_format
from gptkit.tokenizer import (
    EOT,
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
READ_CHUNK = 1 << 20  # bytes read from a file at a time
PIECE_CHARS = 1 << 14  # target size of one piece handed to the encoder (small enough to spread over cores)
BATCH_CHARS = 1 << 20  # characters encoded per batch: bounds the encoder's working memory
FORCE_CUT_CHARS = 1 << 23  # a document with no safe cut point this long is cut anyway (and counted in meta)
TEXT_SNIFF = 8192  # bytes inspected to tell a text file from a binary one when no --glob is given
DEFAULT_MAX_LENGTH = 1024  # supervised examples' length limit when no model gives its context
SPLIT_SEED = 1337  # which supervised examples go to val.bin: a fixed draw, so that a re-prepare gives the same split


def _flag(help: str, metavar: str | None = None) -> dict[str, Any]:
    """Field metadata from which gptkit.cli.flags generates a flag."""
    return {"help": help, "metavar": metavar}


@dataclass
class PrepareConfig:
    """Options of `gptkit prepare`; the CLI flags are generated from these fields."""

    out: str = field(metadata=_flag("the data directory to write (created if missing)", "DATA_DIR"))
    inputs: list[str] = field(
        default_factory=list,
        metadata=_flag("text file, directory (searched recursively) or .jsonl file with a 'text' field; repeatable "
                       "(default: the bundled tiny shakespeare)", "PATH") | {"flag": "--input", "repeatable": True},
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
    errors: str = field(
        default="strict",
        metadata=_flag("invalid UTF-8: strict (stop, naming file and offset) or replace (U+FFFD)")
        | {"choices": ["strict", "replace"]},
    )
    loss_on: str = field(
        default="completion",
        metadata=_flag("supervised examples: train on the replies and completions only (completion) or on every "
                       "token (all)") | {"choices": ["completion", "all"]},
    )  # fmt: skip
    max_length: int | None = field(
        default=None,
        metadata=_flag("supervised examples: the most tokens an example may have (default: the context of the "
                       f"model given as --tokenizer, else {DEFAULT_MAX_LENGTH})", "N"),
    )  # fmt: skip
    overlong: str = field(
        default="truncate",
        metadata=_flag("supervised examples longer than --max-length: truncate (keep the start) or drop")
        | {"choices": ["truncate", "drop"]},
    )

    def validate(self) -> None:
        """Raise InputError for an option no run could use."""
        if not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.errors not in ("strict", "replace"):
            raise InputError(f"--errors must be strict or replace, got {self.errors!r}")
        if self.vocab_size < 1:
            raise InputError(f"--vocab-size must be positive, got {self.vocab_size}")
        if self.max_length is not None and self.max_length < 2:
            raise InputError(f"--max-length must be at least 2 (a token and one to predict), got {self.max_length}")


@dataclass(frozen=True)
class Piece:
    """A run of text from one document; `starts_document` marks a document's first piece."""

    text: str
    starts_document: bool
    source: str  # "file" or "file line N", for error messages
    offset: int  # character offset of text inside its document


# ---------------------------------------------------------------- inputs


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(TEXT_SNIFF)


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def resolve_inputs(inputs: Iterable[str], glob: str | None) -> list[Path]:
    """The files to read, in a fixed order: directories expanded recursively (hidden entries skipped)."""
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if not path.exists():
            raise InputError(f"input {name} does not exist")
        if path.is_dir():
            found = sorted(p for p in path.rglob(glob or "*") if p.is_file() and not _is_hidden(p, path))
            if glob is None:
                found = [p for p in found if _readable(p) and _looks_like_text(p)]
            if not found:
                what = f"no file matching {glob!r}" if glob else "no text file"
                raise InputError(f"input directory {name} holds {what}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"input {name} is neither a file nor a directory")
    for path in files:
        if not _readable(path):
            raise InputError(f"cannot read input {path}: permission denied")
    return list(dict.fromkeys(files))  # the same file named twice is read once


def _readable(path: Path) -> bool:
    return os.access(path, os.R_OK)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


class _Reader:
    """Streams the documents of the input files as Pieces, counting bytes read and hashing each file."""

    def __init__(self, files: list[Path], errors: str, on_bytes: Callable[[int], None] = lambda n: None) -> None:
        self.files = files
        self.errors = errors
        self.on_bytes = on_bytes
        self.documents = 0
        self.inputs: list[dict[str, Any]] = []

    def __iter__(self) -> Iterator[Piece]:
        self.documents = 0
        self.inputs = []
        for path in self.files:
            digest = hashlib.sha256()
            size = 0
            try:
                with open(path, "rb") as f:
                    reader = self._jsonl if _is_jsonl(path) else self._text
                    for piece, raw in reader(path, f):
                        digest.update(raw)
                        size += len(raw)
                        self.on_bytes(len(raw))
                        if piece is not None:
                            yield piece
            except OSError as err:
                raise InputError(f"cannot read input {path}: {err.strerror or err}") from None
            self.inputs.append({"path": str(path), "bytes": size, "sha256": digest.hexdigest()})

    def _text(self, path: Path, f: Any) -> Iterator[tuple[Piece | None, bytes]]:
        decoder = codecs.getincrementaldecoder("utf-8")(self.errors)
        position = 0  # bytes consumed so far
        chars = 0
        first = True
        while True:
            raw = f.read(READ_CHUNK)
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                offset = position - pending + err.start
                raise InputError(
                    f"{path}: invalid UTF-8 at byte offset {offset} ({err.reason}); "
                    "fix the file or pass --errors replace"
                ) from None
            position += len(raw)
            if first:
                self.documents += 1
            if text or first:
                yield Piece(text, first, str(path), chars), raw
                first = False
            elif raw:
                yield None, raw
            chars += len(text)
            if not raw:
                return

    def _jsonl(self, path: Path, f: Any) -> Iterator[tuple[Piece | None, bytes]]:
        for record, where, raw in jsonl_records(path, f, self.errors):
            if record is None:
                yield None, raw
                continue
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise InputError(f"{where} has no string field \"text\" (each JSONL line must be an object with one)")
            text = record["text"]
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                if self.errors == "strict":
                    raise InputError(
                        f"{where}: the text holds a lone surrogate at character {err.start}, which UTF-8 cannot "
                        "encode; fix the file or pass --errors replace"
                    ) from None
                text = re.sub("[\ud800-\udfff]", "\ufffd", text)
            self.documents += 1
            yield Piece(text, True, where, 0), raw


def jsonl_records(path: Path, f: Any, errors: str) -> Iterator[tuple[Any, str, bytes]]:
    """(parsed JSON value or None for a blank line, "file line N", the line's bytes) for each line of a JSONL file."""
    position = 0
    for number, raw in enumerate(f, start=1):
        where = f"{path} line {number}"
        try:
            line = raw.decode("utf-8", errors)
        except UnicodeDecodeError as err:
            raise InputError(
                f"{path}: invalid UTF-8 at byte offset {position + err.start} (line {number}, {err.reason}); "
                "fix the file or pass --errors replace"
            ) from None
        position += len(raw)
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark some editors write is not part of the JSON
        if not line.strip():
            yield None, where, raw
            continue
        try:
            yield json.loads(line), where, raw
        except ValueError as err:
            raise InputError(f"{where} is not valid JSON: {err}") from None


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
    name: str, config: PrepareConfig, reader: _Reader, progress: bool, total: int
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


def _finish_split(
    all_path: Path, out: Path, dtype: str, total: int, val_fraction: float, lengths: np.ndarray
) -> tuple[int, int, int]:
    """Move the tail of the token file into val.bin and the rest into train.bin; returns (train, val, val_bytes)."""

    train = int(total * (1.0 - val_fraction))  # as nanoGPT: the first 90% of the stream trains
    itemsize = np.dtype(dtype).itemsize
    val_bytes = 0

    def write_val(tmp: Path) -> None:
        nonlocal val_bytes
        with open(all_path, "rb") as src, open(tmp, "wb") as dst:
            src.seek(train * itemsize)
            while chunk := src.read(READ_CHUNK // 4 * itemsize):
                dst.write(chunk)
                val_bytes += int(lengths[np.frombuffer(chunk, dtype=dtype)].sum())

    atomic_write(out / "val.bin", write_val)
    with open(all_path, "rb+") as f:
        f.truncate(train * itemsize)
        f.flush()
        os.fsync(f.fileno())
    os.replace(all_path, out / "train.bin")
    fsync_dir(out)
    return train, total - train, val_bytes


TOKENS_TMP_PREFIX = ".tokens."  # the temporary token stream inside the output directory


def prepare(config: PrepareConfig, progress: bool = False) -> dict[str, Any]:
    """Tokenize the configured inputs into config.out; returns the meta.json written there."""

    config.validate()
    started = time.perf_counter()
    files = resolve_inputs(config.inputs or [str(DEFAULT_CORPUS)], config.glob)
    total_input = sum(p.stat().st_size for p in files)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    formats = _example_formats(files, config.errors)
    if any(fmt in SUPERVISED for fmt in formats.values()):
        return _prepare_examples(config, files, formats, out, started, progress)

    reader = _Reader(files, config.errors)
    tokenizer = _train_pass(config.tokenizer, config, reader, progress, total_input)
    if config.tokenizer == "bpe" and tokenizer.vocab_size < config.vocab_size:
        logger.warning("the corpus allowed only %d BPE tokens (asked for %d)", tokenizer.vocab_size, config.vocab_size)
    dtype = _token_dtype(tokenizer.vocab_size)
    cutter = _Cutter(tokenizer.cut_points)

    for stale in out.glob(f"{TOKENS_TMP_PREFIX}*.tmp"):  # the token file of a run killed before its cleanup
        stale.unlink(missing_ok=True)
    fd, name = tempfile.mkstemp(prefix=TOKENS_TMP_PREFIX, suffix=".tmp", dir=out)
    all_path = Path(name)
    total_tokens = 0
    text_bytes = 0
    try:
        with os.fdopen(fd, "wb") as sink, _progress_bar(total_input, "encoding", progress) as bar:
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
        # Encoding succeeded: from here on the directory is incomplete until the new meta.json lands (a failure
        # before this point, such as invalid UTF-8, leaves the previous data set whole).
        (out / "meta.json").unlink(missing_ok=True)
        train, val, val_bytes = _finish_split(
            all_path, out, dtype, total_tokens, config.val_fraction, tokenizer.token_byte_lengths()
        )
    finally:
        all_path.unlink(missing_ok=True)
    tokenizer.save(out)
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
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 3),
    }
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


# ---------------------------------------------------------------- supervised examples


def _example_formats(files: list[Path], errors: str) -> dict[Path, str | None]:
    """Each JSONL input's format, read from the keys of its first row (gptkit.finetune.examples)."""
    formats: dict[Path, str | None] = {}
    for path in files:
        if not _is_jsonl(path):
            continue
        formats[path] = None
        with open(path, "rb") as f:
            for record, where, _ in jsonl_records(path, f, errors):
                if record is not None:
                    formats[path] = row_format(record)
                    if formats[path] is None:
                        raise InputError(f"{where} has no string field \"text\" (nor is it a supervised example with "
                                         "\"messages\", \"prompt\" and \"completion\", or \"instruction\" and "
                                         "\"output\")")  # fmt: skip
                    break
    return formats


def _rows(files: list[Path], formats: dict[Path, str | None], errors: str,
          on_bytes: Callable[[int], Any] = lambda n: None) -> Iterator[tuple[Any, str, str]]:  # fmt: skip
    """(record, format, "file line N") for every non-blank row of the example files."""
    for path in files:
        fmt = formats.get(path)
        if fmt is None:
            continue
        with open(path, "rb") as f:
            for record, where, raw in jsonl_records(path, f, errors):
                on_bytes(len(raw))
                if record is not None:
                    yield _without_surrogates(record, where, errors), fmt, where


def _without_surrogates(value: Any, where: str, errors: str) -> Any:
    """value with any lone surrogate (a JSON escape UTF-8 cannot encode) replaced, or an error naming the row."""
    if isinstance(value, str):
        if not re.search("[\ud800-\udfff]", value):
            return value
        if errors == "strict":
            raise InputError(f"{where}: a string holds a lone surrogate, which UTF-8 cannot encode; fix the file or "
                             "pass --errors replace")  # fmt: skip
        return re.sub("[\ud800-\udfff]", "\ufffd", value)
    if isinstance(value, list):
        return [_without_surrogates(v, where, errors) for v in value]
    if isinstance(value, dict):
        return {k: _without_surrogates(v, where, errors) for k, v in value.items()}
    return value


def _example_tokenizer(config: PrepareConfig, rows: Callable[[], Iterable[tuple[Any, str, str]]],
                       progress: bool) -> tuple[Tokenizer, ChatTemplate]:  # fmt: skip
    """The tokenizer and chat template of a supervised data set: a directory's own, or a new one with the default
    template (char and bpe are trained on the rendered examples)."""
    name = config.tokenizer
    if name not in KINDS:
        tokenizer = _train_pass(name, config, _Reader([], config.errors), progress, 0)
        return tokenizer, load_chat_template(name, eos_text(tokenizer))
    if name == "byte":
        return ByteTokenizer(), ChatTemplate(eos_token=EOT)
    template = ChatTemplate(eos_token=EOT)
    plain = ExampleEncoder(ByteTokenizer(), template, "all")  # renders each row as the real encoder will

    def texts() -> Iterator[str]:
        for record, fmt, where in rows():
            yield plain.tokenizer.decode(plain.encode(record, fmt, where).ids.tolist()).replace(EOT, "")

    if name == "char":
        return CharTokenizer.train(texts(), [EOT]), template
    return BPETokenizer.train(texts(), config.vocab_size), template


def _context_of(tokenizer_source: str) -> int | None:
    """The context length of the model directory a tokenizer came from, when it is one gptkit can read."""
    from gptkit.config import ModelConfig

    try:
        return ModelConfig.load(tokenizer_source).block_size
    except GptkitError:
        return None


EXAMPLES_TMP_PREFIX = ".examples."  # the temporary example files inside the output directory


def _prepare_examples(config: PrepareConfig, files: list[Path], formats: dict[Path, str | None], out: Path,
                      started: float, progress: bool) -> dict[str, Any]:  # fmt: skip
    """Encode supervised examples into train/val token, trained-token and offset files (see gptkit.data)."""
    plain = [str(p) for p in files if formats.get(p) is None]
    if plain:
        raise InputError(f"{plain[0]} is plain text, the other inputs supervised examples; prepare them separately "
                         "(or give the text as {\"text\": ...} JSONL rows)")  # fmt: skip
    tokenizer, template = _example_tokenizer(config, lambda: _rows(files, formats, config.errors), progress)
    encoder = ExampleEncoder(tokenizer, template, config.loss_on)  # type: ignore[arg-type]
    max_length = config.max_length or _context_of(config.tokenizer) or DEFAULT_MAX_LENGTH
    dtype = _token_dtype(tokenizer.vocab_size)

    for stale in out.glob(f"{EXAMPLES_TMP_PREFIX}*.tmp"):  # the files of a run killed before its cleanup
        stale.unlink(missing_ok=True)
    temporaries = [Path(tempfile.mkstemp(prefix=EXAMPLES_TMP_PREFIX, suffix=".tmp", dir=out)[1]) for _ in range(2)]
    offsets, targets = [0], []
    truncated = dropped = 0
    try:
        with open(temporaries[0], "wb") as ids_file, open(temporaries[1], "wb") as mask_file, \
                _progress_bar(sum(p.stat().st_size for p in files), "encoding", progress) as bar:  # fmt: skip
            for record, fmt, where in _rows(files, formats, config.errors, bar.update):
                example = encoder.encode(record, fmt, where)
                fitted = fit(example, max_length, config.overlong)  # type: ignore[arg-type]
                if fitted is None:
                    dropped += 1
                    continue
                truncated += fitted is not example
                ids_file.write(fitted.ids.astype(dtype).tobytes())
                mask_file.write(fitted.trained.astype(np.uint8).tobytes())
                offsets.append(offsets[-1] + len(fitted.ids))
                targets.append(fitted.targets)
        if len(offsets) == 1:
            raise InputError(f"no example fits --max-length {max_length} ({dropped} dropped); raise --max-length")
        val = _val_examples(len(targets), config.val_fraction)
        (out / "meta.json").unlink(missing_ok=True)  # the directory is incomplete until the new meta.json lands
        counts = _write_example_splits(temporaries, np.asarray(offsets, dtype=np.int64), val, out, dtype)
    finally:
        for path in temporaries:
            path.unlink(missing_ok=True)
    tokenizer.save(out)
    carried = Path(config.tokenizer) / TOKENIZER_CONFIG  # the chat template: training carries it into checkpoints
    if config.tokenizer not in KINDS and carried.is_file():
        atomic_write(out / TOKENIZER_CONFIG, lambda tmp: tmp.write_bytes(carried.read_bytes()))
    else:
        (out / TOKENIZER_CONFIG).unlink(missing_ok=True)
    split_targets = {"train": int(np.delete(np.asarray(targets), val).sum()), "val": int(np.asarray(targets)[val].sum())}
    meta = {
        "format": META_FORMAT,
        "format_version": META_VERSION,
        "kind": "examples",
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "train_tokens": counts["train"][0],
        "val_tokens": counts["val"][0],
        "train_examples": counts["train"][1],
        "val_examples": counts["val"][1],
        "train_targets": split_targets["train"],
        "val_targets": split_targets["val"],
        "tokenizer": tokenizer.kind,
        "eos_id": tokenizer.eos_id,
        "chat_template": template.source,
        "loss_on": config.loss_on,
        "max_length": max_length,
        "truncated": truncated,
        "dropped": dropped,
        "val_fraction": config.val_fraction,
        "errors": config.errors,
        "inputs": [{"path": str(p), "bytes": p.stat().st_size, "format": formats[p]} for p in files],
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 3),
    }
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _val_examples(count: int, val_fraction: float) -> np.ndarray:
    """Sorted indices of the examples kept for validation: round(count * val_fraction) of them (at least one when
    the fraction is above 0 and there are two examples), drawn with a fixed seed."""
    n_val = round(count * val_fraction)
    if val_fraction > 0 and n_val == 0 and count >= 2:
        n_val = 1
    n_val = min(n_val, count - 1)  # training needs one example
    return np.sort(np.random.default_rng(SPLIT_SEED).permutation(count)[:n_val])


def _copy_examples(source: np.ndarray, offsets: np.ndarray, chosen: np.ndarray, path: Path) -> None:
    """Write the chosen examples' slices of source (ids or mask) to path, back to back."""
    with open(path, "wb") as sink:
        for i in chosen:
            sink.write(source[offsets[i] : offsets[i + 1]].tobytes())


def _write_example_splits(temporaries: list[Path], offsets: np.ndarray, val: np.ndarray, out: Path,
                          dtype: str) -> dict[str, tuple[int, int]]:  # fmt: skip
    """Copy each split's examples from the temporary files into its token, mask and offset files (see
    gptkit.data.EXAMPLE_FILES); returns {split: (tokens, examples)}."""
    ids = np.memmap(temporaries[0], dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype=dtype)
    mask = np.memmap(temporaries[1], dtype=np.uint8, mode="r") if offsets[-1] else np.zeros(0, dtype=np.uint8)
    is_val = np.zeros(len(offsets) - 1, dtype=bool)
    is_val[val] = True
    counts = {}
    for split, chosen in (("train", np.flatnonzero(~is_val)), ("val", np.flatnonzero(is_val))):
        lengths = offsets[chosen + 1] - offsets[chosen]
        split_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for source, name in ((ids, EXAMPLE_FILES[split]["ids"]), (mask, EXAMPLE_FILES[split]["mask"])):
            atomic_write(out / name, functools.partial(_copy_examples, source, offsets, chosen))
        atomic_write(out / EXAMPLE_FILES[split]["offsets"], split_offsets.tofile)
        counts[split] = (int(split_offsets[-1]), len(chosen))
    fsync_dir(out)
    return counts
