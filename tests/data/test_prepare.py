"""`gptkit prepare`: nanoGPT's split, every input kind, exact BPE round trips, errors, atomicity and flat memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gptkit.prepare as prep
import gptkit.prepare.encoding as encoding
import gptkit.prepare.readers as readers
import gptkit.prepare.text as prep_text
from gptkit.cli import main
from gptkit.data import DataMeta, load_tokens, read_meta
from gptkit.errors import GptkitError, InputError
from gptkit.prepare import DEFAULT_CORPUS, PrepareConfig, prepare
from gptkit.tokenizer import EOT, load_tokenizer

SHAKESPEARE = DEFAULT_CORPUS.read_text(encoding="utf-8")
PACKAGE = Path(prep.__file__).parents[1]  # gptkit/


def _tokens(out: Path) -> tuple[np.ndarray, np.ndarray]:
    meta = read_meta(out)
    return load_tokens(out / "train.bin", meta.dtype), load_tokens(out / "val.bin", meta.dtype)


def _documents(out: Path) -> list[str]:
    """The prepared stream split at the end-of-text token and decoded."""
    tok = load_tokenizer(out)
    stream = np.concatenate(_tokens(out)).tolist()
    docs, current = [], []
    for t in stream:
        if t == tok.eos_id:
            docs.append(current)
            current = []
        else:
            current.append(t)
    return [tok.decode(d) for d in [*docs, current]]


def test_char_on_the_default_corpus_matches_nanogpt(tmp_path: Path) -> None:
    assert main(["prepare", "--tokenizer", "char", "--out", str(tmp_path)]) == 0
    meta = read_meta(tmp_path)
    assert (meta.vocab_size, meta.train_tokens, meta.val_tokens) == (65, 1003854, 111540)
    assert meta.dtype == "uint16" and meta.tokenizer == "char" and meta.separator is None
    assert meta.inputs[0]["bytes"] == 1115394 and len(meta.inputs[0]["sha256"]) == 64
    assert (meta.train_bytes, meta.val_bytes) == (1003854, 111540)
    train, val = _tokens(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.decode(train.tolist()) == SHAKESPEARE[:1003854] and tok.decode(val.tolist()) == SHAKESPEARE[1003854:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gptkit_tokenizer.json", "meta.json", "train.bin", "val.bin"]


def test_bpe_trained_on_a_directory_of_source_files_round_trips_every_file(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("__pycache__", "corpora"))
    out = tmp_path / "data"
    meta = prepare(PrepareConfig(out=str(out), inputs=[str(source)], tokenizer="bpe", vocab_size=700))
    files = sorted(p for p in source.rglob("*") if p.is_file())
    assert meta.documents == len(files) == len(meta.inputs) and meta.vocab_size == 700
    tok = load_tokenizer(out)
    texts = [f.read_text(encoding="utf-8") for f in files]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    assert _documents(out) == texts  # the prepared stream is exactly the files, separated by <|endoftext|>
    assert meta.train_bytes + meta.val_bytes == sum(len(t.encode()) for t in texts)


def test_cut_stream_equals_whole_document_encoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With small pieces and batches the text is cut hundreds of times; the tokens must not change."""
    monkeypatch.setattr(encoding, "PIECE_CHARS", 1000)
    monkeypatch.setattr(encoding, "BATCH_CHARS", 20_000)
    monkeypatch.setattr(readers, "READ_CHUNK", 7_777)
    corpus = tmp_path / "play.txt"
    corpus.write_text(SHAKESPEARE[:150_000] + "\nnaïve café 日本語 🌍\n" * 50)
    prepare(PrepareConfig(out=str(tmp_path / "a"), inputs=[str(corpus)], tokenizer="bpe", vocab_size=400))
    tok = load_tokenizer(tmp_path / "a")
    assert np.concatenate(_tokens(tmp_path / "a")).tolist() == tok.encode(corpus.read_text())
    meta = prepare(PrepareConfig(out=str(tmp_path / "b"), inputs=[str(corpus)], tokenizer=str(tmp_path / "a")))
    assert meta.forced_cuts == 0 and meta.tokenizer == "bpe"
    assert np.concatenate(_tokens(tmp_path / "b")).tolist() == tok.encode(corpus.read_text())


