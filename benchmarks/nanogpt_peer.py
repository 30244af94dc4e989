"""nanoGPT's own train.py as the CPU speed run's peer: its README's CPU command on gptkit's bundled corpus, timed as a
whole command, as bench_train.py times gptkit's recipes.

It runs in a copy of a nanoGPT checkout (`git clone https://github.com/karpathy/nanoGPT NANOGPT`), whose own
data/shakespeare_char/prepare.py turns the bundled corpus (placed as its input.txt, so nothing is downloaded) into
train.bin, val.bin and meta.pkl: the same 90/10 split and character ids as `gptkit prepare --tokenizer char`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gptkit.prepare import DEFAULT_CORPUS

# nanoGPT README's "I only have a macbook" command (karpathy/nanoGPT, README.md): 2,000 steps of a 4-layer,
# 128-wide model on 12 x 64 characters, evaluating 20 batches every 250 steps.
README_CPU_ARGS = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
_EVALUATION = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)$", re.MULTILINE)


def check_checkout(checkout: Path) -> None:
    """SystemExit naming what is missing where checkout is not a nanoGPT checkout."""
    needed = [
        "train.py",
        "model.py",
        "configurator.py",
        "config/train_shakespeare_char.py",
        "data/shakespeare_char/prepare.py",
    ]
    missing = [name for name in needed if not (checkout / name).is_file()]
    if missing:
        raise SystemExit(
            f"--nanogpt {checkout}: not a nanoGPT checkout (no {', '.join(missing)}); clone it with "
            "`git clone https://github.com/karpathy/nanoGPT NANOGPT`"
        )


def prepared_copy(checkout: Path, work: Path) -> Path:
    """A copy of the nanoGPT checkout under work, its shakespeare_char data prepared by its own prepare.py from the
    bundled corpus."""
    check_checkout(checkout)
    copy = work / "nanogpt"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "out*", "assets", "*.bin", "*.pkl"))
    data = copy / "data" / "shakespeare_char"
    shutil.copyfile(DEFAULT_CORPUS, data / "input.txt")
    _run([sys.executable, "prepare.py"], data)
    return copy


def _run(command: list[str], cwd: Path) -> str:
    """command's standard output; SystemExit with the end of its error output where it fails."""
    run = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(
            f"nanoGPT's {Path(command[1]).name} failed (exit {run.returncode}) in {cwd}; its error "
            f"output ended:\n{run.stderr[-800:]}"
        )
    return run.stdout


def timed_run(copy: Path, out: Path, steps: int | None = None) -> dict:
    """Wall time of nanoGPT's README CPU command in copy (start-up included), its steps and its last evaluation.

    steps (for smoke runs only) cuts the run short, with the warm-up cut to fit.
    """
    short = (
        [
            f"--max_iters={steps}",
            f"--lr_decay_iters={steps}",
            f"--eval_interval={steps}",
            f"--warmup_iters={steps // 2}",
        ]
        if steps
        else []
    )
    start = time.perf_counter()
    output = _run([sys.executable, "train.py", *README_CPU_ARGS, *short, f"--out_dir={out}"], copy)
    wall = time.perf_counter() - start
    evaluations = _EVALUATION.findall(output)
    if not evaluations:
        raise SystemExit(f"nanoGPT's train.py printed no evaluation line; its output ended:\n{output[-500:]}")
    step, _, val_loss = evaluations[-1]
    return {
        "config": "nanoGPT train.py, README CPU command",
        "wall_s": wall,
        "steps": int(step),
        "val_loss": float(val_loss),
    }
