"""Training checkpoints: a model directory plus optimiser, RNG and loop state, written so a kill never corrupts one
and checked on resume, so a damaged one is passed over for the one before it.

Layout of RUN_DIR:
    latest                          text: the newest complete checkpoint, e.g. "checkpoints/step-000500"
    checkpoints/step-000500/        a gptkit model directory (config.json, model.safetensors, tokenizer) plus
        optimizer.safetensors       AdamW moments and step counts, keyed "<param name>.<state key>"
        rng.safetensors             torch generator states (uint8 tensors); rank r > 0's keys prefixed "rank<r>."
        trainer.json                step, optimiser structure and scalars, data-loader state, counters
        manifest.json               every other file of the directory with its size and checksum, written last
A checkpoint is assembled in a hidden temporary directory, every file fsynced and listed in the manifest, then
renamed into place; only then is `latest` replaced (atomically). A complete checkpoint is a step-* directory
holding a manifest, whether or not `latest` was updated before a kill; `latest` is for people and scripts, and
is never followed outside the run's checkpoints/. The manifest lists whatever files the directory holds, so any
checkpoint layout (a full model, adapters only) is written and verified the same way.

Under torchrun every rank calls save_checkpoint (sharded FSDP tensors are gathered whole, a collective) and rank
0 alone writes, so a checkpoint of a sharded run is the same single-file model directory as any other.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptkit.atomic import atomic_write_text, fsync_dir, make_parents, remove_empty
from gptkit.distributed import full_module, full_tensor, shard_like
from gptkit.errors import ConfigError, GptkitError
from gptkit.formats.modeldir import save_model_dir
from gptkit.manifest import (
    MANIFEST_FILE,
    Checksums,
    DamagedFiles,
    has_manifest,
    verify_manifest,
    write_manifest,
)
from gptkit.tensors import WEIGHTS_FILE, load_tensors, save_tensors
from gptkit.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

LATEST = "latest"
CHECKPOINTS = "checkpoints"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
TRAINER_FILE = "trainer.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step-(\d+)")
RANK_KEY = re.compile(r"rank(\d+)\.")  # rng.safetensors: rank r > 0's generators, "rank<r>.<name>"


class CheckpointError(GptkitError):
    """A run directory without a usable checkpoint, or a checkpoint that is damaged."""


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after `step` updates."""
    return f"step-{step:06d}"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """The run's step-* checkpoint directories, complete or not, newest (highest step) first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)  # by number: step-1000000 after step-999000


def _complete(path: Path) -> bool:
    """Whether a checkpoint directory was renamed into place whole (older gptkit wrote no manifest)."""
    return (path / MANIFEST_FILE).is_file() or (path / TRAINER_FILE).is_file()


def latest_checkpoint(run_dir: str | Path, verify: bool = False, skipped: list[str] | None = None) -> Path | None:
    """The run's newest complete checkpoint, or None when it has none.

    With verify, the newest that verify_checkpoint accepts against its manifest; where none does, the newest
    without a manifest that is otherwise whole (its files cannot be checked). Why each newer one was passed over
    is appended to skipped. `latest` is not consulted: a kill between a checkpoint's rename and `latest`'s update,
    or garbage in `latest`, must not hide a complete checkpoint.
    """
    if not verify:
        return next((path for path in checkpoint_dirs(run_dir) if _complete(path)), None)
    reasons: list[str] = []
    unverified: Path | None = None
    passed_over = 0  # the reasons that concern checkpoints newer than `unverified`, and itself
    for path in checkpoint_dirs(run_dir):
        try:
            verified = verify_checkpoint(path)
        except CheckpointError as err:
            reasons.append(str(err))
            continue
        if verified:
            if skipped is not None:
                skipped.extend(reasons)
            return path
        reasons.append(unverifiable(path))
        if unverified is None:
            unverified, passed_over = path, len(reasons)
    if skipped is not None:
        skipped.extend(reasons[:passed_over] if unverified is not None else reasons)
    return unverified


def unverifiable(path: Path) -> str:
    """Why a checkpoint without a manifest cannot be trusted blindly (one clause of a warning)."""
    return f"{path} has no {MANIFEST_FILE}, so its files cannot be verified (a damaged byte would go unnoticed)"


def read_latest(run_dir: str | Path) -> Path | None:
    """The checkpoint the `latest` file names, or None when it is missing or names nothing inside checkpoints/."""
    try:
        name = (Path(run_dir) / LATEST).read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    folder, _, step = name.partition("/")
    return Path(run_dir) / CHECKPOINTS / step if folder == CHECKPOINTS and STEP_DIR.fullmatch(step) else None


def verify_checkpoint(path: Path) -> bool:
    """Raise CheckpointError naming the first thing wrong with a checkpoint: a manifest that does not match the
    files (missing, truncated, changed), no manifest and no trainer.json (incomplete), or a trainer.json without
    what a resume needs. Returns whether the files were checked: False for a checkpoint without a manifest (an older
    gptkit's, or one whose manifest was deleted), of which only trainer.json could be."""
    if has_manifest(path):
        try:
            verify_manifest(path, required=TRAINER_FILE)
        except DamagedFiles as err:
            raise CheckpointError(str(err)) from None
    elif not (path / TRAINER_FILE).is_file():
        raise CheckpointError(f"{path} is incomplete (no {MANIFEST_FILE})")
    read_trainer_state(path)
    return has_manifest(path)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer.json, checked to hold what a resume needs."""
    file = path / TRAINER_FILE
    try:
        record = json.loads(file.read_bytes())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None
    shape = {"step": int, "optimizer": dict, "loader": dict}
    for key, kind in shape.items():
        if not isinstance(record, dict) or not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise CheckpointError(f"{file} has no {kind.__name__} {key!r} (damaged?)")
    optimizer = record["optimizer"]
    if not isinstance(optimizer.get("param_groups"), list) or not isinstance(optimizer.get("scalars"), dict):
        raise CheckpointError(f"{file}: 'optimizer' lacks param_groups or scalars (damaged?)")
    match = STEP_DIR.fullmatch(path.name)
    if match and int(match.group(1)) != record["step"]:
        raise CheckpointError(f"{file} holds step {record['step']}, not the directory's {int(match.group(1))}")
    return record


def saved_world(path: Path) -> tuple[int, int | None]:
    """(processes, grad_accum per process) of the run that wrote a checkpoint. trainer.json holds both; a checkpoint
    written before it did tells its processes by the ranks its generators were saved for, and no grad_accum."""
    record = read_trainer_state(path)
    world, accum = record.get("world_size"), record.get("grad_accum")
    if isinstance(world, int) and world >= 1:
        return world, accum if isinstance(accum, int) and accum >= 1 else None
    ranks = [int(match.group(1)) for key in load_tensors(path / RNG_FILE) if (match := RANK_KEY.match(key))]
    return max(ranks, default=0) + 1, None


def rng_state() -> dict[str, torch.Tensor]:
    """Every torch generator the training step draws from (dropout), as uint8 tensors."""
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"torch_cuda_{index}"] = cuda_state
    if torch.backends.mps.is_available():
        state["torch_mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what rng_state() returned (generators absent on this machine are left alone)."""
    torch.set_rng_state(state["torch_cpu"])
    cuda = [state[f"torch_cuda_{i}"] for i in range(len(state)) if f"torch_cuda_{i}" in state]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    if "torch_mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["torch_mps"])


def optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, structure): the optimiser's per-parameter tensors keyed by parameter name, the rest as JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{names[param]}.{key}"] = full_tensor(value)
            else:
                scalars.setdefault(names[param], {})[key] = value
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    structure: dict[str, Any],
    names: dict[torch.nn.Parameter, str],
) -> None:
    """Put optimizer_state()'s output back into an optimiser built over the same named parameters."""
    # optim.name muon marks each group with the optimiser that steps it; AdamW's groups may carry no mark.
    saved, this = (
        "muon" if any(g.get("optimizer") == "muon" for g in groups) else "adamw"
        for groups in (structure["param_groups"], optimizer.param_groups)
    )
    if saved != this:
        raise CheckpointError(
            f"the checkpoint was trained with optim.name {saved}, this run has {this}; resume with --optim.name {saved}"
        )
    index = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            index[names[param]] = len(index)
    saved_names = [name for group in structure["param_groups"] for name in group["params"]]
    if sorted(saved_names) != sorted(index):
        raise CheckpointError("the checkpoint's optimiser covers different parameters than this model")
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = {names[p]: p for group in optimizer.param_groups for p in group["params"]}
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        name, _, field = key.rpartition(".")
        param = params[name]
        if tensor.dim() and tensor.shape != param.shape:
            raise CheckpointError(
                f"optimiser state {key!r} has shape {tuple(tensor.shape)}, the parameter {tuple(param.shape)}"
            )
        if isinstance(param, DTensor) and tensor.shape == param.shape:  # FSDP: keep this rank's shard
            tensor = distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements)
        state.setdefault(index[name], {})[field] = tensor
    for name, values in structure["scalars"].items():
        state.setdefault(index[name], {}).update(values)
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in structure["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def remove_stale_temporaries(run_dir: str | Path) -> None:
    """Delete half-written checkpoints a killed run left behind."""
    folder = Path(run_dir) / CHECKPOINTS
    if folder.is_dir():
        for path in folder.iterdir():
            if path.name.startswith(TMP_PREFIX):
                shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Tokenizer | None,
    optimizer: torch.optim.Optimizer,
    names: dict[torch.nn.Parameter, str],
    trainer: dict[str, Any],
    keep: int,
    rng: dict[str, torch.Tensor] | None = None,
    write: bool = True,
    save_model: Callable[[torch.nn.Module, Path], Any] | None = None,
) -> Path:
    """Write the checkpoint after `step` updates, point `latest` at it, and keep only the newest `keep`.

    rng defaults to this process's generators. Under torchrun every rank calls this (FSDP shards are gathered)
    and only the one with write=True writes; the path is returned on every rank. save_model(module, directory)
    writes the model's files (default: a gptkit model directory with the tokenizer; a LoRA run: its adapters).
    """
    run_dir = Path(run_dir)
    module = full_module(model)
    opt_tensors, structure = optimizer_state(optimizer, names)
    final = run_dir / CHECKPOINTS / checkpoint_name(step)
    if not write:
        return final
    folder = run_dir / CHECKPOINTS
    tmp = folder / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    made = make_parents(tmp)  # removed again if this first checkpoint fails: no empty checkpoints/ stays
    shutil.rmtree(tmp, ignore_errors=True)
    checksums = Checksums(tmp)
    try:
        if save_model is not None:
            save_model(module, tmp)
        else:
            save_model_dir(module, tmp, tokenizer=tokenizer)
        checksums.update()  # the model's files are checksummed while the optimiser state is written
        save_tensors(opt_tensors, tmp / OPTIMIZER_FILE)
        checksums.update()
        save_tensors(rng if rng is not None else rng_state(), tmp / RNG_FILE)
        record = {"step": step, "optimizer": structure, **trainer}
        atomic_write_text(tmp / TRAINER_FILE, json.dumps(record, indent=1) + "\n")
        write_manifest(tmp, checksums)
        if final.exists():  # a run killed after this rename but before `latest` moved leaves one behind
            stale = folder / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(folder)
    except BaseException:
        checksums.close()
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made)
        raise
    checksums.close()
    try:
        atomic_write_text(run_dir / LATEST, f"{CHECKPOINTS}/{final.name}\n")
    except OSError as err:  # the checkpoint is complete, and found without `latest`: only people read that file
        logger.warning(
            "could not update %s (%s); %s is complete all the same", run_dir / LATEST, err.strerror or err, final
        )
    prune(run_dir, keep)
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    for path in checkpoint_dirs(run_dir)[keep:]:
        shutil.rmtree(path, ignore_errors=True)


