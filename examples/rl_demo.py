"""Reinforcement learning from a reward a program checks, on a laptop CPU in minutes: two-digit addition.

1. Problems "a+b=" with a and b below 100; one in a hundred is held out (never seen in any training): `gptkit
   prepare` splits the supervised set and the prompt set alike (the same rows in the same order, the same
   --val-fraction), and the demo checks that their validation problems are the same.
2. Supervised fine-tuning: a small model, from scratch, trained on worked examples of the other problems
   ({"prompt": "23+45=", "completion": "68"}) written by a careless hand: 40% of the answers are one too high.
   The model learns the arithmetic and the carelessness.
3. Reinforcement learning: `--finetune.objective grpo` from that model's checkpoint, on prompt rows
   ({"prompt": "23+45=", "answer": "68"}) with the built-in exact_match reward, which checks the arithmetic: each
   step samples a group of 8 completions of each of 8 prompts through the batch engine, and moves the model
   toward the ones that scored above their group's mean. Demonstrations were imperfect; the verifier is exact.
4. Report, on the held-out problems, what the RL run's own evaluations measured: pass@1 (the chance that one
   completion sampled at temperature 1 is right) and pass@8 (that one of 8 is), at its first evaluation (the
   supervised model, before any RL step) and at its last; and the mean reward along the way. Each seed's
   RUN/seed-S/rl/loss.png draws its curves.

Float sums run in a different order on another CPU (other vector kernels, other thread counts), so one seed's exact
trajectory is not what another machine will see: --seeds N runs N seeds (train.seed, which sets the initial
weights, the batches' order and the samples' draws; the problems and the held-out split stay the same) and reports
the mean, least and most of each figure, the spread to expect from run to run.

Run: python examples/rl_demo.py [--out runs/rl-demo] [--seeds N] [--seed FIRST] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import numpy as np

from gptkit.finetune.policy_loss import LossType

SFT = [
    "--model.n_layer",
    "3",
    "--model.n_head",
    "4",
    "--model.n_embd",
    "128",
    "--model.block_size",
    "16",
    "--model.dropout",
    "0.0",
    "--train.batch_size",
    "64",
    "--optim.lr",
    "3e-3",
    "--optim.warmup_steps",
    "50",
    "--train.eval_iters",
    "4",
    "--train.sample_every",
    "0",
    "--train.eval_examples",
    "64",
]
RL = [
    "--finetune.objective",
    "grpo",
    "--finetune.reward",
    "exact_match",
    "--finetune.group_size",
    "8",
    "--finetune.completion_tokens",
    "4",
    "--finetune.temperature",
    "1.0",
    "--finetune.eval_samples",
    "8",
    "--train.batch_size",
    "8",
    "--train.eval_examples",
    "100",
    "--optim.lr",
    "1e-4",
    "--optim.schedule",
    "constant",
    "--optim.warmup_steps",
    "5",
    "--optim.weight_decay",
    "0.0",
    "--train.sample_every",
    "0",
]
SFT_STEPS, RL_STEPS = 2000, 400
QUICK_STEPS = 40, 6  # --quick: SFT and RL steps of a smoke run
CARELESS = 0.4  # the share of worked answers that are one too high
VAL_FRACTION = "0.01"  # 100 of the 10,000 problems
FIGURES = ("pass@1", "pass@8")


def gptkit_cli(*args: str) -> None:
    """Run one gptkit command, showing it as a user would type it; a failure ends the demo with its exit status."""
    print("$ gptkit " + shlex.join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "gptkit", *args])
    if done.returncode:
        raise SystemExit(f"gptkit {args[0]} failed (exit status {done.returncode}); its message is above")


def problems(seed: int = 0) -> list[tuple[int, int]]:
    """Every (a, b) with a, b < 100, in a shuffled order."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    return [pairs[i] for i in np.random.default_rng(seed).permutation(len(pairs))]


