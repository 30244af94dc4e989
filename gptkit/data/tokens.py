"""Token files: memory-mapped splits of a text data set, and the training windows drawn from them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.data.meta import TOKEN_DTYPES
from gptkit.errors import GptkitError, InputError


def load_tokens(path: str | Path, dtype: str) -> np.memmap:
    """A read-only memory map of a token file (an empty file gives an empty read-only array)."""
    if dtype not in TOKEN_DTYPES:
        raise GptkitError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    return map_array(Path(path), dtype)


def map_array(path: Path, dtype: str) -> np.memmap:
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


def check_length(tokens: np.ndarray, block_size: int, batch_size: int) -> None:
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


def stream_position(state: dict[str, Any], kind: str) -> tuple[int, int]:
    """(seed, step) of a batch stream's saved state (TrainBatches', ExampleBatches'); a one-line error naming kind
    where it is not one."""
    try:
        seed, step = int(state["seed"]), int(state["step"])
    except (KeyError, TypeError, ValueError):
        article = "an" if kind[0] in "AEIOU" else "a"
        raise GptkitError(f"not {article} {kind} state (needs integer 'seed' and 'step'): {state!r}") from None
    if step < 0:
        raise GptkitError(f"{kind} state has a negative step {step}")
    return seed, step


class TrainBatches:
    """Random contiguous training windows, deterministic in (seed, rank, batch number) and resumable.

    Batch k of a rank is drawn from a Philox counter-based generator keyed by (seed, rank) with its counter set
    to k, so the state is just k: restoring it reproduces exactly the batches an uninterrupted run would draw.
    """

    def __init__(
        self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        check_length(tokens, block_size, batch_size)
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
        self.seed, self.step = stream_position(state, "TrainBatches")


def sequential_batches(
    tokens: np.ndarray, block_size: int, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows in order over tokens, batch_size at a time (the last batch may be smaller)."""
    check_length(tokens, block_size, batch_size)
    count = (len(tokens) - 1) // block_size
    for batch, first in enumerate(range(0, count, batch_size)):
        if max_batches is not None and batch >= max_batches:
            return
        starts = np.arange(first, min(first + batch_size, count)) * block_size
        yield _windows(tokens, starts, block_size)
