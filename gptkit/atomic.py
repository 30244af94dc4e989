"""Atomic file writes: a temporary file beside the target, fsync, rename. Torch-free, so cheap to import."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside this directory durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename itself is still atomic
    finally:
        os.close(fd)


def _default_mode() -> int:
    """The mode a plainly created file would get (mkstemp's files are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call write(tmp_path) on a temporary file beside path, fsync it, then rename it over path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _default_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(text))
