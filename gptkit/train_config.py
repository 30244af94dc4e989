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
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from gptkit.config import PRESETS, ModelConfig
from gptkit.errors import ConfigError

Schedule = Literal["cosine", "constant", "wsd"]
OptimizerName = Literal["adamw", "muon"]
MuonLrScale = Literal["original", "match_rms_adamw"]
Device = Literal["auto", "cpu", "cuda", "mps"]
Dtype = Literal["float32", "bfloat16", "float16"]
Parallel = Literal["ddp", "fsdp"]
Method = Literal["full", "lora"]
Objective = Literal["lm", "dpo", "classify", "grpo"]
BasePrecision = Literal["float32", "bfloat16", "int8"]
LoraTargets = Literal["attention", "mlp", "all"]


@dataclass
class ModelSection:
    """Where the architecture comes from; the remaining model keys are ModelConfig fields, kept in `fields`."""

    preset: str | None = None  # a gptkit preset name; its fields are the base the other keys override
    init_from: str | None = None  # a model directory whose weights (and config) start the run: fine-tuning
    fields: dict[str, Any] = field(default_factory=dict)


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
        _check_range("optim.lr", self.lr, low=0.0, low_open=True)
        if self.schedule != "constant":  # (a constant schedule never reaches min_lr)
            _check_range("optim.min_lr", self.min_lr, low=0.0, high=self.lr, why="between 0 and optim.lr")
        _check_range("optim.warmup_steps", self.warmup_steps, low=0)
        if self.decay_steps is not None:
            _check_range("optim.decay_steps", self.decay_steps, low=1)
        _check_range("optim.cooldown_fraction", self.cooldown_fraction, low=0.0, high=1.0)
        _check_range("optim.weight_decay", self.weight_decay, low=0.0)
        for name in ("beta1", "beta2"):
            _check_range(f"optim.{name}", getattr(self, name), low=0.0, high=1.0, high_open=True)
        _check_range("optim.grad_clip", self.grad_clip, low=0.0, why=">= 0 (0 turns clipping off)")
        _check_range("optim.muon_lr", self.muon_lr, low=0.0, low_open=True)
        _check_range("optim.muon_momentum", self.muon_momentum, low=0.0, high=1.0, high_open=True)
        _check_range("optim.muon_weight_decay", self.muon_weight_decay, low=0.0)
        _check_range("optim.muon_ns_steps", self.muon_ns_steps, low=1, high=20)


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
    dtype: Dtype = "float32"  # bfloat16 autocasts (CPU, CUDA); float16 autocasts with a gradient scaler (CUDA)
    compile: bool = False  # torch.compile the model
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~1/3 slower
    parallel: Parallel = "ddp"  # under torchrun: ddp replicates the model, fsdp shards it per block (FSDP2)
    max_bad_steps: int = 10  # stop after this many non-finite steps in a row
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU; None uses a known figure or shows none
    plot: bool = True  # refresh RUN_DIR/loss.png at each evaluation
    tensorboard: bool = False  # also log every metric to RUN_DIR/tensorboard (needs the tensorboard package)
    observe: bool = True  # log icl_score, induction_score and induction_loss at evaluations (text LM runs)
    sample_every: int = 1  # samples at every Nth evaluation (steps that are multiples of N x eval_interval) and at
    #                        the end, into RUN_DIR/samples.jsonl; 0: no samples
    sample_tokens: int = 48  # tokens each sample generates
    sample_prompts: list[str] | None = None  # prompts to complete; None: the first tokens of 2 validation windows

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of its range."""
        for key in ("max_steps", "batch_size", "grad_accum", "eval_interval", "eval_iters", "eval_examples",
                    "log_interval", "checkpoint_interval", "keep_checkpoints", "max_bad_steps"):  # fmt: skip
            _check_range(f"train.{key}", getattr(self, key), low=1)
        _check_range("train.seed", self.seed, low=0)
        if self.peak_flops is not None:
            _check_range("train.peak_flops", self.peak_flops, low=0.0, low_open=True)
        _check_range("train.sample_every", self.sample_every, low=0, why=">= 0 (0 takes no samples)")
        _check_range("train.sample_tokens", self.sample_tokens, low=1)
        if self.sample_prompts is not None and not all(isinstance(p, str) and p for p in self.sample_prompts):
            raise ConfigError(f"train.sample_prompts must be a list of non-empty strings, got {self.sample_prompts!r}")
        if self.sample_prompts == []:
            raise ConfigError("train.sample_prompts is empty: give at least one prompt, or null for validation "
                              "prompts (train.sample_every 0 turns samples off)")  # fmt: skip


@dataclass
class FinetuneConfig:
    """What trains (every weight, or LoRA adapters over a frozen base) and how supervised examples are batched."""

    method: Method = "full"  # lora needs model.init_from (the base) and trains only the adapters
    lora_rank: int = 8  # r: the adapters' inner width
    lora_alpha: float = 16.0  # the update is scaled by alpha / r, as in PEFT
    lora_dropout: float = 0.0  # dropout on an adapter's input (PEFT's default is none)
    lora_targets: LoraTargets = "all"  # the block layers adapted: attention (q, k, v and output), mlp, or all
    base_precision: BasePrecision = "float32"  # lora: the frozen base's weights (bfloat16 or int8 save memory)
    packing: bool = False  # supervised examples: several whole examples per row (attention kept apart) vs padding
    objective: Objective = "lm"  # lm: next-token loss; dpo: preference pairs; classify: a label head (GPT-1);
    #                              grpo: reinforcement learning from rewards on sampled completions of prompts
    dpo_beta: float = 0.1  # dpo: how far the policy may move from the reference (TRL's default)
    dpo_nll_weight: float = 0.0  # dpo: weight of the chosen replies' per-token NLL added (TRL's rpo_alpha; 0: off)
    lm_weight: float = 0.5  # classify: weight of the language-modelling loss beside the label's (GPT-1: 0.5)
    reward: str = "exact_match"  # grpo: exact_match (the row's "answer"), regex:PATTERN, json_schema (the row's
    #                              "schema") or module:function, called as function(prompt, completion, row)
    group_size: int = 8  # grpo: completions sampled per prompt (G); advantages compare each with its group
    completion_tokens: int = 64  # grpo: the longest completion sampled
    kl_weight: float = 0.0  # grpo: weight of the KL penalty against the starting model (0: none, no reference)
    scale_rewards: bool = True  # grpo: divide each group's advantages by its rewards' standard deviation
    length_penalty: float = 0.0  # grpo: subtract this x completion length / completion_tokens from each reward
    temperature: float = 1.0  # grpo: sampling temperature of the completions
    top_k: int | None = None  # grpo: sample from the k most likely tokens only
    top_p: float | None = None  # grpo: nucleus sampling
    stop: list[str] | None = None  # grpo: strings that end a completion (the reward sees the text before)
    json_schema: str | None = None  # grpo: a JSON schema file every completion is constrained to
    eval_samples: int = 8  # grpo: completions per held-out prompt at evaluations (pass@1 and pass@eval_samples)
    pass_reward: float = 1.0  # grpo: a completion passes when its reward (before the length penalty) reaches this
    reward_timeout: float = 30.0  # grpo: seconds one reward call may take; past it the run stops (checkpoint first)

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of its range."""
        _check_range("finetune.lora_rank", self.lora_rank, low=1)
        _check_range("finetune.lora_alpha", self.lora_alpha, low=0.0, low_open=True)
        _check_range("finetune.lora_dropout", self.lora_dropout, low=0.0, high=1.0, high_open=True)
        _check_range("finetune.dpo_beta", self.dpo_beta, low=0.0, low_open=True)
        _check_range("finetune.dpo_nll_weight", self.dpo_nll_weight, low=0.0)
        _check_range("finetune.lm_weight", self.lm_weight, low=0.0)
        for key in ("group_size", "completion_tokens", "eval_samples"):
            _check_range(f"finetune.{key}", getattr(self, key), low=1)
        for key in ("kl_weight", "length_penalty", "temperature"):
            _check_range(f"finetune.{key}", getattr(self, key), low=0.0)
        _check_range("finetune.reward_timeout", self.reward_timeout, low=0.0, low_open=True)
        if self.top_k is not None:
            _check_range("finetune.top_k", self.top_k, low=1)
        if self.top_p is not None:
            _check_range("finetune.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"finetune.stop must be a list of non-empty strings, got {self.stop!r}")
        if self.method != "lora" and self.base_precision != "float32":
            raise ConfigError(f"finetune.base_precision {self.base_precision} needs finetune.method lora (a frozen "
                              "base); full fine-tuning trains every weight in float32")  # fmt: skip


def _check_range(name: str, value: float, low: float, high: float | None = None, low_open: bool = False,
                 high_open: bool = False, why: str | None = None) -> None:  # fmt: skip
    """A ConfigError unless value is finite and within [low, high] (an open end excludes that bound)."""
    inside = math.isfinite(value) and (value > low if low_open else value >= low)
    if high is not None:
        inside = inside and (value < high if high_open else value <= high)
    if not inside:
        if why is None:
            why = (f"> {low}" if low_open else f">= {low}") if high is None else \
                f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"  # fmt: skip
        raise ConfigError(f"{name} must be {why}, got {value}")


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
        sections = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        return {"model": model, **sections}

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
        if self.finetune.method == "lora" and self.model.init_from is None:
            raise ConfigError("finetune.method lora trains adapters over a base model: set model.init_from")
        if self.finetune.objective == "dpo" and self.model.init_from is None:
            raise ConfigError("finetune.objective dpo aligns an existing model (its frozen copy is the reference): "
                              "set model.init_from")  # fmt: skip
        if self.finetune.objective == "grpo" and self.model.init_from is None:
            raise ConfigError("finetune.objective grpo improves a model that can already attempt the task (its "
                              "sampled completions are the data): set model.init_from")  # fmt: skip
        if self.finetune.method == "lora" and self.train.parallel == "fsdp":
            raise ConfigError("finetune.method lora trains under train.parallel ddp (FSDP would shard only the "
                              "small adapters' updates); use ddp")  # fmt: skip
        if self.finetune.objective != "lm" and self.train.parallel == "fsdp":
            raise ConfigError(f"finetune.objective {self.finetune.objective} trains under train.parallel ddp; use ddp")


SECTIONS: dict[str, type] = {"optim": OptimConfig, "train": TrainConfig, "finetune": FinetuneConfig}
# The finetune settings a resumed run may change (the others shaped the weights it continues): a reward that timed
# out can be given longer.
RESUME_MAY_CHANGE = ("reward_timeout",)
MODEL_SPECIAL = {"preset": str | None, "init_from": str | None}


def section_types(section: str) -> dict[str, Any]:
    """Each key a section accepts and its annotated type (the model section's come from ModelConfig)."""
    if section == "model":
        return {**MODEL_SPECIAL, **get_type_hints(ModelConfig)}
    return get_type_hints(SECTIONS[section])


def _describe(kind: Any) -> str:
    """A type as a user reads it: 'an integer', 'one of cosine, constant', ..."""
    args = get_args(kind)
    if type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return _describe(inner[0]) + " or null"
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(map(str, args))
    if get_origin(kind) is list:
        return "a list of strings"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))


