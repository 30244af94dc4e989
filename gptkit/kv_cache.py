"""A preallocated key/value cache, written at explicit positions and passed into the model's forward.

Keys and values are held in the model's dtype, or as int8 with one fp32 scale per row, head and position
(kv_dtype=torch.int8: a quarter of fp32's memory, half of bf16's): each head's vector of head_dim values v is stored
as q = round(v * 127 / max|v|) with scale max|v| / 127, and read back as q * scale. SPEC section 4 names a quantised
cache as one way long contexts fit; its cost in loss is measured in the README.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gptkit.config import ModelConfig
from gptkit.errors import ConfigError

KV_DTYPES = {"int8": torch.int8}  # the cache element types besides the model's own, by the name flags use


def kv_dtype_of(name: str | None) -> torch.dtype | None:
    """The element type a kv_cache setting names: None for the model's own, torch.int8 for "int8"."""
    if name is None:
        return None
    if name not in KV_DTYPES:
        raise ConfigError(f"kv_cache must be one of {', '.join(KV_DTYPES)} (or unset: the model's dtype), got {name!r}")
    return KV_DTYPES[name]


def quantize_rows(v: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 values, fp32 scales) of v (..., head_dim), one scale per vector over its last dimension."""
    v = v.float()
    amax = v.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(v * inverse).to(torch.int8), (amax / 127.0)[..., 0]


@dataclass
class LayerKV:
    """One layer's cache tensors and where the current tokens start; its update writes, never advances."""

    keys: Tensor  # (B, n_kv_head, max_len, head_dim)
    values: Tensor
    start_pos: int | Tensor  # an int shared by every row, or a (B,) tensor of per-row positions
    key_scales: Tensor | None = None  # (B, n_kv_head, max_len) for an int8 cache
    value_scales: Tensor | None = None
    dtype: torch.dtype = field(default=torch.float32)  # what attention reads (the model's dtype)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store k, v (B, n_kv_head, T, head_dim) at their positions; return all keys, values and the mask.

        The mask is boolean (True = attend), broadcastable to (B, heads, T, S); None means plain causal
        attention over exactly the keys returned.
        """
        T = k.size(2)
        if isinstance(self.start_pos, int):
            end = self.start_pos + T
            self._write((slice(None), slice(None), slice(self.start_pos, end)), k, v)
            keys, values = self._read(end)
            if self.start_pos == 0 or T == 1:
                return keys, values, None
            slots = torch.arange(end, device=k.device)
            query_pos = self.start_pos + torch.arange(T, device=k.device)
            return keys, values, slots[None, :] <= query_pos[:, None]  # (T, end)
        positions = self.start_pos[:, None] + torch.arange(T, device=k.device)  # (B, T)
        rows = torch.arange(k.size(0), device=k.device)[:, None]  # (B, 1)
        # Advanced indices on dims 0 and 2 put (B, T) first: the values are (B, T, n_kv_head, head_dim).
        self._write((rows, slice(None), positions), k.transpose(1, 2), v.transpose(1, 2))
        keys, values = self._read(self.keys.size(2))
        slots = torch.arange(self.keys.size(2), device=k.device)
        return keys, values, slots[None, None, None, :] <= positions[:, None, :, None]  # (B, 1, T, S)

    def _write(self, where: tuple, k: Tensor, v: Tensor) -> None:
        if self.key_scales is None:
            self.keys[where], self.values[where] = k, v
            return
        (qk, sk), (qv, sv) = quantize_rows(k), quantize_rows(v)
        self.keys[where], self.values[where] = qk, qv
        self.key_scales[where], self.value_scales[where] = sk, sv

    def _read(self, end: int) -> tuple[Tensor, Tensor]:
        """Keys and values of the first `end` positions, in the dtype attention computes in."""
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if self.key_scales is None:
            return keys, values
        return ((keys.float() * self.key_scales[:, :, :end, None]).to(self.dtype),
                (values.float() * self.value_scales[:, :, :end, None]).to(self.dtype))  # fmt: skip


class KVCache:
    """Keys and values of every layer for past positions, (B, n_kv_head, max_len, head_dim) per layer.

    dtype is the model's (what attention reads); kv_dtype what is stored: the model's dtype (None) or torch.int8,
    then with key_scales and value_scales, (B, n_kv_head, max_len) fp32 per layer.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)
        stored = dtype if kv_dtype is None else kv_dtype
        self.dtype = dtype
        self.keys = [torch.zeros(shape, device=device, dtype=stored) for _ in range(config.n_layer)]
        self.values = [torch.zeros(shape, device=device, dtype=stored) for _ in range(config.n_layer)]
        self.key_scales: list[Tensor] = []
        self.value_scales: list[Tensor] = []
        if kv_dtype == torch.int8:
            self.key_scales = [torch.zeros(shape[:3], device=device) for _ in range(config.n_layer)]
            self.value_scales = [torch.zeros(shape[:3], device=device) for _ in range(config.n_layer)]

    @classmethod
    def of(cls, keys: list[Tensor], values: list[Tensor], key_scales: list[Tensor] | None = None,
           value_scales: list[Tensor] | None = None, dtype: torch.dtype | None = None) -> KVCache:  # fmt: skip
        """A cache over the given per-layer tensors (shared, not copied); dtype: what attention reads (default: the
        tensors' own, float32 for int8 ones)."""
        cache = cls.__new__(cls)
        cache.keys, cache.values = keys, values
        cache.key_scales, cache.value_scales = key_scales or [], value_scales or []
        stored = keys[0].dtype
        cache.dtype = dtype if dtype is not None else (torch.float32 if stored == torch.int8 else stored)
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
    def kv_dtype(self) -> torch.dtype | None:
        """What is stored when it is not the model's dtype (torch.int8), else None."""
        return self.keys[0].dtype if self.key_scales else None

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor the cache holds (keys, values and any scales), each indexed (row, head, position, ...)."""
        return self.keys + self.values + self.key_scales + self.value_scales

    @property
    def nbytes(self) -> int:
        """Memory held by all keys and values, scales included (SPEC section 2)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layer(self, index: int, start_pos: int | Tensor) -> LayerKV:
        """The view one attention layer writes its new keys and values into."""
        if self.key_scales:
            return LayerKV(self.keys[index], self.values[index], start_pos, self.key_scales[index],
                           self.value_scales[index], self.dtype)  # fmt: skip
        return LayerKV(self.keys[index], self.values[index], start_pos, dtype=self.dtype)

    def view(self, rows: int, length: int) -> KVCache:
        """A cache sharing this one's storage: its first `rows` rows and first `length` positions."""
        return self._part(slice(0, rows), length)

    def row(self, index: int, length: int) -> KVCache:
        """A one-row cache sharing this one's storage: row `index`, its first `length` positions."""
        return self._part(slice(index, index + 1), length)

    def _part(self, rows: slice, length: int) -> KVCache:
        part = lambda tensors: [t[rows, :, :length] for t in tensors]  # noqa: E731
        return KVCache.of(part(self.keys), part(self.values), part(self.key_scales), part(self.value_scales),
                          self.dtype)  # fmt: skip

    def read_span(self, row: int, start: int, stop: int) -> list[Tensor]:
        """Copies of row's positions [start, stop) of every tensor (the order of `tensors`), each (n_kv_head,
        stop - start, ...)."""
        return [t[row, :, start:stop].clone() for t in self.tensors]

    def write_span(self, row: int, start: int, span: list[Tensor]) -> None:
        """Put a span read by read_span (from any cache of this layout) at row's positions start.."""
        for t, part in zip(self.tensors, span):
            t[row, :, start : start + part.size(1)] = part

    def copy_rows(self, dst: Tensor, source: KVCache, src: Tensor, length: int) -> None:
        """Copy the first `length` positions of source's rows src into this cache's rows dst (index tensors)."""
        for full, part in zip(self.tensors, source.tensors):
            full[dst, :, :length] = part[src, :, :length]

    def move_row(self, dst: int, src: int, length: int) -> None:
        """Copy row src's first `length` positions into row dst (compacting the rows in use)."""
        for t in self.tensors:
            t[dst, :, :length] = t[src, :, :length]

    def reorder(self, index: Tensor) -> None:
        """Row i becomes what row index[i] was (beam search following each beam's parent)."""
        for t in self.tensors:
            t.copy_(t[index])

    def grow(self, max_len: int) -> None:
        """Hold max_len positions per row from now on, keeping what is stored (new positions are zero)."""
        extra = max_len - self.max_len
        if extra > 0:
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], extra, *t.shape[3:])], dim=2)  # noqa: E731
            self.keys = [pad(t) for t in self.keys]
            self.values = [pad(t) for t in self.values]
            self.key_scales = [pad(t) for t in self.key_scales]
            self.value_scales = [pad(t) for t in self.value_scales]
