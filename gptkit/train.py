"""The training loop: AdamW (or Muon beside it) on an objective's loss, with evaluation, metrics, checkpoints, exact
resume and fault skips.

The step never waits on the device except every log_interval steps (and at evaluations and checkpoints): the
loss, gradient norm and fault counters stay on the device until then, and a non-finite step is skipped by the
fused AdamW kernel itself (its found_inf input) rather than by a Python `if`. What the run writes and reads on
disk (its directory, config.yaml, metrics, checkpoints) is gptkit.run_files' part of the Trainer.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gptkit.accounting import training_flops_per_token
from gptkit.chat import TOKENIZER_CONFIG
from gptkit.checkpoint import (
    read_trainer_state,
    resume_point,
    saved_world,
)
from gptkit.data import load_run_data
from gptkit.devices import (
    attention_backends,
    autocast_for,
    check_precision,
    gpu_recipe_on_cpu,
    mfu,
    peak_flops,
    pick_device,
)
from gptkit.distributed import (
    RankBatches,
    World,
    all_mean,
    any_rank,
    device_for,
    full_tensor,
    init_process_group,
    resumed_grad_accum,
    sync_context,
    world_from_env,
    wrap,
)
from gptkit.errors import ConfigError, GptkitError, StepAbandoned
from gptkit.finetune.catalogue import check_parts, method_for, objective_for
from gptkit.finetune.parts import Setup
from gptkit.moe import routing_metrics, start_routing_count
from gptkit.observe.run_log import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from gptkit.observe.training import Observer
from gptkit.optim import make_optimizer, set_learning_rates
from gptkit.precision import choose_precision
from gptkit.run_files import RunFiles, TrainingStopped
from gptkit.stopping import EvaluationStopped, stop_on_signals
from gptkit.tokenizer import check_same_tokenizer
from gptkit.train_config import RunConfig

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished (or interrupted) run leaves behind."""

    run_dir: Path
    step: int
    checkpoint: Path | None
    val_loss: float | None
    skipped_steps: int
    interrupted: bool


def train(
    config: RunConfig, resume: bool = False, progress: bool = True, resume_from: str | Path | None = None
) -> TrainResult:
    """Run (or, with resume, continue) the training described by config; returns where it ended.

    resume_from names the checkpoint to continue from (implies resume; default: the newest that verifies).
    Under torchrun (WORLD_SIZE > 1 in the environment) every process calls this: it joins the process group
    (unless the caller already did), trains its share of each batch, and leaves the group it joined.
    """
    world = world_from_env()
    device = device_for(world, pick_device(config.train.device, "train.device"))
    joined = init_process_group(world, device)
    try:
        return Trainer(config, resume, world, device, resume_from).run(progress and world.is_main)
    finally:
        if joined:
            gc.collect()  # a DDP/FSDP wrapper caught in a reference cycle still holds the group: free it first
            torch.distributed.destroy_process_group()