def test_jsonl_documents_are_separated_by_the_end_of_text_token(tmp_path: Path) -> None:
    docs = ["first doc", "", "with\nnewlines é", "last"]
    lines = "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n"
    (tmp_path / "d.jsonl").write_text("\ufeff" + lines, encoding="utf-8")  # with a byte-order mark, as some editors
    meta = prepare(
        PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "d.jsonl")], tokenizer="byte", val_fraction=0.2)
    )
    assert meta.documents == 4 and meta.separator == EOT
    assert _documents(tmp_path / "o") == docs
    total = sum(len(d.encode()) for d in docs) + 3
    assert (meta.train_tokens, meta.val_tokens) == (int(total * 0.8), total - int(total * 0.8))


def test_char_on_several_files_adds_the_eot_token(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("abc")
    (tmp_path / "in" / "b.txt").write_text("cd")
    meta = prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "in")], val_fraction=0.0))
    assert meta.vocab_size == 5 and meta.eos_id == 4 and meta.val_tokens == 0
    assert np.concatenate(_tokens(tmp_path / "o")).tolist() == [0, 1, 2, 4, 2, 3]


def test_directory_inputs_glob_skip_binary_and_hidden_files(tmp_path: Path) -> None:
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.py").write_text("print(1)\n")
    (root / "sub" / "b.txt").write_text("hello\n")
    (root / "sub" / "c.py").write_text("x = 2\n")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / ".git" / "config").write_text("hidden\n")
    meta = prepare(PrepareConfig(out=str(tmp_path / "all"), inputs=[str(root)], tokenizer="byte"))
    assert [Path(i["path"]).name for i in meta.inputs] == ["a.py", "b.txt", "c.py"]
    meta = prepare(PrepareConfig(out=str(tmp_path / "py"), inputs=[str(root)], tokenizer="byte", glob="*.py"))
    assert [Path(i["path"]).name for i in meta.inputs] == ["a.py", "c.py"]
    assert _documents(tmp_path / "py") == ["print(1)\n", "x = 2\n"]


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path: Path) -> None:
    chars = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 70_000) if not 0xD800 <= c < 0xE000)
    (tmp_path / "wide.txt").write_text(chars)
    meta = prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "wide.txt")]))
    assert meta.vocab_size == len(chars) > 65536 and meta.dtype == "uint32"
    train, val = _tokens(tmp_path / "o")
    assert np.concatenate([train, val]).tolist() == list(range(len(chars)))


def test_invalid_utf8_names_file_and_byte_offset_and_replace_mode(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(readers, "READ_CHUNK", 1000)  # the bad byte sits in the 6th chunk, after a split character
    good = ("é" * 1000 + "x")[:2501]  # "é" is 2 bytes: 1000 of them and a split one at the chunk boundary
    bad = tmp_path / "bad.txt"
    bad.write_bytes(good.encode() + b"ab\xffcd")
    offset = len(good.encode()) + 2
    with pytest.raises(InputError, match=rf"bad.txt: invalid UTF-8 at byte offset {offset} .*--errors replace"):
        prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(bad)], tokenizer="byte"))
    truncated = tmp_path / "cut.txt"
    truncated.write_bytes(b"abc\xe6\x97")  # a 3-byte character missing its last byte at end of file
    with pytest.raises(InputError, match="cut.txt: invalid UTF-8 at byte offset 3"):
        prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(truncated)], tokenizer="byte"))
    meta = prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(bad)], tokenizer="char", errors="replace"))
    assert _documents(tmp_path / "o") == [good + "ab\ufffdcd"] and meta.errors == "replace"


def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(InputError, match='a.jsonl line 2 has no string field "text"'):
        prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "a.jsonl")]))
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n\n{"text": broken\n')
    with pytest.raises(InputError, match="b.jsonl line 3 is not valid JSON"):
        prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "b.jsonl")]))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a\ud800b"}) + "\n")  # JSON can spell a lone surrogate
    with pytest.raises(InputError, match="c.jsonl line 1: a string holds a lone surrogate at character 1"):
        prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "c.jsonl")], tokenizer="byte"))
    prepare(
        PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "c.jsonl")], tokenizer="byte", errors="replace")
    )
    assert _documents(tmp_path / "o") == ["a\ufffdb"]


