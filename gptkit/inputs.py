"""The documents of `gptkit prepare`'s inputs, streamed from files and directories in the formats people have.

Formats, told by the file's name (after any compression suffix): `.jsonl`/`.ndjson` (a text field per line),
`.csv`/`.tsv` (a named column, through the csv module), `.parquet` (a named column, one row group at a time;
needs pyarrow), and anything else as plain text. Each may be gzip, xz, bzip2 or zstd compressed (told by the
file's first bytes; zstd needs the zstandard package). A format is one reader function from a Source to Pieces;
Reader walks the files, hashes and counts their bytes, and hands the Pieces on. A file of a binary format
(PDF, image, archive, executable, ...) is named in a one-line error that says what to do instead.
"""

from __future__ import annotations

import bz2
import codecs
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
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gptkit.errors import InputError

logger = logging.getLogger(__name__)

READ_CHUNK = 1 << 20  # bytes read from a file at a time
SNIFF_BYTES = 8192  # bytes inspected to tell a file's format from its content
# Above this share of invalid bytes around the first bad one, a file is not "text with a few bad bytes" and
# --errors replace would train on noise.
REPLACE_MAX_INVALID = 0.01
UTF8_WINDOW = 1 << 16  # bytes each side of the first invalid one over which that share is measured

@dataclass(frozen=True)
class Piece:
    """A run of text from one document; `starts_document` marks a document's first piece."""

    text: str
    starts_document: bool
    source: str  # "file", "file line N" or "file row N", for error messages
    offset: int  # character offset of text inside its document


@dataclass
class Source:
    """One input file as a reader sees it: its decompressed bytes and the options that shape its documents."""

    path: Path
    stream: IO[bytes]  # the file's bytes, decompressed
    errors: str  # "strict" or "replace" for invalid UTF-8
    field: str  # the JSONL field or CSV / Parquet column holding the text
    on_bytes: Callable[[int], None]  # progress, in bytes of the file (for readers that bypass `stream`)
    compressed: bool

    @property
    def where(self) -> str:
        """The file's name in messages (decompressed content is said to be so)."""
        return f"{self.path} (decompressed)" if self.compressed else str(self.path)


# ---------------------------------------------------------------- telling formats apart

# Compressions read transparently: (magic bytes, name, extra that provides the module or None for the stdlib).
COMPRESSIONS = [(b"\x1f\x8b", "gzip", None), (b"\xfd7zXZ\x00", "xz", None), (b"BZh", "bzip2", None),
                (b"\x28\xb5\x2f\xfd", "zstd", "zstd")]  # fmt: skip
COMPRESSION_SUFFIXES = {".gz", ".gzip", ".xz", ".bz2", ".zst", ".zstd"}
PARQUET_MAGIC = b"PAR1"

_EXTRACT = "extract its text first and prepare that"
_LEAVE_OUT = "it holds no text to train on: leave it out (in a directory, --glob picks the files to read)"
_UNPACK = "unpack it and prepare the files it holds"
# Binary formats recognised by their first bytes: (magic, offset, what the file is, what to do instead).
BINARY_FORMATS = [
    (b"%PDF-", 0, "a PDF document", "extract its text first (e.g. pdftotext FILE FILE.txt, from poppler-utils) and "
     "prepare that"),
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
    (b"PK\x03\x04", 0, "a ZIP archive (.zip, or a .docx / .xlsx / .epub / .jar, which are ZIP archives)",
     f"{_UNPACK} (or, for a document, {_EXTRACT})"),
    (b"ustar", 257, "a tar archive", f"{_UNPACK} (tar xf FILE)"),
    (b"7z\xbc\xaf\x27\x1c", 0, "a 7-Zip archive", _UNPACK),
    (b"Rar!\x1a\x07", 0, "a RAR archive", _UNPACK),
    (b"\x7fELF", 0, "an ELF executable or library", _LEAVE_OUT),
    (b"\xcf\xfa\xed\xfe", 0, "a Mach-O executable", _LEAVE_OUT),
    (b"SQLite format 3\x00", 0, "an SQLite database", "export the text it holds (e.g. as JSONL) and prepare that"),
    (b"\x89HDF\r\n\x1a\n", 0, "an HDF5 file", _LEAVE_OUT),
    (b"\x93NUMPY", 0, "a NumPy array file", _LEAVE_OUT),
]  # fmt: skip


