"""Throughput of `gptkit prepare`: BPE encoding next to the `tokenizers` library's own, and each input format.

    .venv/bin/python benchmarks/bench_prepare.py                    # 100 MB corpus (the issue's setting), a few minutes
    .venv/bin/python benchmarks/bench_prepare.py --mb 5             # a quick smoke run
    .venv/bin/python benchmarks/bench_prepare.py --formats          # input formats, 100 MB of text
    .venv/bin/python benchmarks/bench_prepare.py --formats --mb 1000

Default (BPE), all on the same generated corpus and the same cores:
1. generate --mb megabytes of text (tiny shakespeare's lines in a seeded random order, in 10 MB files);
2. train a BPE tokenizer (`gptkit prepare --tokenizer bpe`, the full command: training pass + encoding pass);
3. raw: `tokenizers` encode_batch_fast over the whole corpus, held in memory beforehand, in 1 MB batches of
   16 KB pieces (the same batching prepare uses), timing only the encode calls; run before and after step 4,
   and the faster of the two is used;
4. pipeline: `gptkit prepare --tokenizer DIR` with the tokenizer of step 2 (encoding only, as step 3), timed as
   wall-clock time of the command, process start-up included, and as prepare's own time from meta.json.
The target is pipeline >= 80% of raw.

--formats: the same documents (tiny shakespeare's lines, shuffled, 1-8 KB a document; --mb megabytes of text) as
.jsonl, .jsonl.gz (gzip level 6), .jsonl.zst, .parquet (snappy, a row group per 20,000 documents), .csv and (up
to 200 MB) a directory of one .txt file a document, each prepared with `gptkit prepare --tokenizer byte` (the cheapest
encoder, so that reading weighs most) in its own process: MB of text per second (wall, start-up included) and
the process's peak RSS. The target: .jsonl.gz and .parquet at >= 0.8x the plain .jsonl's throughput.
Figures are noisy on a shared machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "gptkit" / "corpora" / "tinyshakespeare.txt"
GPTKIT = [sys.executable, "-m", "gptkit"]


def generate(directory: Path, megabytes: float, seed: int) -> list[Path]:
    """Write about `megabytes` MB of shuffled shakespeare lines into 10 MB files; returns the files."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    rng = random.Random(seed)
    files, remaining, index = [], int(megabytes * 1e6), 0
    while remaining > 0:
        path = directory / f"part{index:03d}.txt"
        size = min(remaining, 10_000_000)
        with open(path, "w", encoding="utf-8") as f:
            written = 0
            while written < size:
                block = "".join(rng.choices(lines, k=1000))
                f.write(block)
                written += len(block.encode("utf-8"))
        files.append(path)
        remaining -= written
        index += 1
    return files


