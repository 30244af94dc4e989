"""Telling an input's format apart: by its name (jsonl, csv, tsv, parquet or text, through a compression suffix) and
by its first bytes (a binary format gptkit cannot read, named with what to do instead)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gptkit.prepare.streams import compression_of, decompressed, read_error, tell

SNIFF_BYTES = 8192  # bytes inspected to tell a file's format from its content
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


def file_format(path: Path) -> str:
    """The format a file's name says: jsonl, csv, tsv, parquet or text (a compression suffix is looked through)."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    last = suffixes[-1] if suffixes else ""
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}.get(
        last, "text"
    )


def first_bytes(path: Path) -> tuple[bytes, bytes, str | None]:
    """(first bytes of the file, first bytes of its content after decompression, compression name or None)."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise read_error(path, err, None, None) or err from None
    name = None
    with f:
        try:
            head = f.read(SNIFF_BYTES)
            found = compression_of(head)
            if found is None:
                return head, head, None
            name, extra = found
            if extra is not None and importlib.util.find_spec("zstandard") is None:
                return head, b"", name  # cannot look inside; reading it gives the error naming the extra
            f.seek(0)
            return head, decompressed(f, name).read(SNIFF_BYTES), name
        except Exception as err:
            error = read_error(path, err, name, tell(f))
            if error is None:
                raise
            raise error from None


def unreadable(path: Path) -> tuple[str, str] | None:
    """(what the file is, what to do) when gptkit cannot read this file as text, else None."""
    head, inner, _ = first_bytes(path)
    if head.startswith(PARQUET_MAGIC) or file_format(path) == "parquet":
        return None
    return binary_kind(inner)
