"""A supervised data set (instruction, chat, preference, labelled or unpaired rows): each row's examples as tokens,
trained-token masks and offsets per split (see gptkit.data.EXAMPLE_FILES)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.chat import TOKENIZER_CONFIG, ChatTemplate
from gptkit.data import EXAMPLE_FILES, DataMeta
from gptkit.data_kinds import DATA_KINDS, SUPERVISED
from gptkit.data_kinds import row_format as row_format_spec
from gptkit.errors import InputError
from gptkit.prepare.encoding import progress_bar, token_dtype, tokenizer_for
from gptkit.prepare.inputs import Reader, first_record, records
from gptkit.prepare.meta import write_meta
from gptkit.prepare.options import DEFAULT_MAX_LENGTH, SPLIT_SEED, PrepareConfig
from gptkit.prepare.readers import row_kind
from gptkit.prepare.rows import ExampleEncoder, fit, is_prompt_row, row_format
from gptkit.tokenizer import (
    EOT,
    KINDS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
)

logger = logging.getLogger(__name__)


def row_formats(files: list[Path], config: PrepareConfig) -> dict[Path, str | None]:
    """Each row file's format, told by the keys of its first row: "text" (its --text-field holds the text), a
    supervised one or "prompt" (gptkit.prepare.rows); plain text files are None."""
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
                raise InputError(
                    f'{where} has no string field "{config.text_field}" (nor is it a supervised example '
                    'with "messages", "prompt" and "completion", or "instruction" and '
                    f'"output"); its fields: {fields}; --text-field names the field that holds the '
                    "text"
                )
            fmt = "text"
        formats[path] = fmt
    return formats


def example_rows(
    files: list[Path], formats: dict[Path, str | None], errors: str, on_bytes: Callable[[int], Any] = lambda n: None
) -> Iterator[tuple[Any, str, str]]:
    """(record, format, "file line N") for every row of the example files."""
    for path in files:
        fmt = formats.get(path)
        if fmt is not None:
            for record, where in records(path, errors, on_bytes=on_bytes):
                yield record, fmt, where


def example_tokenizer(
    config: PrepareConfig, rows: Callable[[], Iterable[tuple[Any, str, str]]], progress: bool
) -> tuple[Tokenizer, ChatTemplate]:
    """The tokenizer and chat template of a supervised data set: a directory's own, or a new one with the default
    template (char and bpe are trained on the rendered examples)."""
    name = config.tokenizer
    if name not in KINDS:
        from gptkit.loading import chat_template  # every format's module: only a model's tokenizer needs it

        tokenizer = tokenizer_for(name, config, Reader([], config.errors), progress, 0)
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


def context_of(tokenizer_source: str) -> int | None:
    """The context length of the model a tokenizer came from (any format gptkit reads), else None."""
    from gptkit.loading import model_context  # every format's module: only an example set with a model's tokenizer

    return model_context(tokenizer_source)


def write_examples(
    stage: Path,
    config: PrepareConfig,
    files: list[Path],
    formats: dict[Path, str | None],
    started: float,
    progress: bool,
) -> DataMeta:
    """Encode supervised examples into stage's train/val token, trained-token and offset files (see gptkit.data)."""
    kind = example_kind(files, formats)
    spec = DATA_KINDS[kind]
    tokenizer, template = example_tokenizer(config, lambda: example_rows(files, formats, config.errors), progress)
    encoder = ExampleEncoder(tokenizer, template, config.loss_on)  # type: ignore[arg-type]
    max_length = config.max_length or context_of(config.tokenizer) or DEFAULT_MAX_LENGTH
    dtype = token_dtype(tokenizer.vocab_size)

    temporaries = [stage / ".ids.tmp", stage / ".mask.tmp"]  # all examples, before the split
    with progress_bar(sum(p.stat().st_size for p in files), "encoding", progress) as bar:
        rows = example_rows(files, formats, config.errors, bar.update)
        encoded = _encode_examples(rows, encoder, temporaries, max_length, config.overlong, not spec.whole_input, dtype)
    offsets, targets, labels = encoded.offsets, encoded.targets, encoded.labels
    if len(offsets) == 1:
        raise InputError(f"no example fits --max-length {max_length} ({encoded.dropped} dropped); raise --max-length")
    _warn_identical(encoded)
    label_names = list(spec.label_names) if spec.label_names is not None else sorted(set(labels))
    if len(set(labels)) < spec.min_labels:
        raise InputError(f"every {kind} row has the label {labels[0]!r}: a classifier needs at least two labels")
    per_item = spec.items_of
    val_items = val_examples(len(targets) // per_item, config.val_fraction)
    val = (val_items[:, None] * per_item + np.arange(per_item)).reshape(-1)
    label_ids = np.asarray([label_names.index(label) for label in labels], dtype=np.int64) if labels else None
    counts = write_example_splits(temporaries, np.asarray(offsets, dtype=np.int64), val, stage, dtype, label_ids)
    for path in temporaries:
        path.unlink()
    save_tokenizer(stage, config, tokenizer, template)
    split_targets = {
        "train": int(np.delete(np.asarray(targets), val).sum()),
        "val": int(np.asarray(targets)[val].sum()),
    }
    own = {
        "kind": kind,
        "train_tokens": counts["train"][0],
        "val_tokens": counts["val"][0],
        "train_examples": counts["train"][1],
        "val_examples": counts["val"][1],
        "train_targets": split_targets["train"],
        "val_targets": split_targets["val"],
        "chat_template": template.source,
        **({"labels": label_names} if spec.labels else {}),
        "loss_on": config.loss_on,
        "max_length": max_length,
        "truncated": encoded.truncated,
        "dropped": encoded.dropped,
        "inputs": [{"path": str(p), "bytes": p.stat().st_size, "format": formats[p]} for p in files],
    }
    return write_meta(stage, own, tokenizer, dtype, config, started)


@dataclass
class _Encoded:
    """What encoding the example rows into the temporary token and mask files found."""

    offsets: list[int] = field(default_factory=lambda: [0])  # where each example starts in the token file
    targets: list[int] = field(default_factory=list)  # each example's trained tokens
    labels: list[Any] = field(default_factory=list)  # each row's label (classification only)
    truncated: int = 0
    dropped: int = 0
    identical: int = 0  # preference pairs with the same reply twice
    first_identical: str = ""  # where the first of them is


def _encode_examples(
    rows: Iterable[tuple[Any, str, str]],
    encoder: ExampleEncoder,
    temporaries: list[Path],
    max_length: int,
    overlong: str,
    cut_input: bool,
    dtype: np.dtype,
) -> _Encoded:
    """Encode each row's examples into temporaries (tokens, trained-token mask), fitted to max_length."""
    found = _Encoded()
    with open(temporaries[0], "wb") as ids_file, open(temporaries[1], "wb") as mask_file:
        for record, fmt, where in rows:
            examples, label = encoder.encode_row(record, fmt, where)
            fitted = [fit(e, max_length, overlong, cut_input) for e in examples]  # type: ignore[arg-type]
            if any(e is None for e in fitted):  # a pair is kept or dropped whole
                found.dropped += 1
                continue
            found.truncated += any(f is not e for f, e in zip(fitted, examples))
            if fmt == "preference" and np.array_equal(examples[0].ids, examples[1].ids):
                found.identical += 1
                found.first_identical = found.first_identical or where
            for example in fitted:
                ids_file.write(example.ids.astype(dtype).tobytes())
                mask_file.write(example.trained.astype(np.uint8).tobytes())
                found.offsets.append(found.offsets[-1] + len(example.ids))
                found.targets.append(example.targets)
            if label is not None:
                found.labels.append(label)
    return found


def _warn_identical(encoded: _Encoded) -> None:
    """A warning for preference pairs whose chosen and rejected replies are the same."""
    if encoded.identical:  # kept (DPO's loss stays at log 2 on them), but most likely a mistake in the data
        logger.warning(
            "%d preference pair(s) have the same chosen and rejected reply, from which DPO learns nothing "
            "(the first at %s); fix or drop them",
            encoded.identical,
            encoded.first_identical,
        )


def save_tokenizer(stage: Path, config: PrepareConfig, tokenizer: Tokenizer, template: ChatTemplate) -> None:
    """Save the tokenizer and the chat template the rows were rendered with (training carries it into checkpoints)."""
    tokenizer.save(stage)
    carried = Path(config.tokenizer) / TOKENIZER_CONFIG
    if config.tokenizer not in KINDS and carried.is_file():
        shutil.copyfile(carried, stage / TOKENIZER_CONFIG)
    elif template.source is not None:  # a GGUF file's template, written where training looks for it
        config_json = {"chat_template": template.source, "eos_token": template.eos_token}
        write_synced(stage / TOKENIZER_CONFIG, [(json.dumps(config_json, indent=1) + "\n").encode()])


def example_kind(files: list[Path], formats: dict[Path, str | None]) -> str:
    """The kind of data set the row files make (as _data_kind); a plain text file among them is an error."""
    plain = [str(p) for p in files if formats.get(p) is None]
    if plain:
        raise InputError(
            f"{plain[0]} is plain text, the other inputs supervised examples or prompts; prepare them "
            'separately (or give the text as {"text": ...} JSONL rows)'
        )
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


def val_examples(count: int, val_fraction: float) -> np.ndarray:
    """Sorted indices of the examples kept for validation: round(count * val_fraction) of them (at least one when
    the fraction is above 0 and there are two examples), drawn with a fixed seed."""
    n_val = round(count * val_fraction)
    if val_fraction > 0 and n_val == 0 and count >= 2:
        n_val = 1
    n_val = min(n_val, count - 1)  # training needs one example
    return np.sort(np.random.default_rng(SPLIT_SEED).permutation(count)[:n_val])


def write_synced(path: Path, chunks: Iterable[bytes]) -> None:
    """Write the chunks to path, back to back, and fsync it (a staged file: the directory is swapped in later)."""
    with open(path, "wb") as sink:
        for chunk in chunks:
            sink.write(chunk)
        sink.flush()
        os.fsync(sink.fileno())


def write_example_splits(
    temporaries: list[Path], offsets: np.ndarray, val: np.ndarray, stage: Path, dtype: str, labels: np.ndarray | None
) -> dict[str, tuple[int, int]]:
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
            write_synced(stage / name, (source[offsets[i] : offsets[i + 1]].tobytes() for i in chosen))
        write_synced(stage / EXAMPLE_FILES[split]["offsets"], [split_offsets.tobytes()])
        if labels is not None:
            write_synced(stage / EXAMPLE_FILES[split]["labels"], [labels[chosen].tobytes()])
        counts[split] = (int(split_offsets[-1]), len(chosen))
    return counts