def _compression(head: bytes) -> tuple[str, str | None] | None:
    """(name, extra) of the compression these first bytes announce, or None."""
    return next(((name, extra) for magic, name, extra in COMPRESSIONS if head.startswith(magic)), None)


def binary_kind(head: bytes) -> tuple[str, str] | None:
    """(what the file is, what to do) when its first bytes are a binary format gptkit cannot read, else None."""
    for magic, offset, what, advice in BINARY_FORMATS:
        if head[offset : offset + len(magic)] == magic:
            return what, advice
    if b"\0" in head:
        return ("binary, not UTF-8 text (it holds NUL bytes)",
                "if it is UTF-16 text, convert it (e.g. iconv -f UTF-16 -t UTF-8); otherwise leave it out")  # fmt: skip
    return None


def _format(path: Path) -> str:
    """The format a file's name says: jsonl, csv, tsv, parquet or text (a compression suffix is looked through)."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    last = suffixes[-1] if suffixes else ""
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}.get(last, "text")


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
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), READ_CHUNK)


def _head(path: Path) -> tuple[bytes, bytes, str | None]:
    """(first bytes of the file, first bytes of its content after decompression, compression name or None)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
        found = _compression(head)
        if found is None:
            return head, head, None
        name, extra = found
        if extra is not None and importlib.util.find_spec("zstandard") is None:
            return head, b"", name  # cannot look inside; reading it gives the error naming the extra
        f.seek(0)
        try:
            inner = _decompressed(f, name).read(SNIFF_BYTES)
        except (OSError, EOFError, lzma.LZMAError, ValueError) as err:
            raise InputError(f"{path} is not a readable {name} file: {err}") from None
        return head, inner, name


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
        advice = (f"{share:.0%} of the bytes around it are invalid, so this is not UTF-8 text: convert text in "
                  "another encoding first (e.g. iconv -f LATIN1 -t UTF-8), and leave binary files out")  # fmt: skip
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


