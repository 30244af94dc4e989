"""Supervised fine-tuning that visibly learns, on a laptop CPU in a few minutes: word reversal.

1. Pre-train a small byte-level model on the bundled tiny shakespeare (it learns English-looking text, and cannot
   reverse a word).
2. Make a task: conversations asking to reverse a word of the corpus ("Reverse: crown" -> "nworc"); the words
   asked about in the held-out set never appear in training.
3. Fine-tune the model on the conversations, fully and with LoRA (same commands a user types).
4. Score held-out exact match before and after: each prompt rendered with the chat template and decoded greedily,
   as `gptkit serve` answers /v1/chat/completions.

Run: python examples/finetune_demo.py [--out DIR] [--quick]
(--quick: 300 pre-training steps and 400 fine-tuning steps instead of 2,000 and 600: a weaker model, but one whose
scores move: 61.4% exact in full, 3.5% with LoRA, from 0.0%.)
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from demo_commands import PRETRAIN, gptkit_cli

import gptkit
from gptkit.chat import eos_text, load_chat_template
from gptkit.prepare import DEFAULT_CORPUS

TASK = "Reverse: {word}"
FINETUNE = [
    "--train.batch_size",
    "32",
    "--optim.warmup_steps",
    "20",
    "--optim.weight_decay",
    "0.0",
    "--train.eval_interval",
    "100",
    "--train.eval_iters",
    "4",
    "--train.checkpoint_interval",
    "1000",
]


def train_cli(run_dir: Path, steps: int, *args: str, every: int = 50) -> None:
    """Run `gptkit train --out run_dir --train.max_steps steps ...`, printing a line of progress every `every`
    steps from the run's metrics.jsonl (the progress bar is off: it is one unreadable line in a log)."""
    command = ["train", "--out", str(run_dir), "--train.max_steps", str(steps), *args, "--quiet"]
    print("$ gptkit " + shlex.join(command), flush=True)
    process = subprocess.Popen([sys.executable, "-m", "gptkit", *command])
    metrics, shown, started = run_dir / "metrics.jsonl", 0, time.perf_counter()
    while True:
        done = process.poll() is not None  # read once more after the end: the last records
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        for record in records:
            if record["step"] > shown and (record["step"] % every == 0 or record["step"] == steps):
                val = f", val loss {record['val_loss']:.3f}" if record.get("val_loss") is not None else ""
                print(
                    f"  step {record['step']}/{steps}: loss {record['loss']:.3f}{val} "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
                shown = record["step"]
        if done:
            break
        time.sleep(1)
    if process.returncode:
        raise SystemExit(f"gptkit train failed (exit {process.returncode})")


@dataclass
class Score:
    """Greedy answers to held-out words: the share reversed exactly, and the share of letters in their place."""

    exact: float
    letters: float


def task_words(seed: int = 0) -> tuple[list[str], list[str]]:
    """(training words, held-out words): the corpus's distinct lower-case words of 3 to 7 letters, split 90/10."""
    words = sorted(set(re.findall(r"\b[a-z]{3,7}\b", DEFAULT_CORPUS.read_text())))
    order = np.random.default_rng(seed).permutation(len(words))
    cut = int(0.9 * len(words))
    return [words[i] for i in order[:cut]], [words[i] for i in order[cut:]]


def conversation(word: str) -> dict:
    return {
        "messages": [{"role": "user", "content": TASK.format(word=word)}, {"role": "assistant", "content": word[::-1]}]
    }


@torch.no_grad()
def replies(model_dir: Path, words: list[str], max_new_tokens: int) -> list[str]:
    """Greedy replies to the task's prompt for each word, rendered with the chat template as the server renders a
    chat."""
    model, tokenizer = gptkit.load(model_dir)
    template = load_chat_template(model_dir, eos_text(tokenizer))
    prompts = [tokenizer.encode(template.render([{"role": "user", "content": TASK.format(word=w)}])) for w in words]
    out = gptkit.generate_ids(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        stop=list(template.stop),
        eos_id=tokenizer.eos_ids,
        tokenizer=tokenizer,
    )
    return [tokenizer.decode(ids).split("\n\nuser:")[0].strip() for ids in out]


def score(model_dir: Path, words: list[str]) -> Score:
    """How well held-out words are reversed, answered as the server answers a chat request."""
    answers = replies(model_dir, words, max_new_tokens=12)
    exact = sum(a == w[::-1] for a, w in zip(answers, words)) / len(words)
    # A graded measure beside exact match: it moves before whole words come out right.
    placed = sum(sum(x == y for x, y in zip(a, w[::-1])) for a, w in zip(answers, words))
    return Score(exact, placed / sum(len(w) for w in words))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="where everything is written (runs/finetune-demo, or runs/finetune-demo-quick)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="300 pre-training and 400 fine-tuning steps: a weaker model, in minutes"
    )
    args = parser.parse_args()
    out: Path = args.out or Path("runs/finetune-demo-quick" if args.quick else "runs/finetune-demo")
    out.mkdir(parents=True, exist_ok=True)
    pretrain_steps, finetune_steps = (300, 400) if args.quick else (2000, 600)
    print(
        "expected: the base model reverses no held-out word; fine-tuned, "
        + (
            "fully about 60% (90% of letters in place), with LoRA a few % (30% of letters; LoRA needs the full "
            "run's steps) (--quick)"
            if args.quick
            else "99% (full) and 95% (LoRA)"
        ),
        flush=True,
    )
    started = time.perf_counter()

    print("\n1. pre-train a byte-level model on tiny shakespeare", flush=True)
    base = out / "base" / "checkpoints" / f"step-{pretrain_steps:06d}"
    if not base.is_dir():
        gptkit_cli("prepare", "--tokenizer", "byte", "--out", str(out / "shakespeare_bytes"))
        train_cli(
            out / "base",
            pretrain_steps,
            "--data",
            str(out / "shakespeare_bytes"),
            *PRETRAIN,
            "--optim.warmup_steps",
            str(pretrain_steps // 20),
            every=100,
        )

    print("\n2. make the task: reverse a word", flush=True)
    train_words, held_out = task_words()
    rng = np.random.default_rng(1)
    rows = [conversation(train_words[i]) for i in rng.integers(0, len(train_words), 4000)]
    (out / "reverse.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gptkit_cli(
        "prepare", "--input", str(out / "reverse.jsonl"), "--tokenizer", str(base), "--out", str(out / "reverse_data")
    )
    runs = {
        "full fine-tuning": ("full", ["--optim.lr", "1e-3", "--optim.min_lr", "1e-4"]),
        "LoRA (rank 16, all layers)": (
            "lora",
            [
                "--finetune.method",
                "lora",
                "--finetune.lora_rank",
                "16",
                "--finetune.lora_alpha",
                "32",
                "--optim.lr",
                "4e-3",
                "--optim.min_lr",
                "4e-4",
            ],
        ),
    }
    print("\n3. score the base model on the held-out words", flush=True)
    results = {"base model (no fine-tuning)": (score(base, held_out), None)}
    for step, (name, (run, flags)) in enumerate(runs.items(), 4):
        print(f"\n{step}. {name}, then score it", flush=True)
        run_dir = out / run
        if not (run_dir / "latest").is_file():
            train_cli(
                run_dir,
                finetune_steps,
                "--data",
                str(out / "reverse_data"),
                "--model.init_from",
                str(base),
                *FINETUNE,
                *flags,
            )
        checkpoint = run_dir / (run_dir / "latest").read_text().strip()
        results[name] = (score(checkpoint, held_out), checkpoint)

    print(f"\nheld-out words never seen in training ({len(held_out)}), {time.perf_counter() - started:.0f} s in all:")
    print(f"  {'model':30s} {'exact match':>11s} {'letters in place':>16s}")
    for name, (result, checkpoint) in results.items():
        print(
            f"  {name:30s} {100 * result.exact:10.1f}% {100 * result.letters:15.1f}%"
            + (f"   {checkpoint}" if checkpoint else "")
        )
    print(json.dumps({name: result.exact for name, (result, _) in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
