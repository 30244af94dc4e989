"""The prefix cache's directory on disk: how its block files are named, and what the cache owns there.

DIR/<namespace>/<block name>.safetensors, both 32 hex digits: the block's tensors and a header naming this format,
the namespace, the parent block and the block's tokens, whose chain hash is the file's name. The cache owns its
directory: claim() refuses one that holds anything but its marker file (MARKER), namespace folders, block files it
can prove it wrote (their name, header and hash agree) and the temporary files of its atomic writes. So a mistaken
directory (a folder of models, a run's checkpoints) is reported in one line and left as it was; the cache deletes
only files it proved its own. A directory of the earlier format (block files, no marker) passes the same check and
is then marked; temporary files a killed writer left are removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from gptkit.atomic import atomic_write_text
from gptkit.errors import GptkitError

log = logging.getLogger("gptkit.decoding")

FORMAT = "gptkit-kv-block-1"  # in each block file's header
SUFFIX = ".safetensors"
MARKER = "gptkit-prefix-cache.json"  # at the directory's root: the cache owns this directory
DIR_FORMAT = "gptkit-prefix-cache-dir-1"  # in the marker
_HEX = re.compile(r"[0-9a-f]{32}")
_BLOCK = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX))
_TEMP = re.compile(r"\.[0-9a-f]{32}" + re.escape(SUFFIX) + r"\.[^/]+\.tmp")  # atomic_write's, beside a block
_MARKER_TEMP = re.compile(r"\." + re.escape(MARKER) + r"\.[^/]+\.tmp")
_SHOWN = 3  # foreign entries named in a refusal


def chain_name(namespace: str, parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of the block holding tokens after the block named parent (b"" for a first block)."""
    start = parent or namespace.encode()
    return hashlib.blake2b(start + b"|" + ",".join(map(str, tokens)).encode(), digest_size=16).digest()


def block_path(directory: Path, namespace: str, name: bytes) -> Path:
    """Where the block named name of namespace lives under directory."""
    return directory / namespace / f"{name.hex()}{SUFFIX}"


def header_problem(meta: dict[str, str], namespace: str, name: bytes) -> str | None:
    """What makes a block file's header not that of block `name` of namespace, or None."""
    if meta.get("format") != FORMAT or meta.get("namespace") != namespace:
        return f"written for {meta.get('format')!r} / {meta.get('namespace')!r}, not this model's cache"
    try:
        tokens = json.loads(meta.get("tokens", ""))
        parent = bytes.fromhex(meta.get("parent", ""))
    except ValueError as err:
        return f"bad metadata: {err}"
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return "bad metadata: its tokens are not a list of token ids"
    if chain_name(namespace, parent, tokens) != name:
        return "its tokens do not give its name"
    return None


def _written_by_the_cache(path: Path, marked: bool) -> bool:
    """Whether path, named as a block file, is one the cache wrote: its header's format, namespace and tokens give
    its path. One whose header cannot be read is a damaged block in a marked directory (its read removes it), and
    foreign in an unmarked one."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        log.debug("prefix cache: %s has no readable header (%s)", path, err)
        return marked
    return header_problem(meta, path.parent.name, bytes.fromhex(path.name[: -len(SUFFIX)])) is None


@dataclass
class Claimed:
    """What a claimed directory holds: its block files (path, size), least recently used first, and the bytes of
    temporary files that could not be removed (counted against the budget)."""

    blocks: list[tuple[Path, int]]
    stray_bytes: int


def claim(directory: Path) -> Claimed:
    """Make directory the cache's (created and marked if need be) and list its blocks; a GptkitError naming what
    else it holds, before anything in it is changed."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise GptkitError(
            f"--cache-dir {directory}: cannot make it ({err.strerror or err}); give a writable directory"
        ) from None
    marked = _check_marker(directory / MARKER)
    blocks, temps, foreign = _inventory(directory, marked)
    if foreign:
        shown = ", ".join(str(p.relative_to(directory)) for p in foreign[:_SHOWN])
        more = " and more" if len(foreign) > _SHOWN else ""
        raise GptkitError(
            f"{directory} holds {shown}{more}, which the prefix cache did not write; the cache deletes files in "
            "its directory, so it needs one of its own: give --cache-dir an empty or new directory (nothing was "
            "changed)"
        )
    stray = _sweep(temps)
    if not marked:
        if blocks:
            log.info("prefix cache: adopting %d block files of an earlier gptkit in %s", len(blocks), directory)
        about = "gptkit's prefix cache: it deletes the files it wrote here as its budget requires"
        atomic_write_text(directory / MARKER, json.dumps({"format": DIR_FORMAT, "about": about}) + "\n")
    return Claimed([(path, size) for _, path, size in sorted(blocks)], stray)


