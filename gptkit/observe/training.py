"""What a training run shows of its model at evaluations: the in-context learning score, the strongest induction
head's score and the loss on a repeated random sequence, what mean-ablating that head changes, and where the
phase change happened (train.observe, into metrics.jsonl; each head's induction score, the loss at each position
of the context and the ablation of each head of the strongest's layer into insight.jsonl), and samples
(train.sample_every); and loss.png with a panel for each. A run on other data than text (supervised, preference,
RL) is measured on held-out text of its own base's data given as train.observe_data.

The Trainer makes one Observer and calls it at each evaluation; everything here reads the model in eval mode, under
no_grad, with private generators, so that training (and its exact resume) is unchanged by it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure

from gptkit.atomic import atomic_write
from gptkit.data import SPLIT_FILES, Examples, load_tokens, read_meta
from gptkit.errors import ConfigError
from gptkit.model import GPT
from gptkit.observe.ablation import ablation_study
from gptkit.observe.measures import chance_induction_score, icl_score_of, induction_test, position_losses
from gptkit.observe.phase_change import phase_change_step
from gptkit.observe.routing import draw_load_history
from gptkit.observe.samples import (
    SAMPLES_FILE,
    Sample,
    append_samples,
    configured_prompts,
    example_prompts,
    keep_samples,
    note_line,
    take_samples,
    validation_prompts,
)
from gptkit.tokenizer import Tokenizer
from gptkit.train_config import TrainConfig

if TYPE_CHECKING:  # matplotlib is loaded where a figure is drawn, not for a hint
    from matplotlib.axes import Axes

logger = logging.getLogger(__name__)

INSIGHT_FILE = "insight.jsonl"  # per evaluation: each head's induction score, the loss by position, the ablations
ICL_TOKENS = 1 << 20  # the ICL windows come from the validation split's first tokens (not all of a large split)
# The longest sample, where the model's context is shorter: a sample is a glimpse at each evaluation, and past a
# learned-position context every further token costs a forward pass over a whole window.
SAMPLE_TOKENS_CAP = 4096


class Observer:
    """The measures and samples one run takes at its evaluations (rank 0 only; nothing under FSDP)."""

    def __init__(
        self,
        train: TrainConfig,
        run_dir: Path,
        model: GPT,
        tokenizer: Tokenizer | None,
        val_tokens: np.ndarray | None,
        examples: Examples | None,
        objective: str,
        is_main: bool,
        sharded: bool,
    ) -> None:
        """val_tokens: a text run's validation split (measured and sampled from); examples: a supervised run's
        validation examples (sampled from); objective names the run's in a log line."""
        self.settings, self.model, self.tokenizer = train, model, tokenizer
        self.path, self.insight_path = run_dir / SAMPLES_FILE, run_dir / INSIGHT_FILE
        self.val_tokens = val_tokens if val_tokens is not None or not is_main else _observe_tokens(train, model)
        self.phase: int | None = None  # the phase change's step as last located (announced when it moves)
        self.insight: dict[str, Any] | None = None  # the evaluation's insight.jsonl line, written with its samples
        longest = max(model.config.block_size, SAMPLE_TOKENS_CAP)
        if train.sample_every and train.sample_tokens > longest:  # checked before any work, on every rank
            raise ConfigError(
                f"train.sample_tokens {train.sample_tokens} is longer than a sample may be: at most "
                f"{longest} (the model's block_size {model.config.block_size} or {SAMPLE_TOKENS_CAP}, "
                "whichever is more); lower it, or set train.sample_every 0 for no samples"
            )
        self.measures = False
        self.prompts: list[list[int]] = []
        if not is_main:
            return
        if sharded and (train.observe or train.sample_every):
            logger.info("no samples or ICL/induction measures under train.parallel fsdp (the weights are sharded)")
            return
        block = model.config.block_size
        self.measures = train.observe and self.val_tokens is not None and block >= 4
        if train.sample_every:
            self.prompts = self._prompts(val_tokens, examples, objective, block)

    def keep_samples(self, resumed_at: int | None, history: list[dict[str, Any]] = ()) -> None:
        """Start samples.jsonl and insight.jsonl: empty for a new run; a resumed one keeps the lines up to its
        checkpoint's step (and the phase change its history located)."""
        if self.prompts:
            keep_samples(self.path, resumed_at)
        if self.measures:
            keep_samples(self.insight_path, resumed_at)
            self.phase = next((r["phase_change_step"] for r in reversed(history) if "phase_change_step" in r), None)

    def _prompts(
        self, val_tokens: np.ndarray | None, examples: Examples | None, objective: str, block: int
    ) -> list[list[int]]:
        """The token ids of the prompts to sample from, or none (with one log line saying why)."""
        t = self.settings
        if self.tokenizer is None:
            logger.info("no samples during training: the run's data has no tokenizer")
            return []
        if t.sample_prompts is not None:
            return configured_prompts(t.sample_prompts, self.tokenizer, block)
        if val_tokens is not None:
            prompts = validation_prompts(val_tokens, self.tokenizer, block)
        elif examples is not None:
            prompts = example_prompts(examples, block)
        else:
            # Not said: a classification, preference or RL run is measured by its task metrics, not by samples.
            logger.debug("no samples during training: set train.sample_prompts to sample this %s run", objective)
            return []
        if not prompts:
            logger.info("no samples during training: no validation prompt fits; set train.sample_prompts")
        return prompts

    def measure(self, step: int, history: list[dict[str, Any]]) -> dict[str, Any]:
        """icl_score, induction_score (the strongest head's), induction_loss, the chance score, what ablating the
        strongest head changes, and phase_change_step once located from the run's history ({} when not measured);
        the evaluation's insight.jsonl line is kept for append."""
        if not self.measures:
            return {}
        induction = induction_test(self.model)
        tokens = self.val_tokens[:ICL_TOKENS]
        positions = position_losses(self.model, tokens)
        ablation = ablation_study(self.model, induction.scores, tokens)
        chance = chance_induction_score(induction.length)
        record = dict(
            icl_score=icl_score_of(positions),
            induction_score=float(induction.scores.max()),
            induction_loss=induction.repeated_half_loss,
            induction_chance=chance,
            ablation_repeat_change=ablation["repeat_change"],
            ablation_icl_change=ablation["icl_change"],
        )
        points = [(r["step"], r["icl_score"]) for r in history if r.get("icl_score") is not None]
        phase = phase_change_step([*points, (step, record["icl_score"])])
        if phase is not None:
            record["phase_change_step"] = phase
        self.insight = {
            "step": step,
            "induction": induction.scores.tolist(),
            "induction_chance": chance,
            "position_loss": positions.tolist(),
            "ablation": ablation,
        }
        return record

    def summary(self, record: dict[str, Any]) -> str:
        """What the measures add to an evaluation's line ('' when not measured); a phase change newly located (or
        moved) is announced."""
        if record.get("icl_score") is None or record.get("induction_score") is None:
            return ""
        line = f", ICL {record['icl_score']:+.3f}, induction {record['induction_score']:.2f}"
        phase = record.get("phase_change_step")
        if phase is not None and phase != self.phase:
            line += f"; phase change at step {phase} (the ICL score's fastest fall)"
        self.phase = phase if phase is not None else self.phase
        return line

    def due(self, step: int) -> bool:
        """Whether step takes samples: every sample_every-th evaluation (steps that are multiples of
        sample_every x eval_interval, step 0 included) and the last step."""
        t = self.settings
        return bool(self.prompts) and (step % (t.sample_every * t.eval_interval) == 0 or step == t.max_steps)

    def take_samples(self, step: int) -> list[Sample]:
        """The step's samples when it takes them (see due), else none; nothing is written yet."""
        if not self.due(step):
            return []
        settings = self.settings
        return take_samples(self.model, self.tokenizer, self.prompts, settings.sample_tokens, settings.seed, step)

    def append(self, samples: list[Sample]) -> None:
        """Append samples to samples.jsonl and the evaluation's line to insight.jsonl (nothing when there are none)."""
        if samples:
            append_samples(self.path, samples)
        if self.insight is not None:
            with open(self.insight_path, "a") as file:  # flushed on close: a kill loses at most this line
                file.write(json.dumps(self.insight) + "\n")
            self.insight = None

    def lines(self, samples: list[Sample]) -> list[str]:
        """The samples' lines for above the progress bar."""
        return [note_line(s) for s in samples]