def rewind(run_dir: Path, checkpoint: Path) -> list[Path]:
    """Make checkpoint the run's newest: delete the checkpoints after it and point `latest` at it.

    A run continued from an older checkpoint would write those steps again; left in place, a later resume would
    jump onto the abandoned line. Returns the deleted directories.
    """
    step = int(checkpoint.name[5:])
    later = [p for p in checkpoint_dirs(run_dir) if int(p.name[5:]) > step]
    for path in later:  # renamed away first, so that a kill mid-delete leaves no half directory named step-*
        doomed = path.with_name(f"{TMP_PREFIX}dropped-{path.name}-{os.getpid()}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    if read_latest(run_dir) != run_dir / CHECKPOINTS / checkpoint.name:
        atomic_write_text(run_dir / LATEST, f"{CHECKPOINTS}/{checkpoint.name}\n")
    return later


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: dict[torch.nn.Parameter, str],
    rank: int = 0,
    load_model: Callable[[torch.nn.Module, Path], Any] | None = None,
) -> dict[str, Any]:
    """Restore weights, optimiser and RNG from a checkpoint into a model built with its config; return trainer.json.

    Rank r > 0 of a distributed run restores its own generators (keys "rank<r>.") when the checkpoint has them,
    and keeps its current ones otherwise (a run resumed on more processes than it had). load_model(module,
    directory) reads the model's files in place of the default full weights (a LoRA run: its adapters).
    """
    record = read_trainer_state(path)
    module = getattr(model, "_orig_mod", model)
    device = next(module.parameters()).device
    (load_model or load_weights)(module, path)
    try:
        load_optimizer_state(optimizer, load_tensors(path / OPTIMIZER_FILE, device), record["optimizer"], names)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(
            f"{path / OPTIMIZER_FILE} does not fit this run's optimiser ({type(err).__name__}: "
            f"{err}); is it another run's file?"
        ) from None
    rng = load_tensors(path / RNG_FILE)
    if rank:
        prefix = f"rank{rank}."
        rng = {k[len(prefix) :]: v for k, v in rng.items() if k.startswith(prefix)}
    if rng:
        try:
            set_rng_state(rng)
        except (KeyError, RuntimeError, TypeError) as err:
            raise CheckpointError(f"{path / RNG_FILE} holds no usable generator state ({err})") from None
    return record


