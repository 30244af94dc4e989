"""Every writing command on storage that refuses the write (a read-only directory, a full disk, a file-size limit):
one line naming the path and what was kept, exit code 2, and nothing half-written left behind. And damaged or
unreadable inputs of `prepare`: one line naming the file and the byte."""

from __future__ import annotations

import bz2
import errno
import gzip
import io
import json
import lzma
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import TINY, write_char_data_dir

import gptkit.prepare.inputs as inputs
import gptkit.prepare.sniffing as sniffing
from gptkit.adapters import add_lora, fingerprint
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.formats.gguf import export_gguf
from gptkit.formats.hf import export_hf
from gptkit.formats.lora import write_lora_dir
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.tokenizer import ByteTokenizer
from gptkit.weights import model_state

TRAIN_FLAGS = [
    "--quiet",
    "--model.n_layer",
    "1",
    "--model.n_head",
    "2",
    "--model.n_embd",
    "16",
    "--model.block_size",
    "16",
    "--train.batch_size",
    "2",
    "--train.eval_iters",
    "1",
    "--train.eval_interval",
    "100",
    "--train.device",
    "cpu",
    "--train.plot",
    "false",
]
# Each writing command: its arguments ({out} is a fresh directory for its output) and what it writes there.
WRITERS = {
    "to-gguf": (["convert", "--to-gguf", "{model}", "--out", "{out}/sub/m.gguf", "--type", "f32"], "sub/m.gguf"),
    "merge": (["convert", "--merge", "{lora}", "--out", "{out}/new/merged"], "new/merged"),
    "from-gguf": (["convert", "--from-gguf", "{gguf}", "--out", "{out}/imported"], "imported"),
    "to-hf": (["convert", "--to-hf", "{model}", "--out", "{out}/hf"], "hf"),
    "from-hf": (["convert", "--from-hf", "{hf}", "--out", "{out}/from-hf"], "from-hf"),
    "prepare": (["prepare", "--input", "{text}", "--tokenizer", "byte", "--out", "{out}/data"], "data"),
    "inspect": (["inspect", "{model}", "--out", "{out}/report", "--device", "cpu"], "report"),
    "train": (["train", "--data", "{data}", "--out", "{out}/run", "--train.max_steps", "1", *TRAIN_FLAGS], "run"),
}
ONE_LINE = r"gptkit (convert|prepare|inspect): error: cannot write {path}: {reason} \(nothing was written[^)]*\)"
TRAIN_LINE = (
    r"gptkit train: error: could not write .*: {reason}.*; the last intact checkpoint is none "
    r"\(none was written\)"
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """What the writers read: a model directory, a LoRA directory over it, its GGUF file and Hugging Face
    directory, a text file and a data directory."""
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**TINY, "vocab_size": 257}))
    save_model_dir(model, root / "model", tokenizer=ByteTokenizer())
    settings = {
        "base": str((root / "model").resolve()),
        "base_fingerprint": fingerprint(model_state(model)),
        "rank": 2,
        "alpha": 4.0,
        "dropout": 0.0,
        "targets": "all",
        "base_precision": "float32",
    }
    write_lora_dir(add_lora(model, 2, 4.0, 0.0, "all"), root / "lora", settings)
    model = GPT(ModelConfig(**{**TINY, "vocab_size": 257}))
    export_gguf(model, root / "m.gguf", ByteTokenizer(), "f32")
    export_hf(model, root / "hf", tokenizer=ByteTokenizer())
    (root / "text.txt").write_text("To be, or not to be, that is the question.\n" * 1500)  # 66 kB: 132 kB of tokens
    (root / "data").mkdir()
    write_char_data_dir(root / "data", 20_000)
    names = {"model": "model", "lora": "lora", "gguf": "m.gguf", "hf": "hf", "text": "text.txt", "data": "data"}
    return {key: str(root / name) for key, name in names.items()}


def writer_argv(name: str, sources: dict[str, str], out: Path) -> list[str]:
    """The command line of writer `name` with its output under out."""
    return [arg.format(out=out, **sources) for arg in WRITERS[name][0]]


