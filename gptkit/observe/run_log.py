"""What a training run writes as it goes: metrics.jsonl, TensorBoard, loss.png and the progress bar's lines.

Rank 0 writes; every other rank's RunLog keeps nothing. A failed write is an OSError for the caller to turn into
its one-line error (the trainer names the last intact checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gptkit.errors import ConfigError
from gptkit.observe.training import plot_run

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"


def read_history(path: Path, up_to: int) -> list[dict[str, Any]]:
    """The metrics records of a run up to step `up_to` (later ones belong to steps a resume will redo).

    A run writes one line per step, in step order, so a line is kept only when its step is a whole number after the
    last kept line's and at most up_to: a damaged line, a repeated or out-of-order step (a line appended by hand, a
    JSON object naming "step" twice) or one past the checkpoint never puts a step in the history twice."""
    if not path.is_file():
        return []
    records: list[dict[str, Any]] = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill, or damaged (invalid UTF-8 is a ValueError too)
        step = record.get("step") if isinstance(record, dict) else None
        last = records[-1]["step"] if records else -1
        if type(step) is int and last < step <= up_to:  # (type, not isinstance: true is an int to Python)
            records.append(record)
    return records


class RunLog:
    """The metrics records of one run (history: those of the steps up to now, the plot's data) and where they go."""

    def __init__(
        self,
        run_dir: Path,
        history: list[dict[str, Any]],
        is_main: bool,
        task_metrics: dict[str, str | None],
        step_shown: tuple[str, ...],
    ) -> None:
        self.run_dir, self.history, self.is_main = run_dir, history, is_main
        self.task_metrics, self.step_shown = task_metrics, step_shown  # the objective's panels and bar statistics
        self.metrics: Any = None
        self.tensorboard: Any = None
        self.bar: Any = None

    def open(self, tensorboard: bool, progress: bool, max_steps: int, step: int) -> None:
        """Open metrics.jsonl for appending (and TensorBoard), and the progress bar at step."""
        if self.is_main:
            self.metrics = open(self.run_dir / METRICS_FILE, "a")
            if tensorboard:
                self.tensorboard = open_tensorboard(self.run_dir / TENSORBOARD_DIR)
        self.bar = (
            tqdm(
                total=max_steps,
                initial=step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                smoothing=0.1,
            )
            if progress
            else None
        )

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

    def announce(self, message: str) -> None:
        """A line the user must see now (a stop requested): above the bar, or as a warning without one."""
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(f"gptkit train: {message}", file=sys.stderr)
        else:
            logger.warning(message)

    @contextlib.contextmanager
    def evaluating(self, model: Any, step: int) -> Iterator[None]:
        """A second bar while an evaluation runs: the model's forward passes so far and the time, refreshed every
        second also while it decodes (the fused decode step passes no forward hook)."""
        if self.bar is None:
            yield
            return

        bar = tqdm(desc=f"evaluating step {step}", unit=" passes", file=sys.stderr, leave=False, dynamic_ncols=True)

        def count(*_: Any) -> None:  # (returns None: a forward hook's value would replace the output)
            bar.update(1)

        hook = model.register_forward_hook(count)
        done = threading.Event()
        ticker = threading.Thread(target=_tick, args=(bar, done), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
            hook.remove()
            bar.close()

    def step_done(self, record: dict[str, Any] | None) -> None:
        """Advance the bar by one step, and show a logged step's loss, statistics, learning rate and speed."""
        if self.bar is None:
            return
        self.bar.update(1)
        if record is not None:
            shown = "".join(f" {key} {record[key]:.3g}" for key in self.step_shown if record.get(key) is not None)
            mfu = f" MFU {100 * record['mfu']:.0f}%" if "mfu" in record else ""
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4f}{shown} lr {record['lr']:.2e} {_si(record['tokens_per_s'])}tok/s{mfu}",
                refresh=False,
            )

    def close(self) -> None:
        """Close the files and the bar."""
        for thing in (self.metrics, self.tensorboard, self.bar):
            if thing is not None:
                thing.close()


def _tick(bar: Any, done: threading.Event) -> None:
    """Redraw bar every second until done, so that its clock moves while nothing counts a pass."""
    while not done.wait(1.0):
        bar.refresh()


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
