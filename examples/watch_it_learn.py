"""Watch a model learn to copy from its context (an induction-head phase change), drawn from the run's own logs.

1. Prepare data/shakespeare_copies if it is missing: the bundled tiny shakespeare with "copy documents" added (after
   30% of its speeches, 512 characters of random strings, each 8-32 characters long and written twice: half the
   characters of the data set). On the bundled text alone no recipe tried grew an induction head within 10 minutes
   of a 2-core CPU; the copies are the smallest change found that does.
2. Train configs/watch-it-learn.yaml (2 layers, a 64-character context; about 6 minutes on a 2-core CPU; --steps N
   for fewer). Training logs, at each evaluation, the losses, the in-context learning score and the strongest
   induction head's score with the loss on a repeated random sequence (metrics.jsonl), and at every tenth a greedy
   and a sampled completion of the recipe's two prompts (samples.jsonl).
3. From those files alone (and insight.jsonl's per-evaluation measures), write a one-page figure: the losses, the
   ICL score, the strongest induction score (with what uniform attention scores) and the repeated sequence's loss,
   what mean-ablating that head changes, Olsson's map, the phase change marked on each, and the samples at four
   moments (step 0, the last before the phase change, the first after it, the end).

Run: python examples/watch_it_learn.py [--out runs/watch-it-learn] [--steps 8000] [--figure PNG]
     python examples/watch_it_learn.py --plot-only --out runs/watch-it-learn   # redraw from an existing run
The page goes to RUN_DIR/watch_it_learn.png unless --figure names another file: a run never changes the
repository's own files (docs/watch_it_learn.png is the reference run's page). --steps N runs the recipe's schedule
scaled to N steps (warm-up, decay, evaluations and checkpoints at the same fractions of the run); the reference
run's change came at about step 4,600, so a much shorter run can be expected to end before it.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from gptkit.observe.run_log import METRICS_FILE
from gptkit.observe.run_reader import parse_records
from gptkit.observe.samples import SAMPLES_FILE, read_samples
from gptkit.observe.training import (
    INSIGHT_FILE,
    draw_ablation,
    draw_icl_history,
    draw_induction_history,
    draw_position_map,
    mark_phase,
)
from gptkit.prepare import DEFAULT_CORPUS

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "watch-it-learn.yaml"
DATA = Path("data") / "shakespeare_copies"  # where the recipe's data goes: relative to where you run this, as the
#                                            run directory is (run from the repository's root, as the docs do)
# The copy documents. A span's two copies are 8-32 characters apart, reaching gptkit's induction test (a random
# sequence of block/2 = 32 tokens, repeated); nothing marks where a copy starts, so only matching finds it.
COPY_CHANCE = 0.3  # after this share of the speeches, one copy document (half the characters of the data set)
COPY_DOCUMENT = 512  # characters in a copy document (the last span may run past it)
SPAN = (8, 32)  # a random string's length, in characters
COPY_SEED = 0
SHOWN_CHARS = 160  # characters of each sample on the page
FIGURE = "watch_it_learn.png"  # written into the run directory
# The recipe's settings that are counted in steps: --steps N scales each by N / the recipe's max_steps.
SCHEDULE = {"optim": ("warmup_steps", "decay_steps"), "train": ("eval_interval", "checkpoint_interval")}


def gptkit_cli(*args: str) -> None:
    """Run one gptkit command, showing it as a user would type it."""
    print("$ gptkit " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "gptkit", *args], check=True)


def copy_document(alphabet: list[str], rng: random.Random) -> str:
    """Random strings of the corpus's characters, each written twice back to back, COPY_DOCUMENT characters."""
    document = ""
    while len(document) < COPY_DOCUMENT:
        span = "".join(rng.choice(alphabet) for _ in range(rng.randint(*SPAN)))
        document += span + span
    return document


def with_copies(text: str) -> str:
    """The text with a copy document after COPY_CHANCE of its speeches (blank-line-separated paragraphs)."""
    alphabet = sorted(set(text) - {"\n"})
    rng = random.Random(COPY_SEED)
    parts = []
    for speech in text.split("\n\n"):
        parts.append(speech)
        if rng.random() < COPY_CHANCE:
            parts.append(copy_document(alphabet, rng))
    return "\n\n".join(parts)


def prepare_data(data: Path) -> None:
    """Write the bundled corpus with its copy documents beside data and prepare it there (char tokenizer)."""
    source = data.with_suffix(".txt")
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(with_copies(DEFAULT_CORPUS.read_text()))
    gptkit_cli("prepare", "--input", str(source), "--tokenizer", "char", "--out", str(data))


def read_records(run_dir: Path, name: str) -> list[dict]:
    """The records of one of the run's JSON-lines files, as `gptkit watch` reads them (a line cut short by a kill
    is skipped); none where the file is missing."""
    path = run_dir / name
    return parse_records(path.read_bytes())[0] if path.is_file() else []


def scaled_schedule(steps: int, recipe: Path = CONFIG) -> list[str]:
    """The flags that run the recipe's schedule in `steps` steps: its warm-up, decay, evaluations and checkpoints at
    the same fractions of the run (8000 steps evaluated every 100: 500 steps every 6)."""
    settings = yaml.safe_load(recipe.read_text())
    scale = steps / settings["train"]["max_steps"]
    flags = ["--train.max_steps", str(steps)]
    for section, keys in SCHEDULE.items():
        for key in keys:
            flags += [f"--{section}.{key}", str(max(1, round(settings[section][key] * scale)))]
    return flags