def test_unknown_character_of_a_given_char_tokenizer_names_file_and_offset(tmp_path: Path) -> None:
    prepare(PrepareConfig(out=str(tmp_path / "ref")))
    (tmp_path / "new.txt").write_text("hello\nwörld")
    with pytest.raises(
        InputError, match=r"new.txt: character 'ö' \(U\+00F6\) at character offset 7 is not in the char"
    ):
        prepare(
            PrepareConfig(out=str(tmp_path / "o"), inputs=[str(tmp_path / "new.txt")], tokenizer=str(tmp_path / "ref"))
        )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "{tmp}/missing.txt"], "input .*missing.txt does not exist"),
        (["--input", "{tmp}/empty.txt"], "the input holds no text"),
        (["--input", "{tmp}/emptydir"], "holds no text file"),
        (["--input", "{tmp}/emptydir", "--glob", "*.md"], "holds no file matching '\\*.md'"),
        (["--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size 100 is too small: .* at least 257"),
        (["--tokenizer", "char", "--vocab-size", "100"], "--vocab-size applies only to --tokenizer bpe"),
        (["--tokenizer", "{tmp}/emptydir"], "--tokenizer .*emptydir: .*holds no tokenizer"),
        (["--tokenizer", "wordpiece"], "--tokenizer must be char, byte, bpe or a directory"),
        (["--val-fraction", "1.5"], "--val-fraction must be in \\[0, 1\\)"),
        (["--input", "{tmp}/bad.jsonl"], "bad.jsonl line 1 has no string field"),
        (["--input", "{tmp}/latin1.txt"], "latin1.txt: invalid UTF-8 at byte offset 2"),
        (["--out", "{tmp}/empty.txt"], "--out .*empty.txt exists and is not a directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "bad.jsonl").write_text('"just a string"\n')
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1")[1:])
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    assert main(["prepare", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gptkit prepare: error: ")
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_input_is_a_clear_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    with pytest.raises(InputError, match="cannot read input .*locked.txt"):
        prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(locked)]))


def test_an_interrupted_run_leaves_the_previous_data_set_whole(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "o"
    before = prepare(PrepareConfig(out=str(out), tokenizer="byte"))  # a finished earlier run in the same directory
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    for leftover in (".tokens.killed.tmp", ".val.bin.x1y2.tmp", ".meta.json.x3.tmp"):  # what older versions' kills left
        (out / leftover).write_bytes(b"\0" * 10)
    calls = {"n": 0}
    real = encoding.encode_batch

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(encoding, "encode_batch", interrupted)
    monkeypatch.setattr(encoding, "BATCH_CHARS", 100_000)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(out=str(out), tokenizer="char"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files  # no temporary file either
    assert read_meta(out).tokenizer == before.tokenizer == "byte"


KILL_CHILD = textwrap.dedent(
    """
    import errno, os, sys
    import gptkit.atomic as atomic
    import gptkit.prepare as prep
    import gptkit.prepare.encoding as encoding

    stage, corpus, out = sys.argv[1:4]

    def die(*args, **kwargs):
        os._exit(9)

    if stage == "encoding":  # before the swap: the staging directory is half written
        real, calls = encoding.encode_batch, []
        def encode(*args):
            calls.append(1)
            return die() if len(calls) == 2 else real(*args)
        encoding.encode_batch = encode
        encoding.BATCH_CHARS = 50_000
    elif stage == "staged":  # before the swap: the new data set is complete beside the old one
        atomic.replace_dir = die
    elif stage == "exchanged":  # during the swap: exchanged, the user's files not yet carried over
        real_finish = atomic.finish_replace
        def finish(target):  # (the sweep at the start calls it too, with no journal to act on)
            return die() if (target / atomic.JOURNAL).exists() else real_finish(target)
        atomic.finish_replace = finish
    elif stage == "cleanup":  # after the swap: the old contents are being deleted
        atomic.shutil.rmtree = die
    elif stage == "moving":  # no atomic exchange on this file system: files move one by one
        def no_exchange(a, b):
            raise OSError(errno.EINVAL, "Invalid argument")
        atomic.exchange = no_exchange
        real_replace, moves = os.replace, []
        def replace(src, dst):
            moves.append(1)
            return die() if len(moves) == 2 else real_replace(src, dst)
        real_move = atomic._move_entries
        def move(*args):
            atomic.os.replace = replace
            real_move(*args)
        atomic._move_entries = move
    prep.prepare(prep.PrepareConfig(out=out, inputs=[corpus], tokenizer="char"))
    """
)


def _data_set(out: Path) -> tuple[str, list[int]]:
    """(tokenizer kind, token stream) of a data directory, checked whole by read_meta."""
    meta = read_meta(out)
    return meta.tokenizer, np.concatenate(_tokens(out)).tolist()


@pytest.mark.parametrize("stage", ["encoding", "staged", "exchanged", "cleanup", "moving"])
def test_a_prepare_killed_at_any_stage_leaves_a_usable_data_set(tmp_path: Path, stage: str) -> None:
    out = tmp_path / "data"
    old_corpus, new_corpus = tmp_path / "old.txt", tmp_path / "new.txt"
    old_corpus.write_text(SHAKESPEARE[:20_000])
    new_corpus.write_text(SHAKESPEARE[50_000:200_000])
    prepare(PrepareConfig(out=str(out), inputs=[str(old_corpus)], tokenizer="byte"))
    (out / "notes.txt").write_text("the user's own file")  # not part of the data set: it must stay
    old = _data_set(out)
    child = subprocess.run(
        [sys.executable, "-c", KILL_CHILD, stage, str(new_corpus), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 9, child.stderr[-2000:]

    if stage in ("encoding", "staged"):  # not swapped yet: the old data set, untouched
        assert _data_set(out) == old and (out / "notes.txt").is_file()
    elif stage == "moving":  # no exchange: the directory says it is incomplete rather than mixing two data sets
        with pytest.raises(GptkitError, match="has no meta.json .*interrupted prepare.*run `gptkit prepare"):
            read_meta(out)
    else:  # swapped: the new data set, whole
        kind, stream = _data_set(out)
        assert kind == "char" and load_tokenizer(out).decode(stream) == new_corpus.read_text()
    # The next run finishes or sweeps what the killed one left, and keeps the user's file.
    prepare(PrepareConfig(out=str(out), inputs=[str(new_corpus)], tokenizer="char"))
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert sorted(p.name for p in out.iterdir()) == [
        "gptkit_tokenizer.json",
        "meta.json",
        "notes.txt",
        "train.bin",
        "val.bin",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging directory left
    assert _data_set(out)[0] == "char"


def test_prepare_files_and_directory_get_the_umask_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        out = tmp_path / "data"
        prepare(PrepareConfig(out=str(out), tokenizer="byte"))
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {
            n: "0o644" for n in ("gptkit_tokenizer.json", "meta.json", "train.bin", "val.bin")
        }
        assert oct(out.stat().st_mode & 0o777) == "0o755"
        out.chmod(0o750)  # a mode the user chose for an existing directory is kept
        prepare(PrepareConfig(out=str(out), tokenizer="char"))
        assert oct(out.stat().st_mode & 0o777) == "0o750"
    finally:
        os.umask(umask)


def test_a_symlinked_data_directory_is_replaced_where_it_lives(tmp_path: Path) -> None:
    real = tmp_path / "disk" / "data"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    prepare(PrepareConfig(out=str(tmp_path / "link"), tokenizer="byte"))
    assert (tmp_path / "link").is_symlink() and (real / "meta.json").is_file()
    assert read_meta(tmp_path / "link").tokenizer == "byte"


def test_a_full_disk_while_preparing_is_one_line_and_keeps_the_old_data(tmp_path: Path, capsys, monkeypatch) -> None:
    import errno

    out = tmp_path / "data"
    prepare(PrepareConfig(out=str(out), tokenizer="byte"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep_text, "_split_tail", full)
    assert main(["prepare", "--tokenizer", "char", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"gptkit prepare: error: cannot write {out}: No space left on device (the existing data set is unchanged)"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# A child process sets its own memory limit after importing everything and warming up, then prepares a corpus
# several times larger than that limit. RLIMIT_DATA (private writable memory: heap, anonymous mmaps, numpy
# buffers) is used rather than RLIMIT_AS because address-space reservations that are never touched (torch's and
# the allocator's) would make an AS limit either meaningless or need a corpus of gigabytes. The child first shows
# that the limit bites (a buffer of the corpus's size cannot be allocated), so a pass cannot come from a limit that
# is not there.
MEMORY_CHILD = textwrap.dedent(
    """
    import json, os, resource, sys
    import gptkit.formats.modeldir  # imported by prepare at the end; load it before measuring the baseline
    from gptkit.prepare import PrepareConfig, prepare

    tokenizer, budget, corpus, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    text_size = int(sys.argv[6]) if len(sys.argv) > 6 else os.path.getsize(corpus)  # (compressed: the text's)
    prepare(PrepareConfig(out=out + "-warm", inputs=[sys.argv[5]], tokenizer=tokenizer))  # warm up lazy state
    data = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData"))
    resource.setrlimit(resource.RLIMIT_DATA, (data + budget, resource.RLIM_INFINITY))
    try:
        bytearray(text_size)  # the corpus cannot be held in memory under this limit
        sys.exit("the memory limit is not enforced")
    except MemoryError:
        pass
    meta = prepare(PrepareConfig(out=out, inputs=[corpus], tokenizer=tokenizer))
    print(json.dumps(meta.raw))
    """
)


def _prepare_under_memory_limit(tmp_path: Path, tokenizer: str, budget_mb: int, times: int) -> dict:
    corpus = tmp_path / "big.txt"
    with open(corpus, "w", encoding="utf-8") as f:
        while f.tell() < times * budget_mb * 2**20:
            f.write(SHAKESPEARE)
    warm = tmp_path / "warm.txt"
    warm.write_text(SHAKESPEARE[:200_000])
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            MEMORY_CHILD,
            tokenizer,
            str(budget_mb * 2**20),
            str(corpus),
            str(tmp_path / "o"),
            str(warm),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    meta = DataMeta.from_dict(json.loads(result.stdout.strip().splitlines()[-1]), tmp_path / "meta.json")
    assert meta.inputs[0]["bytes"] == corpus.stat().st_size >= times * budget_mb * 2**20
    return meta


def test_memory_stays_flat_on_a_corpus_four_times_the_memory_limit(tmp_path: Path) -> None:
    meta = _prepare_under_memory_limit(tmp_path, "char", budget_mb=24, times=4)
    size = meta.inputs[0]["bytes"]
    assert meta.train_tokens + meta.val_tokens == size and meta.vocab_size == 65


@pytest.mark.slow
def test_memory_stays_flat_for_bpe_on_a_corpus_several_times_the_memory_limit(tmp_path: Path) -> None:
    prepare(PrepareConfig(out=str(tmp_path / "tok"), tokenizer="bpe", vocab_size=2000))
    meta = _prepare_under_memory_limit(tmp_path, str(tmp_path / "tok"), budget_mb=64, times=3)
    assert meta.train_tokens + meta.val_tokens > 0 and meta.tokenizer == "bpe"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl.gz", "parquet"])
def test_memory_stays_flat_for_compressed_jsonl_and_parquet(tmp_path: Path, kind: str) -> None:
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    budget, docs = 48 * 2**20, [SHAKESPEARE[i : i + 4000] for i in range(0, len(SHAKESPEARE) - 4000, 4000)]
    rounds = 4 * budget // sum(len(d) for d in docs) + 1  # four times the budget of text

    def write(path: Path, repeat: int) -> None:
        if kind == "parquet":
            with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
                for _ in range(repeat):
                    writer.write_table(pa.table({"text": docs}))
        else:
            with gzip.open(path, "wt", compresslevel=1) as f:
                for _ in range(repeat):
                    f.writelines(json.dumps({"text": d}) + "\n" for d in docs)

    corpus, warm = tmp_path / f"big.{kind}", tmp_path / f"warm.{kind}"
    write(corpus, rounds)
    write(warm, 1)
    text_size = rounds * sum(len(d) for d in docs)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            MEMORY_CHILD,
            "byte",
            str(budget),
            str(corpus),
            str(tmp_path / "o"),
            str(warm),
            str(text_size),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    meta = DataMeta.from_dict(json.loads(result.stdout.strip().splitlines()[-1]), tmp_path / "meta.json")
    assert meta.documents == rounds * len(docs) and meta.train_bytes + meta.val_bytes == text_size


def test_an_unwritable_parent_stages_inside_the_data_directory(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    import gptkit.atomic as atomic

    out = tmp_path / "data"
    prepare(PrepareConfig(out=str(out), tokenizer="byte"))
    (out / "notes.txt").write_text("mine")
    real = tempfile.mkdtemp
    places = []

    def mkdtemp(prefix: str, dir: Path) -> str:
        places.append(Path(dir))
        if Path(dir) == tmp_path:  # the parent is not ours to write (root ignores chmod, so say it here)
            raise PermissionError(13, "Permission denied", str(dir))
        return real(prefix=prefix, dir=dir)

    monkeypatch.setattr(atomic.tempfile, "mkdtemp", mkdtemp)
    prepare(PrepareConfig(out=str(out), tokenizer="char"))
    assert places == [tmp_path, out]
    assert read_meta(out).tokenizer == "char" and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [
        "gptkit_tokenizer.json",
        "meta.json",
        "notes.txt",
        "train.bin",
        "val.bin",
    ]


# ---------------------------------------------------------------- prompts (RL)


def _write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PROMPT_ROWS = [
    {"prompt": f"{a}+{b}=", "answer": str(a + b), "id": a, "meta": {"level": [a % 3, None]}}
    for a, b in zip(range(10, 30), range(40, 60))
]


def test_prompt_rows_make_a_prompt_data_set_with_every_field_kept(tmp_path: Path, capsys) -> None:
    from gptkit.data import PROMPT_FILES, load_prompts
    from gptkit.tokenizer import ByteTokenizer

    path = _write_rows(tmp_path / "prompts.jsonl", PROMPT_ROWS)
    out = tmp_path / "data"
    assert (
        main(["prepare", "--input", str(path), "--tokenizer", "byte", "--out", str(out), "--val-fraction", "0.2"]) == 0
    )
    assert "20 prompts (train 16, val 4)" in capsys.readouterr().out
    meta = read_meta(out)
    assert (meta.kind, meta.train_prompts, meta.val_prompts, meta.dropped) == ("prompts", 16, 4, 0)
    splits = {split: load_prompts(out, split, meta) for split in ("train", "val")}
    assert (len(splits["train"]), len(splits["val"])) == (16, 4)
    seen = []
    for split, prompts in splits.items():
        for i in range(len(prompts)):
            row = prompts.rows[i]
            assert prompts.texts[i] == row["prompt"]
            assert prompts.prompt(i) == ByteTokenizer().encode_prompt(row["prompt"])
            seen.append(row)
        assert not np.fromfile(out / PROMPT_FILES[split]["mask"], np.uint8).any()  # nothing in a prompt is trained
    assert sorted(seen, key=lambda r: r["id"]) == PROMPT_ROWS  # every row once, every field as it was
    assert meta.train_tokens == sum(len(r["prompt"]) for r in splits["train"].rows)
    # A data set of another kind in its place leaves none of the prompt files behind (they are the data set's).
    (out / "notes.txt").write_text("mine")
    prepare(PrepareConfig(out=str(out), tokenizer="byte"))
    assert sorted(p.name for p in out.iterdir()) == [
        "gptkit_tokenizer.json",
        "meta.json",
        "notes.txt",
        "train.bin",
        "val.bin",
    ]


def _chatml_dir(path: Path) -> Path:
    """A byte-level BPE tokenizer with ChatML specials and a ChatML template, saved as Hugging Face saves one."""
    from gptkit.tokenizer import BPETokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = BPETokenizer.train(
        ["What is two plus two? Be brief. Four. " * 20], 300, specials=(EOT, "<|im_start|>", "<|im_end|>")
    )
    (path / "tokenizer.json").write_text(tokenizer.hf.to_str())
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    return path


@pytest.mark.parametrize("kind", ["default", "chatml"])
def test_a_conversation_ending_with_a_user_turn_is_the_prompt_the_server_renders(tmp_path: Path, kind: str) -> None:
    from gptkit.data import load_prompts
    from gptkit.loading import chat_template

    tokenizer_name = "byte" if kind == "default" else str(_chatml_dir(tmp_path / "model"))
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}],
        [
            {"role": "user", "content": "Two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "Plus two?"},
        ],
    ]
    path = _write_rows(tmp_path / "chat.jsonl", [{"messages": m, "answer": "4"} for m in conversations])
    meta = prepare(
        PrepareConfig(out=str(tmp_path / "data"), inputs=[str(path)], tokenizer=tokenizer_name, val_fraction=0.0)
    )
    assert meta.kind == "prompts" and meta.train_prompts == 2
    tokenizer = load_tokenizer(tmp_path / "data")
    server_template = chat_template(tokenizer_name, tokenizer)  # what gptkit serve renders a chat request with
    prompts = load_prompts(tmp_path / "data", "train", meta)
    for i, messages in enumerate(conversations):
        text = server_template.render(messages)  # the server's call: add_generation_prompt defaults to True
        assert prompts.texts[i] == text and prompts.prompt(i) == tokenizer.encode(text)
        assert prompts.rows[i] == {"messages": messages, "answer": "4"}
    if kind == "default":
        assert prompts.texts[0] == "system: Be brief.\n\nuser: What is two plus two?\n\nassistant:"
    else:
        assert prompts.texts[0].endswith("<|im_start|>assistant\n")
        assert meta.chat_template == server_template.source  # training checks the model's template against it
        assert (tmp_path / "data" / "tokenizer_config.json").is_file()
    # TRL's conversational prompt ({"prompt": messages}) is the same prompt.
    trl = _write_rows(tmp_path / "trl.jsonl", [{"prompt": conversations[0]}])
    again = prepare(
        PrepareConfig(out=str(tmp_path / "trl"), inputs=[str(trl)], tokenizer=tokenizer_name, val_fraction=0.0)
    )
    assert load_prompts(tmp_path / "trl", "train", again).texts == prompts.texts[:1]
    # The same conversation ending with the assistant's reply stays a supervised example.
    answered = [*conversations[0], {"role": "assistant", "content": "Four."}]
    supervised = _write_rows(tmp_path / "sft.jsonl", [{"messages": answered}])
    assert (
        prepare(
            PrepareConfig(
                out=str(tmp_path / "sft"), inputs=[str(supervised)], tokenizer=tokenizer_name, val_fraction=0.0
            )
        ).kind
        == "examples"
    )


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "completion": "4"}],
            "prompts.jsonl line 2 is not a prompt row like the file's first row",
        ),
        (
            [
                {"prompt": "1+1=", "answer": "2"},
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            ],
            "prompts.jsonl line 2 is not a prompt row like the file's first row",
        ),
        (
            [
                {"messages": [{"role": "user", "content": "hi"}]},
                {"messages": [{"role": "wizard", "content": "x"}, {"role": "user", "content": "y"}]},
            ],
            "prompts.jsonl line 2: message 1 has unknown role 'wizard'",
        ),
        ([{"prompt": "1+1="}, {"prompt": ""}], "prompts.jsonl line 2: the prompt is empty"),
    ],
)
def test_a_row_that_is_not_a_prompt_in_a_prompt_file_is_one_line(tmp_path: Path, capsys, rows, message) -> None:
    path = _write_rows(tmp_path / "prompts.jsonl", rows)
    assert main(["prepare", "--input", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gptkit prepare: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_an_explicit_text_field_still_reads_prompts_as_text(tmp_path: Path) -> None:
    path = _write_rows(tmp_path / "p.jsonl", PROMPT_ROWS[:3])
    meta = prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(path)], tokenizer="byte", text_field="prompt"))
    assert "kind" not in meta.raw and _documents(tmp_path / "o") == ["10+40=", "11+41=", "12+42="]


def test_prompts_beside_examples_are_refused(tmp_path: Path) -> None:
    prompts = _write_rows(tmp_path / "a.jsonl", PROMPT_ROWS[:2])
    examples = _write_rows(tmp_path / "b.jsonl", [{"prompt": "1+1=", "completion": "2"}])
    with pytest.raises(
        InputError, match="b.jsonl holds examples rows, .*a.jsonl prompts rows; prepare them separately"
    ):
        prepare(PrepareConfig(out=str(tmp_path / "o"), inputs=[str(prompts), str(examples)], tokenizer="byte"))


def test_an_overlong_prompt_is_dropped_not_cut_and_counted(tmp_path: Path, caplog) -> None:
    import logging

    from gptkit.data import load_prompts

    rows = [
        {"prompt": "short", "answer": 1},
        {"prompt": "x" * 30, "answer": 2},
        {"prompt": "tiny", "answer": 3},
        {"prompt": "y" * 11, "answer": 4},
    ]
    path = _write_rows(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="gptkit.prepare"):
        meta = prepare(
            PrepareConfig(
                out=str(tmp_path / "o"), inputs=[str(path)], tokenizer="byte", max_length=10, val_fraction=0.0
            )
        )
    assert (meta.dropped, meta.train_prompts, meta.max_length, meta.longest_prompt) == (2, 2, 10, 5)
    assert [r["answer"] for r in load_prompts(tmp_path / "o", "train", meta).rows] == [1, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 prompt(s) longer than 10 tokens were dropped" in warnings[0]
    assert "p.jsonl line 2" in warnings[0]
    with pytest.raises(InputError, match="no prompt fits --max-length 3 \\(all 4 are longer\\)"):
        prepare(PrepareConfig(out=str(tmp_path / "o2"), inputs=[str(path)], tokenizer="byte", max_length=3))
