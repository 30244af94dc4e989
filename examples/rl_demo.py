"""Reinforcement learning from a reward a program checks, on a laptop CPU in minutes: two-digit addition.

1. Problems "a+b=" with a and b below 100; one in a hundred is held out (never seen in any training): `gptkit
   prepare` splits the supervised set and the prompt set alike (the same rows in the same order, the same
   --val-fraction), and the demo checks that their validation problems are the same.
2. Supervised fine-tuning: a small model, from scratch, trained briefly on worked examples of the other problems
   ({"prompt": "23+45=", "completion": "68"}) written by a careless hand: 40% of the answers are one too high.
   The model learns the arithmetic and the carelessness: sampled, it is right about a third of the time.
3. Reinforcement learning: `--finetune.objective grpo` from that model's checkpoint, on prompt rows
   ({"prompt": "23+45=", "answer": "68"}) with the built-in exact_match reward, which checks the arithmetic: each
   step samples a group of 8 completions of each of 8 prompts through the batch engine, and moves the model
   toward the ones that scored above their group's mean. Demonstrations were imperfect; the verifier is exact.
4. Report, on the held-out problems, what the RL run's own evaluations measured: pass@1 (the chance that one
   completion sampled at temperature 1 is right) and pass@8 (that one of 8 is), at its first evaluation (the
   supervised model, before any RL step) and at its last; and the mean reward along the way. RUN/loss.png
   draws the curves.

Run: python examples/rl_demo.py [--out runs/rl-demo] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SFT = ["--model.n_layer", "3", "--model.n_head", "4", "--model.n_embd", "128", "--model.block_size", "16",
       "--model.dropout", "0.0", "--train.batch_size", "64", "--optim.lr", "3e-3", "--optim.warmup_steps", "50",
       "--train.eval_iters", "4", "--train.sample_every", "0", "--train.eval_examples", "64"]  # fmt: skip
RL = ["--finetune.objective", "grpo", "--finetune.reward", "exact_match", "--finetune.group_size", "8",
      "--finetune.completion_tokens", "4", "--finetune.temperature", "1.0", "--finetune.eval_samples", "8",
      "--train.batch_size", "8", "--train.eval_examples", "100", "--optim.lr", "1e-4", "--optim.schedule",
      "constant", "--optim.warmup_steps", "5", "--optim.weight_decay", "0.0", "--train.sample_every", "0"]  # fmt: skip
CARELESS = 0.4  # the share of worked answers that are one too high
VAL_FRACTION = "0.01"  # 100 of the 10,000 problems


def gptkit_cli(*args: str) -> None:
    """Run one gptkit command, showing it as a user would type it."""
    print("$ gptkit " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "gptkit", *args], check=True)


def problems(seed: int = 0) -> list[tuple[int, int]]:
    """Every (a, b) with a, b < 100, in a shuffled order."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    return [pairs[i] for i in np.random.default_rng(seed).permutation(len(pairs))]


def held_out_prompts(sft_data: Path, rl_data: Path) -> list[str]:
    """The validation problems of the prompt set, checked to be those of the supervised set."""
    from gptkit.data import load_examples, read_meta
    from gptkit.tokenizer import load_tokenizer

    examples, tokenizer = load_examples(sft_data, "val", read_meta(sft_data)), load_tokenizer(sft_data)
    sft = [tokenizer.decode(examples.ids[a:b].tolist()).split("=")[0] + "="
           for a, b in zip(examples.offsets[:-1], examples.offsets[1:])]  # fmt: skip
    rl = [json.loads(line)["text"] for line in (rl_data / "val.prompts.jsonl").read_text().splitlines()]
    if sft != rl:
        raise SystemExit("the supervised and prompt sets hold out different problems; prepare both again")
    return rl


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def evaluations(run: Path) -> list[dict]:
    """The run's evaluation records (those with the held-out pass@1)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("val_pass_at_1") is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/rl-demo"))
    parser.add_argument("--quick", action="store_true", help="a fraction of the steps (a smoke run, not the result)")
    args = parser.parse_args()
    out = args.out
    sft_steps, rl_steps = (40, 6) if args.quick else (600, 800)
    pairs = problems()
    started = time.perf_counter()

    # The supervised set: careless worked examples of every problem, the validation split held out by prepare.
    careless = np.random.default_rng(1).random(len(pairs)) < CARELESS
    examples = write_rows(out / "sft.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b + int(wrong))}
                                              for (a, b), wrong in zip(pairs, careless)])  # fmt: skip
    gptkit_cli("prepare", "--input", str(examples), "--tokenizer", "byte", "--out", str(out / "sft-data"),
               "--val-fraction", VAL_FRACTION)  # fmt: skip
    sft = out / "sft"
    if not (sft / "latest").exists():
        gptkit_cli("train", "--data", str(out / "sft-data"), "--out", str(sft), *SFT, "--train.max_steps",
                   str(sft_steps), "--train.eval_interval", str(sft_steps // 4), "--train.checkpoint_interval",
                   str(sft_steps))  # fmt: skip
    start = sft / (sft / "latest").read_text().strip()

    # The prompt set: the same problems, the same held out (its validation split) to measure.
    prompts = write_rows(out / "prompts.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs])
    gptkit_cli("prepare", "--input", str(prompts), "--tokenizer", str(start), "--out", str(out / "rl-data"),
               "--val-fraction", VAL_FRACTION)  # fmt: skip
    held_out = held_out_prompts(out / "sft-data", out / "rl-data")
    rl = out / "rl"
    if not (rl / "latest").exists():
        gptkit_cli("train", "--data", str(out / "rl-data"), "--out", str(rl), "--model.init_from", str(start), *RL,
                   "--train.max_steps", str(rl_steps), "--train.eval_interval", str(max(rl_steps // 4, 1)),
                   "--train.checkpoint_interval", str(rl_steps))  # fmt: skip

    first, last = evaluations(rl)[0], evaluations(rl)[-1]
    rewards = [(r["step"], r["reward"]) for r in map(json.loads, (rl / "metrics.jsonl").read_text().splitlines())
               if "reward" in r]  # fmt: skip
    summary = {"held_out_prompts": min(100, len(held_out)), "samples_per_prompt": 8,
               "before_rl": {"step": first["step"], "pass@1": first["val_pass_at_1"], "pass@8": first["val_pass_at_8"]},
               "after_rl": {"step": last["step"], "pass@1": last["val_pass_at_1"], "pass@8": last["val_pass_at_8"]},
               "train_reward": rewards, "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"held-out pass@1 {first['val_pass_at_1']:.3f} -> {last['val_pass_at_1']:.3f}, pass@8 "
          f"{first['val_pass_at_8']:.3f} -> {last['val_pass_at_8']:.3f} after {last['step']} RL steps "
          f"({summary['seconds']:.0f} s in all); curves in {rl / 'loss.png'}")


if __name__ == "__main__":
    main()
