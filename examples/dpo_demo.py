"""Preference optimisation (DPO, ORPO, KTO) that visibly moves a chat model's style, on a laptop CPU in minutes.

1. Start from the supervised fine-tuning demonstration's word-reversal chat model (examples/finetune_demo.py,
   run first if its output is missing), and fine-tune it briefly on answers in two styles, half of them ending
   with a full stop ("nworc.") and half without ("nworc"): a chat model that has both habits, as one trained
   on mixed data has. This is the reference.
2. Make preference pairs: for the same prompt, the reversed word ending with a full stop is chosen and the bare
   one rejected. The words of the held-out pairs never appear in training.
3. Train with `--finetune.objective dpo`, fully and with LoRA (the reference is the starting model, frozen),
   with the chosen replies' next-token loss added (`--finetune.dpo_nll_weight 1`); with `orpo` on the same pairs
   (no reference); and with `kto` on the same replies unpaired, each marked desirable or not; the same steps.
4. Report, on the held-out words: preference accuracy (the share of pairs whose implicit reward margin is
   positive) and, in the text the model generates greedily (as `gptkit serve` answers a chat), the share of
   replies ending with a full stop and the share still reversing the word correctly.

Run: python examples/dpo_demo.py [--sft-out DIR] [--out DIR] [--quick]
(--quick: from finetune_demo.py --quick's weaker model, 60 reference steps and 50 steps a method instead of 100
and 100, scored on 200 of the held-out words: replies ending with "." go from 43.5% to 99-100%, and plain DPO
keeps 49.5% of the reversals where the others keep 60-64%.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from demo_commands import gptkit_cli
from finetune_demo import TASK, replies, task_words, train_cli

import gptkit
from gptkit.data import example_batches, load_examples, read_meta
from gptkit.loss import row_logprobs

# Every run: the same steps of 16 pairs (or of 32 marked completions: the same replies, unpaired).
COMMON = [
    "--train.batch_size",
    "16",
    "--optim.warmup_steps",
    "10",
    "--optim.weight_decay",
    "0.0",
    "--train.eval_interval",
    "50",
    "--train.eval_iters",
    "4",
    "--train.checkpoint_interval",
    "1000",
]
# The two replies share every token up to the full stop, so plain DPO can raise "." anywhere in a word (both
# replies' likelihood falls); the chosen replies' NLL (TRL's rpo_alpha) keeps the words right.
DPO = ["--finetune.objective", "dpo", "--finetune.dpo_beta", "0.1", "--finetune.dpo_nll_weight", "1.0"]
ORPO = ["--finetune.objective", "orpo", "--finetune.orpo_beta", "0.1"]  # its NLL term is built in
KTO = ["--finetune.objective", "kto", "--finetune.kto_beta", "0.1", "--train.batch_size", "32"]
FULL, LORA = (
    ["--optim.lr", "2e-5", "--optim.min_lr", "2e-6"],
    [
        "--finetune.method",
        "lora",
        "--finetune.lora_rank",
        "16",
        "--finetune.lora_alpha",
        "32",
        "--optim.lr",
        "2e-4",
        "--optim.min_lr",
        "2e-5",
    ],
)


def mixed(word: str, full_stop: bool) -> dict:
    """A supervised conversation in one of the two styles."""
    return {
        "messages": [
            {"role": "user", "content": TASK.format(word=word)},
            {"role": "assistant", "content": word[::-1] + ("." if full_stop else "")},
        ]
    }


def unpaired(row: dict) -> list[dict]:
    """A preference row as KTO's two marked completions: the chosen one desirable, the rejected one not."""
    return [
        {"prompt": row["prompt"], "completion": row["chosen"], "label": True},
        {"prompt": row["prompt"], "completion": row["rejected"], "label": False},
    ]


def pair(word: str) -> dict:
    """The preference row for one word: the same answer, with and without the full stop."""
    return {
        "prompt": [{"role": "user", "content": TASK.format(word=word)}],
        "chosen": [{"role": "assistant", "content": word[::-1] + "."}],
        "rejected": [{"role": "assistant", "content": word[::-1]}],
    }


