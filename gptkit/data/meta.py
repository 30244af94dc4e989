"""A prepared data directory's meta.json, the file that makes it complete (written last by `gptkit prepare`), and
the names of the files it describes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.data_kinds import DATA_KINDS, EXAMPLE_KINDS, PROMPTS, DataKind
from gptkit.errors import GptkitError

META_FILE = "meta.json"


TOKEN_DTYPES = ("uint16", "uint32")


SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}


# A data set of supervised examples (meta.json "kind": "examples") adds, per split, which tokens are trained on
# (uint8, 1 = the loss trains the model to predict this token) and where each example starts (int64, one offset
# per example into the token file, then the total). Preference pairs ("preferences") are stored the same way, each
# pair's chosen example then its rejected one; labelled texts ("labelled") add each example's label (int64, an
# index into meta.json's "labels").
EXAMPLE_FILES = {
    split: {
        "ids": name,
        "mask": name.replace(".bin", ".mask.bin"),
        "offsets": name.replace(".bin", ".offsets.bin"),
        "labels": name.replace(".bin", ".labels.bin"),
    }
    for split, name in SPLIT_FILES.items()
}


# A data set of prompts ("kind": "prompts", what reinforcement learning samples completions of) stores each prompt's
# token ids as examples are stored (its mask all zeros: nothing in a prompt is trained on), and per split one JSON
# line per prompt: {"text": the prompt as the model sees it, "row": the input row, every field kept}, what the
# reward functions receive (gptkit.finetune.rewards).
PROMPT_KIND = PROMPTS.name


PROMPT_FILES = {
    split: {key: files[key] for key in ("ids", "mask", "offsets")}
    | {"rows": SPLIT_FILES[split].replace(".bin", ".prompts.jsonl")}
    for split, files in EXAMPLE_FILES.items()
}


@dataclass(frozen=True)
class DataMeta:
    """What a data set's meta.json says, typed: `gptkit prepare` builds one before it writes the file, and every reader
    takes this rather than the raw JSON. Fields a kind of data set does not have (or an older prepare did not
    write) are None; `raw` keeps the file's whole object, keys of a newer gptkit included."""

    vocab_size: int
    dtype: str  # the token files' element type, one of TOKEN_DTYPES
    train_tokens: int
    val_tokens: int
    kind: str = "text"  # a name of gptkit.data_kinds.DATA_KINDS
    format: str | None = None
    format_version: int | None = None
    tokenizer: str | None = None  # the tokenizer's kind (char, byte, bpe, hf, ...)
    eos_id: int | None = None
    # text data sets
    train_bytes: int | None = None
    val_bytes: int | None = None
    separator: str | None = None  # the text between documents, when there are several
    documents: int | None = None
    forced_cuts: int | None = None
    # example data sets
    train_examples: int | None = None
    val_examples: int | None = None
    train_targets: int | None = None
    val_targets: int | None = None
    labels: list[str] | None = None  # labelled texts: the label names, by index
    loss_on: str | None = None
    truncated: int | None = None
    # prompt data sets
    train_prompts: int | None = None
    val_prompts: int | None = None
    train_rows_bytes: int | None = None
    val_rows_bytes: int | None = None
    longest_prompt: int | None = None
    # example and prompt data sets
    chat_template: str | None = None
    max_length: int | None = None
    dropped: int | None = None
    # how it was made
    val_fraction: float | None = None
    errors: str | None = None
    inputs: list[dict[str, Any]] | None = None
    config: dict[str, Any] | None = None
    seconds: float | None = None
    files: list[str] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, meta: dict[str, Any], path: Path) -> DataMeta:
        """The typed view of a meta.json object, its counts and kind checked (path names it in errors)."""
        if not isinstance(meta, dict):
            raise GptkitError(f"{path} must hold a JSON object")
        for name in ("vocab_size", "train_tokens", "val_tokens"):
            _count(meta, name, path)
        if meta.get("dtype") not in TOKEN_DTYPES:
            raise GptkitError(
                f"{path}: field 'dtype' must be one of {', '.join(TOKEN_DTYPES)}, got {meta.get('dtype')!r}"
            )
        data_kind(meta, path)
        known = {f.name for f in fields(cls)} - {"raw"}
        return cls(**{k: v for k, v in meta.items() if k in known}, raw=dict(meta))