def run_prepare(args: list[str]) -> tuple[float, dict]:
    """Run `gptkit prepare ARGS`; returns (wall seconds, meta.json)."""
    started = time.perf_counter()
    subprocess.run([*GPTKIT, "prepare", *args], check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    out = Path(args[args.index("--out") + 1])
    return seconds, json.loads((out / "meta.json").read_text())


def raw_encode(files: list[Path], tokenizer_dir: Path) -> tuple[float, int]:
    """Seconds spent in tokenizers' encode_batch_fast over the corpus (texts read beforehand), and tokens."""
    from tokenizers import Tokenizer

    from gptkit.tokenizer import newline_cuts

    hf = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hf.encode_special_tokens = True  # as prepare: a document's text is plain text
    batches: list[list[str]] = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        cuts = newline_cuts(text, 1 << 14)
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        batch, size = [], 0
        for piece in pieces:
            batch.append(piece)
            size += len(piece)
            if size >= 1 << 20:
                batches.append(batch)
                batch, size = [], 0
        if batch:
            batches.append(batch)
    seconds, tokens = 0.0, 0
    for batch in batches:
        started = time.perf_counter()
        encodings = hf.encode_batch_fast(batch, add_special_tokens=False)
        seconds += time.perf_counter() - started
        tokens += sum(len(e) for e in encodings)
    return seconds, tokens


def documents(megabytes: float, seed: int):
    """Documents of 1-8 KB of shuffled shakespeare lines, about `megabytes` MB of UTF-8 text in all."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    rng = random.Random(seed)
    remaining = int(megabytes * 1e6)
    while remaining > 0:
        doc = "".join(rng.choices(lines, k=rng.randint(30, 240)))
        remaining -= len(doc.encode("utf-8"))
        yield doc


TEXT_FILES_MAX_MB = 200  # above this, no directory of one .txt file a document (hundreds of thousands of files)


def write_formats(directory: Path, megabytes: float, seed: int) -> dict[str, Path]:
    """The same documents in each format (a stream of them at a time, so memory stays small); returns the inputs."""
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    paths = {
        "jsonl": directory / "d.jsonl",
        "jsonl.gz": directory / "d.jsonl.gz",
        "jsonl.zst": directory / "d.jsonl.zst",
        "parquet": directory / "d.parquet",
        "csv": directory / "d.csv",
        "txt dir": directory / "txt",
    }
    text_files = megabytes <= TEXT_FILES_MAX_MB
    if text_files:
        paths["txt dir"].mkdir()
    else:
        del paths["txt dir"]
    schema = pa.schema([("text", pa.string())])
    with (
        open(paths["jsonl"], "w", encoding="utf-8") as plain,
        gzip.open(paths["jsonl.gz"], "wt", encoding="utf-8", compresslevel=6) as gz,
        open(paths["jsonl.zst"], "wb") as zst_file,
        zstandard.ZstdCompressor().stream_writer(zst_file) as zst,
        open(paths["csv"], "w", encoding="utf-8", newline="") as csv_file,
        pq.ParquetWriter(paths["parquet"], schema) as parquet,
    ):
        table = csv.writer(csv_file)
        table.writerow(["text"])
        batch: list[str] = []
        for index, doc in enumerate(documents(megabytes, seed)):
            line = json.dumps({"text": doc}) + "\n"
            plain.write(line)
            gz.write(line)
            zst.write(line.encode())
            table.writerow([doc])
            if text_files:
                (paths["txt dir"] / f"{index // 1000:05d}").mkdir(exist_ok=True)
                (paths["txt dir"] / f"{index // 1000:05d}" / f"{index:08d}.txt").write_text(doc, encoding="utf-8")
            batch.append(doc)
            if len(batch) == 20_000:
                parquet.write_table(pa.table({"text": batch}, schema=schema))
                batch = []
        if batch:
            parquet.write_table(pa.table({"text": batch}, schema=schema))
    return paths


# `gptkit prepare`, then the process's peak resident memory (VmHWM: this process image's own, unlike ru_maxrss,
# which Linux carries over from the parent that forked it) as the last line of stdout.
PEAK_CHILD = (
    "import sys; from gptkit.cli import main; code = main(['prepare', *sys.argv[1:]]); "
    "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))); sys.exit(code)"
)


def prepare_in_child(args: list[str]) -> tuple[float, int, dict]:
    """Run `gptkit prepare ARGS` in its own process: (wall seconds, peak RSS in bytes, meta.json)."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PEAK_CHILD, *args], stdout=subprocess.PIPE, text=True, check=True)
    seconds = time.perf_counter() - started
    out = Path(args[args.index("--out") + 1])
    return seconds, int(result.stdout.split()[-1]) * 1024, json.loads((out / "meta.json").read_text())


def formats(megabytes: float, seed: int) -> dict:
    """Prepare the same documents from each format; throughput and peak memory of each."""
    with tempfile.TemporaryDirectory(prefix="bench_prepare.") as tmp:
        tmp_path = Path(tmp)
        paths = write_formats(tmp_path, megabytes, seed)
        results, tokens = {}, set()
        for name, path in paths.items():
            out = tmp_path / f"out-{name.replace(' ', '-')}"
            seconds, rss, meta = prepare_in_child(["--input", str(path), "--tokenizer", "byte", "--out", str(out)])
            text_mb = (meta.train_bytes + meta.val_bytes) / 1e6
            results[name] = {
                "file_mb": round(sum(i["bytes"] for i in meta.inputs) / 1e6, 1),
                "text_mb_per_s": round(text_mb / seconds, 2),
                "seconds": round(seconds, 2),
                "max_rss_mb": round(rss / 2**20, 1),
                "documents": meta.documents,
            }
            tokens.add(meta.train_tokens + meta.val_tokens)
            shutil.rmtree(out)
    plain = results["jsonl"]["text_mb_per_s"]
    for entry in results.values():
        entry["vs_jsonl"] = round(entry["text_mb_per_s"] / plain, 3)
    return {
        "text_mb": round(megabytes, 1),
        "tokenizer": "byte",
        "formats": results,
        "target_vs_jsonl": 0.8,
        "same_token_count": len(tokens) == 1,
    }


def main() -> None:
    """Run the benchmark and print one JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MB (default 100)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", action="store_true", help="measure each input format instead (byte tokenizer)")
    args = parser.parse_args()

    if args.formats:
        import torch

        print(
            json.dumps(
                {
                    "cpu": torch.backends.cpu.get_cpu_capability(),
                    "cores": os.cpu_count(),
                    **formats(args.mb, args.seed),
                },
                indent=2,
            )
        )
        return
    with tempfile.TemporaryDirectory(prefix="bench_prepare.") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "corpus").mkdir()
        files = generate(tmp_path / "corpus", args.mb, args.seed)
        megabytes = sum(f.stat().st_size for f in files) / 1e6

        full_wall, full_meta = run_prepare(
            [
                "--input",
                str(tmp_path / "corpus"),
                "--tokenizer",
                "bpe",
                "--vocab-size",
                str(args.vocab_size),
                "--out",
                str(tmp_path / "trained"),
            ]
        )
        raw_before, raw_tokens = raw_encode(files, tmp_path / "trained")
        wall, meta = run_prepare(
            [
                "--input",
                str(tmp_path / "corpus"),
                "--tokenizer",
                str(tmp_path / "trained"),
                "--out",
                str(tmp_path / "encoded"),
            ]
        )
        raw_after, _ = raw_encode(files, tmp_path / "trained")
        raw_seconds = min(raw_before, raw_after)  # the faster raw run: the ratio errs against prepare
        pipeline_tokens = meta.train_tokens + meta.val_tokens - (meta.documents - 1)  # minus separators

    report = {
        "corpus_mb": round(megabytes, 1),
        "cores": os.cpu_count(),
        "vocab_size": full_meta.vocab_size,
        "raw_tokenizers_mb_per_s": round(megabytes / raw_seconds, 2),
        "prepare_encode_mb_per_s_wall": round(megabytes / wall, 2),
        "prepare_encode_mb_per_s_in_process": round(megabytes / meta.seconds, 2),
        "ratio_wall": round(raw_seconds / wall, 3),
        "ratio_in_process": round(raw_seconds / meta.seconds, 3),
        "target_ratio": 0.8,
        "prepare_bpe_train_and_encode_mb_per_s_wall": round(megabytes / full_wall, 2),
        "same_token_count": pipeline_tokens == raw_tokens,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