class Trainer(RunFiles):
    """One run: everything is checked and built in __init__ (errors come before any work), run() trains.

    The run's method (what trains) and objective (what it minimises) come from gptkit.finetune.catalogue; the loop
    knows them only through their interfaces (gptkit.finetune.parts). The model's four names, each around the last:
    gpt, model (objective.wrap(gpt)), wrapped (in DDP or FSDP), forward (compiled with train.compile)."""

    def __init__(
        self,
        config: RunConfig,
        resume: bool,
        world: World | None = None,
        device: torch.device | None = None,
        resume_from: str | Path | None = None,
    ) -> None:
        self.config, self.settings, self.optim = config, config.train, config.optim
        self.world = world if world is not None else World()
        self.run_dir = config.run_dir()
        check_parts(config)  # the run's method's and objective's rules
        self.data = load_run_data(self.settings.data_dir)
        checkpoint = resume_point(self.run_dir, resume or resume_from is not None, resume_from)
        if checkpoint is not None:  # another process count keeps the global batch through grad_accum
            settings = self.settings
            saved = saved_world(checkpoint)
            settings.grad_accum = resumed_grad_accum(*saved, self.world.world_size, settings.grad_accum)
        self.device = device if device is not None else pick_device(self.settings.device, "train.device")
        check_precision(self.settings.dtype, self.device)
        self.method = method_for(config)
        self.build_model(checkpoint)
        self.choose_precision(checkpoint)
        self.build_objective()
        self.build_optimizer()
        self.open_run_directory(checkpoint, resume_from)
        self.restore(checkpoint)
        self.write_run_files(checkpoint)
        self.start_counters()

    def build_model(self, checkpoint: Path | None) -> None:
        """The model (a fresh one, the one to fine-tune, or the checkpoint's), its tokenizer and chat template."""
        torch.manual_seed(self.settings.seed)  # initial weights and dropout; a resumed run restores its generator state
        vocab_size = self.data.meta.vocab_size
        run = self.method.resume(checkpoint) if checkpoint is not None else self.method.build(self.config, vocab_size)
        if run.gpt.config.vocab_size != vocab_size:
            raise ConfigError(f"the run's model has vocab_size {run.gpt.config.vocab_size}, the data {vocab_size}")
        if self.data.tokenizer is not None and run.tokenizer is not None:
            check_same_tokenizer(self.data.tokenizer, run.tokenizer, str(self.settings.data_dir), str(run.template_dir))
        self.tokenizer = run.tokenizer if run.tokenizer is not None else self.data.tokenizer  # the model's: its eos
        # The chat template the model carries, into every checkpoint: the model's own, else the data's.
        self.template_dir = Path(run.template_dir or self.settings.data_dir)
        if not (self.template_dir / TOKENIZER_CONFIG).is_file():
            self.template_dir = Path(self.settings.data_dir)
        tokenizer_config = self.template_dir / TOKENIZER_CONFIG
        self.tokenizer_config = tokenizer_config.read_bytes() if tokenizer_config.is_file() else None
        self.gpt = run.gpt
        self.block_size = self.gpt.config.block_size

    def choose_precision(self, checkpoint: Path | None) -> None:
        """train.dtype made concrete (auto: the fastest here), and attention's precision under it (or the resumed
        run's choices)."""
        saved = read_trainer_state(checkpoint).get("precision") if checkpoint is not None else None
        config = self.gpt.config
        shape = (self.settings.batch_size, config.n_head, self.block_size, config.head_dim)
        self.requested_dtype = self.settings.dtype
        self.precision = choose_precision(self.settings.dtype, self.device, self.world, shape, saved)
        self.settings.dtype, self.fp32_attention = self.precision.dtype, self.precision.fp32_attention
        self.gpt.attend_in_fp32(self.fp32_attention)
        if self.precision.reason and self.world.is_main:
            logger.info(f"training in {self.precision.describe()} on {self.device.type}")

    def build_objective(self) -> None:
        """The objective over the data and model, the module that trains, and what watches the run."""
        setup = Setup(
            self.config, self.data, self.gpt, self.tokenizer, self.method, self.device, self.world, self.template_dir
        )
        self.objective = objective_for(setup)
        val_tokens = self.data.val if self.data.kind == "text" else None
        examples = self.data.val if self.data.kind == "examples" else None
        self.observer = Observer(
            self.settings,
            self.run_dir,
            self.gpt,
            self.tokenizer,
            val_tokens,
            examples,
            self.config.finetune.objective,
            self.world.is_main,
            setup.sharded,
        )
        self.model = self.objective.wrap(self.gpt).to(self.device)  # a head is made with the model's generator
        self.gpt.check_inputs = False  # the data were checked; the check would sync the device every step
        self.gpt.checkpoint_blocks = self.settings.activation_checkpointing
        self.model.train()

    def build_optimizer(self) -> None:
        """The data-parallel wrapper, the optimiser over what trains, the fp16 gradient scaler and the batch stream."""
        if self.world.rank:  # the same initial weights on every rank (above), but each rank its own dropout
            torch.manual_seed(self.settings.seed + 7919 * self.world.rank)
        # DDP keeps the parameters; FSDP turns them into shards (DTensors), so it wraps before the optimiser.
        self.wrapped = wrap(self.model, self.world, self.settings.parallel, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.optimizer, self.fused = make_optimizer(self.model, self.optim)
        self.scaler = torch.amp.GradScaler("cuda") if self.settings.dtype == "float16" else None
        # Every rank reads one global stream (keyed by the seed alone) and takes its strided share of it.
        self.loader = RankBatches(self.objective.stream(self.settings.grad_accum * self.world.world_size), self.world)

    def start_counters(self) -> None:
        """The compiled forward, the MFU figures, and the counters a step keeps on the device."""
        self.forward = torch.compile(self.wrapped) if self.settings.compile else self.wrapped
        self.flops_per_token = training_flops_per_token(self.gpt.config)
        self.peak = peak_flops(self.device, self.settings.dtype, self.settings.peak_flops)
        per_step = self.settings.batch_size * self.settings.grad_accum * self.world.world_size * self.block_size
        warning = gpu_recipe_on_cpu(
            self.settings.device,
            self.device,
            self.requested_dtype,
            self.settings.compile,
            self.settings.max_steps * per_step * self.flops_per_token,
            self.peak,
        )
        if warning and self.world.is_main:
            logger.warning(warning)
        # Fault counters stay on the device, so no step waits to learn whether it was skipped.
        zero = torch.zeros((), device=self.device)
        self.bad_run, self.bad_run_max, self.bad_count = zero.clone(), zero.clone(), zero.clone()
        self.skipped = self.skipped_before
        self.tokens_seen = 0  # input tokens since the last logged step, on this rank
        self.step_stats: dict[str, Tensor] = {}  # the objective's statistics of the last step
        self.started = time.perf_counter()
        self.before_step = self.position()  # where a step that cannot finish is undone to (see abandon)
        self.cut_short = False  # whether a signal now ends an evaluation at once (see evaluate_into)

    def train_step(self) -> tuple[Tensor, Tensor, float]:
        """One update (or a skipped one); returns the mean loss and gradient norm, still on the device, and the lr."""
        t, optimizer, scaler = self.settings, self.optimizer, self.scaler
        lr = set_learning_rates(optimizer, self.step, self.optim, t.max_steps)
        loss_sum = torch.zeros((), device=self.device)
        step_stats: dict[str, Tensor] = {}
        for micro in range(t.grad_accum):
            batch = self.batches.next()
            # The update's loss is the mean over all its units (trained targets, pairs, texts): micro-batches of
            # examples hold different numbers of them, so each counts by its share (the all-reduce averages over
            # ranks, hence world_size).
            weight = (
                1 / t.grad_accum if batch.step_units is None else batch.units * self.world.world_size / batch.step_units
            )
            # Across ranks, gradients are all-reduced on the final micro-step only.
            with sync_context(self.wrapped, micro == t.grad_accum - 1):
                with autocast_for(self.device, t.dtype):
                    loss, stats = self.objective.loss(self.forward, batch)
                    loss = loss * weight
                (scaler.scale(loss) if scaler is not None else loss).backward()
            self.tokens_seen += batch.tokens  # (after the loss: an objective that samples counts what it forwarded)
            loss_sum += loss.detach()
            for name, value in stats.items():
                step_stats[name] = step_stats.get(name, 0) + value * weight
        self.step_stats = step_stats
        scale = self.objective.update_scale()
        if scale is not None:
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], scale)
            loss_sum = loss_sum * scale
        if scaler is not None:
            scaler.unscale_(optimizer)
        clip = self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=True))  # FSDP: a DTensor
        if scaler is not None:  # the scaler skips overflowing steps itself; only a non-finite loss is a fault
            bad = (~loss_sum.isfinite()).float()
            scaler.step(optimizer)
            scaler.update()
        else:
            bad = (~(loss_sum.isfinite() & grad_norm.isfinite())).float()
            if self.fused:
                optimizer.found_inf = bad  # the fused kernel leaves weights and moments alone when this is 1
                optimizer.step()
            elif not bool(bad):  # no fused kernel on this device, or Muon: this check syncs
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.bad_run.mul_(bad).add_(bad)
        torch.maximum(self.bad_run_max, self.bad_run, out=self.bad_run_max)
        self.bad_count.add_(bad)
        self.step += 1
        return loss_sum, grad_norm, lr

    def log_record(self, loss_sum: Tensor, grad_norm: Tensor, lr: float, tokens: int, since: float) -> dict[str, Any]:
        """Read the step's numbers from the device (the one sync of a logged step) and check the fault counters.

        tokens were trained since the time `since`; the rate is taken after the sync, so that it counts the device's
        work and not only the host's (which runs ahead of a GPU by several steps).
        """
        loss_sum = all_mean(self.world, loss_sum)  # each rank's mean over its micro-batches -> the step's mean
        record = {"step": self.step, "loss": loss_sum.item(), "lr": lr, "grad_norm": grad_norm.item()}
        tokens_per_s = tokens / max(time.perf_counter() - since, 1e-9)
        record.update(tokens_per_s=tokens_per_s, elapsed_s=self.elapsed())
        if self.step_stats:  # the objective's statistics (DPO's rewards, a head's accuracy), in one read
            values = all_mean(self.world, torch.stack([v.float() for v in self.step_stats.values()])).tolist()
            record.update(zip(self.step_stats, values))
        if self.peak:  # per device: the peak is one device's (one process's)
            record["mfu"] = mfu(tokens_per_s * self.flops_per_token / self.world.world_size, self.peak)
        skipped = self.skipped_before + int(self.bad_count.item())
        if skipped != self.skipped:
            record["skipped_steps"] = skipped
            self.log.note(
                f"step {self.step}: skipped {skipped - self.skipped} update(s) with a non-finite loss or "
                f"gradient norm ({skipped} in all)"
            )
            self.skipped = skipped
        streak = int(self.bad_run_max.item())
        if streak >= self.settings.max_bad_steps:
            self.write(record)
            raise TrainingStopped(
                f"{streak} non-finite steps in a row by step {self.step} (train.max_bad_steps "
                f"{self.settings.max_bad_steps}): lower optim.lr, raise optim.warmup_steps or check the data; the last "
                f"good checkpoint is {self.last_good or 'none (no checkpoint was written)'}"
            )
        return record

    def evaluate_into(self, record: dict[str, Any]) -> None:
        """Add the objective's evaluation (losses, task metrics) and what the observer measures to record; a
        signal during it ends it there (EvaluationStopped), and the record says so."""
        samples: list[Any] = []
        self.forward.eval()
        try:  # the flag is cleared inside the try: a signal raises EvaluationStopped only where it is caught
            self.cut_short = not self.world.distributed  # a rank cannot leave a collective on its own
            with self.log.evaluating(self.gpt, self.step):
                start_routing_count(self.gpt)  # a mixture of experts' routing over the evaluation's batches
                record.update(self.objective.evaluate(self.forward))
                record.update(routing_metrics(self.gpt))  # {} for a dense model
                observing = time.perf_counter()
                record.update(self.observer.measure(self.step, self.log.history))
                samples = self.observer.take_samples(self.step)
                if samples or self.observer.measures:
                    record["observe_s"] = time.perf_counter() - observing  # what watching the run costs it
                self.cut_short = False
        except EvaluationStopped:
            record["evaluation"] = "stopped"
        finally:
            self.cut_short = False
        self.forward.train()
        shown = [("train_eval_loss", "train loss"), ("val_loss", "val loss"), ("val_bpb", "val bpb")]
        shown += [(name, name.removeprefix("val_").replace("_", " ")) for name in self.objective.task_metrics]
        line = f"step {self.step}: " + ", ".join(
            f"{label} {record[key]:.4g}" for key, label in shown if isinstance(record.get(key), float)
        )
        line += " (evaluation stopped)" if "evaluation" in record else self.observer.summary(record)
        with self.writing(f"could not append to {self.observer.path}"):
            self.observer.append(samples)
        for text in [line, *self.observer.lines(samples)]:
            self.log.note(text)
        self.write(record)
        if self.settings.plot:
            with self.writing(f"could not write {self.run_dir / PLOT_FILE}"):
                self.log.plot()

    def stop_requested(self, stop: threading.Event) -> bool:
        """Whether to stop now: at once in one process; across ranks, agreed at logged steps (a collective)."""
        if not self.world.distributed:
            return stop.is_set()
        if self.step % self.settings.log_interval and self.step != self.settings.max_steps:
            return False
        return any_rank(self.world, stop.is_set(), self.device)

    def run(self, progress: bool = True) -> TrainResult:
        """Train to max_steps (or until SIGINT/SIGTERM, which checkpoint first); return where the run ended."""
        t = self.settings
        with self.writing(f"could not open {self.run_dir / METRICS_FILE} or {TENSORBOARD_DIR}/ for writing"):
            self.log.open(t.tensorboard, progress, t.max_steps, self.step)
        interrupted, val_loss = False, None
        try:
            with stop_on_signals(self.log.announce, lambda: self.cut_short) as stop, attention_backends(self.device):
                stopping = False
                if self.step == 0 and t.eval_at_start:
                    record: dict[str, Any] = {"step": 0}
                    self.evaluate_into(record)
                    val_loss = record.get("val_loss")
                    stopping = self.stop_requested(stop)
                    if stopping:  # a checkpoint of the starting weights, so that --resume continues from here
                        self.save()
                window_start, self.tokens_seen = time.perf_counter(), 0
                while self.step < t.max_steps and not stopping:
                    self.before_step = self.position()
                    loss_sum, grad_norm, lr = self.train_step()
                    step = self.step
                    is_eval = step % t.eval_interval == 0 or step == t.max_steps
                    stopping = self.stop_requested(stop)
                    is_ckpt = step % t.checkpoint_interval == 0 or step == t.max_steps or stopping
                    if not (step % t.log_interval == 0 or is_eval or is_ckpt):
                        self.log.step_done(None)
                        continue
                    # Input positions that are not padding, on every rank (each reads as many, near enough).
                    seen = self.tokens_seen * self.world.world_size
                    record = self.log_record(loss_sum, grad_norm, lr, seen, window_start)
                    self.log.step_done(record)
                    if is_eval:
                        self.evaluate_into(record)
                        val_loss = record.get("val_loss")
                        if not self.world.distributed and stop.is_set():  # asked during the evaluation
                            stopping = is_ckpt = True
                    else:
                        self.write(record)
                    if is_ckpt:
                        self.save()
                    window_start, self.tokens_seen = time.perf_counter(), 0
                interrupted = stopping and self.step < t.max_steps
        except StepAbandoned as err:
            interrupted = self.abandon(err)
        except torch.OutOfMemoryError:
            raise GptkitError(
                f"out of memory on {self.device} with train.batch_size {t.batch_size} x block_size "
                f"{self.block_size}: lower train.batch_size (raise train.grad_accum to keep the tokens per step), "
                "or model.block_size, or use train.dtype bfloat16"
            ) from None
        finally:
            self.log.close()
        return TrainResult(self.run_dir, self.step, self.last_good, val_loss, self.skipped, interrupted)