def read_meta(data_dir: str | Path) -> DataMeta:
    """The meta.json of a data directory, checked against the sizes of its files."""
    data_dir = Path(data_dir)
    path = data_dir / META_FILE
    if data_dir.is_file():  # e.g. DATA_DIR/val.bin: the directory is what is meant
        raise GptkitError(f"{data_dir} is a file; give the prepared data directory that holds it ({data_dir.parent})")
    if not data_dir.is_dir():
        raise GptkitError(f"data directory {data_dir} does not exist; create it with `gptkit prepare --out {data_dir}`")
    if not path.is_file():
        raise GptkitError(
            f"{data_dir} has no {META_FILE} (not a prepared data directory, or an interrupted prepare); "
            f"run `gptkit prepare --out {data_dir}`"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise GptkitError(f"cannot read {path}: {err}") from None
    meta = DataMeta.from_dict(raw, path)
    for name, size in _expected_sizes(meta, path).items():
        file = data_dir / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise GptkitError(
                f"{file} {found} but {META_FILE} promises {size} bytes; rerun `gptkit prepare --out {data_dir}`"
            )
    return meta


def _expected_sizes(meta: DataMeta, path: Path) -> dict[str, int]:
    """Each file of the data set and its size in bytes, as meta.json describes them."""
    itemsize = np.dtype(meta.dtype).itemsize
    expected = {SPLIT_FILES["train"]: meta.train_tokens * itemsize, SPLIT_FILES["val"]: meta.val_tokens * itemsize}
    kind = DATA_KINDS[meta.kind]
    if not (kind.examples or kind is PROMPTS):
        return expected
    unit = "prompts" if kind is PROMPTS else "examples"
    for split, files in EXAMPLE_FILES.items():
        count = _count(meta.raw, f"{split}_{unit}", path)
        if count % kind.items_of:
            raise GptkitError(
                f"{path}: '{split}_examples' must be a multiple of {kind.items_of} in a data set of {kind.noun}"
            )
        expected[files["mask"]] = meta.train_tokens if split == "train" else meta.val_tokens
        expected[files["offsets"]] = (count + 1) * 8
        if kind.labels:
            expected[files["labels"]] = count * 8
        if kind is PROMPTS:
            expected[PROMPT_FILES[split]["rows"]] = _count(meta.raw, f"{split}_rows_bytes", path)
    labels = meta.labels
    least = max(kind.min_labels, 1)
    if kind.labels and not (
        isinstance(labels, list) and len(labels) >= least and all(isinstance(label, str) for label in labels)
    ):
        raise GptkitError(f"{path}: field 'labels' must list at least {least} label string(s), got {labels!r}")
    return expected


def _count(meta: dict[str, Any], field: str, path: Path) -> int:
    """meta[field], checked to be a non-negative integer."""
    count = meta.get(field)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise GptkitError(f"{path}: field '{field}' must be a non-negative integer, got {count!r}")
    return count


def data_kind(meta: dict[str, Any], path: Path) -> DataKind:
    """The kind of data set meta.json says (text when it says none); an unknown kind is a one-line error."""
    name = meta.get("kind", "text")
    if name not in DATA_KINDS:
        raise GptkitError(
            f"{path}: unknown data kind {name!r} (kinds: {', '.join(DATA_KINDS)}); it was written by a "
            "newer gptkit, or damaged: rerun gptkit prepare"
        )
    return DATA_KINDS[name]


def is_examples(meta: DataMeta) -> bool:
    """Whether a data set holds examples (supervised, preference pairs or labelled) rather than a token stream."""
    return meta.kind in EXAMPLE_KINDS
