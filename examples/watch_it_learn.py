"""Watch a model learn: train nanoGPT's CPU recipe, then draw one page from the run's own logs.

1. Train configs/shakespeare-char-cpu.yaml (about 90 s on a 2-core CPU; --steps N for fewer), preparing the bundled
   tiny shakespeare first if data/shakespeare_char is missing. Training logs, at each evaluation, the losses, the
   in-context learning score and the strongest induction head's score (metrics.jsonl) and a greedy and a sampled
   completion of two validation prompts (samples.jsonl).
2. From those two files alone, write a one-page figure: loss, ICL score, strongest induction score (with what
   uniform attention scores), and the samples at four moments (step 0, early, middle, end).

Run: python examples/watch_it_learn.py [--out runs/watch-it-learn] [--steps 500] [--figure PNG]
     python examples/watch_it_learn.py --plot-only --out runs/watch-it-learn   # redraw from an existing run
The page goes to RUN_DIR/watch_it_learn.png unless --figure names another file: a run never changes the
repository's own files (docs/watch_it_learn.png is the reference run's page). --steps N runs the recipe's schedule
scaled to N steps (warm-up, decay, evaluations and checkpoints at the same fractions of the run).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from gptkit.observe.samples import SAMPLES_FILE, read_samples
from gptkit.observe.training import draw_icl, draw_induction

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare-char-cpu.yaml"
DATA = Path("data") / "shakespeare_char"  # where `gptkit prepare` puts it: relative to where you run this, as the
#                                          run directory is (run from the repository's root, as the README does)
SHOWN_CHARS = 160  # characters of each sample on the page
FIGURE = "watch_it_learn.png"  # written into the run directory
# The recipe's settings that are counted in steps: --steps N scales each by N / the recipe's max_steps.
SCHEDULE = {"optim": ("warmup_steps", "decay_steps"), "train": ("eval_interval", "checkpoint_interval")}


def gptkit_cli(*args: str) -> None:
    """Run one gptkit command, showing it as a user would type it."""
    print("$ gptkit " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "gptkit", *args], check=True)


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics records (a line cut short by a kill is skipped)."""
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def scaled_schedule(steps: int, recipe: Path = CONFIG) -> list[str]:
    """The flags that run the recipe's schedule in `steps` steps: its warm-up, decay, evaluations and checkpoints at
    the same fractions of the run (2000 steps evaluated every 250: 500 steps every 62)."""
    settings = yaml.safe_load(recipe.read_text())
    scale = steps / settings["train"]["max_steps"]
    flags = ["--train.max_steps", str(steps)]
    for section, keys in SCHEDULE.items():
        for key in keys:
            flags += [f"--{section}.{key}", str(max(1, round(settings[section][key] * scale)))]
    return flags


def four_moments(steps: list[int]) -> list[int]:
    """Step 0 (or the first), early (the next), middle and end among the steps that took samples."""
    steps = sorted(set(steps))
    picks = [steps[0], steps[min(1, len(steps) - 1)], steps[len(steps) // 2], steps[-1]]
    return list(dict.fromkeys(picks))


def sample_text(samples: list[dict], step: int) -> str:
    """The first prompt's greedy and sampled completions at a step, as a few wrapped lines."""
    at = [s for s in samples if s["step"] == step]
    prompt = at[0]["prompt"]
    lines = [f"step {step}  prompt: {prompt.strip()!r}"]
    for s in at:
        if s["prompt"] == prompt:
            text = s["completion"][:SHOWN_CHARS].replace("\n", " / ")
            lines += textwrap.wrap(f"{s['kind']}: {text}", width=110, subsequent_indent="    ")
    return "\n".join(lines)


def draw(run_dir: Path, figure_path: Path) -> None:
    """The one-page figure of a run from its metrics.jsonl and samples.jsonl."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history, samples = read_metrics(run_dir), read_samples(run_dir / SAMPLES_FILE)
    evals = [r for r in history if "val_loss" in r]
    figure = Figure(figsize=(8.5, 11), dpi=110)
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(4, 1, height_ratios=[1, 0.8, 0.8, 1.5], hspace=0.35)
    loss = figure.add_subplot(grid[0])
    train = [(r["step"], r["loss"]) for r in history if r.get("loss") is not None]
    loss.plot(*zip(*train), alpha=0.4, label="train (each step)")
    loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], marker="o", label="validation")
    loss.set_ylabel("loss (nats)")  # (the random sequence's second copy: beside the induction score, below)
    loss.set_title(f"Watch it learn: {run_dir.name}")
    loss.legend()
    icl = figure.add_subplot(grid[1], sharex=loss)
    draw_icl(icl, history)
    induction = figure.add_subplot(grid[2], sharex=loss)
    draw_induction(induction, history)
    induction.set_xlabel("step")
    for axes in (loss, icl, induction):
        axes.grid(alpha=0.3)
    text = figure.add_subplot(grid[3])
    text.axis("off")
    blocks = [sample_text(samples, step) for step in four_moments([s["step"] for s in samples])]
    text.text(0, 1, "\n\n".join(blocks), va="top", family="monospace", fontsize=7.5)
    figure_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(figure_path, format="png", bbox_inches="tight")
    print(f"wrote {figure_path}")


def summary(run_dir: Path) -> None:
    """The curves' numbers at each evaluation, from metrics.jsonl."""
    print("step  val_loss  icl_score  induction_score (chance)  induction_loss")
    for r in read_metrics(run_dir):
        if "icl_score" in r:
            print(f"{r['step']:5d}  {r['val_loss']:.4f}  {r['icl_score']:+.4f}    {r['induction_score']:.3f} "
                  f"({r['induction_chance']:.3f})          {r['induction_loss']:.4f}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs") / "watch-it-learn", help="the run directory")
    parser.add_argument("--steps", type=int, default=None, help="train this many steps, the recipe's schedule scaled "
                        "to them (default: the recipe's 2000)")
    parser.add_argument("--figure", type=Path, default=None, help=f"the page (default: RUN_DIR/{FIGURE})")
    parser.add_argument("--plot-only", action="store_true", help="draw an existing run without training")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if not args.plot_only:
        if not (DATA / "meta.json").is_file():
            gptkit_cli("prepare", "--tokenizer", "char", "--out", str(DATA))
        steps = scaled_schedule(args.steps) if args.steps else []
        gptkit_cli("train", "--config", str(CONFIG), "--data", str(DATA), "--out", str(args.out), *steps)
    summary(args.out)
    draw(args.out, args.figure or args.out / FIGURE)


if __name__ == "__main__":
    main()
