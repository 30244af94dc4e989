"""Atomic file writes (a temporary file beside the target, fsync, rename) and atomic replacement of a directory's
contents (built beside it, then swapped in), and the one way a command reports a write the storage refused (a full
disk, a read-only directory, ...): one line naming the path and what was kept. Torch-free, so cheap to import."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from gptkit.errors import GptkitError, WriteError

# Errors that come from the storage, not from gptkit: a full disk or quota, a read-only or unwritable place, a
# failing device, a file over the size limit, a path through a file. A write meeting one is reported in one line.
STORAGE_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.EIO,
        errno.EFBIG,
        errno.ENOTDIR,
        errno.ENAMETOOLONG,
    }
)


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


def make_parents(path: Path) -> list[Path]:
    """Create the missing directories above path; returns those it created, outermost first."""
    missing = [p for p in Path(path).parents if not p.exists()][::-1]
    try:
        for directory in missing:
            directory.mkdir(exist_ok=True)
    except BaseException:
        remove_empty(missing)
        raise
    return missing


def remove_empty(directories: list[Path]) -> None:
    """Remove these directories, innermost first, while they are empty (what a failed write made and left bare)."""
    for directory in reversed(directories):
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty: someone else's files are there, and so in the directories above
            return


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call write(tmp_path) on a temporary file beside path, fsync it, then rename it over path.

    On any failure the temporary file, and the directories made for it, are removed."""
    path = Path(path)
    made = make_parents(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except BaseException:
        remove_empty(made)
        raise
    os.close(fd)
    try:
        try:
            write(Path(tmp))
        except OSError as err:
            raise _with_reason(err, Path(tmp)) from None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        remove_empty(made)
        raise
    fsync_dir(path.parent)


def _with_reason(err: OSError, tmp: Path) -> OSError:
    """err, or for a short write reported without the storage's reason (numpy's tofile says only "N requested and M
    written", on a full disk or past a size limit) the error that writing on past the file's end meets."""
    if err.errno is not None:
        return err
    try:
        with open(tmp, "ab") as f:
            f.write(bytes(1 << 16))
            f.flush()
    except OSError as reason:
        return reason
    return err


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
        carry = [
            e.name
            for e in os.scandir(target)
            if e.name != JOURNAL and not owned(e.name) and not os.path.lexists(staging / e.name)
        ]
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
        if (
            isinstance(name, str)
            and "/" not in name
            and os.path.lexists(old / name)
            and not os.path.lexists(target / name)
        ):
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


# ---------------------------------------------------------------- one line for a write the storage refused


def storage_error(err: OSError, path: str | Path, kept: str) -> WriteError | None:
    """The one-line WriteError for a write to path the storage refused (STORAGE_ERRNOS); None for another OSError."""
    if err.errno not in STORAGE_ERRNOS:
        return None
    return WriteError(f"cannot write {path}: {err.strerror or os.strerror(err.errno)} ({kept})")


def _what_is_kept(path: Path, what: str) -> str:
    return f"the existing {what} is unchanged" if os.path.lexists(path) else "nothing was written"


@contextlib.contextmanager
def reported(path: str | Path, note: str = "", what: str = "file") -> Iterator[None]:
    """Within the block, an OSError of the storage becomes a WriteError naming path and what was kept.

    What was kept is "nothing was written" for a new path, else "the existing <what> is unchanged" (the block
    writes atomically); note adds what else is unchanged, e.g. "the source is unchanged".
    """
    kept = "; ".join(filter(None, (_what_is_kept(Path(path), what), note)))
    try:
        yield
    except OSError as err:
        error = storage_error(err, path, kept)
        if error is None:
            raise
        raise error from None


def _disowned(name: str) -> bool:
    return False


@contextlib.contextmanager
def building_dir(
    target: str | Path, marker: str, owned: Callable[[str], bool] = _disowned, note: str = "", what: str = "directory"
) -> Iterator[Path]:
    """Yield an empty hidden directory beside target to write target's new contents in; when the block ends they
    replace target's at once (replace_dir; `marker` is the file that makes target complete, and target's entries
    that owned() disowns stay). When the block fails they are deleted, with any directory made for them, so nothing
    half-written remains; an OSError of the storage becomes one WriteError line (see reported).
    """
    shown = Path(target)
    target = shown.resolve()  # a symlinked directory is replaced where it lives
    if target.exists() and not target.is_dir():
        raise GptkitError(f"{shown} exists and is not a directory; give a directory to write")
    existed = target.exists()
    with reported(shown, note, what):
        sweep_staging(target)  # what killed runs left
        made = make_parents(target) + ([] if existed else [target])  # (staging_dir may have to make target)
        try:
            stage = staging_dir(target)
        except BaseException:
            remove_empty(made)
            raise
        try:
            yield stage
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            remove_empty(made)
            raise
        _put_in_place(stage, target, owned, marker, shown, existed)


def _put_in_place(
    stage: Path, target: Path, owned: Callable[[str], bool], marker: str, shown: Path, existed: bool
) -> None:
    """building_dir's last step: replace_dir, whose failure over an existing target may leave it part-moved."""
    try:
        replace_dir(stage, target, owned, marker)
    except OSError as err:
        shutil.rmtree(stage, ignore_errors=True)
        kept = "it may be incomplete: run the command again" if existed else "nothing was written"
        raise storage_error(err, shown, kept) or err from None
