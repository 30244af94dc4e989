"""A run's data: a prepared directory's splits as the run reads them, and its batches moved to the device a step
ahead."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gptkit.data.batch import Batch
from gptkit.data.examples import load_examples
from gptkit.data.meta import PROMPT_KIND, SPLIT_FILES, DataMeta, read_meta
from gptkit.data.prompts import load_prompts
from gptkit.data.tokens import load_tokens
from gptkit.data_kinds import DATA_KINDS
from gptkit.errors import ConfigError
from gptkit.tokenizer import Tokenizer, tokenizer_or_none


@dataclass
class RunData:
    """A prepared data directory as a run reads it: its splits are token arrays (text), Examples or Prompts."""

    directory: str
    meta: DataMeta
    kind: str  # "text", one of EXAMPLE_KINDS, or PROMPT_KIND
    train: Any
    val: Any
    tokenizer: Tokenizer | None  # the data's own tokenizer, None when it was saved without one


def load_run_data(data_dir: str | None) -> RunData:
    """The splits of a prepared data directory, memory-mapped; errors name what is missing."""
    if data_dir is None:
        raise ConfigError("no data: pass --data DIR (a directory made by `gptkit prepare`) or set train.data_dir")
    meta = read_meta(data_dir)
    kind = meta.kind
    if DATA_KINDS[kind].examples:
        train, val = load_examples(data_dir, "train", meta), load_examples(data_dir, "val", meta)
    elif kind == PROMPT_KIND:
        train, val = load_prompts(data_dir, "train", meta), load_prompts(data_dir, "val", meta)
    else:
        train = load_tokens(Path(data_dir) / SPLIT_FILES["train"], meta.dtype)
        val = load_tokens(Path(data_dir) / SPLIT_FILES["val"], meta.dtype)
    return RunData(str(data_dir), meta, kind, train, val, tokenizer_or_none(data_dir))


class Batches:
    """Training batches moved to the device one step ahead, with the loader state that reproduces the next one."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self._pending = self._fetch()

    def _fetch(self) -> tuple[dict[str, Any], Batch]:
        state = self.loader.state_dict()
        batch = self.loader.next_batch()
        if isinstance(batch, tuple):  # a text window (TrainBatches): every target trains
            batch = Batch(*batch, units=batch[0].numel(), tokens=batch[0].numel())
        if self.device.type != "cpu":
            batch = batch.to(lambda tensor: _to_device(tensor, self.device))
        return state, batch

    def next(self) -> Batch:
        """The next batch; the one after it is fetched at once, while the device works on this one."""
        _, batch = self._pending
        self._pending = self._fetch()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The loader state whose next batch is the next one this object hands out."""
        return self._pending[0]


def _to_device(tensor: Tensor, device: torch.device) -> Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)  # pinned host memory: the copy overlaps the step
