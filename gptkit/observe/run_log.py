"""What a training run writes as it goes: metrics.jsonl, TensorBoard, loss.png and the progress bar's lines.

Rank 0 writes; every other rank's RunLog keeps nothing. A failed write is an OSError for the caller to turn into
its one-line error (the trainer names the last intact checkpoint).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from gptkit.errors import ConfigError
from gptkit.observe.training import plot_run

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"


def read_history(path: Path, up_to: int) -> list[dict[str, Any]]:
    """The metrics records of a run up to step `up_to` (later ones belong to steps a resume will redo)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill, or damaged (invalid UTF-8 is a ValueError too)
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and step <= up_to:
            records.append(record)
    return records


class RunLog:
    """The metrics records of one run (history: those of the steps up to now, the plot's data) and where they go."""

    def __init__(self, run_dir: Path, history: list[dict[str, Any]], is_main: bool,
                 task_metrics: dict[str, str | None], step_shown: tuple[str, ...]) -> None:  # fmt: skip
        self.run_dir, self.history, self.is_main = run_dir, history, is_main
        self.task_metrics, self.step_shown = task_metrics, step_shown  # the objective's panels and bar statistics
        self.metrics: Any = None
        self.tensorboard: Any = None
        self.bar: Any = None

    def open(self, tensorboard: bool, progress: bool, max_steps: int, step: int) -> None:
        """Open metrics.jsonl for appending (and TensorBoard), and the progress bar at step."""
        from tqdm import tqdm

        if self.is_main:
            self.metrics = open(self.run_dir / METRICS_FILE, "a")
            if tensorboard:
                self.tensorboard = open_tensorboard(self.run_dir / TENSORBOARD_DIR)
        self.bar = tqdm(total=max_steps, initial=step, desc="train", unit="step", file=sys.stderr,
                        dynamic_ncols=True, smoothing=0.1) if progress else None  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        """Append a record to metrics.jsonl (a line, flushed: a kill loses at most the line being written), to
        TensorBoard and to the history; a non-finite number is written as null (NaN is not JSON)."""
        if not self.is_main:
            return
        record.update({k: None for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)})
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        self.history.append(record)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def plot(self) -> None:
        """Redraw loss.png from the history."""
        if self.is_main:
            plot_run(self.history, self.run_dir / PLOT_FILE, self.task_metrics)

    def note(self, message: str) -> None:
        """A line above the progress bar (evaluations, skipped steps); silent without a bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)

    def step_done(self, record: dict[str, Any] | None) -> None:
        """Advance the bar by one step, and show a logged step's loss, statistics, learning rate and speed."""
        if self.bar is None:
            return
        self.bar.update(1)
        if record is not None:
            shown = "".join(f" {key} {record[key]:.3g}" for key in self.step_shown if record.get(key) is not None)
            mfu = f" MFU {100 * record['mfu']:.0f}%" if "mfu" in record else ""
            self.bar.set_postfix_str(f"loss {record['loss']:.4f}{shown} lr {record['lr']:.2e} "
                                     f"{_si(record['tokens_per_s'])}tok/s{mfu}", refresh=False)  # fmt: skip

    def close(self) -> None:
        """Close the files and the bar."""
        for thing in (self.metrics, self.tensorboard, self.bar):
            if thing is not None:
                thing.close()


def open_tensorboard(log_dir: Path) -> Any:
    """A TensorBoard SummaryWriter for log_dir; a clear error when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=str(log_dir))


def _si(n: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix} "
    return f"{n:.0f} "
