"""The training run's settings as data: the YAML sections (model, optim, train, finetune), each declared once.

The model section holds ModelConfig's own fields (not re-declared here) plus `preset` and `init_from`. How they are
composed from defaults, a YAML file and flags (and checked against the methods and objectives a run may name) is
gptkit.run_sources, a floor above the method catalogue: this module imports nothing of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from gptkit.config import ModelSection
from gptkit.errors import ConfigError
from gptkit.settings import PartSettings, check_range

Schedule = Literal["cosine", "constant", "wsd"]
OptimizerName = Literal["adamw", "muon"]
MuonLrScale = Literal["original", "match_rms_adamw"]
Device = Literal["auto", "cpu", "cuda", "mps"]
Dtype = Literal["float32", "bfloat16", "float16", "auto"]
Parallel = Literal["ddp", "fsdp"]
S = TypeVar("S", bound=PartSettings)


@dataclass
class OptimConfig:
    """The optimiser (AdamW, or Muon on the blocks' matrices beside AdamW) and its learning-rate schedule."""

    name: OptimizerName = "adamw"  # muon: Muon on the blocks' 2-D weights (each expert's too), AdamW on the rest
    lr: float = 6e-4  # AdamW's peak learning rate, reached after warm-up
    min_lr: float = 6e-5  # where cosine and wsd end (muon's group ends at muon_lr x min_lr / lr)
    warmup_steps: int = 100  # linear warm-up from lr/(warmup_steps+1)
    schedule: Schedule = "cosine"  # cosine, constant, or wsd (warm-up, stable at lr, linear cool-down to min_lr)
    decay_steps: int | None = None  # step at which cosine or wsd reaches min_lr; None means train.max_steps
    cooldown_fraction: float = 0.2  # wsd: the last fraction of decay_steps spent cooling down linearly
    weight_decay: float = 0.1  # decoupled, on matrices only (linear weights and embeddings)
    beta1: float = 0.9  # AdamW's decay of its running mean of gradients
    beta2: float = 0.95  # AdamW's decay of its running mean of squared gradients
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 turns clipping off
    muon_lr: float = 0.02  # muon: peak learning rate of the blocks' matrices (scaled per shape by muon_lr_scale)
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the matrices' updates
    muon_weight_decay: float = 0.0  # muon: decoupled weight decay of the matrices
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations that orthogonalise each update (each is 3 products)
    muon_lr_scale: MuonLrScale = "original"  # sqrt(max(1, rows/cols)) (Keller Jordan's), or 0.2 sqrt(max(rows, cols))
    #                                          (Moonshot's, which lets muon_lr take AdamW's lr)

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of its range."""
        check_range("optim.lr", self.lr, low=0.0, low_open=True)
        if self.schedule != "constant":  # (a constant schedule never reaches min_lr)
            check_range("optim.min_lr", self.min_lr, low=0.0, high=self.lr, why="between 0 and optim.lr")
        check_range("optim.warmup_steps", self.warmup_steps, low=0)
        if self.decay_steps is not None:
            check_range("optim.decay_steps", self.decay_steps, low=1)
        check_range("optim.cooldown_fraction", self.cooldown_fraction, low=0.0, high=1.0)
        check_range("optim.weight_decay", self.weight_decay, low=0.0)
        for name in ("beta1", "beta2"):
            check_range(f"optim.{name}", getattr(self, name), low=0.0, high=1.0, high_open=True)
        check_range("optim.grad_clip", self.grad_clip, low=0.0, why=">= 0 (0 turns clipping off)")
        check_range("optim.muon_lr", self.muon_lr, low=0.0, low_open=True)
        check_range("optim.muon_momentum", self.muon_momentum, low=0.0, high=1.0, high_open=True)
        check_range("optim.muon_weight_decay", self.muon_weight_decay, low=0.0)
        check_range("optim.muon_ns_steps", self.muon_ns_steps, low=1, high=20)


@dataclass
class TrainConfig:
    """The run: data, batch, cadence of evaluation, logging and checkpoints, device and precision."""

    data_dir: str | None = None  # prepared data (train.bin, val.bin, meta.json); also --data
    out_dir: str | None = None  # the run directory; also --out; default runs/<config file name>
    max_steps: int = 5000  # optimiser updates the run makes
    batch_size: int = 12  # sequences per micro-batch; each step sees batch_size * grad_accum sequences
    grad_accum: int = 1  # micro-batches summed into each update, per process
    eval_interval: int = 250  # evaluate every this many steps (and at step 0 and at the end)
    eval_iters: int = 20  # batches per split in each evaluation
    eval_examples: int = 32  # held-out examples (prompts) whose replies each evaluation generates and scores
    eval_at_start: bool = True  # also evaluate before the first step (a fresh run only)
    log_interval: int = 10  # read the loss from the device every this many steps
    checkpoint_interval: int = 1000  # write a checkpoint every this many steps (and at the end, or on a stop)
    keep_checkpoints: int = 3  # keep the newest K checkpoints
    seed: int = 1337  # initial weights, the batches' order and the samples' draws
    device: Device = "auto"  # auto picks cuda, then mps, then cpu
    dtype: Dtype = "float32"  # bfloat16 autocasts (CPU, CUDA); float16 autocasts with a gradient scaler (CUDA);
    #   auto: bfloat16 on a GPU that has it (else float16), and on a CPU whose bf16 products measure 1.5x fp32's
    compile: bool = False  # torch.compile the model
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~1/3 slower
    parallel: Parallel = "ddp"  # under torchrun: ddp replicates the model, fsdp shards it per block (FSDP2)
    max_bad_steps: int = 10  # stop after this many non-finite steps in a row
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU; None uses a known figure or shows none
    plot: bool = True  # refresh RUN_DIR/loss.png at each evaluation
    tensorboard: bool = False  # also log every metric to RUN_DIR/tensorboard (needs the tensorboard package)
    observe: bool = True  # log icl_score, induction_score and induction_loss at evaluations (text LM runs)
    observe_data: str | None = None  # text data (prepared with the model's tokenizer) to take those measures on in
    #                                  a run on other data (fine-tuning, preference, RL): the base's own held-out text
    sample_every: int = 1  # samples at every Nth evaluation (steps that are multiples of N x eval_interval) and at
    #                        the end, into RUN_DIR/samples.jsonl; 0: no samples
    sample_tokens: int = 48  # tokens each sample generates
    sample_prompts: list[str] | None = None  # prompts to complete; None: the first tokens of 2 validation windows

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of its range."""
        for key in (
            "max_steps",
            "batch_size",
            "grad_accum",
            "eval_interval",
            "eval_iters",
            "eval_examples",
            "log_interval",
            "checkpoint_interval",
            "keep_checkpoints",
            "max_bad_steps",
        ):
            check_range(f"train.{key}", getattr(self, key), low=1)
        check_range("train.seed", self.seed, low=0)
        if self.peak_flops is not None:
            check_range("train.peak_flops", self.peak_flops, low=0.0, low_open=True)
        check_range("train.sample_every", self.sample_every, low=0, why=">= 0 (0 takes no samples)")
        check_range("train.sample_tokens", self.sample_tokens, low=1)
        if self.sample_prompts is not None and not all(isinstance(p, str) and p for p in self.sample_prompts):
            raise ConfigError(f"train.sample_prompts must be a list of non-empty strings, got {self.sample_prompts!r}")
        if self.sample_prompts == []:
            raise ConfigError(
                "train.sample_prompts is empty: give at least one prompt, or null for validation "
                "prompts (train.sample_every 0 turns samples off)"
            )


@dataclass
class FinetuneConfig:
    """What every run has: what trains, what it minimises and how supervised examples are batched. Each part's own
    settings (finetune.lora_rank, finetune.dpo_beta, ...) are declared in the part's file (gptkit/finetune) and kept
    in parts; their keys are flat keys of this section all the same."""

    method: str = "full"  # what trains
    objective: str = "lm"  # what is minimised
    packing: bool = False  # supervised examples: several whole examples per row (attention kept apart) vs padding
    # Each part's settings, by class: gptkit.run_sources fills in every part's defaults (the catalogue's parts).
    parts: dict[type, PartSettings] = field(default_factory=dict)

    def of(self, kind: type[S]) -> S:
        """The settings of one part (kind is its PartSettings class; a part with none of its own gets the empty one)."""
        return self.parts[kind] if kind in self.parts else kind()  # type: ignore[return-value]

    def flat(self) -> dict[str, Any]:
        """Every key of the section and its value, as the YAML file holds them."""
        own = {"method": self.method, "objective": self.objective, "packing": self.packing}
        return own | {k: v for settings in self.parts.values() for k, v in dataclasses.asdict(settings).items()}

    def value(self, key: str) -> Any:
        """The value of a key of the section (its own, or a part's)."""
        return self.flat()[key]

    def set(self, key: str, value: Any) -> None:
        """Set a key of the section (its own, or a part's)."""
        owner = next((p for p in self.parts.values() if key in {f.name for f in dataclasses.fields(p)}), self)
        setattr(owner, key, value)

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of its range."""
        for settings in self.parts.values():
            settings.validate()


@dataclass
class RunConfig:
    """Everything one `gptkit train` run needs."""

    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def to_dict(self) -> dict[str, Any]:
        """The YAML-shaped dict: model keys flattened, None values kept so that the file is complete."""
        model: dict[str, Any] = {}
        if self.model.preset is not None:
            model["preset"] = self.model.preset
        if self.model.init_from is not None:
            model["init_from"] = self.model.init_from
        model.update(self.model.fields)
        sections = {name: dataclasses.asdict(getattr(self, name)) for name in ("optim", "train")}
        return {"model": model, **sections, "finetune": self.finetune.flat()}

    def to_yaml(self) -> str:
        """The config as YAML text, in section order."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def run_dir(self) -> Path:
        """The run directory, after checking every setting (a directory, or where one will be made)."""
        if self.train.out_dir is None:
            raise ConfigError("no run directory: pass --out RUN_DIR or set train.out_dir")
        self.validate()
        run_dir = Path(self.train.out_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--out {run_dir} is a file; give a directory for the run")
        return run_dir

    def validate(self) -> None:
        """Raise ConfigError naming the first optim, train or finetune setting out of its range (the method's and
        objective's run rules are the catalogue's check_parts)."""
        for name in SECTIONS:
            getattr(self, name).validate()


SECTIONS: dict[str, type] = {"optim": OptimConfig, "train": TrainConfig, "finetune": FinetuneConfig}