def _observe_tokens(train: TrainConfig, model: GPT) -> np.ndarray | None:
    """The validation tokens of train.observe_data (a prepared text data set of the model's vocabulary), or None."""
    if train.observe_data is None:
        return None
    meta = read_meta(train.observe_data)
    if meta.kind != "text" or meta.vocab_size != model.config.vocab_size:
        raise ConfigError(
            f"train.observe_data {train.observe_data} must be text prepared with the model's tokenizer "
            f"(vocab_size {model.config.vocab_size}); it holds {meta.kind} of vocab_size "
            f"{meta.vocab_size}"
        )
    tokens = load_tokens(Path(train.observe_data) / SPLIT_FILES["val"], meta.dtype)
    if len(tokens) < model.config.block_size + 1:
        raise ConfigError(
            f"train.observe_data {train.observe_data}: its validation split has {len(tokens)} tokens, "
            f"fewer than the model's block_size + 1; prepare it with more text or --val-fraction"
        )
    return tokens


def _points(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in history if r.get(key) is not None and math.isfinite(r[key])]


def _draw_losses(axes: Axes, history: list[dict[str, Any]]) -> None:
    """The training and validation losses (the induction test's loss, on another scale, is drawn with its score)."""
    series = [
        ("loss", "train (logged steps)", 0.5),
        ("train_eval_loss", "train (eval)", 1.0),
        ("val_loss", "validation", 1.0),
    ]
    for key, label, alpha in series:
        points = _points(history, key)
        if points:
            axes.plot(*zip(*points), label=label, alpha=alpha, marker="o" if key != "loss" else None, markersize=3)
    axes.set_ylabel("loss (nats)")
    axes.legend()


