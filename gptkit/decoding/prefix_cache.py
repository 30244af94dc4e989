"""Keys and values of earlier requests by token prefix: a RAM tier with a byte budget and an optional disk tier.

The unit is a block of PREFILL_CHUNK tokens at positions that are multiples of it, exactly the chunks the batch engine
prefills (decoding.step.prefill_chunks), so a block copied into a row holds the very bits the row would have computed.
A block is named by a chain hash: blake2b of the namespace (what else decides the keys and values: the model's
weights and settings, an adapter, the KV dtype, the kernels), the previous block's name and its own tokens. A lookup
walks a sequence's blocks from the start and stops at the first one missing.

Only blocks a prefill computed are kept: keys and values a decode step wrote are computed by other kernels and
would not match a prefill's bits, so a conversation's next turn reuses its earlier prompts' blocks and recomputes
the last reply.

RAM: least recently used blocks leave first; a hit touches its chain from the last block to the first, so a chain's
tail leaves before its head (a block whose parent left could never be reached). Disk (decoding.kv_store): every
block is also written there, in a background thread, so that an evicted block, or a restarted server, reads it back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gptkit.decoding.kv_dir import chain_name
from gptkit.decoding.kv_store import BlockLayout, KVStore, tensor_bytes
from gptkit.decoding.step import PREFILL_CHUNK
from gptkit.kv_cache import KVCache
from gptkit.native import library
from gptkit.native.choices import MEASURED

FORMAT = "gptkit-prefix-cache-1"  # in every namespace: a change of block layout or hashing starts afresh


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """A size in bytes from a flag: 1000000, 512M, 4G or 1.5GiB (K, M, G and T are powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise ValueError(f"invalid size {text!r}: give bytes, or a number with K, M, G or T (such as 4G)")
    return int(float(match.group(1).replace("_", "")) * _UNITS[match.group(2)])


def available_memory() -> int:
    """Bytes of memory the system could give now (MemAvailable; physical memory where that is unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hex digest of everything in model that decides its keys and values: config, every tensor's name, dtype,
    shape and bytes (about 1 GB/s: half a second for GPT-2 small in fp32)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(getattr(model, "config", None)).encode())
    for name, tensor in model.state_dict(keep_vars=False).items():
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor_bytes(tensor.detach().cpu()))
    return digest.hexdigest()


def namespace_for(fingerprint: str, kv_dtype: torch.dtype | None, adapter: str = "") -> str:
    """A hex name for everything besides the tokens that decides a block's bits: the model (model_fingerprint), an
    adapter, the KV dtype, and the code computing them (this format, torch's version, its threads, gptkit's kernels)."""
    parts = [
        FORMAT,
        fingerprint,
        adapter,
        str(kv_dtype),
        torch.__version__,
        str(torch.get_num_threads()),
        _product_choices() if library.load(wait=False) else "no kernels",
    ]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def _product_choices() -> str:
    """The kernels' product choices, which decide a prefill's bits. Other modules' choices (the fused decode step's,
    timed when a batch first reaches their size) decide no block's bits: hashing them moved a running server's
    namespace the first time they were timed, and every block cached before was missed from then on."""
    chosen = library.choices()
    return json.dumps({name: chosen[name] for name in sorted(MEASURED) if name in chosen})


def block_names(namespace: str, tokens: Sequence[int], count: int) -> list[bytes]:
    """The chain names of tokens' first `count` blocks."""
    names, parent = [], b""
    for b in range(count):
        parent = chain_name(namespace, parent, tokens[b * PREFILL_CHUNK : (b + 1) * PREFILL_CHUNK])
        names.append(parent)
    return names


def block_layout(cache: KVCache) -> BlockLayout:
    """What each block of cache's keys and values is: per tensor, its dtype and (n_kv_head, PREFILL_CHUNK, ...)."""
    shapes = tuple((t.size(1), PREFILL_CHUNK, *t.shape[3:]) for t in cache.tensors)  # each t: (B, H, T, ...)
    return BlockLayout(tuple(t.dtype for t in cache.tensors), shapes)


