"""The on-disk cache of gptkit's CPU kernel library (native/build.py): where it lives, what names it, how a build
claims it, and how a library is checked before it is loaded.

One directory per instruction set and key, under $TORCH_EXTENSIONS_DIR or torch's default root. The key is a hash
of everything the library's bits depend on: the C++ sources, the compiler flags, the compiler's version and torch's
version. So two copies of gptkit with the same sources (two checkouts, two virtual environments) share one library,
and two versions never overwrite each other's.

A build runs in a process of its own (spawn_build, main), so that it finishes even where the command that started
it ends first. It compiles in a directory of its own (.build-PID), then moves the finished library into the cache
under a name holding its SHA-256, and only then writes manifest.json naming it (atomically): a reader sees the
previous state or the new one, never a library half-written. A library is loaded only after its size and SHA-256
match the manifest; a file that does not (cut short, overwritten, garbage) is never loaded, is named in one warning,
and is built again. The build lock (build.lock, an flock the system releases when its holder dies) only keeps two
processes from doing the same work: whoever finds it held by a live builder does not wait for it, and a holder that
is stopped (SIGSTOP, a debugger) or has held it past STALE_AFTER_S does not count.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch

from gptkit.atomic import atomic_write_text

log = logging.getLogger("gptkit.native")

MANIFEST = "manifest.json"
LOCK = "build.lock"
BUILD_LOG = "build.log"  # why the last build failed
BUSY = 3  # the builder process's exit status where a live process is building already
WORK_PREFIX = ".build-"  # + the building process's id
# A build takes about a minute on 2 busy cores: a lock held ten times as long is a builder that will not finish.
STALE_AFTER_S = 600.0
_LIBRARY_NAME = re.compile(r"kernels-[0-9a-f]{16}\.so")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_WARNED: set[str] = set()  # one line per file per process (a waiting process looks again every second)


def directory(isa: str, sources: list[Path], flags: list[str]) -> Path:
    """The cache directory of the library built from these sources with these flags for this instruction set."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"gptkit_kernels_{isa}_{key(sources, flags)}"


def key(sources: list[Path], flags: list[str]) -> str:
    """A hash of what the library's bits depend on: every source and header beside the sources (by name and
    content, not by path: copies share it), the flags, the compiler's version and torch's version."""
    digest = hashlib.sha256()
    folders = sorted({path.parent for path in sources})
    for path in sorted(p for folder in folders for p in folder.iterdir() if p.suffix in (".cpp", ".h")):
        content = path.read_bytes()
        digest.update(f"{path.name}\0{len(content)}\0".encode() + content)
    digest.update("\0".join([*flags, compiler_version(), torch.__version__]).encode())
    return digest.hexdigest()[:16]


@functools.cache
def compiler_version() -> str:
    """The first line of `$CXX --version` (torch's build compiles with $CXX, else c++), or why there is none."""
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"{compiler}: {type(err).__name__}"
    first = done.stdout.splitlines()[0] if done.stdout.strip() else f"exit status {done.returncode}"
    return f"{compiler}: {first}"


def _warn_once(path: Path, problem: str, level: int = logging.WARNING) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        log.log(level, "gptkit's CPU kernel cache: %s %s", path, problem)


def verified_library(cache: Path) -> Path | None:
    """The library the cache's manifest names, if its size and SHA-256 are the manifest's; else None (nothing built
    yet, or with one warning naming the damaged file: it is built again)."""
    manifest = cache / MANIFEST
    try:
        entry = _parse_manifest(manifest.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        entry = f"cannot be read ({err})"
    if isinstance(entry, str):
        _warn_once(manifest, f"{entry}; it is not used and the library is built again")
        return None
    library = cache / entry["library"]
    try:
        data = library.read_bytes()
    except OSError as err:
        _warn_once(library, f"(named by {manifest}) cannot be read ({err.strerror}); building it again")
        return None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        _warn_once(
            library,
            f"does not match {manifest} ({len(data)} bytes of {entry['bytes']}, or other bytes: cut "
            "short or overwritten); it is not loaded and is built again",
        )
        return None
    return library


def _parse_manifest(text: str) -> dict | str:
    """The manifest's fields, checked one by one, or what is wrong with it."""
    try:
        entry = json.loads(text)
    except ValueError:
        return "is not JSON"
    if not isinstance(entry, dict):
        return "is not a JSON object"
    if not isinstance(entry.get("library"), str) or not _LIBRARY_NAME.fullmatch(entry["library"]):
        return 'does not name a library file ("library": "kernels-<16 hex digits>.so")'
    if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
        return 'has no SHA-256 ("sha256": 64 hex digits)'
    if type(entry.get("bytes")) is not int or entry["bytes"] <= 0:
        return 'has no size ("bytes": a positive integer)'
    return entry


def saved_choices(path: Path) -> dict[str, dict[str, bool]]:
    """choices.json's entries ({machine key: {choice: bool}}); missing counts as empty, and so does a file that is
    not of that shape (with one warning naming it: its choices are measured again and the file rewritten)."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        _warn_once(path, f"cannot be read as kernel choices ({err}); measuring them again")
        return {}
    entries = saved.values() if isinstance(saved, dict) else [None]
    if not all(isinstance(e, dict) and all(isinstance(v, bool) for v in e.values()) for e in entries):
        _warn_once(
            path,
            "is not a file of kernel choices (an object of machines, each naming choices true or false); "
            "measuring them again and rewriting it",
        )
        return {}
    return saved


def keep_choices(path: Path, saved: dict[str, dict[str, bool]]) -> None:
    """Write choices.json whole (a warning where the cache cannot be written: the choices hold for this process)."""
    try:
        atomic_write_text(path, json.dumps(saved, indent=1))
    except OSError as err:
        log.warning("could not keep the kernel choices in %s: %s", path, err)


@contextlib.contextmanager
def claim(cache: Path) -> Iterator[bool]:
    """Take the cache's build lock without waiting: True while this process may build (it holds the lock, or the
    holder is stopped or stale: then with one warning), False where a live process is building now."""
    import fcntl  # Unix only, as builds are

    with open(cache / LOCK, "a+") as handle:  # "a+": opening must not erase the holder's line
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            stale = _stale(handle)
            if stale is not None:
                _warn_once(cache / LOCK, f"{stale}; building without waiting for it")
            yield stale is not None
            return
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {time.time():.0f}\n")  # who holds it since when, for those who find it held
        handle.flush()
        yield True


def _stale(handle: IO[str]) -> str | None:
    """Why the lock's holder will not finish (stopped, or holding it too long), or None for a live builder."""
    handle.seek(0)
    fields = handle.read().split()
    try:
        pid, since = int(fields[0]), float(fields[1])
    except (IndexError, ValueError):
        return None  # its holder took it a moment ago and has not written its line yet
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = "?"  # not visible here (another PID namespace): only its age can tell
    if state in ("T", "t"):
        return f"is held by process {pid}, which is stopped"
    held = time.time() - since
    if held > STALE_AFTER_S:
        return f"has been held by process {pid} for {held:.0f} s (a build takes about a minute)"
    return None


