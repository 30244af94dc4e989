"""The readers, one per input format: read_text yields a plain text file's Pieces (one document), a row reader
yields the records (dicts) of a JSONL, CSV, TSV or Parquet file."""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gptkit.errors import InputError
from gptkit.prepare.sniffing import file_format
from gptkit.prepare.streams import READ_CHUNK, optional

# Above this share of invalid bytes around the first bad one, a file is not "text with a few bad bytes" and
# --errors replace would train on noise.
REPLACE_MAX_INVALID = 0.01
UTF8_WINDOW = 1 << 16  # bytes each side of the first invalid one over which that share is measured
PARQUET_BATCH_ROWS = 1024  # rows converted to Python at a time


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


def invalid_utf8_error(where: str, offset: int, reason: str, around: bytes, line: str = "") -> InputError:
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
            raise invalid_utf8_error(src.where, position - pending + err.start, err.reason, around) from None
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
            raise invalid_utf8_error(src.where, position + err.start, err.reason, around, f"line {number}, ") from None
        position += len(raw)
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark some editors write is not part of the JSON
        if not line.strip():
            continue
        try:
            yield json.loads(line), where
        except ValueError as err:
            raise InputError(f"{where} is not valid JSON: {err}") from None


def read_table(src: Source, dialect: type[csv.Dialect], name: str) -> Rows:
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
        raise invalid_utf8_error(src.where, err.start, err.reason, err.object, f"near row {number}, ") from None
    except csv.Error as err:
        raise InputError(f"{src.path} row {number} is not valid {name}: {err}") from None
    finally:
        csv.field_size_limit(limit)
        text.detach()  # the caller closes the file


def read_csv(src: Source, columns: list[str] | None = None) -> Rows:
    """Comma-separated values with a header row."""
    return read_table(src, csv.excel, "CSV")


def read_tsv(src: Source, columns: list[str] | None = None) -> Rows:
    """Tab-separated values with a header row."""
    return read_table(src, csv.excel_tab, "TSV")


def read_parquet(src: Source, columns: list[str] | None = None) -> Rows:
    """Apache Parquet: one record per row, streamed a row group at a time (only the columns asked for)."""
    pa = optional("pyarrow", "parquet", "Parquet input")
    pq = optional("pyarrow.parquet", "parquet", "Parquet input")
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
    fmt = file_format(path)
    return fmt if fmt in ROW_READERS else None
