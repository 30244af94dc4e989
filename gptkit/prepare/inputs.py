"""The documents of `gptkit prepare`'s inputs, streamed from files and directories in the formats people have.

Formats, told by the file's name (after any compression suffix): plain text (one document a file), and rows:
`.jsonl`/`.ndjson`, `.csv`/`.tsv` (through the csv module, a header row naming the columns), `.parquet` (one row
group at a time; needs pyarrow). Each may be gzip, xz, bzip2 or zstd compressed (told by the file's first bytes;
zstd needs the zstandard package). A format is one reader function: read_text yields a document's Pieces, a row
reader yields records (dicts), which Reader turns into documents (a named field's text) and `records` hands to
other uses (supervised examples). A file of a binary format (PDF, image, archive, executable, ...) is named in a
one-line error that says what to do instead.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import csv
import gzip
import hashlib
import importlib
import importlib.util
import io
import json
import logging
import lzma
import os
import queue
import re
import sys
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gptkit.errors import GptkitError, InputError

logger = logging.getLogger(__name__)

READ_CHUNK = 1 << 20  # bytes read from a file at a time
# zstd input is decompressed in pieces of ZSTD_FEED bytes, whose output arrives whole (zstandard's decompressobj
# takes no output limit): a piece of 1 KiB inflates to at most ~32 MB (runs of one byte), text to a few KiB.
# Pieces are decompressed until ZSTD_OUT bytes are ready, so that calls stay few.
ZSTD_FEED = 1 << 10
ZSTD_OUT = 1 << 18
READ_AHEAD = 4  # decompressed chunks a compressed file's reader thread may hold ready
SNIFF_BYTES = 8192  # bytes inspected to tell a file's format from its content
# Above this share of invalid bytes around the first bad one, a file is not "text with a few bad bytes" and
# --errors replace would train on noise.
REPLACE_MAX_INVALID = 0.01
UTF8_WINDOW = 1 << 16
PARQUET_BATCH_ROWS = 1024  # rows converted to Python at a time  # bytes each side of the first invalid one over which that share is measured


@dataclass(frozen=True)
class Piece:
    """A run of text from one document; `starts_document` marks a document's first piece."""

    text: str
    starts_document: bool
    source: str  # "file", "file line N" or "file row N", for error messages
    offset: int  # character offset of text inside its document


@dataclass
class Source:
    """One input file as a reader sees it."""

    path: Path
    stream: IO[bytes]  # the file's bytes, decompressed
    errors: str  # "strict" or "replace" for invalid UTF-8
    on_bytes: Callable[[int], None]  # progress, in bytes of the file (for readers that bypass `stream`)
    compressed: bool

    @property
    def where(self) -> str:
        """The file's name in messages (decompressed content is said to be so)."""
        return f"{self.path} (decompressed)" if self.compressed else str(self.path)


# ---------------------------------------------------------------- telling formats apart

# Compressions read transparently: (magic bytes, name, extra that provides the module or None for the stdlib).
COMPRESSIONS = [
    (b"\x1f\x8b", "gzip", None),
    (b"\xfd7zXZ\x00", "xz", None),
    (b"BZh", "bzip2", None),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd"),
]
COMPRESSION_SUFFIXES = {".gz", ".gzip", ".xz", ".bz2", ".zst", ".zstd"}
PARQUET_MAGIC = b"PAR1"