def four_moments(steps: list[int], phase: int | None = None) -> list[int]:
    """Four of the steps that took samples: the first, the last before the phase change and the first after it
    (where one was located and samples fall on both sides), and the last; else the first, the next, the middle
    and the last."""
    steps = sorted(set(steps))
    before = [s for s in steps if phase is not None and s < phase]
    after = [s for s in steps if phase is not None and s > phase]
    if before and after:
        picks = [steps[0], before[-1], after[0], steps[-1]]
    else:
        picks = [steps[0], steps[min(1, len(steps) - 1)], steps[len(steps) // 2], steps[-1]]
    return list(dict.fromkeys(picks))


def sample_text(samples: list[dict], step: int) -> str:
    """Each prompt's greedy and sampled completions at a step, as a few wrapped lines."""
    at = [s for s in samples if s["step"] == step]
    lines = [f"step {step}"]
    for prompt in dict.fromkeys(s["prompt"] for s in at):
        lines.append(f"  prompt: {prompt!r}")
        for s in at:
            if s["prompt"] == prompt:
                text = s["completion"][:SHOWN_CHARS].replace("\n", " / ")
                lines += textwrap.wrap(
                    f"{s['kind']}: {text}", width=110, initial_indent="    ", subsequent_indent="      "
                )
    return "\n".join(lines)


def draw(run_dir: Path, figure_path: Path) -> None:
    """The one-page figure of a run from its metrics.jsonl, insight.jsonl and samples.jsonl."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history, samples = read_records(run_dir, METRICS_FILE), read_samples(run_dir / SAMPLES_FILE)
    insight = read_records(run_dir, INSIGHT_FILE)
    evals = [r for r in history if "val_loss" in r]
    figure = Figure(figsize=(8.5, 15), dpi=110)
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(6, 1, height_ratios=[1, 0.7, 0.8, 0.7, 0.9, 1.5], hspace=0.35)
    loss = figure.add_subplot(grid[0])
    train = [(r["step"], r["loss"]) for r in history if r.get("loss") is not None]
    loss.plot(*zip(*train), alpha=0.4, label="train (each step)")
    loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], marker="o", label="validation")
    loss.set_ylabel("loss (nats)")  # (the random sequence's second copy: beside the induction score, below)
    loss.legend()
    panels = [loss] + [figure.add_subplot(grid[i], sharex=loss) for i in range(1, 5)]
    draw_icl_history(panels[1], history)
    draw_induction_history(panels[2], history)
    if any(r.get("ablation_repeat_change") is not None for r in history):
        draw_ablation(panels[3], history)
    draw_position_map(panels[4], insight)
    panels[4].set_xlabel("step")
    for axes in panels[:4]:
        axes.grid(alpha=0.3)
    mark_phase(panels, history)
    figure.suptitle(f"Watch it learn: {run_dir.name}", y=0.915)
    text = figure.add_subplot(grid[5])
    text.axis("off")
    phase = next((r["phase_change_step"] for r in reversed(history) if "phase_change_step" in r), None)
    blocks = [sample_text(samples, step) for step in four_moments([s["step"] for s in samples], phase)]
    text.text(0, 1, "\n\n".join(blocks), va="top", family="monospace", fontsize=7.5)
    figure_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(figure_path, format="png", bbox_inches="tight")
    print(f"wrote {figure_path}")


def summary(run_dir: Path) -> None:
    """The curves' numbers at each evaluation, from metrics.jsonl, and the steepest rise of the induction score."""
    evals = [r for r in read_records(run_dir, METRICS_FILE) if r.get("icl_score") is not None]
    print("step  val_loss  icl_score  induction_score (chance)  repeated-half loss")
    for r in evals:
        print(
            f"{r['step']:5d}  {r['val_loss']:.4f}  {r['icl_score']:+.4f}    {r['induction_score']:.3f} "
            f"({r['induction_chance']:.3f})          {r['induction_loss']:.4f}"
        )
    if len(evals) < 2:
        return
    if (run_dir / "config.yaml").is_file():  # (a run's settings; a copied metrics file may come without them)
        vocab = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["vocab_size"]
        # A uniformly random next token costs any prediction at least ln(vocab) nats on average: the first copy's
        # floor, which the metrics do not log.
        print(f"(the first copy of a random sequence costs at least ln {vocab} = {math.log(vocab):.2f} nats)")
    phase = evals[-1].get("phase_change_step")
    print(
        f"phase change (the ICL score's fastest fall) at step {phase}"
        if phase is not None
        else "no phase change located (the ICL score never fell fast enough: a run that ends too soon shows none)"
    )
    before, after = max(zip(evals, evals[1:]), key=lambda p: p[1]["induction_score"] - p[0]["induction_score"])
    print(
        f"steepest rise of the induction score, step {before['step']} -> {after['step']}: induction "
        f"{before['induction_score']:.3f} -> {after['induction_score']:.3f}, repeated-half loss "
        f"{before['induction_loss']:.2f} -> {after['induction_loss']:.2f}, ICL score "
        f"{before['icl_score']:+.3f} -> {after['icl_score']:+.3f}"
    )


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs") / "watch-it-learn", help="the run directory")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train this many steps, the recipe's schedule scaled to them (default: the recipe's max_steps, 8000)",
    )
    parser.add_argument("--figure", type=Path, default=None, help=f"the page (default: RUN_DIR/{FIGURE})")
    parser.add_argument("--plot-only", action="store_true", help="draw an existing run without training")
    return parser


def main() -> None:
    """Prepare the data if missing, train the recipe (unless --plot-only), print the figures and draw the page."""
    args = build_parser().parse_args()
    if not args.plot_only:
        if not (DATA / "meta.json").is_file():
            prepare_data(DATA)
        steps = scaled_schedule(args.steps) if args.steps else []
        gptkit_cli("train", "--config", str(CONFIG), "--data", str(DATA), "--out", str(args.out), *steps)
    summary(args.out)
    draw(args.out, args.figure or args.out / FIGURE)


if __name__ == "__main__":
    main()