def draw_icl_history(axes: Axes, history: list[dict[str, Any]]) -> None:
    """The in-context learning score over steps, with zero (no use of the context) drawn."""
    axes.plot(*zip(*_points(history, "icl_score")), marker="o", markersize=3, color="tab:purple")
    axes.axhline(0.0, color="grey", linewidth=0.8)
    axes.set_ylabel("ICL score (nats)\nlate - early loss")


def draw_induction_history(axes: Axes, history: list[dict[str, Any]]) -> None:
    """The strongest induction head's score over steps, with what uniform attention scores drawn."""
    axes.plot(
        *zip(*_points(history, "induction_score")), marker="o", markersize=3, color="tab:red", label="strongest head"
    )
    chance = _points(history, "induction_chance")
    if chance:
        axes.axhline(chance[-1][1], color="grey", linestyle="--", linewidth=0.8, label="uniform attention")
    axes.set_ylim(0, 1)
    axes.set_ylabel("induction score")
    axes.legend(loc="upper left")
    losses = _points(history, "induction_loss")
    if losses:  # on its own axis: a random repeated sequence's loss can be twice the training loss
        twin = axes.twinx()
        twin.plot(*zip(*losses), marker="o", markersize=3, color="tab:grey", label="loss on the repeated half")
        twin.set_ylabel("loss (nats)")
        twin.legend(loc="upper right")


def draw_ablation(axes: Axes, history: list[dict[str, Any]]) -> None:
    """What mean-ablating the strongest induction head changes over steps: the repeated-sequence loss (up: it
    carried the copying) and the ICL score (up: it carried the context's help)."""
    axes.plot(
        *zip(*_points(history, "ablation_repeat_change")),
        marker="o",
        markersize=3,
        color="tab:red",
        label="repeated-half loss",
    )
    icl = _points(history, "ablation_icl_change")
    if icl:
        axes.plot(*zip(*icl), marker="o", markersize=3, color="tab:purple", label="ICL score")
    axes.axhline(0.0, color="grey", linewidth=0.8)
    axes.set_ylabel("change when the\nstrongest head is\nmean-ablated (nats)")
    axes.legend(loc="upper left")


