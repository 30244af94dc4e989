"""One micro-batch, as every kind of data set hands it to an objective."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One micro-batch: inputs x, targets y (IGNORE_INDEX where nothing is trained), for packed rows the document
    each position belongs to, and for labelled texts each row's label and last real position.

    units counts what the batch's loss is a mean over (trained targets; preference pairs; labelled texts) and
    step_units those of every micro-batch of the same update across all ranks (None for text windows, where every
    micro-batch is full); tokens counts the input positions that are not padding."""

    x: torch.Tensor
    y: torch.Tensor
    document_ids: torch.Tensor | None = None
    units: int = 0
    step_units: int | None = None
    tokens: int = 0
    labels: torch.Tensor | None = None  # (B,) label indices
    last: torch.Tensor | None = None  # (B,) each row's last real position
    prompts: list[int] | None = None  # prompt data sets: the indices of the batch's prompts (they are sampled from)

    def to(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The batch with every tensor passed through move (a copy to a device)."""
        tensors = {k: None if v is None else move(v) for k, v in vars(self).items() if k in TENSOR_FIELDS}
        return dataclasses.replace(self, **tensors)


TENSOR_FIELDS = ("x", "y", "document_ids", "labels", "last")