def busy(cache: Path) -> bool:
    """Whether a live process is building in cache now (claim's answer, the lock released again at once; said once
    per process: the caller does not wait for it)."""
    cache.mkdir(parents=True, exist_ok=True)
    with claim(cache) as ours:
        if not ours:
            _warn_once(cache, "is being built by another process: PyTorch's products until it is done", logging.INFO)
        return not ours


def spawn_build(cache: Path, name: str, sources: list[Path], cflags: list[str]) -> subprocess.Popen:
    """Run main() (build()) in a process of its own, in its own session: it outlives this one (a command that ends
    first leaves it to finish, for the next command to load) and is not interrupted with it (Ctrl-C)."""
    args = [str(cache), name, json.dumps(cflags), *map(str, sources)]
    return subprocess.Popen(
        [sys.executable, "-m", "gptkit.native.cache", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def main(args: list[str]) -> int:
    """The builder process (spawn_build's arguments): builds the library into the cache, unless a live process is
    building it (exit status BUSY) or it is there already (0); where the build fails, writes why to build.log and
    exits with 1."""
    cache, name, cflags, sources = Path(args[0]), args[1], json.loads(args[2]), [Path(a) for a in args[3:]]
    with claim(cache) as ours:
        if not ours:
            return BUSY
        if verified_library(cache) is not None:
            return 0
        try:
            build(cache, name, sources, cflags)
            (cache / BUILD_LOG).unlink(missing_ok=True)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
            with contextlib.suppress(OSError):  # a cache that cannot be written: the exit status says enough
                atomic_write_text(cache / BUILD_LOG, f"{err}\n")
            return 1
    return 0


def build_error(cache: Path) -> str:
    """Why the last build failed (the first line build.log holds, and where the rest is)."""
    try:
        first = (cache / BUILD_LOG).read_text().strip().splitlines()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        return "its builder process ended without a library"
    return f"{first} (the whole message: {cache / BUILD_LOG})"


def build(cache: Path, name: str, sources: list[Path], cflags: list[str]) -> Path:
    """Compile and load the library (torch's JIT build) in this process's own directory, move it into the cache
    whole, write the manifest naming it, and return its path. Raises what the build raises."""
    from torch.utils import cpp_extension

    _remove_abandoned_work(cache)
    work = cache / f"{WORK_PREFIX}{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(work),
            is_python_module=False,
        )
        built = work / f"{name}.so"
        data = built.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        library = cache / f"kernels-{digest[:16]}.so"
        os.replace(built, library)  # within one directory tree: whole or not at all
        manifest = {
            "library": library.name,
            "sha256": digest,
            "bytes": len(data),
            "torch": torch.__version__,
            "compiler": compiler_version(),
            "flags": cflags,
        }
        atomic_write_text(cache / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return library


def _remove_abandoned_work(cache: Path) -> None:
    """Remove the build directories that processes now gone left (a build killed midway leaves its objects), once
    untouched for STALE_AFTER_S: a process of another PID namespace sharing the cache may look gone from here."""
    for work in cache.glob(f"{WORK_PREFIX}*"):
        pid = work.name[len(WORK_PREFIX) :]
        try:
            idle = time.time() - work.stat().st_mtime
        except OSError:
            continue
        if pid.isdigit() and idle > STALE_AFTER_S and not _alive(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
