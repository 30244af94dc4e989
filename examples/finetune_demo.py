"""Supervised fine-tuning that visibly learns, on a laptop CPU in a few minutes: word reversal.

1. Pre-train a small byte-level model on the bundled tiny shakespeare (it learns English-looking text, and cannot
   reverse a word).
2. Make a task: conversations asking to reverse a word of the corpus ("Reverse: crown" -> "nworc"); the words
   asked about in the held-out set never appear in training.
3. Fine-tune the model on the conversations, fully and with LoRA (same commands a user types).
4. Score held-out exact match before and after: each prompt rendered with the chat template and decoded greedily,
   as `gptkit serve` answers /v1/chat/completions.

Run: python examples/finetune_demo.py [--out runs/finetune-demo] [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import gptkit
from gptkit.chat import eos_text, load_chat_template
from gptkit.prepare import DEFAULT_CORPUS

TASK = "Reverse: {word}"
PRETRAIN = [
    "--model.preset",
    "shakespeare-char-cpu",
    "--model.block_size",
    "128",
    "--train.batch_size",
    "16",
    "--optim.lr",
    "2e-3",
    "--optim.min_lr",
    "2e-4",
    "--optim.beta2",
    "0.99",
    "--train.eval_interval",
    "500",
    "--train.eval_iters",
    "10",
    "--train.checkpoint_interval",
    "500",
]
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


def gptkit_cli(*args: str) -> None:
    """Run one gptkit command, showing it as a user would type it."""
    print("$ gptkit " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "gptkit", *args], check=True)


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
def exact_match(model_dir: Path, words: list[str]) -> float:
    """The share of held-out words reversed exactly, answered as the server answers a chat request."""
    model, tokenizer = gptkit.load(model_dir)
    template = load_chat_template(model_dir, eos_text(tokenizer))
    prompts = [tokenizer.encode(template.render([{"role": "user", "content": TASK.format(word=w)}])) for w in words]
    replies = gptkit.generate_ids(
        model,
        prompts,
        max_new_tokens=12,
        temperature=0.0,
        stop=list(template.stop),
        eos_id=tokenizer.eos_ids,
        tokenizer=tokenizer,
    )
    answers = [tokenizer.decode(ids).split("\n\nuser:")[0].strip() for ids in replies]
    return sum(a == w[::-1] for a, w in zip(answers, words)) / len(words)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/finetune-demo"), help="where everything is written")
    parser.add_argument("--quick", action="store_true", help="a fraction of the steps (a smoke run, not the result)")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    scale = 10 if args.quick else 1
    started = time.perf_counter()

    base = out / "base" / "checkpoints" / f"step-{2000 // scale:06d}"
    if not base.is_dir():
        gptkit_cli("prepare", "--tokenizer", "byte", "--out", str(out / "shakespeare_bytes"))
        gptkit_cli(
            "train",
            "--data",
            str(out / "shakespeare_bytes"),
            "--out",
            str(out / "base"),
            *PRETRAIN,
            "--train.max_steps",
            str(2000 // scale),
            "--optim.warmup_steps",
            str(100 // scale),
            "--quiet",
        )

    train_words, held_out = task_words()
    rng = np.random.default_rng(1)
    rows = [conversation(train_words[i]) for i in rng.integers(0, len(train_words), 4000)]
    (out / "reverse.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gptkit_cli(
        "prepare", "--input", str(out / "reverse.jsonl"), "--tokenizer", str(base), "--out", str(out / "reverse_data")
    )
    steps = str(600 // scale)
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
    results = {"base model (no fine-tuning)": (exact_match(base, held_out), None)}
    for name, (run, flags) in runs.items():
        run_dir = out / run
        if not (run_dir / "latest").is_file():
            gptkit_cli(
                "train",
                "--data",
                str(out / "reverse_data"),
                "--out",
                str(run_dir),
                "--model.init_from",
                str(base),
                "--train.max_steps",
                steps,
                *FINETUNE,
                *flags,
                "--quiet",
            )
        checkpoint = run_dir / (run_dir / "latest").read_text().strip()
        results[name] = (exact_match(checkpoint, held_out), checkpoint)

    print(
        f"\nheld-out exact match over {len(held_out)} words never seen in training "
        f"({time.perf_counter() - started:.0f} s in all):"
    )
    for name, (score, checkpoint) in results.items():
        print(f"  {name:30s} {100 * score:5.1f}%" + (f"   {checkpoint}" if checkpoint else ""))
    print(json.dumps({name: score for name, (score, _) in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
