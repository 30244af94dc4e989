"""Prompt data sets (what reinforcement learning samples completions of): each prompt's ids, text and input row."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.data.meta import PROMPT_FILES, DataMeta
from gptkit.data.tokens import load_tokens
from gptkit.errors import GptkitError


@dataclass
class Prompts:
    """One split of a prompt data set: every prompt's token ids back to back, where each starts, and for each the
    text and the input row the reward functions receive."""

    ids: np.ndarray  # every prompt's token ids back to back
    offsets: np.ndarray  # int64, len(prompts) + 1
    texts: list[str]  # the prompt as the model sees it (the string, or the rendered conversation)
    rows: list[dict[str, Any]]  # each prompt's input row, every field kept (its "answer", say)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def prompt(self, i: int) -> list[int]:
        """The token ids of prompt i."""
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        return self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()


def load_prompts(data_dir: str | Path, split: str, meta: DataMeta) -> Prompts:
    """The prompts of a split of a prompt data set read_meta has checked (their ids memory-mapped)."""
    files = PROMPT_FILES[split]
    data_dir = Path(data_dir)
    ids = load_tokens(data_dir / files["ids"], meta.dtype)
    offsets = np.fromfile(data_dir / files["offsets"], dtype=np.int64)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
        raise GptkitError(f"{data_dir / files['offsets']} does not describe {split}'s prompts; rerun gptkit prepare")
    path = data_dir / files["rows"]
    texts, rows = [], []
    try:
        with open(path, encoding="utf-8") as lines:
            for n, line in enumerate(lines, start=1):
                try:
                    item = json.loads(line)
                except ValueError:
                    item = None
                if not (
                    isinstance(item, dict) and isinstance(item.get("text"), str) and isinstance(item.get("row"), dict)
                ):
                    raise GptkitError(f'{path} line {n} is not a {{"text", "row"}} object; rerun gptkit prepare')
                texts.append(item["text"])
                rows.append(item["row"])
    except (OSError, UnicodeDecodeError) as err:
        raise GptkitError(f"cannot read {path}: {err}; rerun gptkit prepare") from None
    if len(rows) != len(offsets) - 1:
        raise GptkitError(
            f"{path} holds {len(rows)} prompts but {data_dir / files['offsets']} describes "
            f"{len(offsets) - 1}; rerun gptkit prepare"
        )
    return Prompts(ids, offsets, texts, rows)
