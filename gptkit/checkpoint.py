"""Training checkpoints: a model directory plus optimiser, RNG and loop state, written so a kill never corrupts one.

Layout of RUN_DIR:
    latest                          text: the newest complete checkpoint, e.g. "checkpoints/step-000500"
    checkpoints/step-000500/        a gptkit model directory (config.json, model.safetensors, tokenizer) plus
        optimizer.safetensors       AdamW moments and step counts, keyed "<param name>.<state key>"
        rng.safetensors             torch generator states (uint8 tensors); rank r > 0's keys prefixed "rank<r>."
        trainer.json                step, optimiser structure and scalars, data-loader state, counters
A checkpoint is assembled in a hidden temporary directory, every file fsynced, then renamed into place; only then
is `latest` replaced (atomically). Whatever instant a kill lands, `latest` names a complete checkpoint.

Under torchrun every rank calls save_checkpoint (sharded FSDP tensors are gathered whole, a collective) and rank
0 alone writes, so a checkpoint of a sharded run is the same single-file model directory as any other.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptkit.atomic import atomic_write_text, fsync_dir
from gptkit.errors import GptkitError
from gptkit.modeldir import load_tensors, save_model_dir, save_tensors

LATEST = "latest"
CHECKPOINTS = "checkpoints"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
TRAINER_FILE = "trainer.json"
TMP_PREFIX = ".tmp-"


class CheckpointError(GptkitError):
    """A run directory without a usable checkpoint."""


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after `step` updates."""
    return f"step-{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when the run has none yet."""
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return None
    path = run_dir / pointer.read_text().strip()
    if not (path / TRAINER_FILE).is_file():
        raise CheckpointError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


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


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) tensor gathered whole on every rank (a collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model with whole weights: itself, or for an FSDP2-sharded GPT an unsharded copy (a collective)."""
    from torch.distributed.tensor import DTensor

    from gptkit.model import GPT

    module = getattr(model, "_orig_mod", model)
    state = module.state_dict()
    if not any(isinstance(t, DTensor) for t in state.values()):
        return module
    full = {name: full_tensor(t) for name, t in state.items()}
    with torch.device("meta"):
        copy = GPT(module.config)
    copy.load_state_dict(full, assign=True)
    if module.config.tie_embeddings:
        copy.lm_head.weight = copy.tok_emb.weight
    return copy


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
        if isinstance(param, DTensor) and tensor.shape == param.shape:  # FSDP: keep this rank's shard
            tensor = distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements)
        state.setdefault(index[name], {})[field] = tensor
    for name, values in structure["scalars"].items():
        state.setdefault(index[name], {}).update(values)
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in structure["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _fsync_tree(path: Path) -> None:
    """fsync every file under path, then the directories, so that a rename publishes durable contents."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


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
    tokenizer: Any | None,
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
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if save_model is not None:
            save_model(module, tmp)
        else:
            save_model_dir(module, tmp, tokenizer=tokenizer)
        save_tensors(opt_tensors, tmp / OPTIMIZER_FILE)
        save_tensors(rng if rng is not None else rng_state(), tmp / RNG_FILE)
        record = {"step": step, "optimizer": structure, **trainer}
        atomic_write_text(tmp / TRAINER_FILE, json.dumps(record, indent=1) + "\n")
        _fsync_tree(tmp)
        if final.exists():  # a run killed after this rename but before `latest` moved leaves one behind
            stale = folder / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(run_dir / LATEST, f"{CHECKPOINTS}/{final.name}\n")
    prune(run_dir, keep)
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, never the one `latest` names."""
    current = latest_checkpoint(run_dir)
    numbered = [p for p in (run_dir / CHECKPOINTS).glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    done = sorted(numbered, key=lambda p: int(p.name[5:]))  # by number: step-1000000 comes after step-999000
    for path in done[: max(len(done) - keep, 0)]:
        if current is None or path.resolve() != current.resolve():
            shutil.rmtree(path, ignore_errors=True)


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
    try:
        record = json.loads((path / TRAINER_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path / TRAINER_FILE}: {err}") from None
    module = getattr(model, "_orig_mod", model)
    device = next(module.parameters()).device
    (load_model or _load_weights)(module, path)
    load_optimizer_state(optimizer, load_tensors(path / OPTIMIZER_FILE, device), record["optimizer"], names)
    rng = load_tensors(path / RNG_FILE)
    if rank:
        prefix = f"rank{rank}."
        rng = {k[len(prefix) :]: v for k, v in rng.items() if k.startswith(prefix)}
    if rng:
        set_rng_state(rng)
    return record


def _load_weights(module: torch.nn.Module, path: Path) -> None:
    """Copy a checkpoint's full weights into the run's model, in place (the optimiser holds these parameters)."""
    from gptkit.modeldir import WEIGHTS_FILE

    weights = _shard_like(module, load_tensors(path / WEIGHTS_FILE, next(module.parameters()).device))
    result = module.load_state_dict(weights, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if module.config.tie_embeddings else set())
    if missing or result.unexpected_keys:
        first = sorted(missing or result.unexpected_keys)[0]
        raise CheckpointError(f"{path} does not match the run's model (tensor {first!r})")


def _shard_like(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole saved weights cut to this rank's shards where the module is FSDP2-sharded (else unchanged)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = module.state_dict()
    return {
        name: distribute_tensor(w, own[name].device_mesh, own[name].placements)
        if isinstance(own.get(name), DTensor) else w
        for name, w in weights.items()
    }  # fmt: skip
