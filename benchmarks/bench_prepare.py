"""Throughput of `gptkit prepare --tokenizer bpe` next to the raw batch encoding of the `tokenizers` library.

    .venv/bin/python benchmarks/bench_prepare.py            # 100 MB corpus (the issue's setting), a few minutes
    .venv/bin/python benchmarks/bench_prepare.py --mb 5     # a quick smoke run

Steps, all on the same generated corpus and the same cores:
1. generate --mb megabytes of text (tiny shakespeare's lines in a seeded random order, in 10 MB files);
2. train a BPE tokenizer (`gptkit prepare --tokenizer bpe`, the full command: training pass + encoding pass);
3. raw: `tokenizers` encode_batch_fast over the whole corpus, held in memory beforehand, in 1 MB batches of
   16 KB pieces (the same batching prepare uses), timing only the encode calls; run before and after step 4,
   and the faster of the two is used;
4. pipeline: `gptkit prepare --tokenizer DIR` with the tokenizer of step 2 (encoding only, as step 3), timed as
   wall-clock time of the command, process start-up included, and as prepare's own time from meta.json.
The target is pipeline >= 80% of raw. Figures are noisy on a shared machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


def main() -> None:
    """Run the benchmark and print one JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MB (default 100)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_prepare.") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "corpus").mkdir()
        files = generate(tmp_path / "corpus", args.mb, args.seed)
        megabytes = sum(f.stat().st_size for f in files) / 1e6

        full_wall, full_meta = run_prepare(
            ["--input", str(tmp_path / "corpus"), "--tokenizer", "bpe", "--vocab-size", str(args.vocab_size),
             "--out", str(tmp_path / "trained")]
        )  # fmt: skip
        raw_before, raw_tokens = raw_encode(files, tmp_path / "trained")
        wall, meta = run_prepare(
            ["--input", str(tmp_path / "corpus"), "--tokenizer", str(tmp_path / "trained"), "--out", str(tmp_path / "encoded")]
        )  # fmt: skip
        raw_after, _ = raw_encode(files, tmp_path / "trained")
        raw_seconds = min(raw_before, raw_after)  # the faster raw run: the ratio errs against prepare
        pipeline_tokens = meta["train_tokens"] + meta["val_tokens"] - (meta["documents"] - 1)  # minus separators

    report = {
        "corpus_mb": round(megabytes, 1),
        "cores": os.cpu_count(),
        "vocab_size": full_meta["vocab_size"],
        "raw_tokenizers_mb_per_s": round(megabytes / raw_seconds, 2),
        "prepare_encode_mb_per_s_wall": round(megabytes / wall, 2),
        "prepare_encode_mb_per_s_in_process": round(megabytes / meta["seconds"], 2),
        "ratio_wall": round(raw_seconds / wall, 3),
        "ratio_in_process": round(raw_seconds / meta["seconds"], 3),
        "target_ratio": 0.8,
        "prepare_bpe_train_and_encode_mb_per_s_wall": round(megabytes / full_wall, 2),
        "same_token_count": pipeline_tokens == raw_tokens,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
