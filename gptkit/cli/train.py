"""`gptkit train`: train (or resume) a model on a prepared data directory, from a YAML recipe plus flags."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptkit.errors import ConfigError

if TYPE_CHECKING:
    from gptkit.train_config import RunConfig

USAGE = (
    "gptkit train [--config FILE.yaml] [--data DIR] [--out RUN_DIR] [--resume | --resume-from CHECKPOINT] "
    "[--SECTION.KEY VALUE ...]"
)
# Short flags that set a config field, and the field's own flag: giving both is an error, not a silent choice.
ALIASES = {"data": "train.data_dir", "out": "train.out_dir"}


# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "train or fine-tune a model on prepared data, with checkpoints and exact resume"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `train` sub-command, with one flag per config key."""
    from gptkit.run_sources import add_flags

    parser = subparsers.add_parser(
        "train",
        help=HELP,
        description="Train a model on a directory made by `gptkit prepare`. Settings come from the dataclass "
        "defaults, then --config FILE.yaml (sections model:, optim:, train:), then --SECTION.KEY VALUE flags. "
        "The run directory receives config.yaml, metrics.jsonl, loss.png and checkpoints/ (each one a model "
        "directory); `latest` names the newest checkpoint. Launched by torchrun (torchrun --nproc_per_node N -m "
        "gptkit train ...), it trains data-parallel (train.parallel ddp or fsdp); rank 0 writes the files.",
        usage=USAGE,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="a recipe, e.g. configs/shakespeare-char-cpu.yaml")
    parser.add_argument("--data", metavar="DIR", help="prepared data directory (same as --train.data_dir)")
    parser.add_argument(
        "--out", metavar="RUN_DIR", help="run directory (same as --train.out_dir; default runs/<config name>)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in RUN_DIR from its newest checkpoint "
        "that verifies (a damaged newer one is passed over, with a warning)",
    )
    parser.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        help="continue the run from this checkpoint, "
        "RUN_DIR/checkpoints/step-N (an error if it is damaged); later checkpoints are removed",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_flags(parser)
    parser.set_defaults(run=run)


def build_config(args: argparse.Namespace) -> RunConfig:
    """The run's settings from the arguments; with --resume, the run directory's config.yaml is the base."""
    from gptkit.checkpoint import CHECKPOINTS
    from gptkit.run_sources import flag_overrides, from_sources

    flags = flag_overrides(args)
    for option, field in ALIASES.items():
        section, key = field.split(".")
        if getattr(args, option) is None:
            continue
        if key in flags.get(section, {}):
            raise ConfigError(f"--{option} and --{field} both set {field}; give one of them")
        flags.setdefault(section, {})[key] = getattr(args, option)
    if args.resume_from is not None:
        checkpoint = Path(args.resume_from)
        folder = checkpoint.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint.resolve().parent
        if folder.name != CHECKPOINTS:
            raise ConfigError(
                f"--resume-from {checkpoint} is not a checkpoint directory (RUN_DIR/{CHECKPOINTS}/step-N)"
            )
        run_dir = folder.parent
        given = flags.get("train", {}).get("out_dir")
        if given is not None and Path(given).resolve() != run_dir.resolve():
            raise ConfigError(f"--resume-from {checkpoint} belongs to the run {run_dir}, not to --out {given}")
        flags.setdefault("train", {})["out_dir"] = str(run_dir if given is None else given)
    recipe = from_sources(args.config, flags)
    if recipe.train.out_dir is None:
        recipe.train.out_dir = str(Path("runs") / (Path(args.config).stem if args.config else "run"))
    if not (args.resume or args.resume_from):
        return recipe
    return resumed_config(recipe, flags)


def resumed_config(recipe: RunConfig, flags: dict[str, dict[str, Any]]) -> RunConfig:
    """A resumed run's settings: its own resolved config.yaml is the base (the recipe was baked into it); flags may
    extend the run (e.g. --train.max_steps) but not change the model it trains."""
    from gptkit.checkpoint import latest_checkpoint
    from gptkit.finetune.catalogue import resume_may_change
    from gptkit.run_files import CONFIG_FILE
    from gptkit.run_sources import from_sources

    run_dir = Path(recipe.train.out_dir)
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        if not run_dir.is_dir():
            raise ConfigError(f"{run_dir} does not exist: there is no run to resume (start it without --resume)")
        if latest_checkpoint(run_dir) is None:
            raise ConfigError(
                f"{run_dir} has no checkpoint to resume from (the run stopped before its first "
                "checkpoint): start it again without --resume"
            )
        raise ConfigError(f"{saved_path} is missing, so the run's settings are unknown; restore it to resume")
    fixed = ("model", "finetune")  # what the checkpoint's weights were built as
    config = from_sources(saved_path, {section: values for section, values in flags.items() if section not in fixed})
    config.train.out_dir = recipe.train.out_dir
    for key, value in flags.get("model", {}).items():
        if key not in ("preset", "init_from") and config.model.fields.get(key) != value:
            raise ConfigError(
                f"model.{key} cannot change on --resume (the run has {config.model.fields.get(key)!r}); "
                "start a new run with model.init_from instead"
            )
    given = from_sources(None, {"finetune": flags.get("finetune", {})}).finetune  # (the values checked, as typed)
    for key in flags.get("finetune", {}):
        if key in resume_may_change():
            config.finetune.set(key, given.value(key))
        elif config.finetune.value(key) != given.value(key):
            raise ConfigError(
                f"finetune.{key} cannot change on --resume (the run has "
                f"{config.finetune.value(key)!r}); start a new run instead"
            )
    return config


def run(args: argparse.Namespace) -> int:
    """Train, then say where the model is and how to continue."""
    from gptkit.distributed import world_from_env
    from gptkit.train import train

    config = build_config(args)
    result = train(config, resume=args.resume, progress=not args.quiet, resume_from=args.resume_from)
    if not world_from_env().is_main:  # under torchrun, rank 0 speaks for the run
        return 130 if result.interrupted else 0
    where = f" (last val loss {result.val_loss:.4f})" if result.val_loss is not None else ""
    print(f"step {result.step}{where}; model: {result.checkpoint}", file=sys.stderr)
    if result.skipped_steps:
        print(f"{result.skipped_steps} update(s) were skipped for a non-finite loss or gradient", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted; continue with: {resume_command(result.run_dir)}", file=sys.stderr)
        return 130
    return 0


def resume_command(run_dir: Path, env: dict[str, str] | None = None) -> str:
    """The command that resumes the run as it was launched: under torchrun, torchrun with the same processes (a
    resume on another count changes each process's grad_accum to keep the global batch)."""
    import shlex

    env = dict(os.environ) if env is None else env
    command = f"gptkit train --resume --out {shlex.quote(str(run_dir))}"
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return command
    local = int(env.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // local)
    if nodes == 1:
        return f"torchrun --nproc_per_node {local} -m {command}"
    return (
        f"torchrun --nnodes {nodes} --nproc_per_node {local} -m {command} (on every machine, each with its "
        "--node_rank and the --master_addr and --master_port of the first)"
    )
