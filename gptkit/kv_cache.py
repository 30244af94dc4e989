"""A preallocated key/value cache, written at explicit positions and passed into the model's forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gptkit.config import ModelConfig


@dataclass
class LayerKV:
    """One layer's cache tensors and where the current tokens start; its update writes, never advances."""

    keys: Tensor  # (B, n_kv_head, max_len, head_dim)
    values: Tensor
    start_pos: int | Tensor  # an int shared by every row, or a (B,) tensor of per-row positions

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store k, v (B, n_kv_head, T, head_dim) at their positions; return all keys, values and the mask.

        The mask is boolean (True = attend), broadcastable to (B, heads, T, S); None means plain causal
        attention over exactly the keys returned.
        """
        T = k.size(2)
        if isinstance(self.start_pos, int):
            end = self.start_pos + T
            self.keys[:, :, self.start_pos : end] = k
            self.values[:, :, self.start_pos : end] = v
            keys, values = self.keys[:, :, :end], self.values[:, :, :end]
            if self.start_pos == 0 or T == 1:
                return keys, values, None
            slots = torch.arange(end, device=k.device)
            query_pos = self.start_pos + torch.arange(T, device=k.device)
            return keys, values, slots[None, :] <= query_pos[:, None]  # (T, end)
        positions = self.start_pos[:, None] + torch.arange(T, device=k.device)  # (B, T)
        rows = torch.arange(k.size(0), device=k.device)[:, None]  # (B, 1)
        # Advanced indices on dims 0 and 2 put (B, T) first: the values are (B, T, n_kv_head, head_dim).
        self.keys[rows, :, positions] = k.transpose(1, 2)
        self.values[rows, :, positions] = v.transpose(1, 2)
        slots = torch.arange(self.keys.size(2), device=k.device)
        return self.keys, self.values, slots[None, None, None, :] <= positions[:, None, :, None]  # (B, 1, T, S)


class KVCache:
    """Keys and values of every layer for past positions, (B, n_kv_head, max_len, head_dim) per layer."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]

    @classmethod
    def of(cls, keys: list[Tensor], values: list[Tensor]) -> KVCache:
        """A cache over the given per-layer tensors (shared, not copied)."""
        cache = cls.__new__(cls)
        cache.keys, cache.values = keys, values
        return cache

    @property
    def batch_size(self) -> int:
        """Rows the cache holds."""
        return self.keys[0].size(0)

    @property
    def max_len(self) -> int:
        """Positions the cache holds per row."""
        return self.keys[0].size(2)

    @property
    def nbytes(self) -> int:
        """Memory held by all keys and values (SPEC section 2)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def layer(self, index: int, start_pos: int | Tensor) -> LayerKV:
        """The view one attention layer writes its new keys and values into."""
        return LayerKV(self.keys[index], self.values[index], start_pos)

    def view(self, rows: int, length: int) -> KVCache:
        """A cache sharing this one's storage: its first `rows` rows and first `length` positions."""
        return KVCache.of([k[:rows, :, :length] for k in self.keys], [v[:rows, :, :length] for v in self.values])

    def copy_rows(self, dst: Tensor, source: KVCache, src: Tensor, length: int) -> None:
        """Copy the first `length` positions of source's rows src into this cache's rows dst (index tensors)."""
        for full, part in zip(self.keys + self.values, source.keys + source.values):
            full[dst, :, :length] = part[src, :, :length]

    def move_row(self, dst: int, src: int, length: int) -> None:
        """Copy row src's first `length` positions into row dst (compacting the rows in use)."""
        for t in self.keys + self.values:
            t[dst, :, :length] = t[src, :, :length]

    def reorder(self, index: Tensor) -> None:
        """Row i becomes what row index[i] was (beam search following each beam's parent)."""
        for t in self.keys + self.values:
            t.copy_(t[index])

    def grow(self, max_len: int) -> None:
        """Hold max_len positions per row from now on, keeping what is stored (new positions are zero)."""
        extra = max_len - self.max_len
        if extra > 0:
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.size(3))], dim=2)  # noqa: E731
            self.keys = [pad(t) for t in self.keys]
            self.values = [pad(t) for t in self.values]
