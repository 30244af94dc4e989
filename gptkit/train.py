"""The training loop: AdamW on next-token loss, with evaluation, metrics, checkpoints, exact resume and fault skips.

The step never waits on the device except every log_interval steps (and at evaluations and checkpoints): the
loss, gradient norm and fault counters stay on the device until then, and a non-finite step is skipped by the
fused AdamW kernel itself (its found_inf input) rather than by a Python `if`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import Tensor

from gptkit.accounting import training_flops_per_token
from gptkit.atomic import atomic_write, atomic_write_text
from gptkit.chat import TOKENIZER_CONFIG, load_chat_template
from gptkit.checkpoint import (
    CHECKPOINTS,
    LATEST,
    STEP_DIR,
    CheckpointError,
    checkpoint_dirs,
    full_tensor,
    has_manifest,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    read_latest,
    remove_stale_temporaries,
    rewind,
    rng_state,
    save_checkpoint,
    unverifiable,
    verify_checkpoint,
)
from gptkit.devices import gpu_peak_flops, pick_device
from gptkit.distributed import (
    RankBatches,
    World,
    all_mean,
    any_rank,
    barrier,
    device_for,
    gather_objects,
    init_process_group,
    sync_context,
    world_from_env,
    wrap,
)
from gptkit.data import Batch, ExampleBatches, Examples, TrainBatches, is_examples, load_examples
from gptkit.errors import ConfigError, GptkitError
from gptkit.finetune.heads import SequenceClassifier, load_head_weights, save_head
from gptkit.finetune.lora import adapters_disabled, load_lora_state
from gptkit.finetune.objectives import Classification, LanguageModeling, Objective, Preference
from gptkit.finetune.objectives import evaluate as evaluate_objective
from gptkit.finetune.lora_dir import WEIGHTS_FILE as LORA_WEIGHTS
from gptkit.finetune.lora_dir import adapt, is_lora_dir, read_lora_config, write_lora_dir
from gptkit.model import GPT
from gptkit.observe.training import Observer, plot_run
from gptkit.formats.modeldir import load_model_tokenizer, load_tensors, read_model_config, save_model_dir
from gptkit.loading import adapted_model, load, load_base
from gptkit.optim import lr_at, make_optimizer
from gptkit.tokenizer import check_same_tokenizer
from gptkit.train_config import RunConfig, TrainConfig, resolve_model

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"

# On CPU, MFU is measured against this CPU's own matmul (CPUs differ too much for one table of peaks): the best of
# a few square products of this size, about 0.1 s at start. The 2-core reference machine gives fp32 260 GFLOP/s and
# bf16 135 (PyTorch 2.13 without AMX); a fixed 146 / 349 used before overstated fp32 MFU about twice. A GPU of
# gptkit.devices.GPU_PEAK_FLOPS is measured against its datasheet; other devices show MFU only when train.peak_flops
# is set.
PEAK_MATMUL_SIZE = 1024


class TrainingStopped(GptkitError):
    """The run stopped on purpose (too many non-finite steps, weights gone bad); the message says why and where."""


@dataclass
class TrainResult:
    """What a finished (or interrupted) run leaves behind."""

    run_dir: Path
    step: int
    checkpoint: Path | None
    val_loss: float | None
    skipped_steps: int
    interrupted: bool


def autocast_for(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The mixed-precision context of the forward pass (a no-op for float32)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def peak_flops(device: torch.device, dtype: str, override: float | None) -> float | None:
    """Peak FLOP/s for MFU: the override, else a CPU's measured matmul rate or a known GPU's datasheet rate, else
    unknown (None)."""
    if override is not None:
        return override
    if device.type == "cpu":
        return measured_cpu_matmul_flops(getattr(torch, dtype))
    return gpu_peak_flops(device, getattr(torch, dtype))


def measured_cpu_matmul_flops(dtype: torch.dtype, repeats: int = 10) -> float:
    """This CPU's dense matmul FLOP/s in dtype at the current thread count: the best of a few square products."""
    n = PEAK_MATMUL_SIZE
    own = torch.Generator().manual_seed(0)  # the global RNG stays untouched: resumed runs replay it exactly
    a, b = torch.randn(n, n, generator=own).to(dtype), torch.randn(n, n, generator=own).to(dtype)
    a @ b  # first-call set-up (thread pool, packing buffers) is not the rate
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def bytes_per_token(meta: dict[str, Any], split: str, tokens: np.ndarray, tokenizer: Any | None) -> float | None:
    """UTF-8 bytes of text per token of a split, for bits per byte (SPEC section 3): from meta.json or counted."""
    if isinstance(meta.get(f"{split}_bytes"), int) and len(tokens):
        return meta[f"{split}_bytes"] / len(tokens)
    if tokenizer is None or not len(tokens):
        return None
    lengths = np.asarray(tokenizer.token_byte_lengths(), dtype=np.float64)
    counts = np.bincount(np.asarray(tokens), minlength=len(lengths))[: len(lengths)]
    return float(counts @ lengths) / len(tokens)


