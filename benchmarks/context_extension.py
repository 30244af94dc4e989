"""Context extension of a RoPE model: the loss by position past the context it was trained at, before and after a
short fine-tune at the longer context, with plain and with scaled RoPE.

A char-level RoPE model is trained on the bundled tiny shakespeare at block 256 (`gptkit train`), then:
  - evaluated at 1024 as it is (plain RoPE: positions 256+ are rotations it never saw);
  - evaluated at 1024 with its RoPE scaled and no fine-tune (linear factor 4: positions squeezed into the trained
    range; yarn factor 4 over an original 256);
  - fine-tuned at block 1024 for a few steps (`gptkit train` with model.init_from) with plain RoPE, with linear
    scaling and with yarn, and evaluated at 1024 again.
Every evaluation is `gptkit eval --data DIR --context 1024 --by-position 256 --json` over the whole val split
(windows of 1024 tokens, none overlapping, so every position is scored in every window). A model is switched to
another context or RoPE rule by copying its directory with block_size and rope_scaling changed in config.json:
`gptkit train` keeps an init_from model's settings (only dropout may change), and neither changes a weight.

The figures are losses (nats per character); each fine-tune also trains the model further on the same data, so
its first bucket improves too and the buckets past 256 are what to compare with the base.

    python benchmarks/context_extension.py                  # about 10 minutes on 2 busy CPU cores
    python benchmarks/context_extension.py --base-steps 100 --tune-steps 20 --json   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gptkit.atomic import atomic_write_text
from gptkit.config import ModelConfig
from gptkit.loading import resolve_model_path

BASE_BLOCK = 256
LONG_BLOCK = 1024
BUCKET = 256
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": BASE_BLOCK}


def gptkit(*args: str) -> str:
    """Run a gptkit command in a child process and return its standard output."""
    done = subprocess.run([sys.executable, "-m", "gptkit", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"gptkit {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def base_recipe(data: Path, out: Path, steps: int) -> dict[str, Any]:
    """The base run: nanoGPT's char model (4 layers, 128 wide) with RoPE, at block 256."""
    return {
        "model": {"preset": "shakespeare-char-cpu", "position": "rope", "block_size": BASE_BLOCK, "dropout": 0.0},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 30, "schedule": "cosine", "decay_steps": steps},
        "train": _train_section(data, out, steps, batch_size=8),
    }


def tune_recipe(data: Path, out: Path, init: Path, steps: int) -> dict[str, Any]:
    """A fine-tune of init (already switched to block 1024) at a low learning rate; 2 x 1024 tokens a step."""
    return {
        "model": {"init_from": str(init)},
        "optim": {"lr": 5e-4, "min_lr": 5e-5, "warmup_steps": 5, "schedule": "cosine", "decay_steps": steps},
        "train": _train_section(data, out, steps, batch_size=2),
    }


def _train_section(data: Path, out: Path, steps: int, batch_size: int) -> dict[str, Any]:
    return {
        "data_dir": str(data),
        "out_dir": str(out),
        "max_steps": steps,
        "batch_size": batch_size,
        "eval_interval": steps,
        "eval_iters": 5,
        "eval_at_start": False,
        "observe": False,  # the ICL and induction measures at the end take longer than a fine-tune here
        "checkpoint_interval": steps,
        "keep_checkpoints": 1,
        "seed": 1337,
        "device": "cpu",
        "dtype": "float32",
        "compile": False,
        "plot": False,
    }


def train(recipe: dict[str, Any], work: Path, name: str) -> Path:
    """Run `gptkit train` on recipe (written as YAML's JSON subset) and return its newest checkpoint."""
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(recipe, indent=1) + "\n")
    gptkit("train", "--config", str(path), "--quiet")
    return resolve_model_path(recipe["train"]["out_dir"])


def switched(model_dir: Path, out: Path, rope_scaling: dict[str, Any] | None) -> Path:
    """A copy of model_dir at block 1024 with rope_scaling (None: plain RoPE); the weights are the same."""
    shutil.copytree(model_dir, out)
    data = json.loads((out / "config.json").read_text())
    fields = dict(data["model"], block_size=LONG_BLOCK, rope_scaling=rope_scaling)
    data["model"] = ModelConfig.from_dict(fields).to_dict()  # checked as any config is
    atomic_write_text(out / "config.json", json.dumps(data, indent=2) + "\n")
    return out


def by_position(model_dir: Path, data: Path) -> dict[str, Any]:
    """`gptkit eval --by-position` at context 1024 over the val split, as its JSON object."""
    context, bucket = str(LONG_BLOCK), str(BUCKET)
    out = gptkit("eval", str(model_dir), "--data", str(data), "--context", context, "--by-position", bucket, "--json")
    return json.loads(out)


def run(work: Path, base_steps: int, tune_steps: int) -> list[dict[str, Any]]:
    """Train, switch, fine-tune and evaluate; one row per model evaluated."""
    data = work / "data"
    gptkit("prepare", "--out", str(data), "--tokenizer", "char")
    base = train(base_recipe(data, work / "base", base_steps), work, "base")
    models = {
        "base, plain RoPE": switched(base, work / "plain", None),
        "base, linear x4, no fine-tune": switched(base, work / "linear", LINEAR),
        "base, yarn x4, no fine-tune": switched(base, work / "yarn", YARN),
    }
    starts = {"plain": "base, plain RoPE", "linear x4": "base, linear x4, no fine-tune"}
    starts["yarn x4"] = "base, yarn x4, no fine-tune"
    for label, start in starts.items():
        name = "tune-" + label.split()[0]
        models[f"fine-tuned at {LONG_BLOCK}, {label}"] = train(
            tune_recipe(data, work / name, models[start], tune_steps), work, name
        )
    rows = []
    for label, model_dir in models.items():
        result = by_position(model_dir, data)
        rows.append({"model": label, "loss": result["loss"], "by_position": result["by_position"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: one column per position bucket and the mean."""
    spans = [f"{b['start']}-{b['end']}" for b in rows[0]["by_position"]]
    lines = ["| model (evaluated at 1024) | " + " | ".join(spans) + " | all |", "|---|" + "---:|" * (len(spans) + 1)]
    for row in rows:
        cells = [f"{b['loss']:.3f}" for b in row["by_position"]]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {row['loss']:.3f} |")
    return "\n".join(lines)


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    """Parse the options, run the experiment, print a table or one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=300, help="steps of the base run at block 256")
    parser.add_argument("--tune-steps", type=int, default=40, help="steps of each fine-tune at block 1024")
    parser.add_argument("--work", type=Path, default=None, help="directory for the data and runs (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work if args.work is not None else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        rows = run(work, args.base_steps, args.tune_steps)
    threads = os.environ.get("OMP_NUM_THREADS", "default")
    cpu = f"{cpu_name()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}, torch {torch.__version__}"
    if args.json:
        print(json.dumps({"base_steps": args.base_steps, "tune_steps": args.tune_steps, "cpu": cpu, "rows": rows}))
        return
    print(
        f"base: {args.base_steps} steps at block {BASE_BLOCK}; fine-tunes: {args.tune_steps} steps at block "
        f"{LONG_BLOCK}; loss in nats per character on the val split ({cpu})"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