def check_failure(name: str, code: int, err: str, out: Path, reason: str) -> None:
    """One error line naming the output path, exit 2, and no output (nor staging or temporary file) left."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if "error" in line]
    assert code == 2 and len(lines) == 1, err
    target = out / WRITERS[name][1]
    if name == "train":
        assert re.fullmatch(TRAIN_LINE.format(reason=reason), lines[0]), lines[0]
        run = out / "run"  # its logs may stay (settings, metrics, samples, measures); no checkpoint, whole or half
        logs = {"config.yaml", "metrics.jsonl", "samples.jsonl", "insight.jsonl"}
        assert not run.exists() or {p.name for p in run.iterdir()} <= logs, list(run.iterdir())
    else:
        assert re.fullmatch(ONE_LINE.format(path=re.escape(str(target)), reason=reason), lines[0]), lines[0]
        assert list(out.iterdir()) == [], list(out.rglob("*"))


@pytest.mark.parametrize("name", WRITERS)
def test_a_read_only_directory_is_one_line_and_leaves_nothing(name, sources, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        if os.access(out, os.W_OK):
            pytest.skip("chmod does not stop this user (root) writing; the file-size limit test covers it")
        code = main(writer_argv(name, sources, out))
        check_failure(name, code, capsys.readouterr().err, out, "Permission denied")
    finally:
        out.chmod(0o755)


# Runs every writer under a 16 kB file-size limit (RLIMIT_FSIZE: a write past it fails with EFBIG, whoever runs it;
# Python ignores SIGXFSZ) in one process, each into its own empty directory; prints {name: [code, stderr]}.
UNDER_LIMIT = """
import contextlib, io, json, resource, sys, traceback
from pathlib import Path
from gptkit.cli import main
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, resource.RLIM_INFINITY))
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException:
        code, err = 1, io.StringIO(traceback.format_exc())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    results[name] = [code, err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def under_size_limit(sources, tmp_path_factory) -> tuple[dict[str, list], Path]:
    """Every writer's (exit code, stderr) under the file-size limit, and the directory of their output folders."""
    pytest.importorskip("resource")
    root = tmp_path_factory.mktemp("limited")
    for name in WRITERS:
        (root / name).mkdir()
    argvs = {name: writer_argv(name, sources, root / name) for name in WRITERS}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [sys.executable, "-c", UNDER_LIMIT, json.dumps(argvs)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), root


@pytest.mark.parametrize("name", WRITERS)
def test_a_file_size_limit_is_one_line_and_leaves_nothing(name, under_size_limit):
    results, root = under_size_limit
    code, err = results[name]
    check_failure(name, code, err, root / name, "File too large")


@pytest.fixture
def full_disk(monkeypatch, tmp_path):
    """From now on, fsync of a file whose path holds the string put in the returned list fails with ENOSPC (as
    on a full disk; every gptkit write fsyncs its files before it renames them into place)."""
    real, where = os.fsync, []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if any(part in path for part in where) and os.path.isfile(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file is being written")
    monkeypatch.setattr(os, "fsync", fsync)
    return where


@pytest.mark.parametrize("name", [n for n in WRITERS if n != "train"])
def test_a_full_disk_is_one_line_and_leaves_nothing(name, sources, tmp_path, capsys, full_disk):
    out = tmp_path / "out"
    out.mkdir()
    full_disk.append(str(out))
    code = main(writer_argv(name, sources, out))
    check_failure(name, code, capsys.readouterr().err, out, "No space left on device")


def test_a_full_disk_over_an_existing_output_keeps_it_whole(sources, tmp_path, capsys, full_disk):
    out = tmp_path / "merged"
    assert main(["convert", "--merge", sources["lora"], "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    full_disk.append(str(tmp_path))
    assert main(["convert", "--merge", sources["lora"], "--out", str(out), "--force"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"gptkit convert: error: cannot write {out}: No space left on device (the existing directory is unchanged; "
        "the source is unchanged)"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no staging directory beside it


def test_a_full_disk_at_a_checkpoint_names_the_one_kept(sources, tmp_path, capsys, full_disk):
    out = tmp_path / "run"
    full_disk.append("step-000002")
    argv = [
        "train",
        "--data",
        sources["data"],
        "--out",
        str(out),
        "--train.max_steps",
        "2",
        "--train.checkpoint_interval",
        "1",
        *TRAIN_FLAGS,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.fullmatch(
        r"gptkit train: error: could not write the checkpoint of step 2: No space left on device"
        rf"(?: \(.*\))?; the last intact checkpoint is {re.escape(str(out))}/checkpoints/step-000001",
        err.strip().splitlines()[-1],
    ), err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]


def test_an_export_of_a_lora_directory_lands_whole_with_its_adapters(sources, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", sources["lora"], "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert f"are in {out / 'adapter'}:" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_an_os_error_of_the_storage_anywhere_is_one_line(monkeypatch, capsys):
    import gptkit.cli.info

    def failing(args):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "some/file")

    monkeypatch.setattr(gptkit.cli.info, "run", failing)
    assert main(["info", "gpt2"]) == 2
    assert capsys.readouterr().err == "gptkit info: error: some/file: Input/output error\n"


# ---------------------------------------------------------------- inputs prepare cannot read


def _zstd(data: bytes) -> bytes:
    """data compressed as the zstd command does (with a checksum of the content)."""
    return pytest.importorskip("zstandard").ZstdCompressor(write_checksum=True).compress(data)


COMPRESSORS = {
    "gz": (gzip.compress, "gzip"),
    "bz2": (bz2.compress, "bzip2"),
    "xz": (lzma.compress, "xz"),
    "zst": (_zstd, "zstd"),
}
TEXT = "".join(f"line {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) + "\n" for i in range(4000)).encode()


def _damaged(data: bytes, how: str) -> bytes:
    """data cut short, or with 64 bytes zeroed near its start (found by the look prepare takes at a file's first
    8 KiB of content, or later) or in its middle."""
    if how == "truncated":
        return data[: len(data) * 6 // 10]
    at = {"start": 40, "middle": len(data) // 2}[how]
    return data[:at] + bytes(64) + data[at + 64 :]


@pytest.mark.parametrize("how", ["truncated", "start", "middle"])
@pytest.mark.parametrize("suffix", COMPRESSORS)
def test_a_damaged_compressed_input_is_one_line_naming_the_file_and_byte(suffix, how, tmp_path, capsys):
    compress, name = COMPRESSORS[suffix]
    path = tmp_path / f"text.txt.{suffix}"
    path.write_bytes(_damaged(compress(TEXT), how))
    # (--errors replace: what a damaged stream decodes to before its damage is found must not stop it first)
    argv = ["prepare", "--input", str(path), "--tokenizer", "byte", "--errors", "replace", "--out", str(tmp_path / "d")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.fullmatch(
        rf"gptkit prepare: error: {re.escape(str(path))}: damaged or truncated compressed file "
        rf"\({name} data at or before byte [\d,]+ of the file: .+\); check it with `{name} -t .+`"
        " and re-create or re-download it",
        err.strip().splitlines()[-1],
    ), err
    assert not (tmp_path / "d").exists()


def test_several_zstd_frames_are_read_in_full(tmp_path):
    (tmp_path / "two.txt.zst").write_bytes(_zstd(b"first frame, ") + _zstd(b"second frame"))  # as `cat a.zst b.zst`
    with inputs.opened(tmp_path / "two.txt.zst", "strict", lambda n: None) as (src, _):
        assert src.stream.read() == b"first frame, second frame"


def test_a_compressed_file_is_read_whole_and_a_reader_stopping_early_leaves_no_thread(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(b'{"text": "row %d of many"}\n' % i for i in range(200_000))))  # 5 MB
    assert sum(1 for _ in inputs.records(path, "strict")) == 200_000
    threads = threading.active_count()
    rows = inputs.records(path, "strict")
    assert [next(rows)[0]["text"] for _ in range(100_000)][-1] == "row 99999 of many"  # past the first chunk
    rows.close()
    assert threading.active_count() == threads


class _FailingFile(io.RawIOBase):
    """A file whose reads past byte `limit` fail with EIO, as a failing disk's do."""

    def __init__(self, f, limit: int) -> None:
        self.f, self.limit = f, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.f.tell() + len(buffer) > self.limit:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.f.readinto(buffer)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.f.close()
        super().close()


@pytest.mark.parametrize("limit", [0, 3 << 20])
def test_an_input_error_is_one_line_naming_the_file(limit, tmp_path, capsys, monkeypatch):
    path = tmp_path / "big.txt"
    path.write_bytes(b"all work and no play\n" * 250_000)  # 5 MB: read 1 MiB at a time
    real = open

    def failing_open(file, mode="r", *args, **kwargs):
        if Path(file) == path:
            return _FailingFile(real(file, "rb", buffering=0), limit)
        return real(file, mode, *args, **kwargs)

    for module in (sniffing, inputs):  # the look at the file, then its reading
        monkeypatch.setattr(module, "open", failing_open, raising=False)
    assert main(["prepare", "--input", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "data")]) == 2
    where = f" at byte {limit:,}"  # (0: the first read, in the look at the file before reading it)
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == f"gptkit prepare: error: cannot read input {path}{where}: Input/output error"
    )
    assert not (tmp_path / "data").exists()
