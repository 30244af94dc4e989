"""A directory's manifest: every file under it with its size and checksum, in manifest.json, written last, so that a
damaged, truncated or missing file is found before it is used (checkpoints are written and verified this way)."""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from gptkit.atomic import fsync_dir
from gptkit.errors import GptkitError

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "gptkit-checkpoint-manifest"
# xxh3 hashes ~12 GB/s through a memory map on the 2-core reference machine (zlib's crc32 3, blake2b 0.6): with the
# checksums in a background thread a GPT-2-small save took 3.23 s against 3.15 s without (+2.6%), and --resume's
# check of its 1.5 GB 0.22 s (benchmarks/bench_checkpoint.py).
CHECKSUM = "xxh3_64"


class DamagedFiles(GptkitError):
    """A file a manifest lists is missing or differs from it, or the manifest itself is unreadable."""


def has_manifest(path: Path) -> bool:
    """Whether a directory holds a manifest to verify its files against."""
    return (path / MANIFEST_FILE).is_file()


def file_checksum(path: Path) -> tuple[int, str]:
    """(size, checksum) of a file, hashed through a memory map: no copy, about 3x the rate of read() here."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # (an empty file cannot be mapped)
            return 0, xxhash.xxh3_64().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return size, xxhash.xxh3_64(mapped).hexdigest()


class Checksums:
    """Checksums of a directory's files, computed in a background thread while the save writes the next ones
    (xxhash releases the GIL), so that the manifest adds little to a save's time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum")
        self.started: dict[Path, Future] = {}

    def update(self) -> None:
        """Start on every file of the directory written since the last call (each file is written whole)."""
        for path in listed_files(self.directory):
            if path not in self.started:
                self.started[path] = self.pool.submit(file_checksum, path)

    def get(self, path: Path) -> tuple[int, str]:
        """(size, checksum) of a file: the background result if it was started, else computed now."""
        return self.started[path].result() if path in self.started else file_checksum(path)

    def close(self) -> None:
        """Stop the thread (after the checksums under way)."""
        self.pool.shutdown(wait=True, cancel_futures=True)


def listed_files(directory: Path) -> list[Path]:
    """Every file under directory but the manifest, in a fixed order."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(directory: Path, checksums: Checksums | None = None) -> None:
    """fsync every file under directory and list it, with its size and checksum, in manifest.json (written last).

    checksums holds those already computed while the files were written (the rest are computed here)."""
    files: dict[str, dict[str, Any]] = {}
    for path in listed_files(directory):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        size, checksum = checksums.get(path) if checksums is not None else file_checksum(path)
        files[path.relative_to(directory).as_posix()] = {"bytes": size, CHECKSUM: checksum}
    record = {"format": MANIFEST_FORMAT, "format_version": 1, "checksum": CHECKSUM, "files": files}
    # A plain write: the directory is renamed into place only after this, so the manifest needs no rename of its own.
    with open(directory / MANIFEST_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for root, _, _ in os.walk(directory):
        fsync_dir(Path(root))


def verify_manifest(path: Path, required: str) -> None:
    """Raise DamagedFiles naming the first file of directory path that its manifest.json does not match (missing,
    truncated, changed), or a manifest that is unreadable or does not list the file required."""
    manifest = path / MANIFEST_FILE
    try:
        record = json.loads(manifest.read_bytes())
        files = record["files"]
        checksum_kind = record["checksum"]
        if not isinstance(files, dict) or required not in files:
            raise ValueError(f"it lists no {required}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DamagedFiles(f"{manifest} is unreadable ({err})") from None
    if checksum_kind != CHECKSUM:
        raise DamagedFiles(f"{manifest} uses checksum {checksum_kind!r}, which this gptkit does not know")
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise DamagedFiles(f"{file} is missing")
        try:
            size, checksum = file_checksum(file)
        except OSError as err:
            raise DamagedFiles(f"cannot read {file}: {err.strerror or err}") from None
        if not isinstance(expected, dict) or size != expected.get("bytes"):
            raise DamagedFiles(f"{file} has {size} bytes, the manifest says {expected.get('bytes')} (truncated?)")
        if checksum != expected.get(CHECKSUM):
            raise DamagedFiles(f"{file} does not match its checksum in the manifest (changed or damaged)")
