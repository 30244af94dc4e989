"""The optimiser a run trains with (AdamW, or Muon on the blocks' matrices beside AdamW) and its lr schedule.

The model's classes and the CPU's flags are imported by the functions that look for them, so that importing the
optimiser and its schedule loads neither the model nor gptkit's native kernels beneath it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gptkit.adapters import adapters
from gptkit.train_config import OptimConfig

logger = logging.getLogger(__name__)

MUON, ADAMW = "muon", "adamw"  # the value of each parameter group's "optimizer" key
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's
# A batch of same-shape updates orthogonalised together holds at most this many entries: its copies (the stack and
# its products) then stay within a few hundred MB, where a large model's whole layer stack would not.
MAX_BATCH_ELEMENTS = 1 << 24
# iterate_on_gram rebuilds A from X after this many rounds: carried along, A's float32 rounding grows about
# a^2 = 11.9 times a round where X has no weight, and a rank-30 512 x 128 update went to 3e10 in 10 rounds, NaN in
# 12. Rebuilt every 5, it stays as close to float64's iteration as the rounds as written (6e-4 against 1e-3 at 10
# rounds, where float32 itself loses it), and the default 5 rounds need no rebuild.
GRAM_ROUNDS = 5


def param_groups(model: nn.Module, weight_decay: float, exclude: set[nn.Parameter] = frozenset()) -> list[dict]:
    """Two AdamW groups: matrices (linear weights, embeddings, expert stacks) decay; vectors (biases, norm gains, and
    experts' stacked biases (E, out)) do not."""
    from gptkit.moe import ExpertWeights  # here: importing the optimiser loads no model (tests/test_imports.py)

    params = [p for p in model.parameters() if p.requires_grad and p not in exclude]  # a tied weight comes once
    vectors = {m.bias for m in model.modules() if isinstance(m, ExpertWeights) and m.bias is not None}
    decay = [p for p in params if p.dim() >= 2 and p not in vectors]
    no_decay = [p for p in params if p.dim() < 2 or p in vectors]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def block_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights that train inside every GPT's blocks, and its experts' (E, out, in) stacks: what Muon takes.

    Embeddings, the LM head, a task head and every vector stay with AdamW, as in modded-nanogpt and nanochat:
    Muon's orthogonalised update suits a hidden layer's matrix, not a lookup table or an output layer. LoRA's
    adapter matrices stay with AdamW too: fine-tuning the CPU recipe's model with rank-8 adapters for 300 steps,
    AdamW reached validation loss 1.9876 (lr 3e-3; 1.9945 at 1e-3) and Muon 1.9889 (muon_lr 0.02; 2.0153 at 0.05),
    for more time a step.

    A mixture of experts' stack (E, out, in) is E matrices, each orthogonalised alone as E separate layers would be;
    its router (E, d) is a block matrix like any other, and its stacked biases (E, out) are vectors, AdamW's.
    """
    from gptkit.model import GPT  # here, as in param_groups: importing the optimiser loads no model
    from gptkit.moe import ExpertWeights

    adapter_weights = {p for lora in adapters(model).values() for p in (lora.lora_A, lora.lora_B)}
    expert_biases = {m.bias for m in model.modules() if isinstance(m, ExpertWeights) and m.bias is not None}
    matrices: dict[nn.Parameter, None] = {}  # ordered, each parameter once
    for module in model.modules():
        if isinstance(module, GPT):
            matrices.update(
                (p, None)
                for p in module.blocks.parameters()
                if p.requires_grad and p.dim() in (2, 3) and p not in adapter_weights | expert_biases
            )
    return list(matrices)


def adamw(groups: list[dict], config: OptimConfig) -> tuple[torch.optim.AdamW, bool]:
    """(AdamW, fused): the fused kernel where this device has one (it can skip a step without a host sync)."""
    betas = (config.beta1, config.beta2)
    try:
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, fused=True), True
    except RuntimeError:  # no fused kernel for this device or dtype
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, foreach=True), False


def orthogonalise(
    update: Tensor,
    steps: int,
    dtype: torch.dtype,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
) -> Tensor:
    """Newton-Schulz's quintic iteration X <- aX + (bA + cA^2) X, A = X X^T, from X = update / ||update||_F, in dtype:
    about U V^T of update = U S V^T (Keller Jordan's coefficients; torch.optim.Muon's products in bfloat16, and in
    float32 the same rounds, on the Gram matrix where a matrix is over 1.5x as wide as tall: iterate_on_gram).

    update is one matrix, or a stack of same-shape matrices (batch, rows, cols), each orthogonalised alone.
    """
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT  # iterate on the wide side: its Gram matrix is the smaller one
    if x.dim() == 2:
        x, product = x / x.norm().clamp(min=eps), torch.addmm
    else:
        x, product = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps), torch.baddbmm
    x = (iterate_on_gram if on_gram(x, steps, dtype) else iterate)(x, steps, coefficients, product)
    return x.mT if tall else x


def on_gram(x: Tensor, steps: int, dtype: torch.dtype) -> bool:
    """Whether orthogonalise iterates a wide x (or stack) on its Gram matrix: float32, more than one round, over 1.5x
    as wide as tall (where that takes fewer FLOPs), and not a DTensor (FSDP2's row shard: adding a to a partial sum's
    diagonal counts it once per rank; two processes' float32 run went non-finite by step 3)."""
    return type(x) is Tensor and dtype == torch.float32 and steps > 1 and x.size(-1) > 1.5 * x.size(-2)


def iterate(x: Tensor, steps: int, coefficients: tuple[float, float, float], product: Callable[..., Tensor]) -> Tensor:
    """orthogonalise's rounds on a normalised wide x, as written: X <- aX + (bA + cA^2) X, A = X X^T."""
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.mT
        x = product(x, product(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def iterate_on_gram(
    x: Tensor, steps: int, coefficients: tuple[float, float, float], product: Callable[..., Tensor]
) -> Tensor:
    """orthogonalise's rounds for a wide x (r rows, n > 1.5 r columns), run on r x r matrices: each round is
    X <- h(A) X with h(A) = aI + bA + cA^2, so X_k = Q_k X_0 with Q_{k+1} = h(A_k) Q_k and A_{k+1} = h(A_k) A_k h(A_k),
    and X_0 is multiplied once at the end (of each GRAM_ROUNDS rounds).

    4 r^2 n + (8 k - 6) r^3 FLOPs for k rounds against k (4 r^2 n + 2 r^3), fewer where n > 1.5 r. In float32 on 2
    threads of an AMD EPYC (`python benchmarks/bench_muon.py`) the CPU record's four 512 x 128 matrices took 2.8 ms
    instead of 5.0, all eight 0.66x the time, as close to float64's iteration (5e-7; 3e-5 for an update whose
    singular values fall to 1e-5, against 1.3e-6). float32 only: in bfloat16 it drifts further (5.0e-3 against
    3.9e-3 at 384 x 128), and the bf16 products stay PyTorch's own.
    """
    a, b, c = coefficients
    for start in range(0, steps, GRAM_ROUNDS):
        rounds = min(GRAM_ROUNDS, steps - start)
        gram = x @ x.mT  # A, from X
        q = None
        for step in range(rounds):
            h = product(gram, gram, gram, beta=b, alpha=c)  # bA + cA^2
            h.diagonal(dim1=-2, dim2=-1).add_(a)
            q = h if q is None else h @ q
            if step < rounds - 1:
                gram = h @ gram @ h
        x = q @ x
    return x


def same_shape_batches(matrices: list[Tensor]) -> list[list[int]]:
    """Indices of matrices in the batches they orthogonalise in, each batch one shape, dtype and device.

    A tall matrix counts by its transpose; a batch holds at most MAX_BATCH_ELEMENTS entries (or one matrix); a
    DTensor (FSDP2's row shard) goes alone, since its products gather what they need.
    """
    batches: list[list[int]] = []
    shapes: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):
        if type(matrix) is not Tensor or matrix.dim() == 3:  # an expert stack is a batch already
            batches.append([index])
        else:
            shapes.setdefault((min(matrix.shape), max(matrix.shape), matrix.dtype, matrix.device), []).append(index)
    for same in shapes.values():
        per_batch = max(1, MAX_BATCH_ELEMENTS // max(1, matrices[same[0]].numel()))
        batches += [same[start : start + per_batch] for start in range(0, len(same), per_batch)]
    return batches


def orthogonalise_batch(
    updates: list[Tensor], steps: int, dtype: torch.dtype, coefficients: tuple[float, float, float], eps: float
) -> list[Tensor]:
    """orthogonalise of each of one batch's updates (same_shape_batches'), as one stack where there are several.

    A stack runs each round's products as one call: on 2 CPU threads the CPU speed record's Muon step took 6.3 ms
    instead of 10.2 (torch.profiler over 200 steps), the same bf16 values bit for bit.
    """
    if len(updates) == 1:
        return [orthogonalise(updates[0], steps, dtype, coefficients, eps)]
    tall = [update.size(0) > update.size(1) for update in updates]
    wide = torch.stack([(u.mT if t else u).to(dtype) for u, t in zip(updates, tall)])  # (batch, short, long)
    return [m.mT if t else m for m, t in zip(orthogonalise(wide, steps, dtype, coefficients, eps), tall)]


def newton_schulz_dtype(device: torch.device) -> str:
    """The dtype Muon's Newton-Schulz products run in on device: bfloat16 on a GPU, and on a CPU with bf16 hardware
    (AVX512-BF16 or AMX); float32 on any other CPU.

    PyTorch's own Muon always iterates in bfloat16, which an AVX2-only CPU multiplies at about 1 GFLOP/s (see
    gptkit.devices.PEAK_MATMUL_SECONDS). With AVX512-BF16 (an AMD EPYC, 2 threads) a 512 x 128 orthogonalisation
    took 1.32 ms in bf16 and 1.88 in fp32, 384 x 128 1.16 and 1.79. A rule of the hardware rather than a timing, so
    that every process of a run (every rank of a DDP or FSDP job) chooses alike.
    """
    from gptkit.native.cpu import cpu_flags  # here: importing the optimiser loads nothing of gptkit.native

    if device.type != "cpu":
        return "bfloat16"
    return "bfloat16" if cpu_flags() & {"avx512_bf16", "amx_bf16"} else "float32"


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan's; torch.optim.Muon's update, step for step) with each group's Newton-Schulz products in
    its "ns_dtype" (newton_schulz_dtype's, kept in a checkpoint so a resume iterates alike); PyTorch's are always
    bfloat16, and it ships Muon from 2.9 only."""

    def __init__(self, params: list[nn.Parameter], config: OptimConfig) -> None:
        if any(p.dim() not in (2, 3) for p in params):
            raise ValueError("Muon takes 2-D weight matrices and experts' 3-D stacks of them only")
        defaults = dict(
            lr=config.muon_lr,
            weight_decay=config.muon_weight_decay,
            momentum=config.muon_momentum,
            nesterov=True,
            ns_coefficients=NS_COEFFICIENTS,
            eps=1e-7,
            ns_steps=config.muon_ns_steps,
            adjust_lr_fn=config.muon_lr_scale,
            ns_dtype=newton_schulz_dtype(params[0].device),
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One update of every matrix with a gradient: momentum, orthogonalisation, decay, the shape-scaled step."""
        if closure is not None:
            raise ValueError("Muon takes no closure")
        for group in self.param_groups:
            dtype, momentum = getattr(torch, group["ns_dtype"]), group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            for batch in same_shape_batches([p.grad for p in params]):  # one batch's temporaries alive at a time
                updates = [self.momentum_update(params[i], momentum, group["nesterov"]) for i in batch]
                updates = orthogonalise_batch(updates, group["ns_steps"], dtype, group["ns_coefficients"], group["eps"])
                for p, update in zip((params[i] for i in batch), updates):
                    rows, cols = p.shape[-2:]  # each expert's matrix (out, in) where p is a stack
                    scale = (
                        0.2 * math.sqrt(max(rows, cols))
                        if group["adjust_lr_fn"] == "match_rms_adamw"
                        else math.sqrt(max(1, rows / cols))
                    )
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update, alpha=-group["lr"] * scale)

    def momentum_update(self, p: nn.Parameter, momentum: float, nesterov: bool) -> Tensor:
        """p's momentum buffer moved toward its gradient, and the update it gives (Nesterov's look-ahead or itself)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buffer = state["momentum_buffer"].lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buffer, momentum) if nesterov else buffer


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the given matrices and AdamW on every other parameter, stepped as one optimiser.

    Its groups are the two inner optimisers' own group dicts, and its state is theirs (their parameters are
    disjoint): the schedule, the checkpoint and the float16 scaler see one optimiser, each inner step reads what
    they set. Each group's "optimizer" key says which inner optimiser steps it.
    """

    def __init__(self, matrices: list[nn.Parameter], others: list[dict], config: OptimConfig) -> None:
        # Either side may be empty (LoRA's adapters are AdamW's alone): PyTorch refuses an optimiser of no parameters.
        # AdamW keeps its empty groups, so that its groups are an AdamW run's and either resumes the other's.
        self.inner: list[torch.optim.Optimizer] = []
        if matrices:
            self.inner.append(self._mark(Muon(matrices, config), MUON))
        if any(group["params"] for group in others):
            self.inner.append(self._mark(adamw(others, config)[0], ADAMW))
        super().__init__([group for inner in self.inner for group in inner.param_groups], {})  # the same dicts
        self._share()

    @staticmethod
    def _mark(inner: torch.optim.Optimizer, kind: str) -> torch.optim.Optimizer:
        for group in inner.param_groups:
            group["optimizer"] = kind
        return inner

    def _share(self) -> None:
        """Point the inner optimisers at this one's groups and state (again after load_state_dict replaced them)."""
        for inner in self.inner:
            kind = inner.param_groups[0]["optimizer"]
            inner.param_groups = [g for g in self.param_groups if g.get("optimizer", ADAMW) == kind]  # (AdamW's own)
            inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Step Muon, then AdamW, each over its own groups."""
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        for inner in self.inner:
            inner.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim.Optimizer's, then the inner optimisers pointed at the loaded groups and state."""
        super().load_state_dict(state_dict)
        self._share()


def make_optimizer(model: nn.Module, config: OptimConfig) -> tuple[torch.optim.Optimizer, bool]:
    """(optimizer, fused): AdamW over everything, or MuonAdamW; fused when it can skip a non-finite step itself."""
    if config.name == ADAMW:
        return adamw(param_groups(model, config.weight_decay), config)
    matrices = block_matrices(model)
    if not matrices:
        logger.warning(
            "optim.name muon: nothing here trains under Muon (LoRA's adapters and heads are AdamW's), so "
            "this run is AdamW's alone"
        )
    others = param_groups(model, config.weight_decay, exclude=set(matrices))
    return MuonAdamW(matrices, others, config), False  # Muon has no found_inf input: a skip costs a host sync


def lr_at(step: int, config: OptimConfig, max_steps: int) -> float:
    """AdamW's learning rate at update number `step` (0-based): linear warm-up, then cosine, constant or wsd.

    Cosine is the same curve as nanoGPT's get_lr (lr * (step+1)/(warmup+1), then a half cosine from lr to min_lr
    over decay_steps, min_lr after), so its recipes reproduce. wsd holds lr until the last cooldown_fraction of
    decay_steps, then falls linearly to min_lr (the warm-up / stable / decay schedule of modded-nanogpt and nanochat).
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / (config.warmup_steps + 1)
    if config.schedule == "constant":
        return config.lr
    decay_steps = config.decay_steps if config.decay_steps is not None else max_steps
    if step >= decay_steps:
        return config.min_lr
    if config.schedule == "wsd":
        cooldown_start = max(config.warmup_steps, decay_steps - round(config.cooldown_fraction * decay_steps))
        if step < cooldown_start:
            return config.lr
        progress = (step - cooldown_start) / max(decay_steps - cooldown_start, 1)
        return config.lr + progress * (config.min_lr - config.lr)
    progress = (step - config.warmup_steps) / max(decay_steps - config.warmup_steps, 1)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def set_learning_rates(optimizer: torch.optim.Optimizer, step: int, config: OptimConfig, max_steps: int) -> float:
    """Give every group its learning rate for update `step` (Muon's groups muon_lr on AdamW's curve); return AdamW's."""
    lr = lr_at(step, config, max_steps)
    for group in optimizer.param_groups:
        group["lr"] = config.muon_lr * lr / config.lr if group.get("optimizer") == MUON else lr
    return lr