_EXTRACT = "extract its text first and prepare that"
_LEAVE_OUT = "it holds no text to train on: leave it out (in a directory, --glob picks the files to read)"
_UNPACK = "unpack it and prepare the files it holds"
# Binary formats recognised by their first bytes: (magic, offset, what the file is, what to do instead).
BINARY_FORMATS = [
    (
        b"%PDF-",
        0,
        "a PDF document",
        "extract its text first (e.g. pdftotext FILE FILE.txt, from poppler-utils) and prepare that",
    ),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", 0, "a Microsoft Office document (.doc, .xls, .ppt)", _EXTRACT),
    (b"{\\rtf", 0, "an RTF document", "extract its text first (e.g. unrtf --text FILE) and prepare that"),
    (b"\x89PNG\r\n\x1a\n", 0, "a PNG image", _LEAVE_OUT),
    (b"\xff\xd8\xff", 0, "a JPEG image", _LEAVE_OUT),
    (b"GIF87a", 0, "a GIF image", _LEAVE_OUT),
    (b"GIF89a", 0, "a GIF image", _LEAVE_OUT),
    (b"II*\x00", 0, "a TIFF image", _LEAVE_OUT),
    (b"MM\x00*", 0, "a TIFF image", _LEAVE_OUT),
    (b"RIFF", 0, "a RIFF file (WebP image, WAV audio or AVI video)", _LEAVE_OUT),
    (b"OggS", 0, "an Ogg audio or video file", _LEAVE_OUT),
    (b"fLaC", 0, "a FLAC audio file", _LEAVE_OUT),
    (b"ID3", 0, "an MP3 audio file", _LEAVE_OUT),
    (b"ftyp", 4, "an MP4 / QuickTime video or audio file", _LEAVE_OUT),
    (
        b"PK\x03\x04",
        0,
        "a ZIP archive (.zip, or a .docx / .xlsx / .epub / .jar, which are ZIP archives)",
        f"{_UNPACK} (or, for a document, {_EXTRACT})",
    ),
    (b"ustar", 257, "a tar archive", f"{_UNPACK} (tar xf FILE)"),
    (b"7z\xbc\xaf\x27\x1c", 0, "a 7-Zip archive", _UNPACK),
    (b"Rar!\x1a\x07", 0, "a RAR archive", _UNPACK),
    (b"\x7fELF", 0, "an ELF executable or library", _LEAVE_OUT),
    (b"\xcf\xfa\xed\xfe", 0, "a Mach-O executable", _LEAVE_OUT),
    (b"SQLite format 3\x00", 0, "an SQLite database", "export the text it holds (e.g. as JSONL) and prepare that"),
    (b"\x89HDF\r\n\x1a\n", 0, "an HDF5 file", _LEAVE_OUT),
    (b"\x93NUMPY", 0, "a NumPy array file", _LEAVE_OUT),
]


def _compression(head: bytes) -> tuple[str, str | None] | None:
    """(name, extra) of the compression these first bytes announce, or None."""
    return next(((name, extra) for magic, name, extra in COMPRESSIONS if head.startswith(magic)), None)


def binary_kind(head: bytes) -> tuple[str, str] | None:
    """(what the file is, what to do) when its first bytes are a binary format gptkit cannot read, else None."""
    for magic, offset, what, advice in BINARY_FORMATS:
        if head[offset : offset + len(magic)] == magic:
            return what, advice
    if b"\0" in head:
        return (
            "binary, not UTF-8 text (it holds NUL bytes)",
            "if it is UTF-16 text, convert it (e.g. iconv -f UTF-16 -t UTF-8); otherwise leave it out",
        )
    return None


def _format(path: Path) -> str:
    """The format a file's name says: jsonl, csv, tsv, parquet or text (a compression suffix is looked through)."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    last = suffixes[-1] if suffixes else ""
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}.get(
        last, "text"
    )


def _optional(module: str, extra: str, what: str) -> Any:
    """Import a module that only one input format needs; a one-line error naming the extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(f"reading {what} needs the optional {module} package: pip install 'gptkit[{extra}]'") from None


