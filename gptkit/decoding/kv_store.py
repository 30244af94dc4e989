"""The prefix cache's disk tier: blocks of keys and values as safetensors files, bounded in bytes, kept across restarts.

DIR/<namespace>/<block name>.safetensors, one file a block: its tensors ("0", "1", ... in the cache's tensor order)
and metadata naming the format, the namespace, the parent block, the block's tokens and a blake2b checksum of the
tensors' bytes. A file is written atomically (beside its place, fsync'd, renamed) by a background thread, so a
prefill never waits on the disk. A read checks all of it, and the block's name against its namespace, parent and
tokens; a file that fails any check (damaged, truncated, another namespace's, another version's) is removed with
one warning and never loaded. Past max_bytes the least recently read or written files go first.
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
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from gptkit.tensors import save_tensors

log = logging.getLogger("gptkit.decoding")

FORMAT = "gptkit-kv-block-1"
SUFFIX = ".safetensors"
PENDING_WRITES = 256  # blocks queued for the disk at most; beyond, a block is not written (it stays in RAM)
CLOSE_WAIT_S = 30.0  # how long a closing server waits for the writes in flight


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


def chain_name(namespace: str, parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of the block holding tokens after the block named parent (b"" for a first block)."""
    start = parent or namespace.encode()
    return hashlib.blake2b(start + b"|" + ",".join(map(str, tokens)).encode(), digest_size=16).digest()


class KVStore:
    """Blocks on disk under directory, at most max_bytes in all."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the disk cache's budget must be >= 0 bytes, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.files: OrderedDict[Path, int] = OrderedDict()  # path -> size, least recently used first
        self.used_bytes = 0
        self.writes = self.write_failures = self.rejected = 0
        self.lock = threading.Lock()
        self.pending: queue.Queue = queue.Queue(PENDING_WRITES)
        self._scan()
        self.writer = threading.Thread(target=self._write_loop, name="gptkit-kv-store", daemon=True)
        self.writer.start()

    def _scan(self) -> None:
        """Learn what an earlier server left, oldest first (by modification time)."""
        found = []
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append((stat.st_mtime, path, stat.st_size))
        for _, path, size in sorted(found):
            self.files[path] = size
            self.used_bytes += size
        self._trim()

    def path(self, namespace: str, name: bytes) -> Path:
        """Where the block named name of namespace lives."""
        return self.directory / namespace / f"{name.hex()}{SUFFIX}"

    # ----- reading (engine thread) -----

    def get(self, namespace: str, name: bytes) -> list[Tensor] | None:
        """The block, read and checked, or None (absent, or damaged: then removed with a warning)."""
        path = self.path(namespace, name)
        with self.lock:
            if path not in self.files:
                return None
            self.files.move_to_end(path)
        problem, tensors = self._read(path, namespace, name)
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
                tensors = [f.get_tensor(str(i)) for i in range(len(f.keys()))]
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            return f"unreadable: {err}", []
        if meta.get("format") != FORMAT or meta.get("namespace") != namespace:
            return f"written for {meta.get('format')!r} / {meta.get('namespace')!r}, not this model's cache", []
        try:
            tokens = json.loads(meta.get("tokens", ""))
            parent = bytes.fromhex(meta.get("parent", ""))
        except ValueError as err:
            return f"bad metadata: {err}", []
        if chain_name(namespace, parent, tokens) != name:
            return "its tokens do not give its name", []
        if checksum(tensors) != meta.get("checksum"):
            return "checksum mismatch", []
        return None, tensors

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
        size = sum(t.numel() * t.element_size() for t in block)
        if size > self.max_bytes:
            return
        metadata = {"format": FORMAT, "namespace": namespace, "parent": parent.hex(), "tokens": json.dumps(tokens),
                    "checksum": checksum(block)}  # fmt: skip
        try:
            save_tensors({str(i): t for i, t in enumerate(block)}, path, metadata)
            size = path.stat().st_size
        except OSError as err:  # a full or read-only disk: the cache goes on in RAM
            self.write_failures += 1
            if self.write_failures == 1:
                log.warning("prefix cache: cannot write %s (%s); blocks that fail to write stay in RAM only", path,
                            err.strerror or err)  # fmt: skip
            return
        with self.lock:
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
            return {"disk_blocks": len(self.files), "disk_bytes": self.used_bytes, "disk_budget_bytes": self.max_bytes,
                    "disk_writes": self.writes, "disk_rejected": self.rejected}  # fmt: skip