@torch.no_grad()
def completion_logprobs(model_dir: Path, pairs_dir: Path) -> np.ndarray:
    """Each held-out pair's (chosen, rejected) completion log-probabilities under a model."""
    model, _ = gptkit.load(model_dir)
    meta = read_meta(pairs_dir)
    examples = load_examples(pairs_dir, "train", meta)
    out = [row_logprobs(model.eval()(b.x), b.y, "sum") for b in example_batches(examples, model.config.block_size, 32)]
    return torch.cat(out).view(-1, 2).numpy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sft-out",
        type=Path,
        help="the supervised fine-tuning demonstration's --out, run first if missing (runs/finetune-demo, or "
        "runs/finetune-demo-quick)",
    )
    parser.add_argument("--out", type=Path, help="where everything is written (runs/dpo-demo, or runs/dpo-demo-quick)")
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps from the quick fine-tuning demonstration: minutes, not hours"
    )
    args = parser.parse_args()
    suffix = "-quick" if args.quick else ""
    out: Path = args.out or Path(f"runs/dpo-demo{suffix}")
    sft_out: Path = args.sft_out or Path(f"runs/finetune-demo{suffix}")
    out.mkdir(parents=True, exist_ok=True)
    reference_steps, steps = (60, 50) if args.quick else (100, 100)
    print(
        'expected: every method learns the preference (accuracy near 100%) and ends nearly every reply with "."; '
        "plain DPO, without the NLL term, also breaks reversals"
        + (
            ' (--quick: the reference ends about 45% of replies with "." and reverses about 60% of the words)'
            if args.quick
            else ' (the reference ends about 30% of replies with ".")'
        ),
        flush=True,
    )
    started = time.perf_counter()

    if not (sft_out / "full" / "latest").is_file():
        print("\n0. the supervised fine-tuning demonstration, whose chat model this starts from", flush=True)
        demo = Path(__file__).with_name("finetune_demo.py")
        subprocess.run(
            [sys.executable, str(demo), "--out", str(sft_out), *(["--quick"] if args.quick else [])], check=True
        )
    sft = sft_out / "full" / (sft_out / "full" / "latest").read_text().strip()

    print("\n1. the reference: the word-reversal model fine-tuned on replies in both styles", flush=True)
    train_words, held_out = task_words()
    held_out = held_out[:200] if args.quick else held_out
    rng = np.random.default_rng(2)
    rows = [mixed(train_words[i], bool(i % 2)) for i in rng.integers(0, len(train_words), 2000)]
    (out / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gptkit_cli("prepare", "--input", str(out / "mixed.jsonl"), "--tokenizer", str(sft), "--out", str(out / "mixed"))
    if not (out / "reference" / "latest").is_file():
        train_cli(
            out / "reference",
            reference_steps,
            "--data",
            str(out / "mixed"),
            "--model.init_from",
            str(sft),
            "--train.batch_size",
            "32",
            "--optim.lr",
            "5e-4",
            "--optim.min_lr",
            "5e-5",
            "--optim.warmup_steps",
            "10",
            "--train.eval_interval",
            "100",
            "--train.eval_iters",
            "4",
            every=20,
        )
    sft = out / "reference" / (out / "reference" / "latest").read_text().strip()
    print("\n2. preference pairs: the reply ending with a full stop chosen", flush=True)
    rows = [pair(train_words[i]) for i in rng.integers(0, len(train_words), 2000)]  # the same words, new draws
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "marked.jsonl").write_text("".join(json.dumps(u) + "\n" for r in rows for u in unpaired(r)))
    gptkit_cli("prepare", "--input", str(out / "marked.jsonl"), "--tokenizer", str(sft), "--out", str(out / "marked"))
    (out / "held_out.jsonl").write_text("".join(json.dumps(pair(w)) + "\n" for w in held_out))
    gptkit_cli("prepare", "--input", str(out / "pairs.jsonl"), "--tokenizer", str(sft), "--out", str(out / "pairs"))
    gptkit_cli(
        "prepare",
        "--input",
        str(out / "held_out.jsonl"),
        "--tokenizer",
        str(sft),
        "--out",
        str(out / "held_out"),
        "--val-fraction",
        "0",
    )
    runs = {  # name: (run directory, data, flags)
        "DPO, full": ("full", "pairs", DPO + FULL),
        "DPO, full, no NLL term": ("full-dpo-only", "pairs", DPO + FULL + ["--finetune.dpo_nll_weight", "0"]),
        "DPO, LoRA (rank 16)": ("lora", "pairs", DPO + LORA),
        "ORPO, full": ("orpo-full", "pairs", ORPO + FULL),
        "ORPO, LoRA (rank 16)": ("orpo-lora", "pairs", ORPO + LORA),
        "KTO, full": ("kto-full", "marked", KTO + FULL),
        "KTO, LoRA (rank 16)": ("kto-lora", "marked", KTO + LORA),
    }
    reference = completion_logprobs(sft, out / "held_out")  # log ref(y | x) of each held-out pair
    results = {}
    for stage, (name, (run, data, flags)) in enumerate(
        [("reference (both styles)", (None, None, None)), *runs.items()], 3
    ):
        print(f"\n{stage}. {name}: " + ("train, then score" if run else "score"), flush=True)
        checkpoint = sft
        if run is not None:
            run_dir = out / run
            if not (run_dir / "latest").is_file():
                train_cli(
                    run_dir,
                    steps,
                    "--data",
                    str(out / data),
                    "--model.init_from",
                    str(sft),
                    *COMMON,
                    *flags,
                    every=25,
                )
            checkpoint = run_dir / (run_dir / "latest").read_text().strip()
        policy = completion_logprobs(checkpoint, out / "held_out")
        margins = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
        said = replies(checkpoint, held_out, max_new_tokens=14)
        results[name] = {
            "preference_accuracy": float(np.mean(margins > 0)),
            "ends_with_full_stop": float(np.mean([s.endswith(".") for s in said])),
            "reversed_correctly": float(np.mean([s.rstrip(".") == w[::-1] for s, w in zip(said, held_out)])),
            "example": f"Reverse: {held_out[0]} -> {said[0]!r}",
        }

    print(f"\non {len(held_out)} held-out words ({time.perf_counter() - started:.0f} s in all):")
    print(f"  {'model':28s} {'pref. acc.':>10s} {'ends with .':>12s} {'reversed ok':>12s}   example")
    for name, r in results.items():
        accuracy = "(margins 0)" if name.startswith("reference") else f"{100 * r['preference_accuracy']:9.1f}%"
        print(
            f"  {name:28s} {accuracy:>10s} {100 * r['ends_with_full_stop']:11.1f}% "
            f"{100 * r['reversed_correctly']:11.1f}%   {r['example']}"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
