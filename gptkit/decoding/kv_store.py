"""The prefix cache's disk tier: blocks of keys and values as safetensors files, bounded in bytes, kept across restarts.

One file a block (decoding.kv_dir names them and says what the cache owns in its directory): its tensors ("0", "1",
... in the cache's tensor order) and metadata naming the format, the namespace, the parent block, the block's tokens
and a blake2b checksum of the tensors' bytes. A file is written atomically (beside its place, fsync'd, renamed) by a
background thread, so a prefill never waits on the disk. A read checks all of it: the header against the block's
name, the checksum, and the tensors against the model's block layout (count, dtype, shape, finite values); a file
that fails any check (damaged, truncated, another namespace's, another version's, another model's layout) is a
miss, removed with one warning, and never loaded. Past max_bytes the least recently read or written files go first,
a file about to be written counting already; only files the cache proved it wrote are ever removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from gptkit.decoding.kv_dir import FORMAT, block_path, claim, header_problem
from gptkit.tensors import save_tensors

log = logging.getLogger("gptkit.decoding")

PENDING_WRITES = 256  # blocks queued for the disk at most; beyond, a block is not written (it stays in RAM)
CLOSE_WAIT_S = 30.0  # how long a closing server waits for the writes in flight
ENTRY_BYTES = 128  # a bound on one tensor's entry in a safetensors header ('"12":{"dtype":"F32","shape":[...],...')


def tensor_bytes(t: Tensor) -> bytes:
    """A CPU tensor's elements as raw bytes, in order (any dtype: bf16 has no numpy type of its own)."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def checksum(tensors: Sequence[Tensor]) -> str:
    """blake2b of the tensors' bytes, in order."""
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        digest.update(tensor_bytes(t))
    return digest.hexdigest()


@dataclass(frozen=True)
class BlockLayout:
    """What each block of one KV cache is: its tensors' dtypes and shapes, (n_kv_head, block tokens, ...) each."""

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]

    def problem(self, tensors: Sequence[Tensor]) -> str | None:
        """What makes tensors not a block of this layout (their count, a dtype, a shape), or None."""
        if len(tensors) != len(self.shapes):
            return f"{len(tensors)} tensors where the model's cache has {len(self.shapes)}"
        for i, (t, dtype, shape) in enumerate(zip(tensors, self.dtypes, self.shapes)):
            if t.dtype != dtype:
                return f"tensor {i} has dtype {t.dtype} where the model's cache has {dtype}"
            if tuple(t.shape) != shape:
                return f"tensor {i} has shape {tuple(t.shape)} where the model's cache has {shape}"
        return None


def contents_problem(tensors: Sequence[Tensor], tokens: int) -> str | None:
    """What makes tensors not keys and values of `tokens` positions whatever the model (no tensors, a shape
    without those positions, a value not finite), or None."""
    if not tensors:
        return "no tensors"
    for i, t in enumerate(tensors):
        if t.dim() < 2 or t.size(1) != tokens:
            return f"tensor {i} has shape {tuple(t.shape)}, not (heads, {tokens}, ...) for its {tokens} tokens"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"tensor {i} holds values that are not finite"
    return None


def file_bytes(block: Sequence[Tensor], metadata: dict[str, str]) -> int:
    """At least the size of block's file: its tensors' bytes, and a header of its metadata and a tensor entry each."""
    return sum(t.numel() * t.element_size() for t in block) + len(json.dumps(metadata)) + ENTRY_BYTES * (len(block) + 1)


