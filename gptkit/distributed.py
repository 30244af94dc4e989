"""Data-parallel training on PyTorch's own engine: the torchrun environment, the process group, DDP and FSDP2.

A run is distributed when torchrun (or anything else) sets WORLD_SIZE > 1 with RANK and LOCAL_RANK; no flag is
needed. Every rank runs the same loop; rank 0 alone writes files.

Batch assignment: the ranks share ONE global batch stream (gptkit.data.TrainBatches keyed by the seed alone).
Rank r's k-th micro-batch is the stream's batch k * W + r. With W ranks and grad_accum A, update s therefore
consumes global batches s*A*W ... s*A*W + A*W - 1, exactly the micro-batches a single process with grad_accum A*W
would use for update s, so the two runs compute the same gradient (up to float summation order). The loader
state saved in a checkpoint is the global position (k * W), which every rank maps back to its own k: a run
resumes exactly. Resumed on another world size, each process's grad_accum changes so that an update takes the same
A * W micro-batches (resumed_grad_accum), or the resume is refused when they cannot be shared evenly.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gptkit.errors import ConfigError, GptkitError

logger = logging.getLogger(__name__)

# A collective that waits longer than this is taken as a dead rank (the default of 10 min hides hangs in tests).
TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class World:
    """This process's place in the run: rank among world_size processes, local_rank on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Whether this process writes files and logs (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether more than one process trains."""
        return self.world_size > 1


def world_from_env(env: dict[str, str] | None = None) -> World:
    """The World torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK (a single process when they are absent)."""
    env = dict(os.environ) if env is None else env
    if "WORLD_SIZE" not in env:
        return World()
    try:
        world = World(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))
    except ValueError:
        raise ConfigError(
            f"RANK, WORLD_SIZE and LOCAL_RANK must be integers, got {env.get('RANK')!r}, {env.get('WORLD_SIZE')!r}, "
            f"{env.get('LOCAL_RANK')!r}; launch with torchrun"
        ) from None
    if world.world_size < 1 or not 0 <= world.rank < world.world_size:
        raise ConfigError(f"RANK {world.rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE {world.world_size})")
    return world


def device_for(world: World, device: torch.device) -> torch.device:
    """Each rank's own accelerator: cuda:LOCAL_RANK when training on CUDA across processes."""
    if world.distributed and device.type == "cuda" and device.index is None:
        if world.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {world.local_rank} has no GPU ({torch.cuda.device_count()} visible); lower "
                "--nproc_per_node to the number of GPUs"
            )
        device = torch.device("cuda", world.local_rank)
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index: "cuda" is the current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def init_process_group(world: World, device: torch.device) -> bool:
    """Join the run's process group (NCCL on CUDA, gloo otherwise); False if there is none to join or one exists."""
    if not world.distributed or dist.is_initialized():
        return False
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ConfigError("WORLD_SIZE > 1 but MASTER_ADDR / MASTER_PORT are not set; launch with torchrun")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=world.rank,
        world_size=world.world_size,
        timeout=TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    return True


def leave_if_distributed(code: int) -> None:
    """Under torchrun, end this rank's process now with code, its output flushed (a no-op in one process).

    By then the run is written and the process group left; what remains is the interpreter's shutdown, during
    which gloo's threads can abort the process ("terminate called without an active exception", signal 6) and
    torchrun would report a finished run as failed."""
    if not world_from_env().distributed:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(world: World) -> None:
    """Wait for every rank (a no-op in a single process)."""
    if world.distributed:
        dist.barrier()


def all_mean(world: World, value: Tensor) -> Tensor:
    """The mean of a tensor over the ranks (the tensor itself in a single process)."""
    if not world.distributed:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / world.world_size


def any_rank(world: World, flag: bool, device: torch.device) -> bool:
    """Whether flag is true on any rank (every rank must call this at the same point)."""
    if not world.distributed:
        return flag
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_objects(world: World, obj: Any) -> list[Any]:
    """Every rank's obj, in rank order (a collective)."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


class RankBatches:
    """Rank r's share of one global batch stream: its k-th batch is the stream's batch k * world_size + r."""

    def __init__(self, stream: Any, world: World) -> None:
        self.stream = stream  # a TrainBatches keyed by the seed alone (rank 0 of 1): the global stream
        self.world = world
        self.k = 0

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """This rank's next (x, y)."""
        self.stream.step = self.k * self.world.world_size + self.world.rank
        self.k += 1
        return self.stream.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The global stream position (the same on every rank); with one rank, TrainBatches' own state."""
        return {"seed": self.stream.seed, "step": self.k * self.world.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a global position saved by a run of any world size that it divides."""
        self.stream.load_state_dict(state)
        position = self.stream.step
        if position % self.world.world_size:
            raise GptkitError(
                f"the checkpoint's batch position {position} is not a multiple of the {self.world.world_size} "
                "processes; resume with the world size the run used"
            )
        self.k = position // self.world.world_size


def resumed_grad_accum(saved_world: int, saved_accum: int | None, world_size: int, grad_accum: int) -> int:
    """The grad_accum a run resumed on world_size processes takes: the one that keeps the micro-batches of each
    update (saved_world x saved_accum) when the process count changed, or a ConfigError when they cannot be shared
    evenly. A grad_accum the resume itself changed (saved_accum differs) is kept, with a warning."""
    if saved_accum is None:  # a checkpoint from before trainer.json said: the run's config.yaml has it
        saved_accum = grad_accum
    if saved_world == world_size:
        return grad_accum
    per_update = saved_world * saved_accum
    if grad_accum != saved_accum:
        logger.warning(
            "resuming a %d-process run on %d processes with train.grad_accum %d: each update now takes "
            "%d micro-batches instead of %d",
            saved_world,
            world_size,
            grad_accum,
            grad_accum * world_size,
            per_update,
        )
        return grad_accum
    if per_update % world_size:
        raise ConfigError(
            f"the checkpoint's run took {per_update} micro-batches an update ({saved_world} processes x "
            f"train.grad_accum {saved_accum}), which {world_size} processes cannot share evenly; resume "
            f"with torchrun --nproc_per_node {saved_world}"
        )
    logger.warning(
        "resuming a %d-process run on %d process(es): train.grad_accum %d -> %d keeps its %d micro-batches an update",
        saved_world,
        world_size,
        saved_accum,
        per_update // world_size,
        per_update,
    )
    return per_update // world_size


def wrap(model: nn.Module, world: World, parallel: str, device: torch.device) -> nn.Module:
    """The model as the training step calls it: DDP or FSDP2 (fully_shard per block) across ranks, else itself."""
    if not world.distributed:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def sync_context(wrapped: nn.Module, sync: bool) -> Any:
    """Gradient accumulation: a context that skips the gradient all-reduce unless sync (final micro-step)."""
    if isinstance(wrapped, DistributedDataParallel) and not sync:
        return wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):  # an FSDP2 module
        wrapped.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) tensor gathered whole on every rank (a collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: this rank's shard of an FSDP2 DTensor (a replicated one's whole value), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model with whole weights: itself, or for an FSDP2-sharded GPT an unsharded copy (a collective)."""
    from torch.distributed.tensor import DTensor

    from gptkit.model import GPT  # here: the launcher's helpers (world_from_env, leave_if_distributed) load no model

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


def shard_like(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole saved weights cut to this rank's shards where the module is FSDP2-sharded (else unchanged)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = module.state_dict()
    return {
        name: distribute_tensor(w, own[name].device_mesh, own[name].placements)
        if isinstance(own.get(name), DTensor)
        else w
        for name, w in weights.items()
    }
