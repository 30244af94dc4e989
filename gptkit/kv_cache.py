"""A preallocated key/value cache, written at explicit positions and passed into the model's forward.

Keys and values are held in the model's dtype, or as int8 with one fp32 scale per row, head and position
(kv_dtype=torch.int8: a quarter of fp32's memory, half of bf16's): each head's vector of head_dim values v is stored
as q = round(v * 127 / max|v|), scale max|v| / 127, read back as q * scale. docs/spec.md section 4.5 names a quantised
cache as one way long contexts fit; its cost in loss is measured in docs/benchmarks.md.

A sliding-window layer (config.layer_window(i) = W: query i sees keys i - W < j <= i) keeps a ring of
R = min(W, max_len) slots, not max_len positions, position p in slot p mod R (Mistral's rolling buffer): docs/spec.md
section 2.3's memory with min(T, W) in place of T for that layer. Full layers keep max_len positions. A caller that
writes tokens it may take back (speculative decoding's rejected drafts, overwritten by the next pass) asks for
`spare` more slots, min(W + spare, max_len): its writes then never reach a position the next queries still see.
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


def layer_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window W, or None for a layer that sees every earlier position."""
    return [config.layer_window(i) for i in range(config.n_layer)]


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
    window: int | None = None  # W of a sliding-window layer, whose tensors are a ring of R = size(2) slots

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store k, v (B, n_kv_head, T, head_dim) at their positions; return all keys, values and the mask.

        The mask is boolean (True = attend), broadcastable to (B, heads, T, S); None means plain causal
        attention over exactly the keys returned. A windowed layer's keys come in ring order, its mask holds the window.
        """
        if self.window is not None:
            return self._update_ring(k, v)
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

    def _update_ring(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """update for a windowed layer: attend over [the ring before this write] + [the T new keys], then write.

        Attending before writing lets a T-token extend that wraps the ring still give every query its W previous keys.
        """
        R, W, T = self.keys.size(2), self.window, k.size(2)
        if isinstance(self.start_pos, int) and T == 1 and R <= W:
            # One token: once written, the ring's first min(p + 1, R) slots hold exactly the window p - R < j <= p.
            slot = self.start_pos % R
            self._write((slice(None), slice(None), slice(slot, slot + 1)), k, v)
            return (*self._read(min(self.start_pos + 1, R)), None)
        starts = torch.as_tensor(self.start_pos, device=k.device).reshape(-1)  # (B,) or (1,)
        # Only slots below p can hold anything yet; a shared p reads just those.
        held_slots = min(self.start_pos, R) if isinstance(self.start_pos, int) else R
        slots = torch.arange(held_slots, device=k.device)
        # Before the write, slot s holds the latest position below p that is s mod R (negative: nothing yet).
        held = starts[:, None] - 1 - (starts[:, None] - 1 - slots) % R  # (B, held_slots)
        queries = starts[:, None] + torch.arange(T, device=k.device)  # (B, T) positions; also the new keys'
        old = (held[:, None, :] >= 0) & (held[:, None, :] > queries[:, :, None] - W)  # (B, T, held_slots)
        new = (queries[:, None, :] <= queries[:, :, None]) & (queries[:, None, :] > queries[:, :, None] - W)  # (B,T,T)
        ring_k, ring_v = self._read(held_slots)
        new_k, new_v = self._as_stored(k), self._as_stored(v)
        keys, values = torch.cat([ring_k, new_k], dim=2), torch.cat([ring_v, new_v], dim=2)  # (B, KV, S, hd)
        kept = min(T, R)  # the last R new keys are all a ring keeps
        rows = torch.arange(k.size(0), device=k.device)[:, None]  # (B, 1)
        # Advanced indices on dims 0 and 2 put (B, kept) first: the values are (B, kept, n_kv_head, head_dim).
        where = (rows, slice(None), queries[:, T - kept :] % R)
        self._write(where, k[:, :, T - kept :].transpose(1, 2), v[:, :, T - kept :].transpose(1, 2))
        return keys, values, torch.cat([old, new], dim=-1)[:, None]  # mask (B, 1, T, S)

    def _as_stored(self, x: Tensor) -> Tensor:
        """x as attention reads it back from the cache (rounded to the stored type), without storing it."""
        if self.key_scales is None:
            return x.to(self.keys.dtype)
        q, scale = quantize_rows(x)
        return (q.float() * scale[..., None]).to(self.dtype)

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
        return (
            (keys.float() * self.key_scales[:, :, :end, None]).to(self.dtype),
            (values.float() * self.value_scales[:, :, :end, None]).to(self.dtype),
        )


class KVCache:
    """Keys and values of every layer for past positions, (B, n_kv_head, max_len, head_dim) per layer, or a ring of
    min(W, max_len) slots for a layer with sliding window W (position p in slot p mod the ring's size).

    dtype is the model's (what attention reads); kv_dtype what is stored: the model's dtype (None) or torch.int8,
    then with key_scales and value_scales, (B, n_kv_head, slots) fp32 per layer.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
        spare: int = 0,
    ) -> None:
        self.windows = layer_windows(config)
        self._max_len = max_len
        self.spare = spare
        stored = dtype if kv_dtype is None else kv_dtype
        self.dtype = dtype
        shapes = [(batch_size, config.n_kv_head, self._slots(w, max_len, spare), config.head_dim) for w in self.windows]
        self.keys = [torch.zeros(shape, device=device, dtype=stored) for shape in shapes]
        self.values = [torch.zeros(shape, device=device, dtype=stored) for shape in shapes]
        self.key_scales: list[Tensor] = []
        self.value_scales: list[Tensor] = []
        if kv_dtype == torch.int8:
            self.key_scales = [torch.zeros(shape[:3], device=device) for shape in shapes]
            self.value_scales = [torch.zeros(shape[:3], device=device) for shape in shapes]

    @staticmethod
    def _slots(window: int | None, max_len: int, spare: int = 0) -> int:
        """Positions a layer holds: max_len, or a windowed layer's ring of min(W + spare, max_len)."""
        return max_len if window is None else min(window + spare, max_len)

    @classmethod
    def of(
        cls,
        keys: list[Tensor],
        values: list[Tensor],
        key_scales: list[Tensor] | None = None,
        value_scales: list[Tensor] | None = None,
        dtype: torch.dtype | None = None,
        windows: list[int | None] | None = None,
        max_len: int | None = None,
    ) -> KVCache:
        """A cache over the given per-layer tensors (shared, not copied); dtype: what attention reads (default: the
        tensors' own, float32 for int8 ones); windows: each layer's window (default none); max_len: the positions
        a full layer holds (default keys[0]'s)."""
        cache = cls.__new__(cls)
        cache.keys, cache.values = keys, values
        cache.key_scales, cache.value_scales = key_scales or [], value_scales or []
        cache.windows = list(windows) if windows is not None else [None] * len(keys)
        cache._max_len = max_len if max_len is not None else keys[0].size(2)
        cache.spare = 0  # only grow reads it, and a view of another cache's storage never grows
        stored = keys[0].dtype
        cache.dtype = dtype if dtype is not None else (torch.float32 if stored == torch.int8 else stored)
        return cache

    @property
    def batch_size(self) -> int:
        """Rows the cache holds."""
        return self.keys[0].size(0)

    @property
    def max_len(self) -> int:
        """Positions the cache holds per row (a windowed layer's ring holds the last min(W, max_len) of them)."""
        return self._max_len

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """What is stored when it is not the model's dtype (torch.int8), else None."""
        return self.keys[0].dtype if self.key_scales else None

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor the cache holds (keys, values and any scales), each indexed (row, head, position, ...)."""
        return self.keys + self.values + self.key_scales + self.value_scales

    @property
    def tensor_windows(self) -> list[int | None]:
        """The window of each tensor of `tensors` (its layer's)."""
        return self.windows * (len(self.tensors) // len(self.windows))

    @property
    def nbytes(self) -> int:
        """Memory held by all keys and values, scales included (docs/spec.md section 2.3)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layer(self, index: int, start_pos: int | Tensor) -> LayerKV:
        """The view one attention layer writes its new keys and values into."""
        scales = (self.key_scales[index], self.value_scales[index]) if self.key_scales else (None, None)
        return LayerKV(self.keys[index], self.values[index], start_pos, *scales, self.dtype, self.windows[index])

    def view(self, rows: int, length: int) -> KVCache:
        """A cache sharing this one's storage: its first `rows` rows and first `length` positions (a ring: all)."""
        return self._part(slice(0, rows), length)

    def row(self, index: int, length: int) -> KVCache:
        """A one-row cache sharing this one's storage: row `index`, its first `length` positions (a ring: all)."""
        return self._part(slice(index, index + 1), length)

    def rows(self, first: int, count: int, length: int) -> KVCache:
        """A cache sharing this one's storage: rows first..first+count-1, their first `length` positions (a ring:
        all)."""
        return self._part(slice(first, first + count), length)

    def _part(self, rows: slice, length: int) -> KVCache:
        def part(tensors: list[Tensor]) -> list[Tensor]:
            return [t[rows, :, : length if w is None else None] for t, w in zip(tensors, self.windows)]

        return KVCache.of(
            part(self.keys),
            part(self.values),
            part(self.key_scales),
            part(self.value_scales),
            self.dtype,
            self.windows,
            length,
        )

    def read_span(self, row: int, start: int, stop: int) -> list[Tensor]:
        """Copies of row's positions [start, stop) of every tensor (the order of `tensors`), each (n_kv_head,
        stop - start, ...). A ring must still hold them: read a span right after computing it."""
        return [t[row, :, self._where(t, w, start, stop)].clone() for t, w in zip(self.tensors, self.tensor_windows)]

    def write_span(self, row: int, start: int, span: list[Tensor]) -> None:
        """Put a span read by read_span (from any cache of this layout) at row's positions start.. (a ring keeps
        the span's last positions, as computing them would have)."""
        for t, w, part in zip(self.tensors, self.tensor_windows, span):
            stop = start + part.size(1)
            kept = stop - start if w is None else min(stop - start, t.size(2))
            t[row, :, self._where(t, w, stop - kept, stop)] = part[:, part.size(1) - kept :]

    @staticmethod
    def _where(t: Tensor, window: int | None, start: int, stop: int) -> slice | Tensor:
        """The slots of positions [start, stop) in a layer's tensor t."""
        if window is None:
            return slice(start, stop)
        return torch.arange(start, stop, device=t.device) % t.size(2)

    def copy_rows(self, dst: Tensor, source: KVCache, src: Tensor, length: int) -> None:
        """Copy the first `length` positions of source's rows src into this cache's rows dst (index tensors)."""
        for full, part in zip(self.tensors, source.tensors):
            # A ring holding `length` positions or more is full; a shorter one holds them at slots 0..length-1.
            n = min(length, full.size(2), part.size(2))
            full[dst, :, :n] = part[src, :, :n]

    def move_row(self, dst: int, src: int, length: int) -> None:
        """Copy row src's first `length` positions into row dst (compacting the rows in use)."""
        for t in self.tensors:
            n = min(length, t.size(2))
            t[dst, :, :n] = t[src, :, :n]

    def reorder(self, index: Tensor) -> None:
        """Row i becomes what row index[i] was (beam search following each beam's parent)."""
        for t in self.tensors:
            t.copy_(t[index])

    def grow(self, max_len: int) -> None:
        """Hold max_len positions per row from now on, keeping what is stored (new positions are zero); a ring
        grows to min(W + spare, max_len) slots (a shorter one never wrapped, so its positions keep their slots)."""
        if max_len <= self._max_len:
            return

        def pad(t: Tensor, window: int | None) -> Tensor:
            extra = self._slots(window, max_len, self.spare) - t.size(2)
            return torch.cat([t, t.new_zeros(*t.shape[:2], extra, *t.shape[3:])], dim=2) if extra > 0 else t

        self.keys = [pad(t, w) for t, w in zip(self.keys, self.windows)]
        self.values = [pad(t, w) for t, w in zip(self.values, self.windows)]
        self.key_scales = [pad(t, w) for t, w in zip(self.key_scales, self.windows)]
        self.value_scales = [pad(t, w) for t, w in zip(self.value_scales, self.windows)]
        self._max_len = max_len
