"""Reading a prepared data directory: meta.json, memory-mapped token files, and training/evaluation batches.

A data directory (written by `gptkit prepare`, see gptkit.prepare) holds train.bin and val.bin (flat arrays of
token ids, uint16 or uint32), the tokenizer's files, and meta.json, written last: a directory without meta.json
is incomplete.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gptkit.data_kinds import DATA_KINDS, EXAMPLE_KINDS, PROMPTS, DataKind
from gptkit.errors import ConfigError, GptkitError, InputError
from gptkit.loss import IGNORE_INDEX

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


def load_tokens(path: str | Path, dtype: str) -> np.memmap:
    """A read-only memory map of a token file (an empty file gives an empty read-only array)."""
    if dtype not in TOKEN_DTYPES:
        raise GptkitError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    return _map(Path(path), dtype)


def _map(path: Path, dtype: str) -> np.memmap:
    """A read-only memory map of a flat array file, checked to hold whole elements."""
    if not path.is_file():
        raise GptkitError(f"token file {path} does not exist")
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise GptkitError(f"{path} has {size} bytes, not a whole number of {dtype} tokens (truncated?)")
    if size == 0:  # numpy cannot map an empty file
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty  # type: ignore[return-value]
    return np.memmap(path, dtype=dtype, mode="r")


def _check_length(tokens: np.ndarray, block_size: int, batch_size: int) -> None:
    if block_size < 1 or batch_size < 1:
        raise InputError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
    if tokens.ndim != 1:
        raise InputError(f"token data must be one-dimensional, got shape {tuple(tokens.shape)}")
    if len(tokens) < block_size + 1:
        raise InputError(
            f"the data has {len(tokens)} tokens but one window needs block_size + 1 = {block_size + 1}; "
            "use a smaller block size or more text"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors for the windows tokens[s : s + block_size + 1], s in starts."""
    rows = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)
    windows = torch.from_numpy(rows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class TrainBatches:
    """Random contiguous training windows, deterministic in (seed, rank, batch number) and resumable.

    Batch k of a rank is drawn from a Philox counter-based generator keyed by (seed, rank) with its counter set
    to k, so the state is just k: restoring it reproduces exactly the batches an uninterrupted run would draw.
    """

    def __init__(
        self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        _check_length(tokens, block_size, batch_size)
        if not 0 <= rank < world_size:
            raise InputError(f"rank must be in 0..world_size-1, got rank {rank} of world_size {world_size}")
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.step = 0

    @property
    def seed(self) -> int:
        """The seed the batch stream is drawn from."""
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = int(value)
        # One 128-bit Philox key per (seed, rank); SeedSequence mixes them so nearby seeds give unrelated streams.
        self._key = np.random.SeedSequence([self._seed, self.rank]).generate_state(2, dtype=np.uint64)

    def _starts(self, step: int) -> np.ndarray:
        generator = np.random.Generator(np.random.Philox(key=self._key, counter=[0, 0, 0, step]))
        return generator.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y): int64 CPU tensors of shape (batch_size, block_size), y being x shifted by one."""
        starts = self._starts(self.step)
        self.step += 1
        return _windows(self.tokens, starts, self.block_size)

    def state_dict(self) -> dict[str, int]:
        """The position in the batch stream (JSON-able)."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (any rank's state: all ranks advance in lockstep)."""
        try:
            seed, step = int(state["seed"]), int(state["step"])
        except (KeyError, TypeError, ValueError):
            raise GptkitError(f"not a TrainBatches state (needs integer 'seed' and 'step'): {state!r}") from None
        if step < 0:
            raise GptkitError(f"TrainBatches state has a negative step {step}")
        self.seed = seed
        self.step = step


def sequential_batches(
    tokens: np.ndarray, block_size: int, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows in order over tokens, batch_size at a time (the last batch may be smaller)."""
    _check_length(tokens, block_size, batch_size)
    count = (len(tokens) - 1) // block_size
    for batch, first in enumerate(range(0, count, batch_size)):
        if max_batches is not None and batch >= max_batches:
            return
        starts = np.arange(first, min(first + batch_size, count)) * block_size
        yield _windows(tokens, starts, block_size)


# ---------------------------------------------------------------- supervised examples


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


def load_examples(data_dir: str | Path, split: str, meta: dict[str, Any]) -> Examples:
    """The memory-mapped examples of a split of a data set read_meta has checked."""
    files = EXAMPLE_FILES[split]
    data_dir = Path(data_dir)
    ids = load_tokens(data_dir / files["ids"], meta["dtype"])
    trained = _map(data_dir / files["mask"], "uint8")
    offsets = np.fromfile(data_dir / files["offsets"], dtype=np.int64)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
        raise GptkitError(f"{data_dir / files['offsets']} does not describe {split}'s examples; rerun gptkit prepare")
    labels = None
    if DATA_KINDS[meta["kind"]].labels:
        labels = np.fromfile(data_dir / files["labels"], dtype=np.int64)
        if len(labels) and (labels.min() < 0 or labels.max() >= len(meta["labels"])):
            raise GptkitError(f"{data_dir / files['labels']} holds a label outside meta.json's labels; rerun gptkit "
                              "prepare")  # fmt: skip
    return Examples(ids, trained, offsets, meta["kind"], labels)


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


def load_prompts(data_dir: str | Path, split: str, meta: dict[str, Any]) -> Prompts:
    """The prompts of a split of a prompt data set read_meta has checked (their ids memory-mapped)."""
    files = PROMPT_FILES[split]
    data_dir = Path(data_dir)
    ids = load_tokens(data_dir / files["ids"], meta["dtype"])
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
                if not (isinstance(item, dict) and isinstance(item.get("text"), str)
                        and isinstance(item.get("row"), dict)):  # fmt: skip
                    raise GptkitError(f"{path} line {n} is not a {{\"text\", \"row\"}} object; rerun gptkit prepare")
                texts.append(item["text"])
                rows.append(item["row"])
    except (OSError, UnicodeDecodeError) as err:
        raise GptkitError(f"cannot read {path}: {err}; rerun gptkit prepare") from None
    if len(rows) != len(offsets) - 1:
        raise GptkitError(f"{path} holds {len(rows)} prompts but {data_dir / files['offsets']} describes "
                          f"{len(offsets) - 1}; rerun gptkit prepare")  # fmt: skip
    return Prompts(ids, offsets, texts, rows)


def _example_rows(examples: Examples, rows: list[list[int]], block_size: int, packed: bool) -> Batch:
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
    return Batch(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(docs) if packed else None,
                 labels=torch.from_numpy(examples.labels[[row[0] for row in rows]]) if labelled else None,
                 last=torch.from_numpy(last) if labelled else None)  # fmt: skip


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

    def __init__(self, examples: Examples, block_size: int, batch_size: int, seed: int, packed: bool,
                 group: int = 1) -> None:  # fmt: skip
        if examples.items() == 0:
            raise InputError("the data set has no examples to train on")
        if packed and not DATA_KINDS[examples.kind].packable:
            raise InputError(f"packing applies to supervised examples, not {examples.kind}; set finetune.packing "
                             "false")  # fmt: skip
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
                self.examples.items())
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
        batch = _example_rows(self.examples, rows, self.block_size, self.packed)
        first = k - k % self.group
        if self._update[0] != first:  # the update's count, once per update rather than once per micro-batch
            self._update = (first, sum(self._count(b) for b in range(first, first + self.group)))
        positions = sum(int(self.positions[row].sum()) for row in rows)
        return dataclasses.replace(batch, units=sum(int(self.units[item].sum()) for item in items),
                                   step_units=self._update[1], tokens=positions)  # fmt: skip

    def state_dict(self) -> dict[str, int]:
        """The position in the batch stream (JSON-able)."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        try:
            seed, step = int(state["seed"]), int(state["step"])
        except (KeyError, TypeError, ValueError):
            raise GptkitError(f"not an ExampleBatches state (needs integer 'seed' and 'step'): {state!r}") from None
        if step < 0:
            raise GptkitError(f"ExampleBatches state has a negative step {step}")
        if seed != self.seed:
            self.seed, self._epochs, self._epoch_starts, self._update = seed, {}, [0], (-1, 0)
        self.step = step


def example_batches(examples: Examples, block_size: int, batch_size: int, limit: int | None = None,
                    order: np.ndarray | None = None) -> Iterator[Batch]:  # fmt: skip
    """Padded batches over the first `limit` items of a split (in `order`, default as stored): evaluation."""
    chosen = np.arange(examples.items()) if order is None else order
    chosen = chosen[:limit] if limit is not None else chosen
    units = examples.units()
    for start in range(0, len(chosen), batch_size):
        items = [int(i) for i in chosen[start : start + batch_size]]
        batch = _example_rows(examples, [row for i in items for row in examples.item_rows(i)], block_size, False)
        yield dataclasses.replace(batch, units=int(units[items].sum()))


# ---------------------------------------------------------------- a run's data


@dataclass
class RunData:
    """A prepared data directory as a run reads it: its splits are token arrays (text), Examples or Prompts."""

    directory: str
    meta: dict[str, Any]
    kind: str  # "text", one of EXAMPLE_KINDS, or PROMPT_KIND
    train: Any
    val: Any
    tokenizer: Any | None  # the data's own tokenizer, None when it was saved without one


def load_run_data(data_dir: str | None) -> RunData:
    """The splits of a prepared data directory, memory-mapped; errors name what is missing."""
    from gptkit.tokenizer import tokenizer_or_none

    if data_dir is None:
        raise ConfigError("no data: pass --data DIR (a directory made by `gptkit prepare`) or set train.data_dir")
    meta = read_meta(data_dir)
    kind = meta.get("kind", "text")
    if DATA_KINDS[kind].examples:
        train, val = load_examples(data_dir, "train", meta), load_examples(data_dir, "val", meta)
    elif kind == PROMPT_KIND:
        train, val = load_prompts(data_dir, "train", meta), load_prompts(data_dir, "val", meta)
    else:
        train = load_tokens(Path(data_dir) / SPLIT_FILES["train"], meta["dtype"])
        val = load_tokens(Path(data_dir) / SPLIT_FILES["val"], meta["dtype"])
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
