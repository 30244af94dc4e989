"""The training run's settings: YAML sections (model, optim, train, finetune), each declared once and turned into flags.

Precedence: dataclass defaults < the YAML file < `--section.field VALUE` flags. The model section holds
ModelConfig's own fields (not re-declared here) plus `preset` and `init_from`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from gptkit.config import MODEL_SPECIAL, ModelConfig, ModelSection
from gptkit.errors import ConfigError
from gptkit.finetune.catalogue import (
    METHODS, OBJECTIVES, check_parts, choices_help, default_settings, part_keys, part_settings,
)  # fmt: skip
from gptkit.settings import PartSettings, check_range, coerce, describe, field_comments

Schedule = Literal["cosine", "constant", "wsd"]
OptimizerName = Literal["adamw", "muon"]
MuonLrScale = Literal["original", "match_rms_adamw"]
Device = Literal["auto", "cpu", "cuda", "mps"]
Dtype = Literal["float32", "bfloat16", "float16", "auto"]
Parallel = Literal["ddp", "fsdp"]
MethodName = Literal[tuple(METHODS)]  # type: ignore[valid-type]  # the catalogue's names
ObjectiveName = Literal[tuple(OBJECTIVES)]  # type: ignore[valid-type]
S = TypeVar("S", bound=PartSettings)


@dataclass
class OptimConfig:
    """The optimiser (AdamW, or Muon on the blocks' matrices beside AdamW) and its learning-rate schedule."""

    name: OptimizerName = "adamw"  # muon: Muon on the blocks' 2-D weights, AdamW (the settings below) on the rest
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
        for key in ("max_steps", "batch_size", "grad_accum", "eval_interval", "eval_iters", "eval_examples",
                    "log_interval", "checkpoint_interval", "keep_checkpoints", "max_bad_steps"):  # fmt: skip
            check_range(f"train.{key}", getattr(self, key), low=1)
        check_range("train.seed", self.seed, low=0)
        if self.peak_flops is not None:
            check_range("train.peak_flops", self.peak_flops, low=0.0, low_open=True)
        check_range("train.sample_every", self.sample_every, low=0, why=">= 0 (0 takes no samples)")
        check_range("train.sample_tokens", self.sample_tokens, low=1)
        if self.sample_prompts is not None and not all(isinstance(p, str) and p for p in self.sample_prompts):
            raise ConfigError(f"train.sample_prompts must be a list of non-empty strings, got {self.sample_prompts!r}")
        if self.sample_prompts == []:
            raise ConfigError("train.sample_prompts is empty: give at least one prompt, or null for validation "
                              "prompts (train.sample_every 0 turns samples off)")  # fmt: skip


@dataclass
class FinetuneConfig:
    """What every run has: what trains, what it minimises and how supervised examples are batched. Each part's own
    settings (finetune.lora_rank, finetune.dpo_beta, ...) are declared in the part's file (gptkit/finetune) and kept
    in parts; their keys are flat keys of this section all the same."""

    method: MethodName = "full"  # what trains
    objective: ObjectiveName = "lm"  # what is minimised
    packing: bool = False  # supervised examples: several whole examples per row (attention kept apart) vs padding
    parts: dict[type, PartSettings] = field(default_factory=default_settings)  # each part's settings, by class

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
        """Raise ConfigError naming the first optim, train or finetune setting out of its range."""
        for name in SECTIONS:
            getattr(self, name).validate()
        check_parts(self)


SECTIONS: dict[str, type] = {"optim": OptimConfig, "train": TrainConfig, "finetune": FinetuneConfig}


def section_types(section: str) -> dict[str, Any]:
    """Each key a section accepts and its annotated type (the model section's come from ModelConfig, the finetune
    section's parts' from their own settings)."""
    if section == "model":
        return {**MODEL_SPECIAL, **get_type_hints(ModelConfig)}
    hints = get_type_hints(SECTIONS[section])
    if section == "finetune":
        hints.pop("parts")
        hints.update({key: kind for key, (_, kind) in part_keys().items()})
    return hints


def section_comments(section: str) -> dict[str, str]:
    """Each key's description, from its field's comment (a part's settings' own)."""
    if section == "model":
        return {**field_comments(ModelSection), **field_comments(ModelConfig)}
    described = field_comments(SECTIONS[section])
    if section == "finetune":
        described["method"] += ": " + choices_help(METHODS)
        described["objective"] += ": " + choices_help(OBJECTIVES)
        owners = part_settings()  # a part's key is described as "PART: its comment"
        described.update({key: f"{owners[kind].split()[-1]}: {field_comments(kind)[key]}"
                          for key, (kind, _) in part_keys().items() if key in field_comments(kind)})  # fmt: skip
    return described


def _unknown(key: str, known: typing.Iterable[str]) -> ConfigError:
    """An error for an unknown key, suggesting the nearest known one."""
    close = difflib.get_close_matches(key.split(".")[-1], list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def apply(config: RunConfig, overrides: dict[str, dict[str, Any]], source: str) -> RunConfig:
    """A copy of config with {section: {key: value}} applied, every key and value checked."""
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, fields=dict(config.model.fields)),
        **{name: dataclasses.replace(getattr(config, name)) for name in SECTIONS},
    )
    config.finetune.parts = {kind: dataclasses.replace(settings) for kind, settings in config.finetune.parts.items()}
    names = ", ".join(("model", *SECTIONS))
    if not isinstance(overrides, dict):
        raise ConfigError(f"{source} must be a mapping with sections {names}")
    for section, values in overrides.items():
        if section not in ("model", *SECTIONS):
            raise ConfigError(f"{source}: unknown section {section!r}; sections are {names}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of keys to values")
        known = section_types(section)
        for key, value in values.items():
            if key not in known:
                raise _unknown(f"{section}.{key}", known)
            value = coerce(f"{section}.{key}", value, known[key])
            if section == "model" and key in MODEL_SPECIAL:
                setattr(config.model, key, value)
            elif section == "model":
                config.model.fields[key] = value
            elif section == "finetune":
                config.finetune.set(key, value)
            else:
                setattr(getattr(config, section), key, value)
    return config


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The parsed YAML file; an unreadable or malformed file is a one-line ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML: {getattr(err, 'problem', err)}") from None
    return {} if data is None else data


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One `--section.key VALUE` flag per config key, generated from the dataclasses and ModelConfig, each described
    by its field's comment."""
    defaults = {"optim": vars(OptimConfig()), "train": vars(TrainConfig()), "finetune": FinetuneConfig().flat()}
    for section in ("model", *SECTIONS):
        group = parser.add_argument_group(f"{section} settings (YAML section {section}:)")
        described = section_comments(section)
        for key, kind in section_types(section).items():
            if section == "model":
                shown = "the preset's or ModelConfig's" if key not in MODEL_SPECIAL else "none"
            else:
                shown = repr(defaults[section][key])
            what = described.get(key, "")
            group.add_argument(
                f"--{section}.{key}",
                dest=f"cfg:{section}.{key}",
                metavar="VALUE",
                default=argparse.SUPPRESS,
                help=f"{what}{'; ' if what else ''}{describe(kind)} (default {shown})",
            )


def flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The generated flags the user gave, as {section: {key: value}}, each value parsed as a YAML scalar."""
    overrides: dict[str, dict[str, Any]] = {}
    for dest, text in vars(args).items():
        if not dest.startswith("cfg:"):
            continue
        section, key = dest[4:].split(".", 1)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        kind = section_types(section).get(key) if section in ("model", *SECTIONS) else None
        wants_text = kind is str or str in get_args(kind)  # a path named 2024 or yes stays a string
        if any(get_origin(k) is list for k in (kind, *get_args(kind))):
            value = value if isinstance(value, list) or value is None else [text]  # one flag value: one item
        elif value is not None and (wants_text or not isinstance(value, (bool, int, float))):
            value = text  # keep strings (and anything structured) exactly as typed
        overrides.setdefault(section, {})[key] = value
    return overrides


def from_sources(yaml_path: str | Path | None, flags: dict[str, dict[str, Any]]) -> RunConfig:
    """Defaults, then the YAML file (if any), then the flags."""
    config = RunConfig()
    if yaml_path is not None:
        config = apply(config, load_yaml(yaml_path), str(yaml_path))
    return apply(config, flags, "command line")