def _check_encodable(text: str, where: str, errors: str) -> str:
    """text, or an error (strict) / U+FFFD in place (replace) for lone surrogates, which UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        if errors == "strict":
            raise InputError(
                f"{where}: the text holds a lone surrogate at character {err.start}, which UTF-8 cannot "
                "encode; fix the file or pass --errors replace"
            ) from None
        text = re.sub("[\ud800-\udfff]", "\ufffd", text)
    return text


def read_jsonl(src: Source) -> Iterator[Piece]:
    """JSON Lines: each non-blank line an object whose text field is one document."""
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
            record = json.loads(line)
        except ValueError as err:
            raise InputError(f"{where} is not valid JSON: {err}") from None
        if not isinstance(record, dict) or not isinstance(record.get(src.field), str):
            raise InputError(f"{where} has no string field \"{src.field}\" (each JSONL line must be an object with "
                             "one; --text-field names another field)")  # fmt: skip
        yield Piece(_check_encodable(record[src.field], where, src.errors), True, where, 0)


def _read_table(src: Source, dialect: type[csv.Dialect], name: str) -> Iterator[Piece]:
    """CSV or TSV: a header row, then one document per row, from the column named by --text-field."""
    text = io.TextIOWrapper(src.stream, encoding="utf-8-sig", errors=src.errors, newline="")
    rows = csv.reader(text, dialect)
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a document can be longer than the module's 128 KiB default
    number = 1
    try:
        header = next(rows, None)
        if header is None:
            return
        if src.field not in header:
            raise InputError(f"{src.path} has no column {src.field!r} in its header row (columns: "
                             f"{', '.join(map(repr, header[:10]))}); --text-field names the column to read")  # fmt: skip
        column = header.index(src.field)
        for number, row in enumerate(rows, start=2):
            if not row:
                continue  # a blank line
            if len(row) <= column:
                raise InputError(f"{src.path} row {number} has {len(row)} fields, too few for column {src.field!r}")
            where = f"{src.path} row {number}"
            yield Piece(_check_encodable(row[column], where, src.errors), True, where, 0)
    except UnicodeDecodeError as err:
        raise _invalid_utf8_error(src.where, err.start, err.reason, err.object, f"near row {number}, ") from None
    except csv.Error as err:
        raise InputError(f"{src.path} row {number} is not valid {name}: {err}") from None
    finally:
        csv.field_size_limit(limit)
        text.detach()  # the caller closes the file


def read_csv(src: Source) -> Iterator[Piece]:
    """Comma-separated values with a header row."""
    return _read_table(src, csv.excel, "CSV")


def read_tsv(src: Source) -> Iterator[Piece]:
    """Tab-separated values with a header row."""
    return _read_table(src, csv.excel_tab, "TSV")


def read_parquet(src: Source) -> Iterator[Piece]:
    """Apache Parquet: one document per row of a string column, read one row group at a time."""
    pa = _optional("pyarrow", "parquet", "Parquet input")
    pq = _optional("pyarrow.parquet", "parquet", "Parquet input")
    try:
        table = pq.ParquetFile(src.path)
    except (pa.ArrowException, OSError) as err:
        raise InputError(f"{src.path} is not a readable Parquet file: {err}") from None
    schema = table.schema_arrow
    if src.field not in schema.names:
        raise InputError(f"{src.path} has no column {src.field!r} (columns: {', '.join(map(repr, schema.names[:10]))}); "
                         "--text-field names the column to read")  # fmt: skip
    kind = schema.field(src.field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or getattr(pa.types, "is_string_view",
                                                                                   lambda _: False)(kind)):
        raise InputError(f"{src.path}: column {src.field!r} holds {kind}, not text; --text-field names a string column")
    size, rows = src.path.stat().st_size, max(table.metadata.num_rows, 1)
    row = 0
    for group in range(table.num_row_groups):
        try:
            column = table.read_row_group(group, columns=[src.field]).column(0)
        except (pa.ArrowException, OSError) as err:
            raise InputError(f"{src.path}: cannot read row group {group}: {err}") from None
        for chunk in column.chunks:
            if chunk.null_count:
                first = row + next(i for i, v in enumerate(chunk.is_null().to_pylist()) if v)
                raise InputError(f"{src.path} row {first}: column {src.field!r} is null; drop such rows first")
            for text in chunk.to_pylist():
                yield Piece(text, True, f"{src.path} row {row}", 0)
                row += 1
        src.on_bytes(size * table.metadata.row_group(group).num_rows // rows)


READERS: dict[str, Callable[[Source], Iterator[Piece]]] = {
    "text": read_text, "jsonl": read_jsonl, "csv": read_csv, "tsv": read_tsv, "parquet": read_parquet,
}  # fmt: skip


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Reader:
    """Streams the documents of the input files as Pieces, counting bytes read and hashing each file."""

    def __init__(self, files: list[Path], errors: str, field: str = "text",
                 on_bytes: Callable[[int], None] = lambda n: None) -> None:  # fmt: skip
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
            try:
                yield from self._file(path)
            except OSError as err:
                raise InputError(f"cannot read input {path}: {err.strerror or err}") from None
            except (EOFError, lzma.LZMAError) as err:  # a compressed file cut short or damaged
                raise InputError(f"{path}: damaged or truncated compressed file ({err})") from None

    def _file(self, path: Path) -> Iterator[Piece]:
        fmt = _format(path)
        with open(path, "rb", buffering=0) as f:
            counted = _Counted(f, self.on_bytes)
            stream: IO[bytes] = io.BufferedReader(counted, READ_CHUNK)
            compression = _compression(stream.peek(8)[:8]) if fmt != "parquet" else None
            if compression is not None:
                stream = _decompressed(stream, compression[0])
            src = Source(path, stream, self.errors, self.field, self.on_bytes, compression is not None)
            for piece in READERS[fmt](src):
                self.documents += piece.starts_document
                yield piece
        if fmt == "parquet":  # pyarrow reads the file out of order: hash it as a whole
            digest, size = _sha256(path), path.stat().st_size
        else:
            digest, size = counted.digest.hexdigest(), counted.size
        self.inputs.append({"path": str(path), "bytes": size, "sha256": digest})