@dataclass
class CacheStats:
    """What the cache has done since the server started."""

    lookups: int = 0  # prefills that consulted the cache
    hits: int = 0  # lookups that found at least one block
    hit_tokens: int = 0  # prompt tokens not computed thanks to the cache
    computed_tokens: int = 0  # prompt tokens prefilled
    disk_hits: int = 0  # blocks read back from disk
    evicted: int = 0  # blocks dropped from RAM


class PrefixCache:
    """Blocks of keys and values by chain name, within ram_bytes of RAM, backed by an optional KVStore on disk.

    Thread-safe: the engine thread looks up and inserts; /metrics and /health read stats from others.
    """

    def __init__(self, ram_bytes: int, store: KVStore | None = None) -> None:
        if ram_bytes < 0:
            raise ValueError(f"the prefix cache's RAM budget must be >= 0 bytes, got {ram_bytes}")
        self.ram_bytes = ram_bytes
        self.store = store
        self.blocks: OrderedDict[bytes, list[Tensor]] = OrderedDict()  # oldest use first
        self.used_bytes = 0
        self.stats = CacheStats()
        self.lock = threading.Lock()

    def match(self, namespace: str, tokens: Sequence[int], layout: BlockLayout | None = None) -> list[list[Tensor]]:
        """The cached blocks that begin tokens, at most those before its last token (whose logits must be
        computed); each block is one tensor per cache tensor, (n_kv_head, PREFILL_CHUNK, ...). layout: the
        model's (block_layout), which a block read from disk must have."""
        usable = (len(tokens) - 1) // PREFILL_CHUNK
        found: list[list[Tensor]] = []
        with self.lock:
            self.stats.lookups += 1
            names = block_names(namespace, tokens, usable)
            for name in names:
                block = self.blocks.get(name)
                if block is None and self.store is not None:
                    block = self.store.get(namespace, name, layout)
                    if block is not None:
                        self.stats.disk_hits += 1
                        self._keep(name, block)
                if block is None:
                    break
                found.append(block)
            for name in reversed(names[: len(found)]):  # the chain's head ends most recent: tails leave first
                if name in self.blocks:  # a block read from disk may not fit the RAM budget (0: RAM off)
                    self.blocks.move_to_end(name)
            self.stats.hits += bool(found)
            self.stats.hit_tokens += len(found) * PREFILL_CHUNK
            self.stats.computed_tokens += len(tokens) - len(found) * PREFILL_CHUNK
        return found

    def insert(self, namespace: str, tokens: Sequence[int], first: int, blocks: Sequence[list[Tensor]]) -> None:
        """Keep blocks first, first + 1, ... of tokens (as computed by a prefill)."""
        names = block_names(namespace, tokens, first + len(blocks))
        with self.lock:
            for b, block in enumerate(blocks):
                name = names[first + b]
                if name in self.blocks:
                    continue
                self._keep(name, block)
                if self.store is not None:
                    parent = names[first + b - 1] if first + b else b""
                    self.store.put(
                        namespace, name, parent, tokens[(first + b) * PREFILL_CHUNK :][:PREFILL_CHUNK], block
                    )
            for name in reversed(names):
                if name in self.blocks:
                    self.blocks.move_to_end(name)

    def _keep(self, name: bytes, block: list[Tensor]) -> None:
        """Hold block in RAM, evicting the least recently used blocks beyond the budget (caller holds the lock)."""
        size = sum(t.numel() * t.element_size() for t in block)
        if size > self.ram_bytes:
            return
        self.blocks[name] = block
        self.used_bytes += size
        while self.used_bytes > self.ram_bytes:
            _, old = self.blocks.popitem(last=False)
            self.used_bytes -= sum(t.numel() * t.element_size() for t in old)
            self.stats.evicted += 1

    def report(self) -> dict[str, int]:
        """Counters and sizes for /health and /metrics."""
        with self.lock:
            report = {
                **vars(self.stats),
                "blocks": len(self.blocks),
                "ram_bytes": self.used_bytes,
                "ram_budget_bytes": self.ram_bytes,
                "block_tokens": PREFILL_CHUNK,
            }
        if self.store is not None:
            report.update(self.store.report())
        return report

    def close(self) -> None:
        """Finish the disk writes in flight (bounded wait)."""
        if self.store is not None:
            self.store.close()
