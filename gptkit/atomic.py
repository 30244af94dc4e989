"""Atomic file writes (a temporary file beside the target, fsync, rename) and atomic replacement of a directory's
contents (built beside it, then swapped in). Torch-free, so cheap to import."""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    umask = os.umask(0)  # the only way to read it; set straight back
    os.umask(umask)
    return umask


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


def default_file_mode() -> int:
    """The mode a plainly created file would get (mkstemp's files are 0600)."""
    return 0o666 & ~_umask()


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
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(text))


# ---------------------------------------------------------------- replacing a directory's contents at once

STAGING_TAG = ".staging-"  # a staging directory: "<target>.staging-<pid>-<random>", hidden beside the target
JOURNAL = ".gptkit-swap.json"  # in a target swapped in: its entries still to carry over from the old contents


def default_dir_mode() -> int:
    """The mode a plainly created directory would get (mkdtemp's are 0700)."""
    return 0o777 & ~_umask()


def exchange(a: Path, b: Path) -> None:
    """Swap two paths in one atomic step (Linux renameat2, macOS renamex_np); OSError where that cannot be done."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith(("linux", "darwin")) else None
    if libc is not None and hasattr(libc, "renameat2"):  # Linux 3.15+, glibc 2.28+
        at_fdcwd, rename_exchange = -100, 2
        result = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    elif libc is not None and hasattr(libc, "renamex_np"):  # macOS 10.12+
        result = libc.renamex_np(os.fsencode(a), os.fsencode(b), 2)  # RENAME_SWAP
    else:
        raise OSError(errno.ENOSYS, "this system cannot swap two directories atomically")
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def staging_dir(target: Path) -> Path:
    """A new empty hidden directory to build target's replacement in: beside target, or inside it if need be."""
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(target.stat().st_mode) if target.is_dir() else default_dir_mode()
    try:
        path = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_TAG}{os.getpid()}-", dir=target.parent))
    except PermissionError:  # the parent is not ours to write: stage inside the target (files then move singly)
        target.mkdir(exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{STAGING_TAG}{os.getpid()}-", dir=target))
    os.chmod(path, mode)
    return path


def replace_dir(staging: Path, target: Path, owned: Callable[[str], bool], marker: str) -> None:
    """Put staging's entries in place of target's; target's entries that owned() disowns stay in target.

    Where the system can exchange two directories, target's old and new contents swap in one step, so every
    instant sees one or the other whole; the disowned entries are then carried from the old contents (a journal
    in target lets finish_replace complete that after a kill). Elsewhere (no exchange on this system or file
    system, target a mount point or the working directory, staging inside target) the entries move one by one:
    `marker`, the file that makes target complete, is removed first and moved in last.
    """
    if staging.parent == target.parent and not target.exists():
        os.rename(staging, target)
        fsync_dir(target.parent)
        return
    if staging.parent == target.parent and not os.path.ismount(target) and not _holds_cwd(target):
        carry = [e.name for e in os.scandir(target)
                 if e.name != JOURNAL and not owned(e.name) and not os.path.lexists(staging / e.name)]  # fmt: skip
        journal = staging / JOURNAL
        if carry:
            atomic_write_text(journal, json.dumps({"from": staging.name, "carry": carry}) + "\n")
        try:
            exchange(staging, target)
        except OSError:
            journal.unlink(missing_ok=True)
        else:
            fsync_dir(target.parent)
            if carry:
                finish_replace(target)
            shutil.rmtree(staging, ignore_errors=True)  # the old contents
            return
    _move_entries(staging, target, owned, marker)


def _holds_cwd(path: Path) -> bool:
    cwd = Path.cwd()
    return cwd == path or path in cwd.parents


def _move_entries(staging: Path, target: Path, owned: Callable[[str], bool], marker: str) -> None:
    """replace_dir's fallback: target loses its marker, its owned entries are replaced, and the marker comes last."""
    target.mkdir(parents=True, exist_ok=True)
    (target / marker).unlink(missing_ok=True)
    fsync_dir(target)
    new = {e.name for e in os.scandir(staging)}
    for entry in os.scandir(target):
        if owned(entry.name) and entry.name not in new:  # a file of the old contents the new ones lack
            _remove(Path(entry.path))
    for name in sorted(new - {marker}) + [marker]:
        if (target / name).is_dir() and not (target / name).is_symlink():
            shutil.rmtree(target / name)
        os.replace(staging / name, target / name)
    fsync_dir(target)
    shutil.rmtree(staging, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def finish_replace(target: Path) -> None:
    """Carry what a journal in target lists from the old contents into target, then delete the old contents."""
    journal = target / JOURNAL
    try:
        plan = json.loads(journal.read_text(encoding="utf-8"))
        old, carry = target.parent / plan["from"], list(plan["carry"])
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError):
        journal.unlink(missing_ok=True)  # unreadable: nothing safe to do with it
        return
    if old.parent != target.parent or not old.name.startswith(f".{target.name}{STAGING_TAG}"):
        journal.unlink(missing_ok=True)  # names no staging directory of this target: ignore it
        return
    for name in carry:
        if isinstance(name, str) and "/" not in name and os.path.lexists(old / name) \
                and not os.path.lexists(target / name):  # fmt: skip
            os.rename(old / name, target / name)
    fsync_dir(target)
    shutil.rmtree(old, ignore_errors=True)
    journal.unlink(missing_ok=True)


def sweep_staging(target: Path) -> None:
    """Finish a replacement a killed process swapped in, and delete the staging directories dead processes left."""
    if target.is_dir():
        finish_replace(target)
    found = list(target.parent.glob(f".{glob.escape(target.name)}{STAGING_TAG}*"))
    if target.is_dir():
        found += target.glob(f"{STAGING_TAG}*")
    for path in found:
        pid = path.name.rsplit(STAGING_TAG, 1)[1].split("-", 1)[0]
        if path.is_dir() and not path.is_symlink() and not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether another process with this id runs (this process's own leftovers count as dead)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