def _check_marker(marker: Path) -> bool:
    """Whether the marker is there; a GptkitError when something else has its name."""
    if not marker.exists() and not marker.is_symlink():
        return False
    try:
        found = json.loads(marker.read_text()) if marker.is_file() and not marker.is_symlink() else None
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict) or found.get("format") != DIR_FORMAT:
        raise GptkitError(
            f"{marker} is not a marker of gptkit's prefix cache ({DIR_FORMAT}): another program's file, or "
            "another gptkit version's cache; give --cache-dir an empty or new directory (nothing was changed)"
        )
    return True


def _inventory(directory: Path, marked: bool) -> tuple[list[tuple[float, Path, int]], list[Path], list[Path]]:
    """(block files as (mtime, path, size), temporary files, files the cache did not write), sorted; the search stops
    once more than _SHOWN foreign files are found (a mistaken directory may be large)."""
    blocks: list[tuple[float, Path, int]] = []
    temps: list[Path] = []
    foreign: list[Path] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if len(foreign) > _SHOWN:
            break
        path = Path(entry.path)
        if entry.name == MARKER:
            continue  # _check_marker read it
        if entry.is_file(follow_symlinks=False) and _MARKER_TEMP.fullmatch(entry.name):
            temps.append(path)
        elif entry.is_dir(follow_symlinks=False) and _HEX.fullmatch(entry.name):
            _inventory_namespace(path, marked, blocks, temps, foreign)
        else:
            foreign += _files_in(path)
    return blocks, temps, foreign


def _inventory_namespace(folder: Path, marked: bool, blocks: list, temps: list, foreign: list) -> None:
    """Sort one namespace folder's entries into blocks, temporary files and foreign entries."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        path = Path(entry.path)
        if not entry.is_file(follow_symlinks=False):
            foreign += _files_in(path)
        elif _TEMP.fullmatch(entry.name):
            temps.append(path)
        elif _BLOCK.fullmatch(entry.name) and _written_by_the_cache(path, marked):
            stat = entry.stat(follow_symlinks=False)
            blocks.append((stat.st_mtime, path, stat.st_size))
        else:
            foreign.append(path)


def _files_in(path: Path) -> list[Path]:
    """Up to _SHOWN + 1 files under a foreign entry, first in name order (the entry itself when it is a file, a link
    or an empty folder): what a refusal names."""
    if path.is_symlink() or not path.is_dir():
        return [path]
    found: list[Path] = []
    for root, folders, files in os.walk(path):
        folders.sort()
        found += [Path(root) / name for name in sorted(files)][: _SHOWN + 1 - len(found)]
        if len(found) > _SHOWN:
            break
    return found or [path]


def _sweep(temps: list[Path]) -> int:
    """Remove temporary files a killed writer left (never renamed into place, so never read); returns the bytes of
    those that could not be removed."""
    stray = 0
    for path in temps:
        try:
            size = path.lstat().st_size
        except OSError:  # gone already
            continue
        try:
            path.unlink()
        except OSError:
            stray += size
    return stray
