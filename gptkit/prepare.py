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

from gptkit.atomic import atomic_write_text, building_dir, sweep_staging
from gptkit.chat import TOKENIZER_CONFIG, ChatTemplate
from gptkit.data import EXAMPLE_FILES, META_FILE, PROMPT_FILES, PROMPT_KIND, SPLIT_FILES
from gptkit.data_kinds import DATA_KINDS, SUPERVISED
from gptkit.data_kinds import row_format as row_format_spec
from gptkit.errors import InputError
from gptkit.formats.gguf import gguf_tokenizer, is_gguf_file
from gptkit.finetune.examples import ExampleEncoder, fit, is_prompt_row, row_format
from gptkit.inputs import READ_CHUNK, Piece, Reader, first_record, records, resolve_inputs, row_kind
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
    loss_on: str = field(
        default="completion",
        metadata=_flag("supervised examples: train on the replies and completions only (completion) or on every "
                       "token (all)") | {"choices": ["completion", "all"]},
    )  # fmt: skip
    max_length: int | None = field(
        default=None,
        metadata=_flag("supervised examples and prompts: the most tokens an example or prompt may have (default: "
                       f"the context of the model given as --tokenizer, else {DEFAULT_MAX_LENGTH}); a longer prompt "
                       "is dropped", "N"),
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
            return gguf_tokenizer(path) if is_gguf_file(path) else load_tokenizer(path)
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
DATA_FILES = {META_FILE, *SPLIT_FILES.values(), *(n for f in EXAMPLE_FILES.values() for n in f.values()),
              *(f["rows"] for f in PROMPT_FILES.values()), GPTKIT_FILE, HF_FILE, TOKENIZER_CONFIG}  # fmt: skip


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
        prefixes = tuple(f".{name}." for name in (*DATA_FILES, "tokens", "examples"))  # atomic_write's, and the streams'
        for path in out.glob(".*.tmp"):
            if path.is_file() and path.name.startswith(prefixes):
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

    formats = _example_formats(files, config)
    if any(fmt in SUPERVISED for fmt in formats.values()):
        write = _write_prompts if _example_kind(files, formats) == PROMPT_KIND else _write_examples
        return _publish(out, config.out, lambda stage: write(stage, config, files, formats, started, progress))
    reader = Reader(files, config.errors, config.text_field)
    tokenizer = _train_pass(config.tokenizer, config, reader, progress, total_input)
    if config.tokenizer == "bpe" and tokenizer.vocab_size < config.vocab_size:
        logger.warning("the corpus allowed only %d BPE tokens (asked for %d)", tokenizer.vocab_size, config.vocab_size)
    return _publish(out, config.out, lambda stage: _write_data_set(stage, files, reader, tokenizer, config, progress,
                                                                   total_input, started))  # fmt: skip


def _publish(out: Path, name: str, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Have write() build a data set in a staging directory (meta.json last), then swap it in for out's.

    A failed write (a full disk, say) leaves the previous data set untouched and is one line naming `name`."""
    with building_dir(name, META_FILE, _owned(out), what="data set") as stage:  # (name resolves to out)
        return write(stage)


def _write_meta(stage: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Write meta.json, the file that makes a data set complete, listing the data set's files."""
    meta["files"] = sorted([*os.listdir(stage), META_FILE])
    atomic_write_text(stage / META_FILE, json.dumps(meta, indent=2) + "\n")
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
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return _write_meta(stage, meta)


# ---------------------------------------------------------------- supervised examples


def _example_formats(files: list[Path], config: PrepareConfig) -> dict[Path, str | None]:
    """Each row file's format, told by the keys of its first row: "text" (its --text-field holds the text), a
    supervised one or "prompt" (gptkit.finetune.examples); plain text files are None."""
    formats: dict[Path, str | None] = {}
    for path in files:
        kind = row_kind(path)
        first = first_record(path, config.errors) if kind is not None else None
        if first is None:  # a text file, or rows without a row
            formats[path] = None if kind is None else "text"
            continue
        record, where = first
        # An explicit --text-field naming a field of the row asks for its text, even of a prompt row.
        asked = config.text_field != "text" and isinstance(record, dict) and config.text_field in record
        fmt = "prompt" if is_prompt_row(record) and not asked else row_format(record)
        if fmt not in SUPERVISED:
            if not (isinstance(record, dict) and isinstance(record.get(config.text_field), str)):
                fields = ", ".join(map(repr, list(record)[:10])) if isinstance(record, dict) else "none"
                raise InputError(f"{where} has no string field \"{config.text_field}\" (nor is it a supervised example "
                                 "with \"messages\", \"prompt\" and \"completion\", or \"instruction\" and "
                                 f"\"output\"); its fields: {fields}; --text-field names the field that holds the "
                                 "text")  # fmt: skip
            fmt = "text"
        formats[path] = fmt
    return formats


def _rows(files: list[Path], formats: dict[Path, str | None], errors: str,
          on_bytes: Callable[[int], Any] = lambda n: None) -> Iterator[tuple[Any, str, str]]:  # fmt: skip
    """(record, format, "file line N") for every row of the example files."""
    for path in files:
        fmt = formats.get(path)
        if fmt is not None:
            for record, where in records(path, errors, on_bytes=on_bytes):
                yield record, fmt, where


def _example_tokenizer(config: PrepareConfig, rows: Callable[[], Iterable[tuple[Any, str, str]]],
                       progress: bool) -> tuple[Tokenizer, ChatTemplate]:  # fmt: skip
    """The tokenizer and chat template of a supervised data set: a directory's own, or a new one with the default
    template (char and bpe are trained on the rendered examples)."""
    name = config.tokenizer
    if name not in KINDS:
        from gptkit.loading import chat_template  # every format's module: only a model's tokenizer needs it

        tokenizer = _train_pass(name, config, Reader([], config.errors), progress, 0)
        return tokenizer, chat_template(name, tokenizer)
    if name == "byte":
        return ByteTokenizer(), ChatTemplate(eos_token=EOT)
    template = ChatTemplate(eos_token=EOT)
    plain = ExampleEncoder(ByteTokenizer(), template, "all")  # renders each row as the real encoder will

    def texts() -> Iterator[str]:
        for record, fmt, where in rows():
            for example in plain.encode_row(record, fmt, where)[0]:
                yield plain.tokenizer.decode(example.ids.tolist()).replace(EOT, "")

    if name == "char":
        return CharTokenizer.train(texts(), [EOT]), template
    return BPETokenizer.train(texts(), config.vocab_size), template


def _context_of(tokenizer_source: str) -> int | None:
    """The context length of the model a tokenizer came from (any format gptkit reads), else None."""
    from gptkit.loading import model_context  # every format's module: only an example set with a model's tokenizer

    return model_context(tokenizer_source)


def _write_examples(stage: Path, config: PrepareConfig, files: list[Path], formats: dict[Path, str | None],
                    started: float, progress: bool) -> dict[str, Any]:  # fmt: skip
    """Encode supervised examples into stage's train/val token, trained-token and offset files (see gptkit.data)."""
    kind = _example_kind(files, formats)
    spec = DATA_KINDS[kind]
    tokenizer, template = _example_tokenizer(config, lambda: _rows(files, formats, config.errors), progress)
    encoder = ExampleEncoder(tokenizer, template, config.loss_on)  # type: ignore[arg-type]
    max_length = config.max_length or _context_of(config.tokenizer) or DEFAULT_MAX_LENGTH
    dtype = _token_dtype(tokenizer.vocab_size)

    temporaries = [stage / ".ids.tmp", stage / ".mask.tmp"]  # all examples, before the split
    offsets, targets, labels = [0], [], []
    truncated = dropped = identical = 0
    first_identical = ""  # where the first preference pair with the same reply twice is
    with open(temporaries[0], "wb") as ids_file, open(temporaries[1], "wb") as mask_file, \
            _progress_bar(sum(p.stat().st_size for p in files), "encoding", progress) as bar:  # fmt: skip
        for record, fmt, where in _rows(files, formats, config.errors, bar.update):
            examples, label = encoder.encode_row(record, fmt, where)
            fitted = [fit(e, max_length, config.overlong, not spec.whole_input)  # type: ignore[arg-type]
                      for e in examples]  # fmt: skip
            if any(e is None for e in fitted):  # a pair is kept or dropped whole
                dropped += 1
                continue
            truncated += any(f is not e for f, e in zip(fitted, examples))
            if fmt == "preference" and np.array_equal(examples[0].ids, examples[1].ids):
                identical += 1
                first_identical = first_identical or where
            for example in fitted:
                ids_file.write(example.ids.astype(dtype).tobytes())
                mask_file.write(example.trained.astype(np.uint8).tobytes())
                offsets.append(offsets[-1] + len(example.ids))
                targets.append(example.targets)
            if label is not None:
                labels.append(label)
    if len(offsets) == 1:
        raise InputError(f"no example fits --max-length {max_length} ({dropped} dropped); raise --max-length")
    if identical:  # kept (DPO's loss stays at log 2 on them), but most likely a mistake in the data
        logger.warning("%d preference pair(s) have the same chosen and rejected reply, from which DPO learns nothing "
                       "(the first at %s); fix or drop them", identical, first_identical)  # fmt: skip
    label_names = list(spec.label_names) if spec.label_names is not None else sorted(set(labels))
    if len(set(labels)) < spec.min_labels:
        raise InputError(f"every {kind} row has the label {labels[0]!r}: a classifier needs at least two labels")
    per_item = spec.items_of
    val_items = _val_examples(len(targets) // per_item, config.val_fraction)
    val = (val_items[:, None] * per_item + np.arange(per_item)).reshape(-1)
    label_ids = np.asarray([label_names.index(label) for label in labels], dtype=np.int64) if labels else None
    counts = _write_example_splits(temporaries, np.asarray(offsets, dtype=np.int64), val, stage, dtype, label_ids)
    for path in temporaries:
        path.unlink()
    _save_tokenizer(stage, config, tokenizer, template)
    split_targets = {"train": int(np.delete(np.asarray(targets), val).sum()), "val": int(np.asarray(targets)[val].sum())}
    meta = {
        "format": META_FORMAT,
        "format_version": META_VERSION,
        "kind": kind,
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
        **({"labels": label_names} if spec.labels else {}),
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
    return _write_meta(stage, meta)


def _save_tokenizer(stage: Path, config: PrepareConfig, tokenizer: Tokenizer, template: ChatTemplate) -> None:
    """Save the tokenizer and the chat template the rows were rendered with (training carries it into checkpoints)."""
    tokenizer.save(stage)
    carried = Path(config.tokenizer) / TOKENIZER_CONFIG
    if config.tokenizer not in KINDS and carried.is_file():
        shutil.copyfile(carried, stage / TOKENIZER_CONFIG)
    elif template.source is not None:  # a GGUF file's template, written where training looks for it
        config_json = {"chat_template": template.source, "eos_token": template.eos_token}
        _write_synced(stage / TOKENIZER_CONFIG, [(json.dumps(config_json, indent=1) + "\n").encode()])


# ---------------------------------------------------------------- prompts


def _write_prompts(stage: Path, config: PrepareConfig, files: list[Path], formats: dict[Path, str | None],
                   started: float, progress: bool) -> dict[str, Any]:  # fmt: skip
    """Encode prompt rows into stage: per split, the token, mask (all zeros) and offset files examples have, and
    the rows file, one {"text", "row"} JSON line per prompt (see gptkit.data.PROMPT_FILES)."""
    tokenizer, template = _example_tokenizer(config, lambda: _rows(files, formats, config.errors), progress)
    encoder = ExampleEncoder(tokenizer, template)
    max_length = config.max_length or _context_of(config.tokenizer) or DEFAULT_MAX_LENGTH
    dtype = _token_dtype(tokenizer.vocab_size)
    temporaries = [stage / ".ids.tmp", stage / ".mask.tmp", stage / ".rows.tmp"]  # all prompts, before the split
    offsets = [0]
    dropped, first_dropped = 0, ""
    with open(temporaries[0], "wb") as ids_file, open(temporaries[1], "wb") as mask_file, \
            open(temporaries[2], "wb") as rows_file, \
            _progress_bar(sum(p.stat().st_size for p in files), "encoding", progress) as bar:  # fmt: skip
        for record, _, where in _rows(files, formats, config.errors, bar.update):
            text, ids = encoder.encode_prompt(record, where)
            if len(ids) > max_length:  # dropped, never cut: a cut prompt asks another question
                dropped += 1
                first_dropped = first_dropped or where
                continue
            ids_file.write(ids.astype(dtype).tobytes())
            mask_file.write(bytes(len(ids)))
            rows_file.write(_prompt_line(text, record, where))
            offsets.append(offsets[-1] + len(ids))
    if len(offsets) == 1:
        raise InputError(f"no prompt fits --max-length {max_length} (all {dropped} are longer); raise --max-length")
    if dropped:
        logger.warning("%d prompt(s) longer than %d tokens were dropped, not cut (a cut prompt asks another question; "
                       "the first at %s); raise --max-length to keep them", dropped, max_length, first_dropped)
    val = _val_examples(len(offsets) - 1, config.val_fraction)
    counts = _write_example_splits(temporaries[:2], np.asarray(offsets, dtype=np.int64), val, stage, dtype, None)
    row_bytes = _write_prompt_rows(temporaries[2], val, stage)
    for path in temporaries:
        path.unlink()
    _save_tokenizer(stage, config, tokenizer, template)
    meta = {
        "format": META_FORMAT,
        "format_version": META_VERSION,
        "kind": PROMPT_KIND,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "train_tokens": counts["train"][0],
        "val_tokens": counts["val"][0],
        "train_prompts": counts["train"][1],
        "val_prompts": counts["val"][1],
        "train_rows_bytes": row_bytes["train"],
        "val_rows_bytes": row_bytes["val"],
        "longest_prompt": int(np.diff(offsets).max()),
        "tokenizer": tokenizer.kind,
        "eos_id": tokenizer.eos_id,
        "chat_template": template.source,
        "max_length": max_length,
        "dropped": dropped,
        "val_fraction": config.val_fraction,
        "errors": config.errors,
        "inputs": [{"path": str(p), "bytes": p.stat().st_size, "format": formats[p]} for p in files],
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return _write_meta(stage, meta)


def _prompt_line(text: str, record: Any, where: str) -> bytes:
    """A prompt's line of the rows file: its text as the model sees it and its input row, every field kept."""
    try:
        return (json.dumps({"text": text, "row": record}, ensure_ascii=False) + "\n").encode("utf-8")
    except (TypeError, ValueError) as err:  # a Parquet column of dates or bytes, say
        raise InputError(f"{where}: the row holds a value JSON cannot store ({err}); make that field a string or a "
                         "number") from None  # fmt: skip


def _write_prompt_rows(source: Path, val: np.ndarray, stage: Path) -> dict[str, int]:
    """Copy each prompt's line from source into its split's rows file in stage (fsynced before the swap); returns
    {split: bytes written}."""
    held_out = set(val.tolist())
    names = {split: stage / files["rows"] for split, files in PROMPT_FILES.items()}
    with open(source, "rb") as lines, open(names["train"], "wb") as train, open(names["val"], "wb") as held:
        for i, line in enumerate(lines):
            (held if i in held_out else train).write(line)
        for sink in (train, held):
            sink.flush()
            os.fsync(sink.fileno())
    return {split: path.stat().st_size for split, path in names.items()}


def _example_kind(files: list[Path], formats: dict[Path, str | None]) -> str:
    """The kind of data set the row files make (as _data_kind); a plain text file among them is an error."""
    plain = [str(p) for p in files if formats.get(p) is None]
    if plain:
        raise InputError(f"{plain[0]} is plain text, the other inputs supervised examples or prompts; prepare them "
                         "separately (or give the text as {\"text\": ...} JSONL rows)")  # fmt: skip
    return _data_kind(files, formats)


def _data_kind(files: list[Path], formats: dict[Path, str | None]) -> str:
    """The kind of data set the row files make together (gptkit.data.EXAMPLE_KINDS or PROMPT_KIND); mixed kinds are
    an error."""
    kinds = {path: row_format_spec(fmt).kind for path, fmt in formats.items() if fmt is not None}
    first = files[0]
    for path, kind in kinds.items():
        if kind != kinds[first]:
            raise InputError(f"{path} holds {kind} rows, {first} {kinds[first]} rows; prepare them separately")
    return kinds[first]


def _val_examples(count: int, val_fraction: float) -> np.ndarray:
    """Sorted indices of the examples kept for validation: round(count * val_fraction) of them (at least one when
    the fraction is above 0 and there are two examples), drawn with a fixed seed."""
    n_val = round(count * val_fraction)
    if val_fraction > 0 and n_val == 0 and count >= 2:
        n_val = 1
    n_val = min(n_val, count - 1)  # training needs one example
    return np.sort(np.random.default_rng(SPLIT_SEED).permutation(count)[:n_val])


def _write_synced(path: Path, chunks: Iterable[bytes]) -> None:
    """Write the chunks to path, back to back, and fsync it (a staged file: the directory is swapped in later)."""
    with open(path, "wb") as sink:
        for chunk in chunks:
            sink.write(chunk)
        sink.flush()
        os.fsync(sink.fileno())


def _write_example_splits(temporaries: list[Path], offsets: np.ndarray, val: np.ndarray, stage: Path, dtype: str,
                          labels: np.ndarray | None) -> dict[str, tuple[int, int]]:  # fmt: skip
    """Copy each split's examples from the temporary files into its token, mask and offset (and label) files in
    stage (see gptkit.data.EXAMPLE_FILES; fsynced before the swap); returns {split: (tokens, examples)}."""
    ids = np.memmap(temporaries[0], dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype=dtype)
    mask = np.memmap(temporaries[1], dtype=np.uint8, mode="r") if offsets[-1] else np.zeros(0, dtype=np.uint8)
    is_val = np.zeros(len(offsets) - 1, dtype=bool)
    is_val[val] = True
    counts = {}
    for split, chosen in (("train", np.flatnonzero(~is_val)), ("val", np.flatnonzero(is_val))):
        lengths = offsets[chosen + 1] - offsets[chosen]
        split_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for source, name in ((ids, EXAMPLE_FILES[split]["ids"]), (mask, EXAMPLE_FILES[split]["mask"])):
            _write_synced(stage / name, (source[offsets[i] : offsets[i + 1]].tobytes() for i in chosen))
        _write_synced(stage / EXAMPLE_FILES[split]["offsets"], [split_offsets.tobytes()])
        if labels is not None:
            _write_synced(stage / EXAMPLE_FILES[split]["labels"], [labels[chosen].tobytes()])
        counts[split] = (int(split_offsets[-1]), len(chosen))
    return counts