def load_weights(module: torch.nn.Module, path: Path) -> None:
    """Copy a checkpoint's full weights into the run's model, in place (the optimiser holds these parameters)."""
    weights = shard_like(module, load_tensors(path / WEIGHTS_FILE, next(module.parameters()).device))
    try:
        result = module.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        last = str(err).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{path / WEIGHTS_FILE} does not match the run's model: {last}") from None
    missing = set(result.missing_keys) - ({"lm_head.weight"} if module.config.tie_embeddings else set())
    if missing or result.unexpected_keys:
        first = sorted(missing or result.unexpected_keys)[0]
        raise CheckpointError(f"{path} does not match the run's model (tensor {first!r})")


def resume_point(run_dir: Path, resume: bool, resume_from: str | Path | None = None) -> Path | None:
    """The checkpoint a run continues from: None for a new run; resume_from, verified; or the newest that verifies.

    Passing over a damaged, incomplete or unverifiable (manifest-less) checkpoint is said in one warning line, and
    so is a `latest` file that names no checkpoint here; with resume_from, damage is an error naming it, and a
    checkpoint without a manifest is taken with a warning.
    """
    if resume_from is not None:
        path = Path(resume_from)
        if not STEP_DIR.fullmatch(path.name) or path.resolve().parent != (run_dir / CHECKPOINTS).resolve():
            raise ConfigError(
                f"--resume-from {path} is not a checkpoint of the run {run_dir} "
                f"(a directory {run_dir / CHECKPOINTS}/step-N)"
            )
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
        raise CheckpointError(
            f"{run_dir} has no checkpoint to resume from (a run stopped before its first "
            "checkpoint starts again without --resume)"
        )
    newer = " (the newer ones are removed)" if checkpoint_dirs(run_dir)[0] != checkpoint else ""
    if not has_manifest(checkpoint):  # (skipped ends with why it cannot be verified)
        logger.warning(
            "%s; resuming from %s all the same, as no checkpoint of the run verifies%s",
            "; ".join(skipped),
            checkpoint,
            newer,
        )
    elif skipped:
        logger.warning(
            "%s; resuming from %s, the newest checkpoint that verifies%s", "; ".join(skipped), checkpoint, newer
        )
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
        logger.warning(
            "%s does not name a checkpoint inside %s (ignored); resuming from %s", latest, CHECKPOINTS, checkpoint
        )
    elif not named.is_dir():
        logger.warning("%s names %s, which does not exist (ignored); resuming from %s", latest, named, checkpoint)