def _decompressed(raw: IO[bytes], compression: str) -> IO[bytes]:
    """A stream of raw's decompressed bytes."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "xz":
        return lzma.LZMAFile(raw)
    if compression == "bzip2":
        return bz2.BZ2File(raw)
    zstandard = _optional("zstandard", "zstd", "zstd-compressed input")
    return io.BufferedReader(_ZstdFrames(raw, zstandard.ZstdDecompressor()), READ_CHUNK)


class _ZstdFrames(io.RawIOBase):
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


def _damage_types() -> tuple[type[Exception], ...]:
    """What the decompressors raise for damaged or cut-short data (bzip2 and gzip's header checks: an OSError
    without an errno; zstandard's ZstdError once the module is loaded)."""
    zstandard = sys.modules.get("zstandard")
    return (EOFError, lzma.LZMAError, zlib.error) + ((zstandard.ZstdError,) if zstandard else ())


def _read_error(path: Path, err: Exception, compression: str | None, offset: int | None) -> InputError | None:
    """The one-line error for a failed read of an input: damaged compressed data (with the byte of the file it is
    at or before, when known) or an error of the storage; None for any other exception."""
    if isinstance(err, GptkitError):  # a reader's own error (invalid UTF-8, say) says what it needs to
        return None
    at = f" at or before byte {offset:,} of the file" if offset is not None else ""
    errno_less = isinstance(err, OSError) and err.errno is None  # (bzip2's "Invalid data stream", BadGzipFile)
    if compression is not None and (isinstance(err, _damage_types()) or errno_less):
        return InputError(
            f"{path}: damaged or truncated compressed file ({compression} data{at}: {err}); check it "
            f"with `{compression} -t {path}` and re-create or re-download it"
        )
    if isinstance(err, OSError):
        where = f" at byte {offset:,}" if offset is not None else ""
        return InputError(f"cannot read input {path}{where}: {err.strerror or err}")
    return None


def _head(path: Path) -> tuple[bytes, bytes, str | None]:
    """(first bytes of the file, first bytes of its content after decompression, compression name or None)."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise _read_error(path, err, None, None) or err from None
    name = None
    with f:
        try:
            head = f.read(SNIFF_BYTES)
            found = _compression(head)
            if found is None:
                return head, head, None
            name, extra = found
            if extra is not None and importlib.util.find_spec("zstandard") is None:
                return head, b"", name  # cannot look inside; reading it gives the error naming the extra
            f.seek(0)
            return head, _decompressed(f, name).read(SNIFF_BYTES), name
        except Exception as err:
            error = _read_error(path, err, name, _tell(f))
            if error is None:
                raise
            raise error from None


def _tell(f: IO[bytes]) -> int | None:
    """Where a file stands (the bytes read from it), or None when even that cannot be asked."""
    try:
        return f.tell()
    except OSError:
        return None


def unreadable(path: Path) -> tuple[str, str] | None:
    """(what the file is, what to do) when gptkit cannot read this file as text, else None."""
    head, inner, _ = _head(path)
    if head.startswith(PARQUET_MAGIC) or _format(path) == "parquet":
        return None
    return binary_kind(inner)


# ---------------------------------------------------------------- choosing the files


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _readable(path: Path) -> bool:
    return os.access(path, os.R_OK)


def resolve_inputs(inputs: Iterable[str], glob: str | None) -> list[Path]:
    """The files to read, in a fixed order: directories expanded recursively (hidden entries skipped).

    Without --glob a directory's binary files are skipped (and counted in a warning); a binary file named on the
    command line or matched by --glob is an error that says what it is and what to do.
    """
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if not path.exists():
            raise InputError(f"input {name} does not exist")
        if path.is_dir():
            found = sorted(p for p in path.rglob(glob or "*") if p.is_file() and not _is_hidden(p, path))
            skipped: Counter[str] = Counter()
            if glob is None:
                kept = []
                for p in found:
                    kind = unreadable(p) if _readable(p) else ("unreadable (permission denied)", "")
                    if kind is None:
                        kept.append(p)
                    else:
                        skipped[kind[0]] += 1
                found = kept
            if not found:
                what = f"no file matching {glob!r}" if glob else "no text file"
                if skipped:
                    what += " (only " + ", ".join(f"{n} x {kind}" for kind, n in skipped.most_common()) + ")"
                raise InputError(f"input directory {name} holds {what}; convert those files to text first")
            if skipped:
                logger.warning("skipped %s in %s (not text)", ", ".join(f"{n} x {k}" for k, n in skipped.items()), name)
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"input {name} is neither a file nor a directory")
    for path in files:
        if not _readable(path):
            raise InputError(f"cannot read input {path}: permission denied")
        found = unreadable(path)
        if found is not None:
            raise InputError(f"{path} is {found[0]}: {found[1]}")
    return list(dict.fromkeys(files))  # the same file named twice is read once


# ---------------------------------------------------------------- readers: one per format


def _invalid_utf8_error(where: str, offset: int, reason: str, around: bytes, line: str = "") -> InputError:
    """The error for invalid UTF-8: --errors replace is suggested only for text with a few bad bytes."""
    invalid = sum(1 for c in around.decode("utf-8", "surrogateescape") if "\udc80" <= c <= "\udcff")
    share = invalid / max(len(around), 1)
    if share <= REPLACE_MAX_INVALID:
        advice = "fix the file or pass --errors replace"
    else:
        advice = (
            f"{share:.0%} of the bytes around it are invalid, so this is not UTF-8 text: convert text in "
            "another encoding first (e.g. iconv -f LATIN1 -t UTF-8), and leave binary files out"
        )
    return InputError(f"{where}: invalid UTF-8 at byte offset {offset} ({line}{reason}); {advice}")


def read_text(src: Source) -> Iterator[Piece]:
    """A plain text file: one document, streamed in chunks."""
    decoder = codecs.getincrementaldecoder("utf-8")(src.errors)
    position = 0  # bytes consumed so far
    chars = 0
    first = True
    previous = b""
    while True:
        raw = src.stream.read(READ_CHUNK)
        pending = len(decoder.getstate()[0])
        try:
            text = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as err:
            around = previous[-UTF8_WINDOW:] + err.object + src.stream.read(UTF8_WINDOW)
            raise _invalid_utf8_error(src.where, position - pending + err.start, err.reason, around) from None
        previous = raw
        position += len(raw)
        if text or first:
            yield Piece(text, first, str(src.path), chars)
            first = False
        chars += len(text)
        if not raw:
            return


def without_surrogates(value: Any, where: str, errors: str) -> Any:
    """value with any lone surrogate (a JSON escape UTF-8 cannot encode) replaced, or an error naming the row."""
    if isinstance(value, str):
        found = re.search("[\ud800-\udfff]", value)
        if found is None:
            return value
        if errors == "strict":
            raise InputError(
                f"{where}: a string holds a lone surrogate at character {found.start()}, which UTF-8 "
                "cannot encode; fix the file or pass --errors replace"
            )
        return re.sub("[\ud800-\udfff]", "\ufffd", value)
    if isinstance(value, list):
        return [without_surrogates(v, where, errors) for v in value]
    if isinstance(value, dict):
        return {k: without_surrogates(v, where, errors) for k, v in value.items()}
    return value


# A row reader yields (record, "file line N" / "file row N"); columns, when given, are all the caller needs.
Rows = Iterator[tuple[Any, str]]


def read_jsonl(src: Source, columns: list[str] | None = None) -> Rows:
    """JSON Lines: each non-blank line one JSON value (a row is an object)."""
    position = 0
    for number, raw in enumerate(src.stream, start=1):
        where = f"{src.path} line {number}"
        try:
            line = raw.decode("utf-8", src.errors)
        except UnicodeDecodeError as err:
            around = raw + src.stream.read(UTF8_WINDOW)
            raise _invalid_utf8_error(src.where, position + err.start, err.reason, around, f"line {number}, ") from None
        position += len(raw)
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark some editors write is not part of the JSON
        if not line.strip():
            continue
        try:
            yield json.loads(line), where
        except ValueError as err:
            raise InputError(f"{where} is not valid JSON: {err}") from None


def _read_table(src: Source, dialect: type[csv.Dialect], name: str) -> Rows:
    """CSV or TSV: a header row naming the columns, then one row per record."""
    text = io.TextIOWrapper(src.stream, encoding="utf-8-sig", errors=src.errors, newline="")
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a document can be longer than the module's 128 KiB default
    number = 1
    try:
        rows = csv.reader(text, dialect)
        header = next(rows, None)
        for number, row in enumerate(rows, start=2):
            if row:  # (a blank line is no row)
                yield dict(zip(header, row)), f"{src.path} row {number}"
    except UnicodeDecodeError as err:
        raise _invalid_utf8_error(src.where, err.start, err.reason, err.object, f"near row {number}, ") from None
    except csv.Error as err:
        raise InputError(f"{src.path} row {number} is not valid {name}: {err}") from None
    finally:
        csv.field_size_limit(limit)
        text.detach()  # the caller closes the file


def read_csv(src: Source, columns: list[str] | None = None) -> Rows:
    """Comma-separated values with a header row."""
    return _read_table(src, csv.excel, "CSV")


def read_tsv(src: Source, columns: list[str] | None = None) -> Rows:
    """Tab-separated values with a header row."""
    return _read_table(src, csv.excel_tab, "TSV")


def read_parquet(src: Source, columns: list[str] | None = None) -> Rows:
    """Apache Parquet: one record per row, streamed a row group at a time (only the columns asked for)."""
    pa = _optional("pyarrow", "parquet", "Parquet input")
    pq = _optional("pyarrow.parquet", "parquet", "Parquet input")
    try:
        table = pq.ParquetFile(src.path)
    except (pa.ArrowException, OSError) as err:
        raise InputError(f"{src.path} is not a readable Parquet file: {err}") from None
    names = table.schema_arrow.names
    if columns is not None:
        columns = [c for c in columns if c in names]  # an absent one: each row then lacks it, and the caller says so
    size, rows = src.path.stat().st_size, max(table.metadata.num_rows, 1)
    number = 0
    for group in range(table.num_row_groups):  # one row group at a time: pyarrow reads no further ahead
        batches = table.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as err:
                raise InputError(f"{src.path}: cannot read row group {group}: {err}") from None
            if batch is None:
                break
            for record in batch.to_pylist():
                number += 1
                yield record, f"{src.path} row {number}"
            src.on_bytes(size * batch.num_rows // rows)
        pa.default_memory_pool().release_unused()  # hand the row group's buffers back to the system


ROW_READERS: dict[str, Callable[..., Rows]] = {
    "jsonl": read_jsonl,
    "csv": read_csv,
    "tsv": read_tsv,
    "parquet": read_parquet,
}


def row_kind(path: Path) -> str | None:
    """The row format a file's name says (jsonl, csv, tsv, parquet), or None for text."""
    fmt = _format(path)
    return fmt if fmt in ROW_READERS else None


# ---------------------------------------------------------------- the files in turn


class _Counted(io.RawIOBase):
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


class _ReadAhead(io.RawIOBase):
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


@contextlib.contextmanager
def _opened(path: Path, errors: str, on_bytes: Callable[[int], None]) -> Iterator[tuple[Source, _Counted]]:
    """A Source for the file (decompressed if it is compressed), and the counter of its bytes; a failed read or
    damaged compressed data is one InputError line naming the file and the byte."""
    compression, counted = None, None
    try:
        with open(path, "rb", buffering=0) as f:
            counted = _Counted(f, on_bytes)
            stream: IO[bytes] = io.BufferedReader(counted, READ_CHUNK)
            found = _compression(stream.peek(8)[:8]) if _format(path) != "parquet" else None
            if found is not None:
                compression = found[0]
                stream = io.BufferedReader(_ReadAhead(_decompressed(stream, compression)), READ_CHUNK)
            try:
                yield Source(path, stream, errors, on_bytes, compression is not None), counted
            finally:
                stream.close()  # (stops a read-ahead thread before its file closes)
    except Exception as err:
        error = _read_error(path, err, compression, counted.size if counted is not None else None)
        if error is None:
            raise
        raise error from None


def records(
    path: Path, errors: str, columns: list[str] | None = None, on_bytes: Callable[[int], None] = lambda n: None
) -> Rows:
    """(record, where) for each row of a JSONL, CSV, TSV or Parquet file, lone surrogates handled as `errors` says."""
    with _opened(path, errors, on_bytes) as (src, _):
        for record, where in ROW_READERS[_format(path)](src, columns):
            yield without_surrogates(record, where, errors), where


def first_record(path: Path, errors: str) -> tuple[Any, str] | None:
    """The first row of a JSONL, CSV, TSV or Parquet file, or None when it has none."""
    rows = records(path, errors)
    try:
        return next(rows, None)
    finally:
        rows.close()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Reader:
    """Streams the documents of the input files as Pieces, counting bytes read and hashing each file: a text file is
    one document; each row of the other formats is one, its text in the field (column) named `field`."""

    def __init__(
        self, files: list[Path], errors: str, field: str = "text", on_bytes: Callable[[int], None] = lambda n: None
    ) -> None:
        self.files = files
        self.errors = errors
        self.field = field
        self.on_bytes = on_bytes
        self.documents = 0
        self.inputs: list[dict[str, Any]] = []

    def __iter__(self) -> Iterator[Piece]:
        self.documents = 0
        self.inputs = []
        for path in self.files:
            fmt = _format(path)
            with _opened(path, self.errors, self.on_bytes) as (src, counted):
                for piece in read_text(src) if fmt == "text" else self._rows(src, ROW_READERS[fmt]):
                    self.documents += piece.starts_document
                    yield piece
            if fmt == "parquet":  # pyarrow reads the file out of order: hash it as a whole
                digest, size = _sha256(path), path.stat().st_size
            else:
                digest, size = counted.digest.hexdigest(), counted.size
            self.inputs.append({"path": str(path), "bytes": size, "sha256": digest})

    def _rows(self, src: Source, read: Callable[..., Rows]) -> Iterator[Piece]:
        for record, where in read(src, [self.field]):
            text = record.get(self.field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise InputError(
                    f'{where} has no string field "{self.field}" (each row must have one; '
                    "--text-field names another field)"
                )
            yield Piece(without_surrogates(text, where, self.errors), True, where, 0)