class Batches:
    """Training batches moved to the device one step ahead, with the loader state that reproduces the next one."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self._pending = self._fetch()

    def _fetch(self) -> tuple[dict[str, Any], Batch]:
        state = self.loader.state_dict()
        batch = self.loader.next_batch()
        if isinstance(batch, tuple):  # a text window (TrainBatches): every target trains
            batch = Batch(*batch, units=batch[0].numel(), tokens=batch[0].numel())
        if self.device.type != "cpu":
            batch = batch.to(lambda tensor: _to_device(tensor, self.device))
        return state, batch

    def next(self) -> Batch:
        """The next batch; the one after it is fetched at once, while the device works on this one."""
        _, batch = self._pending
        self._pending = self._fetch()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The loader state whose next batch is the next one this object hands out."""
        return self._pending[0]


def _to_device(tensor: Tensor, device: torch.device) -> Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)  # pinned host memory: the copy overlaps the step


# Evaluation forwards up to this many tokens at once (at least one training batch): bigger matrix products run
# faster per token on CPU, and the mean over equal-size windows is the same however they are grouped.
EVAL_TOKENS = 8192


@torch.no_grad()  # not inference_mode: FSDP2 reuses its all-gather buffers in the next training step
def evaluate(model: torch.nn.Module, tokens: np.ndarray, train: TrainConfig, block_size: int, seed: int,
             device: torch.device, dtype: str) -> float:
    """Mean loss over eval_iters x batch_size fixed windows of a split (the same windows at every evaluation)."""
    batches = TrainBatches(tokens, block_size, train.batch_size, seed)
    x, y = (torch.cat(parts) for parts in zip(*(batches.next_batch() for _ in range(train.eval_iters))))
    chunk = max(train.batch_size, EVAL_TOKENS // block_size)
    total = torch.zeros((), device=device)
    for start in range(0, len(x), chunk):
        xb, yb = x[start : start + chunk].to(device), y[start : start + chunk].to(device)
        with autocast_for(device, dtype):
            total += model(xb, targets=yb).float() * len(xb)
    return (total / len(x)).item()


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


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by the first SIGINT or SIGTERM (the loop then checkpoints and returns); a second SIGINT aborts."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum: int, frame: Any) -> None:
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def load_data(data_dir: str | None) -> tuple[dict[str, Any], np.ndarray, np.ndarray, Any | None]:
    """(meta, train tokens, val tokens, tokenizer) of a prepared data directory; errors name what is missing."""
    from gptkit.data import SPLIT_FILES, load_tokens, read_meta
    from gptkit.tokenizer import tokenizer_or_none

    if data_dir is None:
        raise ConfigError("no data: pass --data DIR (a directory made by `gptkit prepare`) or set train.data_dir")
    meta = read_meta(data_dir)
    train_tokens = load_tokens(Path(data_dir) / SPLIT_FILES["train"], meta["dtype"])
    val_tokens = load_tokens(Path(data_dir) / SPLIT_FILES["val"], meta["dtype"])
    return meta, train_tokens, val_tokens, tokenizer_or_none(data_dir)


# Splits up to this many tokens are checked whole; larger ones (made by `gptkit prepare`, which writes only ids
# of its tokenizer) by their first and last chunks, so that starting a large run does not read it all.
FULL_CHECK_TOKENS = 1 << 28
CHECK_CHUNK = 1 << 24


def check_tokens(name: str, tokens: np.ndarray, vocab_size: int, block_size: int) -> None:
    """Each split must be long enough for one window and hold only ids inside the vocabulary (the model skips it)."""
    if len(tokens) == 0 and name.startswith("val"):
        raise GptkitError(f"{name} is empty (data prepared with --val-fraction 0): training evaluates on it; "
                          "prepare the data again with --val-fraction above 0")  # fmt: skip
    if len(tokens) < block_size + 1:
        raise GptkitError(
            f"{name} has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}; "
            "lower model.block_size or prepare more text"
        )
    if len(tokens) <= FULL_CHECK_TOKENS:
        starts = range(0, len(tokens), CHECK_CHUNK)
    else:
        starts = [0, len(tokens) - CHECK_CHUNK]
    top = max(int(tokens[i : i + CHECK_CHUNK].max()) for i in starts)
    if top >= vocab_size:
        raise GptkitError(f"{name} holds token id {top}, outside the vocabulary of {vocab_size}; re-prepare the data")


@dataclass
class RunModel:
    """The model a run trains and what comes with it."""

    model: GPT
    tokenizer: Any | None  # the model's own (init_from's or the checkpoint's), None for a fresh model
    template_dir: str | None  # the directory whose chat template the model carries (init_from or the checkpoint)
    lora: dict[str, Any] | None = None  # a LoRA run's settings (gptkit.finetune.lora_dir), None for full training


def check_examples(meta: dict[str, Any], examples: tuple[Examples, Examples], vocab_size: int,
                   template_dir: Path) -> None:  # fmt: skip
    """Supervised examples must hold ids of the vocabulary, and have been rendered with the run's chat template
    (the one it will be served with)."""
    for name, split in zip(("train", "val"), examples):
        if len(split) == 0 and name == "val":
            raise GptkitError("the data set has no validation examples (prepared with --val-fraction 0): training "
                              "evaluates on them; prepare the data again with --val-fraction above 0")  # fmt: skip
        if len(split.ids) and int(split.ids.max()) >= vocab_size:
            raise GptkitError(f"{name} examples hold token id {int(split.ids.max())}, outside the vocabulary of "
                              f"{vocab_size}; re-prepare the data")  # fmt: skip
    own = load_chat_template(template_dir).source
    if meta.get("chat_template") != own:
        raise GptkitError(
            f"the examples were rendered with {'a different' if meta.get('chat_template') else 'the default'} chat "
            f"template than the model's ({template_dir}); prepare them again with --tokenizer {template_dir}"
        )


def build_model(config: RunConfig, vocab_size: int) -> RunModel:
    """A fresh model, or init_from's weights for fine-tuning (with LoRA: frozen, in their precision, adapted)."""
    section, finetune = config.model, config.finetune
    if section.init_from is None:
        return RunModel(GPT(resolve_model(section, vocab_size)), None, None)
    lora = finetune.method == "lora"
    pretrained, tokenizer, fingerprint = load_base(section.init_from) if lora else (*load(section.init_from), None)
    model_config = resolve_model(section, vocab_size, init_config=pretrained.config)
    if model_config == pretrained.config:
        model = pretrained.train()
    else:
        model = GPT(model_config)  # only dropout differs
        model.load_state_dict(pretrained.state_dict())
    if not lora:
        return RunModel(model, tokenizer, section.init_from)
    settings = {"base": str(Path(section.init_from).resolve()), "base_fingerprint": fingerprint,
                "rank": finetune.lora_rank, "alpha": finetune.lora_alpha, "dropout": finetune.lora_dropout,
                "targets": finetune.lora_targets, "base_precision": finetune.base_precision}  # fmt: skip
    return RunModel(adapt(model, settings), tokenizer, section.init_from, settings)


def resume_model(checkpoint: Path) -> RunModel:
    """The model of a run's checkpoint, built as the run built it (its weights are loaded with the optimiser)."""
    if is_lora_dir(checkpoint):
        settings = read_lora_config(checkpoint)
        model, tokenizer = adapted_model(settings)
        settings = {k: v for k, v in settings.items() if k not in ("format", "format_version")}
        return RunModel(model, tokenizer, str(checkpoint), settings)
    return RunModel(GPT(read_model_config(checkpoint)), load_model_tokenizer(checkpoint), str(checkpoint))


def resume_point(run_dir: Path, resume: bool, resume_from: str | Path | None = None) -> Path | None:
    """The checkpoint a run continues from: None for a new run; resume_from, verified; or the newest that verifies.

    Passing over a damaged, incomplete or unverifiable (manifest-less) checkpoint is said in one warning line, and
    so is a `latest` file that names no checkpoint here; with resume_from, damage is an error naming it, and a
    checkpoint without a manifest is taken with a warning.
    """
    if resume_from is not None:
        path = Path(resume_from)
        if not STEP_DIR.fullmatch(path.name) or path.resolve().parent != (run_dir / CHECKPOINTS).resolve():
            raise ConfigError(f"--resume-from {path} is not a checkpoint of the run {run_dir} "
                              f"(a directory {run_dir / CHECKPOINTS}/step-N)")  # fmt: skip
        if not path.is_dir():
            raise CheckpointError(f"--resume-from {path} does not exist")
        if not verify_checkpoint(path):
            logger.warning("%s; continuing from it all the same, as --resume-from names it", unverifiable(path))
        return run_dir / CHECKPOINTS / path.name
    if not resume:
        if latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it, or choose another --out")
        return None
    skipped: list[str] = []
    checkpoint = latest_checkpoint(run_dir, verify=True, skipped=skipped)
    if checkpoint is None:
        if skipped:
            raise CheckpointError(f"no checkpoint of {run_dir} can be resumed from: {'; '.join(skipped)}")
        raise CheckpointError(f"{run_dir} has no checkpoint to resume from (a run stopped before its first "
                              "checkpoint starts again without --resume)")  # fmt: skip
    newer = " (the newer ones are removed)" if checkpoint_dirs(run_dir)[0] != checkpoint else ""
    if not has_manifest(checkpoint):  # (skipped ends with why it cannot be verified)
        logger.warning("%s; resuming from %s all the same, as no checkpoint of the run verifies%s",
                       "; ".join(skipped), checkpoint, newer)  # fmt: skip
    elif skipped:
        logger.warning("%s; resuming from %s, the newest checkpoint that verifies%s", "; ".join(skipped), checkpoint,
                       newer)  # fmt: skip
    warn_about_latest(run_dir, checkpoint)
    return checkpoint


def warn_about_latest(run_dir: Path, checkpoint: Path) -> None:
    """Warn when the run's `latest` file names no checkpoint of it, saying which one the run continues from.

    (`latest` naming an older checkpoint than the newest complete one is a kill before it was updated: not warned.)
    """
    latest = run_dir / LATEST
    if not latest.exists():
        return
    named = read_latest(run_dir)
    if named is None:
        logger.warning("%s does not name a checkpoint inside %s (ignored); resuming from %s", latest, CHECKPOINTS,
                       checkpoint)  # fmt: skip
    elif not named.is_dir():
        logger.warning("%s names %s, which does not exist (ignored); resuming from %s", latest, named, checkpoint)


def train(config: RunConfig, resume: bool = False, progress: bool = True,
          resume_from: str | Path | None = None) -> TrainResult:  # fmt: skip
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


class Trainer:
    """One run: everything is checked and built in __init__ (errors come before any work), run() trains."""

    def __init__(self, config: RunConfig, resume: bool, world: World | None = None,
                 device: torch.device | None = None, resume_from: str | Path | None = None) -> None:  # fmt: skip
        t = self.t = config.train
        self.world = world if world is not None else World()
        self.o = config.optim
        if t.out_dir is None:
            raise ConfigError("no run directory: pass --out RUN_DIR or set train.out_dir")
        config.validate()
        self.run_dir = Path(t.out_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"--out {self.run_dir} is a file; give a directory for the run")
        self.meta, self.train_tokens, self.val_tokens, tokenizer = load_data(t.data_dir)
        vocab_size = self.meta["vocab_size"]
        checkpoint = resume_point(self.run_dir, resume or resume_from is not None, resume_from)
        self.device = device if device is not None else pick_device(t.device, "train.device")
        if t.dtype == "float16" and self.device.type != "cuda":
            raise ConfigError(f"train.dtype float16 needs CUDA (gradient scaling); on {self.device.type} use "
                              "bfloat16 or float32")  # fmt: skip

        torch.manual_seed(t.seed)  # initial weights and dropout; a resumed run restores its generator state instead
        run = resume_model(checkpoint) if checkpoint is not None else build_model(config, vocab_size)
        model = run.model
        if model.config.vocab_size != vocab_size:
            raise ConfigError(f"the run's model has vocab_size {model.config.vocab_size}, the data {vocab_size}")
        if tokenizer is not None and run.tokenizer is not None:
            check_same_tokenizer(tokenizer, run.tokenizer, str(t.data_dir), str(run.template_dir))
        self.tokenizer = run.tokenizer if run.tokenizer is not None else tokenizer  # the model's keeps its eos ids
        self.lora = run.lora
        if self.lora is not None and t.parallel == "fsdp":
            raise ConfigError("finetune.method lora trains under train.parallel ddp (FSDP would shard only the "
                              "small adapters' updates); use ddp")  # fmt: skip
        # The chat template the model carries, into every checkpoint: the model's own, else the data's.
        template_dir = Path(run.template_dir or t.data_dir)
        if not (template_dir / TOKENIZER_CONFIG).is_file():
            template_dir = Path(t.data_dir)
        tokenizer_config = template_dir / TOKENIZER_CONFIG
        self.tokenizer_config = tokenizer_config.read_bytes() if tokenizer_config.is_file() else None
        self.block_size = model.config.block_size
        self.examples: tuple[Examples, Examples] | None = None
        if is_examples(self.meta):
            self.examples = (load_examples(t.data_dir, "train", self.meta), load_examples(t.data_dir, "val", self.meta))
            check_examples(self.meta, self.examples, vocab_size, template_dir)
        else:
            check_tokens("train.bin", self.train_tokens, vocab_size, self.block_size)
            check_tokens("val.bin", self.val_tokens, vocab_size, self.block_size)
        self.objective_name = config.finetune.objective
        check_objective(self.objective_name, self.meta, str(t.data_dir))
        self.gpt = model
        sharded = t.parallel == "fsdp" and self.world.distributed
        self.observer = Observer(t, self.run_dir, model, self.tokenizer, self.val_tokens, self.examples,
                                 self.objective_name, self.world.is_main, sharded)  # fmt: skip
        if self.objective_name == "classify":  # the head wraps the model; the optimiser and checkpoints hold both
            model = SequenceClassifier(model, self.meta["labels"])

        self.model = model.to(self.device)
        self.gpt.check_inputs = False  # the data were checked above; the check would sync the device every step
        self.gpt.checkpoint_blocks = t.activation_checkpointing
        model.train()
        self.objective = self.make_objective(config)
        if self.world.rank:  # the same initial weights on every rank (above), but each rank its own dropout
            torch.manual_seed(t.seed + 7919 * self.world.rank)
        # DDP keeps the parameters; FSDP turns them into shards (DTensors), so it wraps before the optimiser.
        self.wrapped = wrap(model, self.world, t.parallel, self.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = {p: n for n, p in model.named_parameters()}
        self.optimizer, self.fused = make_optimizer(model, self.o)
        self.scaler = torch.amp.GradScaler("cuda") if t.dtype == "float16" else None
        # Every rank reads one global stream (keyed by the seed alone) and takes its strided share of it.
        if self.examples is not None:
            stream: Any = ExampleBatches(self.examples[0], self.block_size, t.batch_size, t.seed,
                                         config.finetune.packing, group=t.grad_accum * self.world.world_size)
        else:
            stream = TrainBatches(self.train_tokens, self.block_size, t.batch_size, t.seed)
        loader = RankBatches(stream, self.world)

        self.step, self.elapsed_before, self.skipped_before = 0, 0.0, 0
        self.last_good = checkpoint
        if self.world.is_main:
            with self.writing(f"could not write the run directory {self.run_dir}"):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                remove_stale_temporaries(self.run_dir)
                dropped = rewind(self.run_dir, checkpoint) if checkpoint is not None else []
            if dropped and resume_from is not None:  # (damaged ones passed over were named already)
                logger.warning("continuing from %s: removed the later checkpoint(s) %s", checkpoint.name,
                               ", ".join(p.name for p in dropped))  # fmt: skip
        if checkpoint is not None:
            saved = load_checkpoint(checkpoint, model, self.optimizer, self.names, self.world.rank, self.read_model)
            self.step, self.elapsed_before = saved["step"], saved.get("elapsed_s", 0.0)
            self.skipped_before = saved.get("skipped_steps", 0)
            loader.load_state_dict(saved["loader"])
            if self.scaler is not None and saved.get("scaler"):
                self.scaler.load_state_dict(saved["scaler"])
        self.batches = Batches(loader, self.device)

        resolved = config.to_dict()
        init_from = {"init_from": config.model.init_from} if config.model.init_from else {}
        resolved["model"] = {**init_from, **model.config.to_dict()}
        header = "# The resolved settings of this run, written by gptkit train.\n"
        # Records after the checkpoint belong to steps this run is about to redo; a new run starts a new file.
        self.history = read_history(self.run_dir / METRICS_FILE, self.step) if checkpoint is not None else []
        self.tensorboard: Any = None  # a SummaryWriter while run() goes, with train.tensorboard
        if self.world.is_main:
            with self.writing(f"could not write {CONFIG_FILE} and {METRICS_FILE} in {self.run_dir}"):
                atomic_write_text(self.run_dir / CONFIG_FILE, header + yaml.safe_dump(resolved, sort_keys=False))
                atomic_write_text(self.run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in self.history))
                self.observer.keep_samples(self.step if checkpoint is not None else None)
        barrier(self.world)  # no rank starts before rank 0 has made the run directory

        self.forward = torch.compile(self.wrapped) if t.compile else self.wrapped
        self.flops_per_token = training_flops_per_token(model.config)
        self.peak = peak_flops(self.device, t.dtype, t.peak_flops)
        self.val_bytes_per_token = None if self.examples is not None else \
            bytes_per_token(self.meta, "val", self.val_tokens, self.tokenizer)  # fmt: skip
        # Fault counters stay on the device, so no step waits to learn whether it was skipped.
        zero = torch.zeros((), device=self.device)
        self.bad_run, self.bad_run_max, self.bad_count = zero.clone(), zero.clone(), zero.clone()
        self.skipped = self.skipped_before
        self.tokens_seen = 0  # input tokens since the last logged step, on this rank
        self.step_stats: dict[str, Tensor] = {}  # the objective's statistics of the last step
        self.started = time.perf_counter()

    def make_objective(self, config: RunConfig) -> Objective:
        """The run's objective; DPO's reference is the starting model, frozen (with LoRA: adapters switched off)."""
        finetune = config.finetune
        if self.objective_name == "classify":
            return Classification(finetune.lm_weight)
        if self.objective_name == "lm":
            return LanguageModeling()
        if self.lora is not None:
            gpt = self.gpt

            def reference(ids: Tensor) -> Tensor:
                with adapters_disabled(gpt), evaluation_mode(gpt):
                    return gpt(ids)

            return Preference(finetune.dpo_beta, reference, finetune.dpo_nll_weight)
        frozen, _ = load(config.model.init_from)  # the model DPO started from, also when this run resumes
        if frozen.config.vocab_size != self.gpt.config.vocab_size or frozen.config.n_embd != self.gpt.config.n_embd:
            raise ConfigError(f"model.init_from {config.model.init_from} is not the model this run started from")
        frozen = frozen.to(self.device).eval().requires_grad_(False)
        frozen.check_inputs = False
        return Preference(finetune.dpo_beta, frozen, finetune.dpo_nll_weight)

    def elapsed(self) -> float:
        """Training wall time of the whole run, across resumes."""
        return self.elapsed_before + time.perf_counter() - self.started

    def train_step(self) -> tuple[Tensor, Tensor, float]:
        """One update (or a skipped one); returns the mean loss and gradient norm, still on the device, and the lr."""
        t, optimizer, scaler = self.t, self.optimizer, self.scaler
        lr = lr_at(self.step, self.o, t.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        step_stats: dict[str, Tensor] = {}
        for micro in range(t.grad_accum):
            batch = self.batches.next()
            self.tokens_seen += batch.tokens
            # The update's loss is the mean over all its units (trained targets, pairs, texts): micro-batches of
            # examples hold different numbers of them, so each counts by its share (the all-reduce averages over
            # ranks, hence world_size).
            weight = 1 / t.grad_accum if batch.step_units is None else \
                batch.units * self.world.world_size / batch.step_units  # fmt: skip
            # Across ranks, gradients are all-reduced on the final micro-step only.
            with sync_context(self.wrapped, micro == t.grad_accum - 1):
                with autocast_for(self.device, t.dtype):
                    loss, stats = self.objective.loss(self.forward, batch)
                    loss = loss * weight
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.detach()
            for name, value in stats.items():
                step_stats[name] = step_stats.get(name, 0) + value * weight
        self.step_stats = step_stats
        if scaler is not None:
            scaler.unscale_(optimizer)
        clip = self.o.grad_clip if self.o.grad_clip > 0 else math.inf
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
            elif not bool(bad):  # no fused kernel on this device: this check syncs
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
            record["mfu"] = tokens_per_s * self.flops_per_token / (self.peak * self.world.world_size)
        skipped = self.skipped_before + int(self.bad_count.item())
        if skipped != self.skipped:
            record["skipped_steps"] = skipped
            self.note(f"step {self.step}: skipped {skipped - self.skipped} update(s) with a non-finite loss or "
                      f"gradient norm ({skipped} in all)")  # fmt: skip
            self.skipped = skipped
        streak = int(self.bad_run_max.item())
        if streak >= self.t.max_bad_steps:
            self.write(record)
            raise TrainingStopped(
                f"{streak} non-finite steps in a row by step {self.step} (train.max_bad_steps "
                f"{self.t.max_bad_steps}): lower optim.lr, raise optim.warmup_steps or check the data; the last "
                f"good checkpoint is {self.last_good or 'none (no checkpoint was written)'}"
            )
        return record

    def evaluate_into(self, record: dict[str, Any]) -> None:
        """Add train and validation loss, perplexity and bits per byte to record."""
        t = self.t
        self.forward.eval()
        extra: dict[str, float] = {}
        if self.examples is not None:
            train_examples, val_examples = self.examples
            order = np.random.default_rng(t.seed + 1).permutation(train_examples.items())  # the same ones every time
            limit = t.eval_iters * t.batch_size
            with autocast_for(self.device, t.dtype):
                train_m = evaluate_objective(self.objective, self.forward, train_examples, self.block_size,
                                             t.batch_size, limit, order, self.device)  # fmt: skip
                val_m = evaluate_objective(self.objective, self.forward, val_examples, self.block_size, t.batch_size,
                                           limit, None, self.device)  # fmt: skip
            train_loss, val_loss = train_m.pop("loss"), val_m.pop("loss")
            extra = {f"val_{name}": value for name, value in val_m.items()}
        else:
            train_loss = evaluate(self.forward, self.train_tokens, t, self.block_size, t.seed + 1, self.device,
                                  t.dtype)  # fmt: skip
            val_loss = evaluate(self.forward, self.val_tokens, t, self.block_size, t.seed + 2, self.device, t.dtype)
        self.forward.train()
        record.update(train_eval_loss=train_loss, val_loss=val_loss, **extra)
        if self.objective_name == "lm":
            record.update(train_eval_ppl=_exp(train_loss), val_ppl=_exp(val_loss))
        line = f"step {self.step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}"
        if "val_accuracy" in extra:
            line += f", val accuracy {extra['val_accuracy']:.3f}"
        if self.val_bytes_per_token:
            record["val_bpb"] = val_loss / (math.log(2) * self.val_bytes_per_token)
            line += f", val bpb {record['val_bpb']:.4f}"
        observing = time.perf_counter()
        line += self.observer.measure_into(record)
        samples = []
        if self.observer.due(self.step):
            with self.writing(f"could not append to {self.observer.path}"):
                samples = self.observer.sample(self.step)
        if samples or self.observer.measures:
            record["observe_s"] = time.perf_counter() - observing  # what watching the run costs it
        for text in [line, *samples]:
            self.note(text)
        self.write(record)
        if t.plot and self.world.is_main:
            with self.writing(f"could not write {self.run_dir / PLOT_FILE}"):
                plot_run(self.history, self.run_dir / PLOT_FILE)

    def save(self) -> Path:
        """Checkpoint the current step, unless the weights went bad (then the last good one stays the latest)."""
        finite = bool(torch.stack([_local(p).detach().isfinite().all() for p in self.params]).all())
        if any_rank(self.world, not finite, self.device):
            raise TrainingStopped(
                f"weights became non-finite by step {self.step}; the last good checkpoint is {self.last_good}"
            )
        trainer = {"loader": self.batches.state_dict(), "elapsed_s": self.elapsed(), "skipped_steps": self.skipped,
                   "scaler": self.scaler.state_dict() if self.scaler is not None else None}  # fmt: skip
        # Each rank's generators, so that every rank's dropout resumes exactly (rank 0's keys unprefixed).
        rngs = gather_objects(self.world, rng_state())
        rng = {(f"rank{r}." if r else "") + k: v for r, state in enumerate(rngs) for k, v in state.items()}
        failure = None
        try:
            saved = save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer, self.optimizer, self.names,
                                    trainer, self.t.keep_checkpoints, rng=rng, write=self.world.is_main,
                                    save_model=self.write_model)  # fmt: skip
        except OSError as err:  # a full disk, a lost mount: the checkpoint before stays whole
            failure = err
        if any_rank(self.world, failure is not None, self.device):  # every rank stops, not only the writer
            raise self.io_error(f"could not write the checkpoint of step {self.step}", failure)
        self.last_good = saved
        barrier(self.world)  # no rank goes on (or exits) while rank 0 is still writing
        return self.last_good

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
        """A checkpoint's model files: a model directory, or a LoRA run's adapters; with the chat template, and
        a classifier's head beside them."""
        gpt = module.gpt if isinstance(module, SequenceClassifier) else module
        if self.lora is not None:
            write_lora_dir(gpt, directory, self.lora, self.tokenizer_config)
        else:
            save_model_dir(gpt, directory, tokenizer=self.tokenizer)
            if self.tokenizer_config is not None:
                atomic_write(directory / TOKENIZER_CONFIG, lambda tmp: tmp.write_bytes(self.tokenizer_config))
        if isinstance(module, SequenceClassifier):
            save_head(module, directory)

    def read_model(self, module: torch.nn.Module, directory: Path) -> None:
        """Load what write_model wrote into the run's model, in place (the optimiser holds its parameters)."""
        gpt = module.gpt if isinstance(module, SequenceClassifier) else module
        if self.lora is not None:
            load_lora_state(gpt, load_tensors(directory / LORA_WEIGHTS, self.device), str(directory))
        else:
            load_weights(gpt, directory)
        if isinstance(module, SequenceClassifier):
            load_head_weights(module, directory)

    def note(self, message: str) -> None:
        """A line above the progress bar (evaluations, skipped steps); silent without a bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)

    def write(self, record: dict[str, Any]) -> None:
        """Append a record to metrics.jsonl and the in-memory history the plot draws (rank 0 only)."""
        if self.metrics is not None:
            try:
                _write(self.metrics, record, self.history)
            except OSError as err:
                raise self.io_error(f"could not append to {self.run_dir / METRICS_FILE}", err) from None
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def stop_requested(self, stop: threading.Event) -> bool:
        """Whether to stop now: at once in one process; across ranks, agreed at logged steps (a collective)."""
        if not self.world.distributed:
            return stop.is_set()
        if self.step % self.t.log_interval and self.step != self.t.max_steps:
            return False
        return any_rank(self.world, stop.is_set(), self.device)

    def run(self, progress: bool = True) -> TrainResult:
        """Train to max_steps (or until SIGINT/SIGTERM, which checkpoint first); return where the run ended."""
        from tqdm import tqdm

        t = self.t
        with self.writing(f"could not open {self.run_dir / METRICS_FILE} or {TENSORBOARD_DIR}/ for writing"):
            self.metrics = open(self.run_dir / METRICS_FILE, "a") if self.world.is_main else None
            if t.tensorboard and self.world.is_main:
                self.tensorboard = open_tensorboard(self.run_dir / TENSORBOARD_DIR)
        self.bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", file=sys.stderr,
                        dynamic_ncols=True, smoothing=0.1) if progress else None  # fmt: skip
        interrupted, val_loss = False, None
        try:
            with stop_on_signals() as stop:
                if self.step == 0 and t.eval_at_start:
                    record: dict[str, Any] = {"step": 0}
                    self.evaluate_into(record)
                    val_loss = record["val_loss"]
                window_start, self.tokens_seen = time.perf_counter(), 0
                stopping = False
                while self.step < t.max_steps and not stopping:
                    loss_sum, grad_norm, lr = self.train_step()
                    if self.bar is not None:
                        self.bar.update(1)
                    step = self.step
                    is_eval = step % t.eval_interval == 0 or step == t.max_steps
                    stopping = self.stop_requested(stop)
                    is_ckpt = step % t.checkpoint_interval == 0 or step == t.max_steps or stopping
                    if not (step % t.log_interval == 0 or is_eval or is_ckpt):
                        continue
                    # Input positions that are not padding, on every rank (each reads as many, near enough).
                    seen = self.tokens_seen * self.world.world_size
                    record = self.log_record(loss_sum, grad_norm, lr, seen, window_start)
                    if self.bar is not None:
                        mfu = f" MFU {100 * record['mfu']:.0f}%" if "mfu" in record else ""
                        self.bar.set_postfix_str(f"loss {record['loss']:.4f} lr {lr:.2e} "
                                                 f"{_si(record['tokens_per_s'])}tok/s{mfu}", refresh=False)  # fmt: skip
                    if is_eval:
                        self.evaluate_into(record)
                        val_loss = record["val_loss"]
                    else:
                        self.write(record)
                    if is_ckpt:
                        self.save()
                    window_start, self.tokens_seen = time.perf_counter(), 0
                interrupted = stopping and self.step < t.max_steps
        except torch.OutOfMemoryError:
            raise GptkitError(
                f"out of memory on {self.device} with train.batch_size {t.batch_size} x block_size "
                f"{self.block_size}: lower train.batch_size (raise train.grad_accum to keep the tokens per step), "
                "or model.block_size, or use train.dtype bfloat16"
            ) from None
        finally:
            if self.metrics is not None:
                self.metrics.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            if self.bar is not None:
                self.bar.close()
        return TrainResult(self.run_dir, self.step, self.last_good, val_loss, self.skipped, interrupted)


# The data each objective trains on (gptkit.data.EXAMPLE_KINDS), and the rows prepare makes it from.
OBJECTIVE_DATA = {"lm": ("examples", "text or supervised rows"), "dpo": ("preferences", '{"prompt", "chosen", '
                  '"rejected"} rows'), "classify": ("labelled", '{"text", "label"} rows')}  # fmt: skip


def check_objective(objective: str, meta: dict[str, Any], data_dir: str) -> None:
    """A ConfigError unless the data set is what the objective trains on."""
    kind = meta.get("kind", "text")
    wanted, rows = OBJECTIVE_DATA[objective]
    if kind == wanted or (objective == "lm" and not is_examples(meta)):
        return
    fits = next((name for name, (data, _) in OBJECTIVE_DATA.items() if data == kind), "lm")
    raise ConfigError(f"finetune.objective {objective} trains on {wanted} (prepared from {rows}), but {data_dir} "
                      f"holds {kind}: use finetune.objective {fits}, or prepare other data")  # fmt: skip


@contextlib.contextmanager
def evaluation_mode(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, module is in eval mode (no dropout); its mode is restored after."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def open_tensorboard(log_dir: Path) -> Any:
    """A TensorBoard SummaryWriter for log_dir; a clear error when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=str(log_dir))


def _write(file: Any, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
    """Append one metrics record (a line, flushed: a kill loses at most the line being written).

    A non-finite number is written as null, since NaN and Infinity are not JSON.
    """
    record.update({k: None for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)})
    file.write(json.dumps(record) + "\n")
    file.flush()
    history.append(record)


def _local(tensor: Tensor) -> Tensor:
    """A plain tensor: this rank's shard of an FSDP2 DTensor (a replicated one's whole value), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _exp(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def _si(n: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix} "
    return f"{n:.0f} "