def draw_position_map(axes: Axes, insight: list[dict[str, Any]]) -> None:
    """Olsson's map: the loss at each position of the context (rows, log scale) at each evaluation (columns, at
    their steps), from insight.jsonl's records; the colour is the loss."""
    rows = [r for r in insight if r.get("position_loss")]
    if not rows:
        return
    width = max(len(r["position_loss"]) for r in rows)
    losses = np.full((len(rows), width), np.nan)  # (evaluations, positions); a missing value stays blank
    for i, r in enumerate(rows):
        losses[i, : len(r["position_loss"])] = [np.nan if v is None else v for v in r["position_loss"]]
    steps = np.array([r["step"] for r in rows], dtype=float)
    gaps = np.diff(steps) if len(steps) > 1 else np.ones(1)
    # Each column spans halfway to its neighbours; position p spans p + 1 to p + 2 (a log axis has no 0).
    before = np.concatenate([gaps[:1], gaps])[: len(steps)]  # the gap before each column (the first: its next)
    step_edges = np.concatenate([steps - before / 2, steps[-1:] + gaps[-1] / 2])
    mesh = axes.pcolormesh(step_edges, np.arange(1, width + 2), losses.T, cmap="viridis", shading="flat")
    axes.set_yscale("log")
    axes.set_ylabel("position in the context\n(log scale)")
    key = axes.inset_axes([1.01, 0.0, 0.015, 1.0])  # beside the panel, so that its width matches the others'
    axes.figure.colorbar(mesh, cax=key, label="loss (nats)")


def mark_phase(panels: Any, history: list[dict[str, Any]]) -> None:
    """The phase change, where last located, as a dotted line on each panel, and named above the first."""
    phase = _points(history, "phase_change_step")
    if not phase:
        return
    for axes in panels:
        axes.axvline(phase[-1][1], color="tab:orange", linestyle=":", linewidth=1.2)
    panels[0].set_title(
        f"phase change (the ICL score's fastest fall): step {int(phase[-1][1])}", fontsize=9, color="tab:orange"
    )


def draw_metric(axes: Axes, history: list[dict[str, Any]], key: str, trained_key: str | None) -> None:
    """One task metric over the evaluations (exact match, accuracy, reward, pass@k, ...), and beside it the
    training steps' statistic it pairs with, where there is one (val_reward with each step's reward)."""
    trained = _points(history, trained_key) if trained_key is not None else []
    if trained:
        axes.plot(*zip(*trained), alpha=0.5, color="tab:blue", label="train (logged steps)")
    axes.plot(*zip(*_points(history, key)), marker="o", markersize=3, color="tab:green", label="validation")
    axes.set_ylabel(key.removeprefix("val_").replace("_", " "))
    axes.legend()


def plot_run(history: list[dict[str, Any]], path: Path, task_metrics: dict[str, str | None] | None = None) -> None:
    """Write loss.png: the loss curves (when the run has any), a panel per task metric the run logged (with the
    training statistic task_metrics pairs it with), the ICL and induction scores when it logged them, and a mixture
    of experts' load per layer and expert."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    losses = any(_points(history, key) for key in ("loss", "val_loss"))
    drawers = [lambda axes: _draw_losses(axes, history)] if losses else []
    drawers += [
        lambda axes, key=key, twin=twin: draw_metric(axes, history, key, twin)
        for key, twin in (task_metrics or {}).items()
        if _points(history, key)
    ]
    if _points(history, "icl_score"):
        drawers += [lambda axes: draw_icl_history(axes, history), lambda axes: draw_induction_history(axes, history)]
    if _points(history, "ablation_repeat_change"):
        drawers.append(lambda axes: draw_ablation(axes, history))
    if any(r.get("moe_tokens_per_expert") for r in history):
        drawers.append(lambda axes: draw_load_history(axes, history))
    if not drawers:
        return
    figure = Figure(figsize=(7, 4 + 2.25 * (len(drawers) - 1)), dpi=100)
    FigureCanvasAgg(figure)
    panels = figure.subplots(len(drawers), 1, sharex=True, squeeze=False)[:, 0]
    for draw, axes in zip(drawers, panels):
        draw(axes)
    for axes in panels:
        axes.grid(alpha=0.3)
    mark_phase(panels, history)
    panels[-1].set_xlabel("step")
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png"))
