"""A prompt data set (for RL): each prompt's tokens and its input row per split (see gptkit.data.PROMPT_FILES)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.data import PROMPT_FILES, PROMPT_KIND, DataMeta
from gptkit.errors import InputError
from gptkit.prepare.encoding import progress_bar, token_dtype
from gptkit.prepare.examples import (
    context_of,
    example_rows,
    example_tokenizer,
    save_tokenizer,
    val_examples,
    write_example_splits,
)
from gptkit.prepare.meta import write_meta
from gptkit.prepare.options import DEFAULT_MAX_LENGTH, PrepareConfig
from gptkit.prepare.rows import ExampleEncoder

logger = logging.getLogger(__name__)


def write_prompts(
    stage: Path,
    config: PrepareConfig,
    files: list[Path],
    formats: dict[Path, str | None],
    started: float,
    progress: bool,
) -> DataMeta:
    """Encode prompt rows into stage: per split, the token, mask (all zeros) and offset files examples have, and
    the rows file, one {"text", "row"} JSON line per prompt (see gptkit.data.PROMPT_FILES)."""
    tokenizer, template = example_tokenizer(config, lambda: example_rows(files, formats, config.errors), progress)
    encoder = ExampleEncoder(tokenizer, template)
    max_length = config.max_length or context_of(config.tokenizer) or DEFAULT_MAX_LENGTH
    dtype = token_dtype(tokenizer.vocab_size)
    temporaries = [stage / ".ids.tmp", stage / ".mask.tmp", stage / ".rows.tmp"]  # all prompts, before the split
    offsets = [0]
    dropped, first_dropped = 0, ""
    with (
        open(temporaries[0], "wb") as ids_file,
        open(temporaries[1], "wb") as mask_file,
        open(temporaries[2], "wb") as rows_file,
        progress_bar(sum(p.stat().st_size for p in files), "encoding", progress) as bar,
    ):
        for record, _, where in example_rows(files, formats, config.errors, bar.update):
            text, ids = encoder.encode_prompt(record, where)
            if len(ids) > max_length:  # dropped, never cut: a cut prompt asks another question
                dropped += 1
                first_dropped = first_dropped or where
                continue
            ids_file.write(ids.astype(dtype).tobytes())
            mask_file.write(bytes(len(ids)))
            rows_file.write(_prompt_line(text, record, where))
            offsets.append(offsets[-1] + len(ids))
    _report_dropped(len(offsets) - 1, dropped, max_length, first_dropped)
    val = val_examples(len(offsets) - 1, config.val_fraction)
    counts = write_example_splits(temporaries[:2], np.asarray(offsets, dtype=np.int64), val, stage, dtype, None)
    row_bytes = _write_prompt_rows(temporaries[2], val, stage)
    for path in temporaries:
        path.unlink()
    save_tokenizer(stage, config, tokenizer, template)
    own = {
        "kind": PROMPT_KIND,
        "train_tokens": counts["train"][0],
        "val_tokens": counts["val"][0],
        "train_prompts": counts["train"][1],
        "val_prompts": counts["val"][1],
        "train_rows_bytes": row_bytes["train"],
        "val_rows_bytes": row_bytes["val"],
        "longest_prompt": int(np.diff(offsets).max()),
        "chat_template": template.source,
        "max_length": max_length,
        "dropped": dropped,
        "inputs": [{"path": str(p), "bytes": p.stat().st_size, "format": formats[p]} for p in files],
    }
    return write_meta(stage, own, tokenizer, dtype, config, started)


def _report_dropped(kept: int, dropped: int, max_length: int, first_dropped: str) -> None:
    """An error when no prompt fits max_length; a warning naming the first one dropped when some do not."""
    if not kept:
        raise InputError(f"no prompt fits --max-length {max_length} (all {dropped} are longer); raise --max-length")
    if dropped:
        logger.warning(
            "%d prompt(s) longer than %d tokens were dropped, not cut (a cut prompt asks another question; "
            "the first at %s); raise --max-length to keep them",
            dropped,
            max_length,
            first_dropped,
        )


def _prompt_line(text: str, record: Any, where: str) -> bytes:
    """A prompt's line of the rows file: its text as the model sees it and its input row, every field kept."""
    try:
        return (json.dumps({"text": text, "row": record}, ensure_ascii=False) + "\n").encode("utf-8")
    except (TypeError, ValueError) as err:  # a Parquet column of dates or bytes, say
        raise InputError(
            f"{where}: the row holds a value JSON cannot store ({err}); make that field a string or a number"
        ) from None


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
