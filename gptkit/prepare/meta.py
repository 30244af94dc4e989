"""meta.json, the file that makes a data set complete: what every kind of data set records, written last."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gptkit.atomic import atomic_write_text
from gptkit.data import META_FILE, DataMeta
from gptkit.prepare.options import PrepareConfig
from gptkit.tokenizer import Tokenizer

META_FORMAT = "gptkit-data"
META_VERSION = 1


def write_meta(
    stage: Path, own: dict[str, Any], tokenizer: Tokenizer, dtype: str, config: PrepareConfig, started: float
) -> DataMeta:
    """Write stage's meta.json: the fields every data set has, its kind's own fields (own), the options it was made
    with and the list of its files; returns it as readers will see it (DataMeta checks it before it is written)."""
    meta = {
        "format": META_FORMAT,
        "format_version": META_VERSION,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "tokenizer": tokenizer.kind,
        "eos_id": tokenizer.eos_id,
        **own,
        "val_fraction": config.val_fraction,
        "errors": config.errors,
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 3),
    }
    meta["files"] = sorted([*os.listdir(stage), META_FILE])
    typed = DataMeta.from_dict(meta, stage / META_FILE)
    atomic_write_text(stage / META_FILE, json.dumps(meta, indent=2) + "\n")
    return typed
