"""Example data sets (supervised examples, preference pairs, labelled or unpaired texts): a split's examples and
their padded or packed batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.data.batch import Batch
from gptkit.data.meta import EXAMPLE_FILES, DataMeta
from gptkit.data.tokens import load_tokens, map_array, stream_position
from gptkit.data_kinds import DATA_KINDS
from gptkit.errors import GptkitError, InputError
from gptkit.loss import IGNORE_INDEX


@dataclass
class Examples:
    """One split of an example data set: every example's tokens back to back, its trained tokens, its offsets,
    and what kind of set it is (gptkit.data.EXAMPLE_KINDS; labelled sets carry each example's label)."""

    ids: np.ndarray
    trained: np.ndarray  # uint8, 1 where the token is a trained target
    offsets: np.ndarray  # int64, len(examples) + 1
    kind: str = "examples"
    labels: np.ndarray | None = None  # int64 per example, labelled sets only

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def rows_per_item(self) -> int:
        """Examples per item a batch draws: two for a preference pair (chosen, rejected), else one."""
        return DATA_KINDS[self.kind].items_of

    def items(self) -> int:
        """How many items (examples, or preference pairs) the split holds."""
        return len(self) // self.rows_per_item

    def item_rows(self, item: int) -> list[list[int]]:
        """The batch rows (lists of example indices) of one item."""
        first = item * self.rows_per_item
        return [[first + k] for k in range(self.rows_per_item)]

    def lengths(self) -> np.ndarray:
        """Tokens per example."""
        return np.diff(self.offsets)

    def targets(self) -> np.ndarray:
        """Trained targets per example (an example's first token has no context, so it is never one)."""
        starts, ends = self.offsets[:-1] + 1, self.offsets[1:]
        bounds = np.stack([np.minimum(starts, ends), ends], axis=1).reshape(-1)  # [s0, e0, s1, e1, ...]
        padded = np.concatenate([self.trained, np.zeros(1, dtype=np.uint8)])  # reduceat needs every index < len
        sums = np.add.reduceat(padded, bounds, dtype=np.int64)[::2]  # sums over [s_i, e_i)
        return np.where(starts < ends, sums, 0)

    def units(self) -> np.ndarray:
        """What each item adds to the count a loss is a mean over: its trained targets; one per pair or text."""
        return self.targets() if DATA_KINDS[self.kind].per_token else np.ones(self.items(), dtype=np.int64)

    def positions(self) -> np.ndarray:
        """Input positions per example: a labelled text reads all its tokens (its class is read at the last)."""
        return self.lengths() - (not DATA_KINDS[self.kind].whole_input)


def load_examples(data_dir: str | Path, split: str, meta: DataMeta) -> Examples:
    """The memory-mapped examples of a split of a data set read_meta has checked."""
    files = EXAMPLE_FILES[split]
    data_dir = Path(data_dir)
    ids = load_tokens(data_dir / files["ids"], meta.dtype)
    trained = map_array(data_dir / files["mask"], "uint8")
    offsets = np.fromfile(data_dir / files["offsets"], dtype=np.int64)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
        raise GptkitError(f"{data_dir / files['offsets']} does not describe {split}'s examples; rerun gptkit prepare")
    labels = None
    if DATA_KINDS[meta.kind].labels:
        labels = np.fromfile(data_dir / files["labels"], dtype=np.int64)
        if len(labels) and (labels.min() < 0 or labels.max() >= len(meta.labels)):
            raise GptkitError(
                f"{data_dir / files['labels']} holds a label outside meta.json's labels; rerun gptkit prepare"
            )
    return Examples(ids, trained, offsets, meta.kind, labels)


def example_rows(examples: Examples, rows: list[list[int]], block_size: int, packed: bool) -> Batch:
    """The batch of rows of example indices: each example's inputs and targets side by side, right-padded (padding
    predicts nothing; packed rows give it a document id of its own). A labelled text's inputs are all its tokens,
    and each row's label and last real position come with it."""
    whole = DATA_KINDS[examples.kind].whole_input
    width = max(sum(int(examples.offsets[i + 1] - examples.offsets[i]) - (not whole) for i in row) for row in rows)
    width = block_size if packed else min(block_size, -(-width // PAD_MULTIPLE) * PAD_MULTIPLE)
    x = np.zeros((len(rows), width), dtype=np.int64)
    y = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    docs = np.full((len(rows), width), -1, dtype=np.int64)
    last = np.zeros(len(rows), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            a, b = examples.offsets[i], examples.offsets[i + 1]
            n = b - a - (not whole)
            x[r, at : at + n] = examples.ids[a : a + n]
            targets = examples.ids[a + 1 : b].astype(np.int64)
            y[r, at : at + b - a - 1] = np.where(examples.trained[a + 1 : b] != 0, targets, IGNORE_INDEX)
            docs[r, at : at + n] = d
            at += n
        last[r] = at - 1
    labelled = examples.labels is not None
    return Batch(
        torch.from_numpy(x),
        torch.from_numpy(y),
        torch.from_numpy(docs) if packed else None,
        labels=torch.from_numpy(examples.labels[[row[0] for row in rows]]) if labelled else None,
        last=torch.from_numpy(last) if labelled else None,
    )


# Padded batches are as wide as their longest example, rounded up to this: fewer distinct shapes for a compiled
# model to see, at the cost of a few padding positions.
PAD_MULTIPLE = 8


class ExampleBatches:
    """Training batches of whole examples, padded or packed, deterministic in (seed, batch number).

    Epoch e visits every item (an example, or a preference pair) once, in an order drawn from a Philox generator
    keyed by the seed with its counter set to e. Each item gives its rows (padded; a pair's chosen then rejected
    example), or supervised examples are packed in that order into rows of block_size positions (next fit: an
    example that does not fit the current row starts the next one). Batch k is items k * batch_size ... of that
    endless stream, so the state is just k, as for TrainBatches. group is how many consecutive batches make one
    update (grad_accum x processes): each batch says how many units its whole update has, for a loss that is the
    mean over the update's trained tokens (or pairs, or texts).
    """

    def __init__(
        self, examples: Examples, block_size: int, batch_size: int, seed: int, packed: bool, group: int = 1
    ) -> None:
        if examples.items() == 0:
            raise InputError("the data set has no examples to train on")
        if packed and not DATA_KINDS[examples.kind].packable:
            raise InputError(f"packing applies to supervised examples, not {examples.kind}; set finetune.packing false")
        self.positions = examples.positions()
        longest, next_token = int(self.positions.max()), not DATA_KINDS[examples.kind].whole_input
        if longest > block_size:
            raise InputError(
                f"an example of {longest + next_token} tokens does not fit the model's block_size {block_size}; "
                f"prepare the data again with --max-length {block_size + next_token}"
            )
        self.examples, self.block_size, self.batch_size = examples, block_size, batch_size
        self.packed, self.group = packed, group
        self.units = examples.units()
        self.seed = int(seed)
        self.step = 0
        self._epochs: dict[int, list[list[int]]] = {}  # items of recent epochs (for packed rows, their examples)
        self._epoch_starts = [0]  # first global item of each epoch computed so far
        self._update = (-1, 0)  # (first batch of an update, its units) last computed

    def _items_of(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            key = np.random.SeedSequence([self.seed, 1]).generate_state(2, dtype=np.uint64)
            order = np.random.Generator(np.random.Philox(key=key, counter=[0, 0, 0, epoch])).permutation(
                self.examples.items()
            )
            self._epochs = {e: items for e, items in self._epochs.items() if e >= epoch - 1}  # memory stays bounded
            self._epochs[epoch] = self._pack(order) if self.packed else [[int(i)] for i in order]
        return self._epochs[epoch]

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        rows, row, used = [], [], 0
        for i in order.tolist():
            if row and used + self.positions[i] > self.block_size:
                rows.append(row)
                row, used = [], 0
            row.append(i)
            used += int(self.positions[i])
        return rows + [row]

    def _items(self, first: int, count: int) -> list[list[int]]:
        """Items first ... first + count - 1 of the endless stream (a packed row is one item)."""
        while self._epoch_starts[-1] <= first + count:  # learn where each epoch starts, as far as needed
            epoch = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + len(self._items_of(epoch)))
        out = []
        for g in range(first, first + count):
            epoch = int(np.searchsorted(self._epoch_starts, g, side="right")) - 1
            out.append(self._items_of(epoch)[g - self._epoch_starts[epoch]])
        return out

    def _count(self, batch: int) -> int:
        return sum(int(self.units[item].sum()) for item in self._items(batch * self.batch_size, self.batch_size))

    def next_batch(self) -> Batch:
        """The next micro-batch."""
        k = self.step
        self.step += 1
        items = self._items(k * self.batch_size, self.batch_size)
        rows = items if self.packed else [row for (item,) in items for row in self.examples.item_rows(item)]
        batch = example_rows(self.examples, rows, self.block_size, self.packed)
        first = k - k % self.group
        if self._update[0] != first:  # the update's count, once per update rather than once per micro-batch
            self._update = (first, sum(self._count(b) for b in range(first, first + self.group)))
        positions = sum(int(self.positions[row].sum()) for row in rows)
        return dataclasses.replace(
            batch,
            units=sum(int(self.units[item].sum()) for item in items),
            step_units=self._update[1],
            tokens=positions,
        )

    def state_dict(self) -> dict[str, int]:
        """The position in the batch stream (JSON-able)."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        seed, step = stream_position(state, "ExampleBatches")
        if seed != self.seed:
            self.seed, self._epochs, self._epoch_starts, self._update = seed, {}, [0], (-1, 0)
        self.step = step


def example_batches(
    examples: Examples, block_size: int, batch_size: int, limit: int | None = None, order: np.ndarray | None = None
) -> Iterator[Batch]:
    """Padded batches over the first `limit` items of a split (in `order`, default as stored): evaluation."""
    chosen = np.arange(examples.items()) if order is None else order
    chosen = chosen[:limit] if limit is not None else chosen
    units = examples.units()
    for start in range(0, len(chosen), batch_size):
        items = [int(i) for i in chosen[start : start + batch_size]]
        batch = example_rows(examples, [row for i in items for row in examples.item_rows(i)], block_size, False)
        yield dataclasses.replace(batch, units=int(units[items].sum()))