class KVStore:
    """Blocks on disk under directory, at most max_bytes in all; a directory holding anything the cache did not
    write is refused (GptkitError, see kv_dir)."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the disk cache's budget must be >= 0 bytes, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.files: OrderedDict[Path, int] = OrderedDict()  # path -> size, least recently used first
        self.writes = self.write_failures = self.rejected = 0
        self.lock = threading.Lock()
        self.pending: queue.Queue = queue.Queue(PENDING_WRITES)
        claimed = claim(self.directory)
        self.files.update(claimed.blocks)
        self.stray_bytes = claimed.stray_bytes  # temporary files a killed writer left that could not be removed
        self.used_bytes = self.stray_bytes + sum(self.files.values())
        self._trim()
        self.writer = threading.Thread(target=self._write_loop, name="gptkit-kv-store", daemon=True)
        self.writer.start()

    def path(self, namespace: str, name: bytes) -> Path:
        """Where the block named name of namespace lives."""
        return block_path(self.directory, namespace, name)

    # ----- reading (engine thread) -----

    def get(self, namespace: str, name: bytes, layout: BlockLayout | None = None) -> list[Tensor] | None:
        """The block, read and checked (against layout, the model's, where given), or None (absent, or failing a
        check: then removed with a warning)."""
        path = self.path(namespace, name)
        with self.lock:
            if path not in self.files:
                return None
            self.files.move_to_end(path)
        problem, tensors = self._read(path, namespace, name)
        if problem is None and layout is not None:
            problem = layout.problem(tensors)
        if problem is None:
            try:
                os.utime(path)  # the order of use survives a restart
            except OSError:
                pass
            return tensors
        log.warning("prefix cache: ignoring %s (%s); removed it", path, problem)
        self.rejected += 1
        self._remove(path)
        return None

    @staticmethod
    def _read(path: Path, namespace: str, name: bytes) -> tuple[str | None, list[Tensor]]:
        """(None, tensors) for a sound block file, else (what is wrong, [])."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                keys = set(f.keys())
                if keys != {str(i) for i in range(len(keys))}:
                    return f"its tensors are named {sorted(keys)[:4]}, not 0, 1, ...", []
                tensors = [f.get_tensor(str(i)) for i in range(len(keys))]
        except (SafetensorError, OSError, ValueError) as err:
            return f"unreadable: {err}", []
        problem = header_problem(meta, namespace, name)
        if problem is None and checksum(tensors) != meta.get("checksum"):
            problem = "checksum mismatch"
        if problem is None:  # a header that passed names its tokens (a JSON list)
            problem = contents_problem(tensors, len(json.loads(meta["tokens"])))
        return problem, [] if problem else tensors

    # ----- writing (a background thread) -----

    def put(self, namespace: str, name: bytes, parent: bytes, tokens: Sequence[int], block: list[Tensor]) -> None:
        """Queue the block for writing (nothing happens if it is on disk already or the queue is full)."""
        path = self.path(namespace, name)
        with self.lock:
            if path in self.files:
                return
        try:
            self.pending.put_nowait((path, namespace, parent, list(tokens), block))
        except queue.Full:
            log.debug("prefix cache: the disk is behind; block %s stays in RAM only", name.hex())

    def _write_loop(self) -> None:
        while True:
            item = self.pending.get()
            if item is None:
                self.pending.task_done()
                return
            path, namespace, parent, tokens, block = item
            try:
                self._write(path, namespace, parent, tokens, block)
            finally:
                self.pending.task_done()

    def _write(self, path: Path, namespace: str, parent: bytes, tokens: list[int], block: list[Tensor]) -> None:
        """Write one block, after making room for it within max_bytes; a file already at its path is left alone."""
        metadata = {
            "format": FORMAT,
            "namespace": namespace,
            "parent": parent.hex(),
            "tokens": json.dumps(tokens),
            "checksum": checksum(block),
        }
        reserved = file_bytes(block, metadata)
        if reserved > self.max_bytes:
            return
        with self.lock:
            if path in self.files or path.exists():  # written already, or a file the cache does not own
                return
            self.used_bytes += reserved  # the file being written counts: older ones leave before it lands
            self._trim()
        size = 0
        try:
            save_tensors({str(i): t for i, t in enumerate(block)}, path, metadata)
            size = path.stat().st_size
        except OSError as err:  # a full or read-only disk: the cache goes on in RAM
            self.write_failures += 1
            if self.write_failures == 1:
                log.warning(
                    "prefix cache: cannot write %s (%s); blocks that fail to write stay in RAM only",
                    path,
                    err.strerror or err,
                )
        with self.lock:
            self.used_bytes -= reserved
            if size:
                self.files[path] = size
                self.used_bytes += size
                self.writes += 1
                self._trim()

    def _trim(self) -> None:
        """Remove the least recently used files beyond max_bytes (caller holds the lock, or is the constructor)."""
        while self.used_bytes > self.max_bytes and self.files:
            path, size = self.files.popitem(last=False)
            self.used_bytes -= size
            try:
                path.unlink()
            except OSError:
                pass

    def _remove(self, path: Path) -> None:
        with self.lock:
            size = self.files.pop(path, 0)
            self.used_bytes -= size
        try:
            path.unlink()
        except OSError:
            pass

    def flush(self) -> None:
        """Wait until every queued block is written (tests; close)."""
        self.pending.join()

    def close(self) -> None:
        """Finish the queued writes (at most CLOSE_WAIT_S) and stop the writer."""
        try:
            self.pending.put(None, timeout=CLOSE_WAIT_S)
        except queue.Full:
            return
        self.writer.join(timeout=CLOSE_WAIT_S)

    def report(self) -> dict[str, int]:
        """Disk counters for /health and /metrics."""
        with self.lock:
            return {
                "disk_blocks": len(self.files),
                "disk_bytes": self.used_bytes,
                "disk_budget_bytes": self.max_bytes,
                "disk_writes": self.writes,
                "disk_rejected": self.rejected,
            }