def coerce(key: str, value: Any, kind: Any) -> Any:
    """Check value against kind (int, float, bool, str, Literal, Optional), returning it normalised."""
    args = get_args(kind)
    if get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        try:
            return coerce(key, value, inner)
        except ConfigError:
            raise ConfigError(f"{key} must be {_describe(kind)}, got {value!r}") from None
    ok = False
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string; it is meant as a number
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    elif get_origin(kind) is Literal:
        ok = value in args
    elif get_origin(kind) is list:  # list[str], the only list a section holds
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
    if not ok:
        raise ConfigError(f"{key} must be {_describe(kind)}, got {value!r}")
    return value


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


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in cls's source (after `name: type = value  # `, with its indented continuation lines
    `#   ...`), joined into one line: the description `gptkit train --help` shows, kept in one place."""
    lines, _ = inspect.getsourcelines(cls)
    comments = {}
    for node in ast.parse(textwrap.dedent("".join(lines))).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        parts = [lines[end - 1].partition("  # ")[2].strip()]
        while parts[0] and end < len(lines) and lines[end].strip().startswith("#  "):
            parts.append(lines[end].strip()[1:].strip())
            end += 1
        if parts[0]:
            comments[node.target.id] = " ".join(parts)
    return comments


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One `--section.key VALUE` flag per config key, generated from the dataclasses and ModelConfig, each described
    by its field's comment."""
    defaults = {name: kind() for name, kind in SECTIONS.items()}
    for section in ("model", *SECTIONS):
        group = parser.add_argument_group(f"{section} settings (YAML section {section}:)")
        described = {**field_comments(ModelSection), **field_comments(ModelConfig)} if section == "model" else \
            field_comments(SECTIONS[section])  # fmt: skip
        for key, kind in section_types(section).items():
            if section == "model":
                shown = "the preset's or ModelConfig's" if key not in MODEL_SPECIAL else "none"
            else:
                shown = repr(getattr(defaults[section], key))
            what = described.get(key, "")
            group.add_argument(
                f"--{section}.{key}",
                dest=f"cfg:{section}.{key}",
                metavar="VALUE",
                default=argparse.SUPPRESS,
                help=f"{what}{'; ' if what else ''}{_describe(kind)} (default {shown})",
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


def resolve_model(section: ModelSection, vocab_size: int, init_config: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig a run trains: preset (or init_from's config) + overrides, vocab_size from the data."""
    overrides = dict(section.fields)
    if "vocab_size" in overrides and overrides["vocab_size"] != vocab_size:
        raise ConfigError(
            f"model.vocab_size {overrides['vocab_size']} does not match the data's vocab_size {vocab_size} "
            "(meta.json); drop model.vocab_size or prepare the data with the matching tokenizer"
        )
    if init_config is not None:
        base = init_config.to_dict()
        if base["vocab_size"] != vocab_size:
            raise ConfigError(
                f"model.init_from {section.init_from} has vocab_size {base['vocab_size']} but the data's is "
                f"{vocab_size}; prepare the data with that model's tokenizer"
            )
        for key, value in overrides.items():
            if key != "dropout" and value != base[key]:
                raise ConfigError(
                    f"model.{key} {value!r} conflicts with init_from's {base[key]!r}; only dropout may change"
                )
    elif section.preset is not None:
        ModelConfig.preset(section.preset)  # raises for an unknown name, listing the presets
        base = dict(PRESETS[section.preset])  # raw, so derived sizes follow overridden widths
    else:
        base = {}
    base.update(overrides)
    base["vocab_size"] = vocab_size
    try:
        return ModelConfig.from_dict(base)
    except ConfigError as err:
        raise ConfigError(f"model: {err}") from None

