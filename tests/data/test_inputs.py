"""`gptkit prepare`'s input formats: compressed, JSONL, CSV/TSV and Parquet give the same tokens as plain text; binary
files are named; the invalid-UTF-8 advice fits the damage; a missing optional package names its extra."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import gptkit.prepare.readers as readers
import gptkit.prepare.sniffing as sniffing
from gptkit.cli import main
from gptkit.data import load_tokens, read_meta
from gptkit.errors import InputError
from gptkit.prepare import PrepareConfig, prepare

# Documents that exercise quoting, separators, newlines, non-ASCII and an empty one.
DOCS = [
    "First document.\nIt has two lines.",
    'Quotes " and , commas, and\ttabs',
    "",
    "naïve café 日本語 🌍",
    "line one\r\nline two\n\nlast",
]

COMPRESS = {".gz": gzip.compress, ".xz": lzma.compress, ".bz2": bz2.compress}


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


COMPRESS[".zst"] = _zstd


def _stream(out: Path) -> list[int]:
    meta = read_meta(out)
    parts = [load_tokens(out / name, meta.dtype) for name in ("train.bin", "val.bin")]
    return np.concatenate(parts).tolist()


def _prepare(tmp_path: Path, *paths: Path, **options) -> tuple[list[int], dict]:
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    meta = prepare(PrepareConfig(out=str(out), inputs=[str(p) for p in paths], tokenizer="byte", **options))
    return _stream(out), meta


def _jsonl(docs: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()


def _table(docs: list[str], dialect: str) -> bytes:
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer, dialect)
    writer.writerow(["id", "body"])
    writer.writerows([i, d] for i, d in enumerate(docs))
    return buffer.getvalue().encode()


@pytest.fixture
def plain(tmp_path: Path) -> list[int]:
    """The token stream of DOCS given as plain text files, one per document (a directory, read in name order)."""
    folder = tmp_path / "plain"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i}.txt").write_bytes(doc.encode())
    stream, meta = _prepare(tmp_path, folder)
    assert meta.documents == len(DOCS)
    return stream


@pytest.mark.parametrize("suffix", ["", *COMPRESS])
def test_jsonl_csv_tsv_plain_and_compressed_give_the_plain_text_stream(tmp_path, plain, suffix):
    files = {"d.jsonl": _jsonl(DOCS, "body"), "d.csv": _table(DOCS, "excel"), "d.tsv": _table(DOCS, "excel-tab")}
    for name, data in files.items():
        path = tmp_path / (name + suffix)
        path.write_bytes(COMPRESS[suffix](data) if suffix else data)
        stream, meta = _prepare(tmp_path, path, text_field="body")
        assert stream == plain, name + suffix
        assert meta.documents == len(DOCS)
        assert meta.inputs[0]["bytes"] == path.stat().st_size  # the file's own size, compressed or not
        import hashlib

        assert meta.inputs[0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_compressed_text_is_told_by_content_and_equals_the_plain_file(tmp_path, suffix):
    text = "\n".join(DOCS) * 300
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / ("b.txt" + suffix)).write_bytes(COMPRESS[suffix](text.encode()))
    (tmp_path / "c.data").write_bytes(COMPRESS[suffix](text.encode()))  # no telling suffix: the magic bytes decide
    expected, _ = _prepare(tmp_path, tmp_path / "a.txt")
    assert _prepare(tmp_path, tmp_path / ("b.txt" + suffix))[0] == expected
    assert _prepare(tmp_path, tmp_path / "c.data")[0] == expected


def test_parquet_is_streamed_row_group_by_row_group(tmp_path, plain, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": list(range(len(DOCS))), "content": DOCS})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=2)  # three row groups
    assert pq.ParquetFile(path).num_row_groups == 3

    def whole(*args, **kwargs):
        raise AssertionError("the whole file was read at once")

    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(pq, "read_table", whole)
    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 1)
    stream, meta = _prepare(tmp_path, path, text_field="content")
    assert stream == plain and meta.documents == len(DOCS)
    # A directory holding it reads it too (Parquet holds NUL bytes, but its magic says what it is).
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "d.parquet").write_bytes(path.read_bytes())
    assert _prepare(tmp_path, folder, text_field="content")[0] == plain


def test_parquet_errors_name_the_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"n": [1, 2], "text": ["a", None]}), tmp_path / "t.parquet")
    with pytest.raises(
        InputError,
        match=r't.parquet row 1 has no string field "body" .*; its fields: \'n\', \'text\'; '
        r"--text-field names",
    ):
        _prepare(tmp_path, tmp_path / "t.parquet", text_field="body")
    with pytest.raises(InputError, match='t.parquet row 1 has no string field "n"'):  # a column of numbers
        _prepare(tmp_path, tmp_path / "t.parquet", text_field="n")
    with pytest.raises(InputError, match='t.parquet row 2 has no string field "text"'):  # a null
        _prepare(tmp_path, tmp_path / "t.parquet")


def test_csv_errors_name_the_column_and_row(tmp_path):
    (tmp_path / "a.csv").write_text("id,body\n1,hello\n")
    with pytest.raises(InputError, match=r'a.csv row 2 has no string field "text" .*; its fields: \'id\', \'body\''):
        _prepare(tmp_path, tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("body,id\nfine,1\n\n2\n")  # row 4 lacks nothing: column 0 is there
    assert _prepare(tmp_path, tmp_path / "b.csv", text_field="body")[1].documents == 2
    (tmp_path / "c.csv").write_text("id,body\n1,fine\n2\n")
    with pytest.raises(InputError, match='c.csv row 3 has no string field "body"'):
        _prepare(tmp_path, tmp_path / "c.csv", text_field="body")
    long_doc = "x" * 300_000  # longer than the csv module's default field limit of 128 KiB
    (tmp_path / "d.csv").write_text(f"text\n{long_doc}\n")
    stream, _ = _prepare(tmp_path, tmp_path / "d.csv")
    assert len(stream) == 300_000
    (tmp_path / "e.csv").write_bytes("\ufefftext\nwith a byte-order mark\n".encode())  # as Excel writes
    assert _prepare(tmp_path, tmp_path / "e.csv")[1].documents == 1


def _minimal_png() -> bytes:
    return b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00"


PDF = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n" + bytes(range(128, 256)) * 4


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("paper.pdf", PDF, r"paper.pdf is a PDF document: extract its text first \(e.g. pdftotext"),
        ("plot.png", _minimal_png(), "plot.png is a PNG image: it holds no text to train on: leave it out"),
        ("bundle.zip", b"PK\x03\x04" + b"\x00" * 40, "bundle.zip is a ZIP archive .*: unpack it"),
        ("tool", b"\x7fELF\x02\x01\x01" + b"\x00" * 40, "tool is an ELF executable"),
        ("wide.txt", "text".encode("utf-16"), "wide.txt is binary, not UTF-8 text .*iconv -f UTF-16"),
        ("paper.pdf.gz", gzip.compress(PDF), r"paper.pdf.gz is a PDF document"),  # looked inside
    ],
)
def test_binary_files_are_named_in_a_one_line_error(tmp_path, capsys, name, data, message):
    (tmp_path / name).write_bytes(data)
    assert main(["prepare", "--input", str(tmp_path / name), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gptkit prepare: error: ") and re.search(message, err[0]), err


def test_a_directory_skips_binary_files_and_names_them_when_nothing_else_is_left(tmp_path, caplog):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.pdf").write_bytes(PDF)
    (folder / "b.pdf").write_bytes(PDF)
    (folder / "c.png").write_bytes(_minimal_png())
    with pytest.raises(InputError, match=r"holds no text file \(only 2 x a PDF document, 1 x a PNG image\)"):
        _prepare(tmp_path, folder)
    (folder / "notes.md").write_text("some text")
    (folder / "more.txt.gz").write_bytes(gzip.compress(b" and more"))
    with caplog.at_level("WARNING", logger="gptkit.prepare.inputs"):
        stream, meta = _prepare(tmp_path, folder)
    assert [Path(i["path"]).name for i in meta.inputs] == ["more.txt.gz", "notes.md"]
    assert bytes(t for t in stream if t < 256) == b" and moresome text"
    assert "skipped 2 x a PDF document, 1 x a PNG image" in caplog.text


def test_errors_replace_is_suggested_only_for_a_few_bad_bytes(tmp_path):
    few = tmp_path / "few.txt"
    few.write_bytes(b"a" * 5000 + b"\xff" + b"b" * 5000)
    with pytest.raises(
        InputError, match=r"few.txt: invalid UTF-8 at byte offset 5000 .*; fix the file or pass --errors replace$"
    ):
        _prepare(tmp_path, few)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("àéîõü çà ëï".encode("latin-1") * 100)
    with pytest.raises(
        InputError,
        match=r"latin.txt: invalid UTF-8 at byte offset 0 .*\d+% of the bytes around it are "
        r"invalid, so this is not UTF-8 text: convert .* iconv",
    ) as info:
        _prepare(tmp_path, latin)
    assert "--errors replace" not in str(info.value)
    gz = tmp_path / "few.txt.gz"
    gz.write_bytes(gzip.compress(few.read_bytes()))
    with pytest.raises(InputError, match=r"few.txt.gz \(decompressed\): invalid UTF-8 at byte offset 5000"):
        _prepare(tmp_path, gz)
    stream, _ = _prepare(tmp_path, few, errors="replace")
    assert len(stream) == 10_003  # U+FFFD is three bytes


def test_damaged_compressed_files_are_one_line_errors(tmp_path):
    data = gzip.compress(("hello world\n" * 10_000).encode())
    (tmp_path / "cut.txt.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.txt.gz: damaged or truncated compressed file"):
        _prepare(tmp_path, tmp_path / "cut.txt.gz")


def test_a_missing_optional_package_names_its_extra(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "t.parquet")
    (tmp_path / "t.txt.zst").write_bytes(_zstd(b"hello"))
    for module in ("pyarrow", "pyarrow.parquet", "zstandard"):
        monkeypatch.setitem(sys.modules, module, None)  # import then raises ImportError
    with pytest.raises(
        InputError, match=r"reading Parquet input needs the optional pyarrow package: pip install 'gptkit\[parquet\]'"
    ):
        _prepare(tmp_path, tmp_path / "t.parquet")
    monkeypatch.setattr(sniffing.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        InputError, match=r"zstd-compressed input needs the optional zstandard package: pip install 'gptkit\[zstd\]'"
    ):
        _prepare(tmp_path, tmp_path / "t.txt.zst")


def test_supervised_examples_read_from_compressed_jsonl_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("one", "two", "three", "four", "five")
    ]
    plain = tmp_path / "chat.jsonl"
    plain.write_bytes(_jsonl([r["messages"] for r in rows], "messages"))
    (tmp_path / "chat.jsonl.xz").write_bytes(lzma.compress(plain.read_bytes()))
    pq.write_table(pa.table({"messages": [r["messages"] for r in rows]}), tmp_path / "chat.parquet", row_group_size=2)

    def example_files(path: Path) -> dict[str, bytes]:
        out = tmp_path / f"out-{path.name}"
        meta = prepare(PrepareConfig(out=str(out), inputs=[str(path)], tokenizer="byte", val_fraction=0.2))
        assert meta.kind == "examples" and meta.train_examples + meta.val_examples == 5
        return {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".bin"}

    expected = example_files(plain)
    assert len(expected) == 6  # ids, trained-token mask and offsets of each split
    assert example_files(tmp_path / "chat.jsonl.xz") == expected
    assert example_files(tmp_path / "chat.parquet") == expected
