"""An input file's bytes as its readers see them: compression told by its first bytes and undone (gzip, xz, bzip2,
zstd frame by frame), decompressed ahead on a thread, counted and hashed as read; a failed read or damaged data as
one line naming the file and the byte."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import importlib
import io
import lzma
import queue
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gptkit.errors import GptkitError, InputError

READ_CHUNK = 1 << 20  # bytes read from a file at a time
# zstd input is decompressed in pieces of ZSTD_FEED bytes, whose output arrives whole (zstandard's decompressobj
# takes no output limit): a piece of 1 KiB inflates to at most ~32 MB (runs of one byte), text to a few KiB.
# Pieces are decompressed until ZSTD_OUT bytes are ready, so that calls stay few.
ZSTD_FEED = 1 << 10
ZSTD_OUT = 1 << 18
READ_AHEAD = 4  # decompressed chunks a compressed file's reader thread may hold ready

# Compressions read transparently: (magic bytes, name, extra that provides the module or None for the stdlib).
COMPRESSIONS = [
    (b"\x1f\x8b", "gzip", None),
    (b"\xfd7zXZ\x00", "xz", None),
    (b"BZh", "bzip2", None),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd"),
]


def compression_of(head: bytes) -> tuple[str, str | None] | None:
    """(name, extra) of the compression these first bytes announce, or None."""
    return next(((name, extra) for magic, name, extra in COMPRESSIONS if head.startswith(magic)), None)


def optional(module: str, extra: str, what: str) -> Any:
    """Import a module that only one input format needs; a one-line error naming the extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(f"reading {what} needs the optional {module} package: pip install 'gptkit[{extra}]'") from None


def decompressed(raw: IO[bytes], compression: str) -> IO[bytes]:
    """A stream of raw's decompressed bytes."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "xz":
        return lzma.LZMAFile(raw)
    if compression == "bzip2":
        return bz2.BZ2File(raw)
    zstandard = optional("zstandard", "zstd", "zstd-compressed input")
    return io.BufferedReader(ZstdFrames(raw, zstandard.ZstdDecompressor()), READ_CHUNK)


class ZstdFrames(io.RawIOBase):
    """zstd-compressed bytes decompressed frame after frame (`cat a.zst b.zst` makes a file of two); input that ends
    inside a frame is an EOFError, as gzip's is (zstandard's stream_reader ends there quietly: a cut file would be
    read as if it were whole)."""

    def __init__(self, raw: IO[bytes], decompressor: Any) -> None:
        self.raw = raw
        self.decompressor = decompressor
        self.frame: Any = None  # the frame being decoded; None between frames
        self.out = memoryview(b"")  # decompressed bytes not read yet
        self.unfed = b""  # input past the end of the last frame

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.out:
            if not self._decode():
                return 0
        n = min(len(buffer), len(self.out))
        buffer[:n] = self.out[:n]
        self.out = self.out[n:]
        return n

    def _decode(self) -> bool:
        """Decompress the next pieces of input into self.out (about ZSTD_OUT bytes); False at the end of the
        input."""
        pieces, size, fed = [], 0, False
        while size < ZSTD_OUT:
            data, self.unfed = self.unfed or self.raw.read(ZSTD_FEED), b""
            if not data:
                if self.frame is not None:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                break
            fed = True
            if self.frame is None:
                self.frame = self.decompressor.decompressobj()
            pieces.append(self.frame.decompress(data))
            size += len(pieces[-1])
            if self.frame.eof:
                self.frame, self.unfed = None, self.frame.unused_data
        self.out = memoryview(b"".join(pieces))
        return fed


def damage_types() -> tuple[type[Exception], ...]:
    """What the decompressors raise for damaged or cut-short data (bzip2 and gzip's header checks: an OSError
    without an errno; zstandard's ZstdError once the module is loaded)."""
    zstandard = sys.modules.get("zstandard")
    return (EOFError, lzma.LZMAError, zlib.error) + ((zstandard.ZstdError,) if zstandard else ())


def read_error(path: Path, err: Exception, compression: str | None, offset: int | None) -> InputError | None:
    """The one-line error for a failed read of an input: damaged compressed data (with the byte of the file it is
    at or before, when known) or an error of the storage; None for any other exception."""
    if isinstance(err, GptkitError):  # a reader's own error (invalid UTF-8, say) says what it needs to
        return None
    at = f" at or before byte {offset:,} of the file" if offset is not None else ""
    errno_less = isinstance(err, OSError) and err.errno is None  # (bzip2's "Invalid data stream", BadGzipFile)
    if compression is not None and (isinstance(err, damage_types()) or errno_less):
        return InputError(
            f"{path}: damaged or truncated compressed file ({compression} data{at}: {err}); check it "
            f"with `{compression} -t {path}` and re-create or re-download it"
        )
    if isinstance(err, OSError):
        where = f" at byte {offset:,}" if offset is not None else ""
        return InputError(f"cannot read input {path}{where}: {err.strerror or err}")
    return None


def tell(f: IO[bytes]) -> int | None:
    """Where a file stands (the bytes read from it), or None when even that cannot be asked."""
    try:
        return f.tell()
    except OSError:
        return None


class Counted(io.RawIOBase):
    """A file's bytes as read in order: hashed, and counted for the progress bar."""

    def __init__(self, f: IO[bytes], on_bytes: Callable[[int], None]) -> None:
        self.f = f
        self.on_bytes = on_bytes
        self.digest = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.f.readinto(buffer)
        if n:
            view = memoryview(buffer)[:n]
            self.digest.update(view)
            self.size += n
            self.on_bytes(n)
        return n or 0


class ReadAhead(io.RawIOBase):
    """A stream read READ_CHUNK at a time by a background thread, up to READ_AHEAD chunks ahead of its reader, so
    that decompressing (zlib, lzma, bz2 and zstd let go of the GIL) runs beside tokenizing instead of before it.
    The thread starts at the second chunk (a reader of the first row only reads no further); an error of the
    thread's is raised to the reader where the data would have come."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.chunks: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=READ_AHEAD)
        self.stopping = threading.Event()
        self.current = memoryview(b"")
        self.ended = False
        self.thread: threading.Thread | None = None

    def _fill(self) -> None:
        try:
            while not self.stopping.is_set():
                chunk = self.stream.read(READ_CHUNK)
                self._put(chunk)
                if not chunk:
                    return
        except BaseException as err:  # whatever it is, the reader raises it where its data would have come
            self._put(err)

    def _put(self, item: bytes | BaseException) -> None:
        while not self.stopping.is_set():  # a reader that stops early (close) must not leave the thread waiting
            try:
                self.chunks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.current:
            if self.ended:
                return 0
            if self.thread is None:  # the first chunk: read here
                item: bytes | BaseException = self.stream.read(READ_CHUNK)
                self.thread = threading.Thread(target=self._fill, name="gptkit-read-ahead", daemon=True)
                self.thread.start()
            else:
                item = self.chunks.get()
            if isinstance(item, BaseException):
                self.ended = True
                raise item
            if not item:
                self.ended = True
                return 0
            self.current = memoryview(item)
        n = min(len(buffer), len(self.current))
        buffer[:n] = self.current[:n]
        self.current = self.current[n:]
        return n

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            with contextlib.suppress(queue.Empty):  # a put the thread is waiting on goes through at once
                while True:
                    self.chunks.get_nowait()
            self.thread.join()
        super().close()
