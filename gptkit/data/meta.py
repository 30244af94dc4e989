"""A prepared data directory's meta.json, the file that makes it complete (written last by `gptkit prepare`), and
the names of the files it describes."""

from __future__ import annotations

import json
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
EXAMPLE_FILES = {split: {"ids": name, "mask": name.replace(".bin", ".mask.bin"),
                         "offsets": name.replace(".bin", ".offsets.bin"), "labels": name.replace(".bin", ".labels.bin")}
                 for split, name in SPLIT_FILES.items()}  # fmt: skip


# A data set of prompts ("kind": "prompts", what reinforcement learning samples completions of) stores each prompt's
# token ids as examples are stored (its mask all zeros: nothing in a prompt is trained on), and per split one JSON
# line per prompt: {"text": the prompt as the model sees it, "row": the input row, every field kept}, what the
# reward functions receive (gptkit.finetune.rewards).
PROMPT_KIND = PROMPTS.name


PROMPT_FILES = {split: {key: files[key] for key in ("ids", "mask", "offsets")}
                | {"rows": SPLIT_FILES[split].replace(".bin", ".prompts.jsonl")}
                for split, files in EXAMPLE_FILES.items()}  # fmt: skip


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """The parsed meta.json of a data directory, checked against the sizes of train.bin and val.bin."""
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
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise GptkitError(f"cannot read {path}: {err}") from None
    if not isinstance(meta, dict):
        raise GptkitError(f"{path} must hold a JSON object")
    for field in ("vocab_size", "train_tokens", "val_tokens"):
        if not isinstance(meta.get(field), int) or isinstance(meta.get(field), bool) or meta[field] < 0:
            raise GptkitError(f"{path}: field {field!r} must be a non-negative integer, got {meta.get(field)!r}")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise GptkitError(f"{path}: field 'dtype' must be one of {', '.join(TOKEN_DTYPES)}, got {meta.get('dtype')!r}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    expected = {}
    for split, name in SPLIT_FILES.items():
        expected[name] = meta[f"{split}_tokens"] * itemsize
    kind = data_kind(meta, path)
    if kind.examples or kind is PROMPTS:
        unit = "prompts" if kind is PROMPTS else "examples"
        for split, files in EXAMPLE_FILES.items():
            count = _count(meta, f"{split}_{unit}", path)
            if count % kind.items_of:
                raise GptkitError(f"{path}: '{split}_examples' must be a multiple of {kind.items_of} in a data set of "
                                  f"{kind.noun}")  # fmt: skip
            expected[files["mask"]] = meta[f"{split}_tokens"]
            expected[files["offsets"]] = (count + 1) * 8
            if kind.labels:
                expected[files["labels"]] = count * 8
            if kind is PROMPTS:
                expected[PROMPT_FILES[split]["rows"]] = _count(meta, f"{split}_rows_bytes", path)
        labels = meta.get("labels")
        least = max(kind.min_labels, 1)
        if kind.labels and not (isinstance(labels, list) and len(labels) >= least
                                and all(isinstance(label, str) for label in labels)):  # fmt: skip
            raise GptkitError(f"{path}: field 'labels' must list at least {least} label string(s), got {labels!r}")
    for name, size in expected.items():
        file = data_dir / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise GptkitError(
                f"{file} {found} but {META_FILE} promises {size} bytes; rerun `gptkit prepare --out {data_dir}`"
            )
    return meta


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
        raise GptkitError(f"{path}: unknown data kind {name!r} (kinds: {', '.join(DATA_KINDS)}); it was written by a "
                          "newer gptkit, or damaged: rerun gptkit prepare")  # fmt: skip
    return DATA_KINDS[name]


def is_examples(meta: dict[str, Any]) -> bool:
    """Whether a data set holds examples (supervised, preference pairs or labelled) rather than a token stream."""
    return meta.get("kind") in EXAMPLE_KINDS