def held_out_prompts(sft_data: Path, rl_data: Path) -> list[str]:
    """The validation problems of the prompt set, checked to be those of the supervised set."""
    from gptkit.data import load_examples, read_meta
    from gptkit.tokenizer import load_tokenizer

    examples, tokenizer = load_examples(sft_data, "val", read_meta(sft_data)), load_tokenizer(sft_data)
    sft = [
        tokenizer.decode(examples.ids[a:b].tolist()).split("=")[0] + "="
        for a, b in zip(examples.offsets[:-1], examples.offsets[1:])
    ]
    rl = [json.loads(line)["text"] for line in (rl_data / "val.prompts.jsonl").read_text().splitlines()]
    if sft != rl:
        raise SystemExit("the supervised and prompt sets hold out different problems; prepare both again")
    return rl


def write_rows(path: Path, rows: list[dict]) -> Path:
    """The rows as JSON lines at path."""
    from gptkit.atomic import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def evaluations(run: Path) -> list[dict]:
    """The run's evaluation records (those with the held-out pass@1)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("val_pass_at_1") is not None]


def supervised_data(out: Path, pairs: list[tuple[int, int]]) -> Path:
    """Careless worked examples of every problem, prepared with the validation split held out."""
    careless = np.random.default_rng(1).random(len(pairs)) < CARELESS
    examples = write_rows(
        out / "sft.jsonl",
        [{"prompt": f"{a}+{b}=", "completion": str(a + b + int(wrong))} for (a, b), wrong in zip(pairs, careless)],
    )
    gptkit_cli(
        "prepare",
        "--input",
        str(examples),
        "--tokenizer",
        "byte",
        "--out",
        str(out / "sft-data"),
        "--val-fraction",
        VAL_FRACTION,
    )
    return out / "sft-data"


def train(data: Path, run: Path, steps: int, seed: int, recipe: list[str], *extra: str) -> Path:
    """Train run to its last step (unless it got there before) and return that checkpoint."""
    from gptkit.checkpoint import checkpoint_name, latest_checkpoint

    last, newest = run / "checkpoints" / checkpoint_name(steps), latest_checkpoint(run)
    if newest != last:
        # A run stopped early (Ctrl-C checkpoints it) continues where it stopped, not from its partial model.
        resume = ["--resume"] if newest is not None else []
        gptkit_cli(
            "train",
            *resume,
            "--data",
            str(data),
            "--out",
            str(run),
            *extra,
            *recipe,
            "--train.seed",
            str(seed),
            "--train.max_steps",
            str(steps),
            "--train.eval_interval",
            str(max(steps // 4, 1)),
            "--train.checkpoint_interval",
            str(steps),
        )
    return last


def one_seed(
    out: Path, sft_data: Path, pairs: list[tuple[int, int]], seed: int, steps: tuple[int, int], loss_type: str = "dapo"
) -> dict:
    """Supervised fine-tuning then RL with one train.seed, in out/seed-S (RL under another loss type than the
    default in rl-LOSS_TYPE, from the same supervised model); what the RL run's evaluations measured."""
    where = out / f"seed-{seed}"
    start = train(sft_data, where / "sft", steps[0], seed, SFT)
    # The prompt set: the same problems, the same held out (its validation split) to measure.
    prompts = write_rows(where / "prompts.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs])
    gptkit_cli(
        "prepare",
        "--input",
        str(prompts),
        "--tokenizer",
        str(start),
        "--out",
        str(where / "rl-data"),
        "--val-fraction",
        VAL_FRACTION,
    )
    held_out = held_out_prompts(sft_data, where / "rl-data")
    rl = where / ("rl" if loss_type == "dapo" else f"rl-{loss_type}")
    train(where / "rl-data", rl, steps[1], seed, RL, "--model.init_from", str(start), "--finetune.loss_type", loss_type)
    first, last = evaluations(rl)[0], evaluations(rl)[-1]
    rewards = [
        (r["step"], r["reward"])
        for r in map(json.loads, (rl / "metrics.jsonl").read_text().splitlines())
        if "reward" in r
    ]
    result = {
        "seed": seed,
        "loss_type": loss_type,
        "held_out_prompts": min(100, len(held_out)),
        "train_reward": rewards,
    }
    for name, record in (("before_rl", first), ("after_rl", last)):
        result[name] = {"step": record["step"], "pass@1": record["val_pass_at_1"], "pass@8": record["val_pass_at_8"]}
    print(
        f"seed {seed}: held-out pass@1 {first['val_pass_at_1']:.3f} -> {last['val_pass_at_1']:.3f}, pass@8 "
        f"{first['val_pass_at_8']:.3f} -> {last['val_pass_at_8']:.3f} after {last['step']} RL steps; curves in "
        f"{rl / 'loss.png'}",
        flush=True,
    )
    return result


def spread(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """The mean, least and most of each figure over the runs, before and after RL, and of the gain in pass@1."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for phase in ("before_rl", "after_rl"):
        summary[phase] = {name: _stats([run[phase][name] for run in runs]) for name in FIGURES}
    summary["gain"] = {"pass@1": _stats([run["after_rl"]["pass@1"] - run["before_rl"]["pass@1"] for run in runs])}
    return summary


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "min": float(min(values)), "max": float(max(values))}


def _shown(stats: dict[str, float], unit: str = "%") -> str:
    return f"{100 * stats['mean']:.1f}{unit} ({100 * stats['min']:.1f}-{100 * stats['max']:.1f})"


def machine() -> str:
    """The CPU, what gptkit's CPU kernels run with here (and chose), and the thread count the runs inherit."""
    import torch

    from gptkit.native import library

    return f"{library.capability()}; {torch.get_num_threads()} threads"


def at_least(low: int) -> Callable[[str], int]:
    """argparse's type for a whole number of at least low."""

    def whole(text: str) -> int:
        if not text.isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {low}")
        return int(text)

    return whole


def build_parser() -> argparse.ArgumentParser:
    """The demo's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/rl-demo"))
    parser.add_argument("--seeds", type=at_least(1), default=1, help="how many seeds to run (default 1)")
    parser.add_argument("--seed", type=at_least(0), default=1, help="the first seed's train.seed (default 1)")
    parser.add_argument("--quick", action="store_true", help="a fraction of the steps (a smoke run, not the result)")
    parser.add_argument(
        "--loss-type",
        default="dapo",
        choices=get_args(LossType),
        help="GRPO's loss type (finetune.loss_type; default dapo, gptkit's default)",
    )
    return parser


def report(out: Path, runs: list[dict], steps: tuple[int, int], seconds: float) -> None:
    """Write out/summary.json (summary-LOSS_TYPE.json for another loss type than the default); print the spread
    over the seeds and the machine they ran on."""
    from gptkit.atomic import atomic_write_text

    figures = spread(runs)
    summary = {
        "held_out_prompts": runs[0]["held_out_prompts"],
        "samples_per_prompt": 8,
        "sft_steps": steps[0],
        "rl_steps": steps[1],
        "machine": machine(),
        "seeds": [run["seed"] for run in runs],
        **figures,
        "runs": runs,
        "seconds": round(seconds, 1),
    }
    loss_type = runs[0]["loss_type"]
    path = out / ("summary.json" if loss_type == "dapo" else f"summary-{loss_type}.json")
    atomic_write_text(path, json.dumps(summary, indent=1) + "\n")
    raised = sum(run["after_rl"]["pass@1"] > run["before_rl"]["pass@1"] for run in runs)
    print(
        f"{len(runs)} seed(s), held-out mean (least-most): pass@1 {_shown(figures['before_rl']['pass@1'])} -> "
        f"{_shown(figures['after_rl']['pass@1'])}, pass@8 {_shown(figures['before_rl']['pass@8'])} -> "
        f"{_shown(figures['after_rl']['pass@8'])}; RL raised pass@1 on {raised} of {len(runs)} seeds, by "
        f"{_shown(figures['gain']['pass@1'], ' points')}; {seconds:.0f} s in all\n"
        f"machine: {summary['machine']}\nsummary: {path}"
    )


def main() -> None:
    args = build_parser().parse_args()
    started, pairs = time.perf_counter(), problems()
    steps = QUICK_STEPS if args.quick else (SFT_STEPS, RL_STEPS)
    sft_data = supervised_data(args.out, pairs)
    runs = [
        one_seed(args.out, sft_data, pairs, seed, steps, args.loss_type)
        for seed in range(args.seed, args.seed + args.seeds)
    ]
    report(args.out, runs, steps, time.perf_counter() - started)


if __name__ == "__main__":
    main()
