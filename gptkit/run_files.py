"""What a training run keeps on disk and how a failure leaves it: the run directory, its config.yaml and metrics,
checkpoints (saving, restoring, undoing a step cut short) and the one-line error of a failed write.

RunFiles is the part of gptkit.train's Trainer that writes and reads the run's files; Trainer sets the attributes
annotated below while it builds the run (Trainer.__init__), and these methods only use them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from gptkit.atomic import atomic_write_text
from gptkit.checkpoint import (
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    remove_stale_temporaries,
    rewind,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from gptkit.data import Batches
from gptkit.distributed import RankBatches, World, any_rank, barrier, gather_objects, local_tensor
from gptkit.errors import GptkitError, StepAbandoned
from gptkit.finetune.parts import Method, Objective
from gptkit.model import GPT
from gptkit.observe.run_log import METRICS_FILE, RunLog, read_history
from gptkit.observe.training import Observer
from gptkit.precision import Precision
from gptkit.tokenizer import Tokenizer
from gptkit.train_config import RunConfig, TrainConfig

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"


class TrainingStopped(GptkitError):
    """The run stopped on purpose (too many non-finite steps, weights gone bad); the message says why and where."""


class RunFiles:
    """The run directory, its files and checkpoints, for Trainer (which sets these attributes)."""

    config: RunConfig
    settings: TrainConfig
    world: World
    device: torch.device
    run_dir: Path
    gpt: GPT
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    tokenizer_config: bytes | None
    method: Method
    objective: Objective
    observer: Observer
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    params: list[torch.nn.Parameter]
    names: dict[torch.nn.Parameter, str]
    loader: RankBatches
    batches: Batches
    precision: Precision
    requested_dtype: str
    log: RunLog
    step: int
    skipped: int
    last_good: Path | None
    before_step: dict[str, Any]
    elapsed_before: float  # the wall time of the runs before this resume
    started: float  # time.perf_counter() when this process began training

    def elapsed(self) -> float:
        """Training wall time of the whole run, across resumes."""
        return self.elapsed_before + time.perf_counter() - self.started

    def open_run_directory(self, checkpoint: Path | None, resume_from: str | Path | None) -> None:
        """Make the run directory; when resuming, drop temporaries and the checkpoints after the one resumed."""
        if not self.world.is_main:
            return
        with self.writing(f"could not write the run directory {self.run_dir}"):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.run_dir)
            dropped = rewind(self.run_dir, checkpoint) if checkpoint is not None else []
        if dropped and resume_from is not None:  # (damaged ones passed over were named already)
            logger.warning(
                "continuing from %s: removed the later checkpoint(s) %s",
                checkpoint.name,
                ", ".join(p.name for p in dropped),
            )

    def restore(self, checkpoint: Path | None) -> None:
        """Weights, optimiser, generators, batch position and the objective's state from the checkpoint."""
        self.step, self.elapsed_before, self.skipped_before = 0, 0.0, 0
        self.last_good = checkpoint
        if checkpoint is not None:
            saved = load_checkpoint(
                checkpoint, self.model, self.optimizer, self.names, self.world.rank, self.read_model
            )
            self.step, self.elapsed_before = saved["step"], saved.get("elapsed_s", 0.0)
            self.skipped_before = saved.get("skipped_steps", 0)
            self.loader.load_state_dict(saved["loader"])
            self.objective.load_state_dict(saved.get("objective") or {})
            if self.scaler is not None and saved.get("scaler"):
                self.scaler.load_state_dict(saved["scaler"])
        self.batches = Batches(self.loader, self.device)

    def write_run_files(self, checkpoint: Path | None) -> None:
        """config.yaml (the resolved settings), metrics.jsonl as far as the checkpoint, and samples.jsonl."""
        resolved = self.config.to_dict()
        init_from = {"init_from": self.config.model.init_from} if self.config.model.init_from else {}
        resolved["model"] = {**init_from, **self.gpt.config.to_dict()}
        header = "# The resolved settings of this run, written by gptkit train.\n"
        if self.requested_dtype == "auto":  # kept as asked: a resume reads it and takes the checkpoint's choice
            resolved["train"]["dtype"] = "auto"
        if self.precision.reason:  # what was chosen for this machine, and why (trainer.json keeps it too)
            header += f"# precision: this run trains in {self.precision.describe()} on {self.device.type}.\n"
        # Records after the checkpoint belong to steps this run is about to redo; a new run starts a new file.
        history = read_history(self.run_dir / METRICS_FILE, self.step) if checkpoint is not None else []
        self.log = RunLog(
            self.run_dir, history, self.world.is_main, self.objective.task_metrics, self.objective.step_shown
        )
        if self.world.is_main:
            with self.writing(f"could not write {CONFIG_FILE} and {METRICS_FILE} in {self.run_dir}"):
                atomic_write_text(self.run_dir / CONFIG_FILE, header + yaml.safe_dump(resolved, sort_keys=False))
                atomic_write_text(self.run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in history))
                self.observer.keep_samples(self.step if checkpoint is not None else None, history)
        barrier(self.world)  # no rank starts before rank 0 has made the run directory

    def save(self) -> Path:
        """Checkpoint the current step, unless the weights went bad (then the last good one stays the latest)."""
        finite = bool(torch.stack([local_tensor(p).detach().isfinite().all() for p in self.params]).all())
        if any_rank(self.world, not finite, self.device):
            raise TrainingStopped(
                f"weights became non-finite by step {self.step}; the last good checkpoint is {self.last_good}"
            )
        trainer = {
            "loader": self.batches.state_dict(),
            "elapsed_s": self.elapsed(),
            "skipped_steps": self.skipped,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "objective": self.objective.state_dict(),
            "world_size": self.world.world_size,
            "grad_accum": self.settings.grad_accum,
            "precision": self.precision.state(self.device),
        }
        # Each rank's generators, so that every rank's dropout resumes exactly (rank 0's keys unprefixed).
        rngs = gather_objects(self.world, rng_state())
        rng = {(f"rank{r}." if r else "") + k: v for r, state in enumerate(rngs) for k, v in state.items()}
        failure = None
        try:
            saved = save_checkpoint(
                self.run_dir,
                self.step,
                self.model,
                self.tokenizer,
                self.optimizer,
                self.names,
                trainer,
                self.settings.keep_checkpoints,
                rng=rng,
                write=self.world.is_main,
                save_model=self.write_model,
            )
        except OSError as err:  # a full disk, a lost mount: the checkpoint before stays whole
            failure = err
        if any_rank(self.world, failure is not None, self.device):  # every rank stops, not only the writer
            raise self.io_error(f"could not write the checkpoint of step {self.step}", failure)
        self.last_good = saved
        barrier(self.world)  # no rank goes on (or exits) while rank 0 is still writing
        return self.last_good

    def position(self) -> dict[str, Any]:
        """What a step changes before its update and a checkpoint holds (host copies, no device sync): the step, the
        batch position, the objective's state (RL's sampling seeds) and the random generators."""
        return {
            "step": self.step,
            "loader": self.batches.state_dict(),
            "objective": self.objective.state_dict(),
            "rng": rng_state(),
        }

    def abandon(self, err: StepAbandoned) -> bool:
        """After user code a step ran failed, or a signal came while the step waited on it: a step cut short is
        undone (a resume takes its batches, seeds and random draws again), the run is checkpointed as of its last
        whole step, and True is returned for a signal (the run ends as interrupted); a failure raises its error,
        naming the checkpoint. Under torchrun no checkpoint is written (the other ranks are not here to join)."""
        before = self.before_step
        if self.step == before["step"]:  # inside the step: nothing was updated yet
            self.optimizer.zero_grad(set_to_none=True)
            self.loader.load_state_dict(before["loader"])
            self.batches = Batches(self.loader, self.device)
            self.objective.load_state_dict(before["objective"])
            set_rng_state(before["rng"])
        last = self.last_good
        if not self.world.distributed and (last is None or last.name != checkpoint_name(self.step)):
            last = self.save()
        if err.interrupted:
            logger.warning("%s", err)
            return True
        saved = (
            f"saved as of step {self.step} ({last})"
            if last is not None and last.name == checkpoint_name(self.step)
            else f"not saved (its last checkpoint: {last or 'none'})"
        )
        raise StepAbandoned(f"{err}; the run is {saved}: continue it with --resume once that is fixed") from None

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Within the block, a failed write (a full disk, a read-only directory) stops the run with io_error's line."""
        try:
            yield
        except OSError as err:
            raise self.io_error(what, err) from None

    def io_error(self, what: str, err: OSError | None) -> CheckpointError:
        """The one-line error for a failed write: what failed, why, and the run's last intact checkpoint."""
        if err is None:  # this rank writes nothing: rank 0 failed
            reason = " (rank 0 failed to write it)"
        else:
            named = err.filename and str(err.filename) not in what
            reason = f": {err.strerror or err}" + (f" ({err.filename})" if named else "")
        intact = latest_checkpoint(self.run_dir, verify=True) if self.world.is_main else self.last_good
        return CheckpointError(f"{what}{reason}; the last intact checkpoint is {intact or 'none (none was written)'}")

    def write_model(self, module: torch.nn.Module, directory: Path) -> None:
        """A checkpoint's model files: the method's (a model directory, or adapters), then the objective's (a head)."""
        self.method.save(self.gpt_of(module), directory, self.tokenizer, self.tokenizer_config)
        self.objective.save(module, directory)

    def read_model(self, module: torch.nn.Module, directory: Path) -> None:
        """Load what write_model wrote into the run's model, in place (the optimiser holds its parameters)."""
        self.method.restore(self.gpt_of(module), directory)
        self.objective.restore(module, directory)

    def gpt_of(self, module: torch.nn.Module) -> GPT:
        """The GPT of a module that trains (model, or the whole copy FSDP gathers of it): itself, or the `gpt` of
        the module the objective wrapped around it (Objective.wrap's contract)."""
        inner = module if isinstance(module, GPT) else getattr(module, "gpt", None)
        if not isinstance(inner, GPT):  # a new objective's wrap broke its contract
            raise TypeError(f"{type(module).__name__} is not a GPT and holds none as .gpt (see Objective.wrap)")
        return inner

    def write(self, record: dict[str, Any]) -> None:
        """Append a record to the run's metrics (metrics.jsonl, TensorBoard, the plot's history)."""
        with self.writing(f"could not append to {self.run_dir / METRICS_FILE}"):
            self.log.write(record)
