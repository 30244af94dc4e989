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

import contextlib
import hashlib
import io
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from gptkit.errors import InputError
from gptkit.prepare.readers import ROW_READERS, Piece, Rows, Source, read_text, without_surrogates
from gptkit.prepare.sniffing import file_format, unreadable
from gptkit.prepare.streams import READ_CHUNK, Counted, ReadAhead, compression_of, decompressed, read_error

logger = logging.getLogger(__name__)


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


@contextlib.contextmanager
def opened(path: Path, errors: str, on_bytes: Callable[[int], None]) -> Iterator[tuple[Source, Counted]]:
    """A Source for the file (decompressed if it is compressed), and the counter of its bytes; a failed read or
    damaged compressed data is one InputError line naming the file and the byte."""
    compression, counted = None, None
    try:
        with open(path, "rb", buffering=0) as f:
            counted = Counted(f, on_bytes)
            stream: IO[bytes] = io.BufferedReader(counted, READ_CHUNK)
            found = compression_of(stream.peek(8)[:8]) if file_format(path) != "parquet" else None
            if found is not None:
                compression = found[0]
                stream = io.BufferedReader(ReadAhead(decompressed(stream, compression)), READ_CHUNK)
            try:
                yield Source(path, stream, errors, on_bytes, compression is not None), counted
            finally:
                stream.close()  # (stops a read-ahead thread before its file closes)
    except Exception as err:
        error = read_error(path, err, compression, counted.size if counted is not None else None)
        if error is None:
            raise
        raise error from None


def records(
    path: Path, errors: str, columns: list[str] | None = None, on_bytes: Callable[[int], None] = lambda n: None
) -> Rows:
    """(record, where) for each row of a JSONL, CSV, TSV or Parquet file, lone surrogates handled as `errors` says."""
    with opened(path, errors, on_bytes) as (src, _):
        for record, where in ROW_READERS[file_format(path)](src, columns):
            yield without_surrogates(record, where, errors), where


def first_record(path: Path, errors: str) -> tuple[Any, str] | None:
    """The first row of a JSONL, CSV, TSV or Parquet file, or None when it has none."""
    rows = records(path, errors)
    try:
        return next(rows, None)
    finally:
        rows.close()


def sha256(path: Path) -> str:
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
            fmt = file_format(path)
            with opened(path, self.errors, self.on_bytes) as (src, counted):
                for piece in read_text(src) if fmt == "text" else self._rows(src, ROW_READERS[fmt]):
                    self.documents += piece.starts_document
                    yield piece
            if fmt == "parquet":  # pyarrow reads the file out of order: hash it as a whole
                digest, size = sha256(path), path.stat().st_size
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
