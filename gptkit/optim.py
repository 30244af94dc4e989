"""The optimiser a run trains with (AdamW, or Muon on the blocks' matrices beside AdamW) and its lr schedule."""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch
from torch import Tensor, nn

from gptkit.adapters import adapters
from gptkit.model import GPT
from gptkit.train_config import OptimConfig

MUON, ADAMW = "muon", "adamw"  # the value of each parameter group's "optimizer" key


def param_groups(model: nn.Module, weight_decay: float, exclude: set[nn.Parameter] = frozenset()) -> list[dict]:
    """Two AdamW groups: matrices (linear weights, embeddings) decay; vectors (biases, norm gains) do not."""
    params = [p for p in model.parameters() if p.requires_grad and p not in exclude]  # a tied weight comes once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def block_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights that train inside every GPT's blocks: what Muon takes.

    Embeddings, the LM head, a task head and every vector stay with AdamW, as in modded-nanogpt and nanochat:
    Muon's orthogonalised update suits a hidden layer's matrix, not a lookup table or an output layer. LoRA's
    adapter matrices stay with AdamW too: fine-tuning the CPU recipe's model with rank-8 adapters for 300 steps,
    AdamW reached validation loss 1.9876 (lr 3e-3; 1.9945 at 1e-3) and Muon 1.9889 (muon_lr 0.02; 2.0153 at 0.05),
    for more time a step.
    """
    adapter_weights = {p for lora in adapters(model).values() for p in (lora.lora_A, lora.lora_B)}
    matrices: dict[nn.Parameter, None] = {}  # ordered, each parameter once
    for module in model.modules():
        if isinstance(module, GPT):
            matrices.update((p, None) for p in module.blocks.parameters()
                            if p.requires_grad and p.dim() == 2 and p not in adapter_weights)  # fmt: skip
    return list(matrices)


def adamw(groups: list[dict], config: OptimConfig) -> tuple[torch.optim.AdamW, bool]:
    """(AdamW, fused): the fused kernel where this device has one (it can skip a step without a host sync)."""
    betas = (config.beta1, config.beta2)
    try:
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, fused=True), True
    except RuntimeError:  # no fused kernel for this device or dtype
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, foreach=True), False


def orthogonalise(update: Tensor, steps: int, dtype: torch.dtype, coefficients: tuple[float, float, float] = (
        3.4445, -4.7750, 2.0315), eps: float = 1e-7) -> Tensor:  # fmt: skip
    """Newton-Schulz's quintic iteration X <- aX + (bA + cA^2) X, A = X X^T, from X = update / ||update||_F, in dtype:
    about U V^T of update = U S V^T (Keller Jordan's coefficients; torch.optim.Muon's products, in any dtype)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # iterate on the wide side: its Gram matrix is the smaller one
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@functools.cache
def newton_schulz_dtype(device_type: str, rows: int, cols: int) -> str:
    """bfloat16 on a GPU; on a CPU whichever of bfloat16 and float32 orthogonalises a rows x cols matrix faster here.

    PyTorch's Muon always iterates in bfloat16, which an AVX2-only CPU multiplies at about 1 GFLOP/s (see
    gptkit.devices.PEAK_MATMUL_SECONDS); on an AMD EPYC with AVX512-BF16 a 384 x 128 orthogonalisation took 1.16 ms
    in bf16 and 1.79 in fp32, a 128 x 128 one 0.63 and 0.56 (2 threads). Measured once a process at the largest
    matrix's shape (every Muon of a run chooses alike); the choice is kept in the checkpoint's groups for a resume.
    """
    if device_type != "cpu":
        return "bfloat16"
    sample = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    seconds = {}
    for dtype in (torch.bfloat16, torch.float32):
        orthogonalise(sample, 5, dtype)  # first-call set-up is not the rate
        seconds[str(dtype).removeprefix("torch.")] = min(_seconds(orthogonalise, sample, 5, dtype) for _ in range(3))
    return min(seconds, key=seconds.get)


def _seconds(function: Any, *args: Any) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


class Muon(torch.optim.Muon):
    """torch.optim.Muon, step for step, with each group's Newton-Schulz products in its "ns_dtype" (PyTorch's own are
    always bfloat16): newton_schulz_dtype's choice for the device, or bfloat16 as PyTorch's."""

    def __init__(self, params: list[nn.Parameter], config: OptimConfig) -> None:
        super().__init__(params, lr=config.muon_lr, weight_decay=config.muon_weight_decay,
                         momentum=config.muon_momentum, ns_steps=config.muon_ns_steps,
                         adjust_lr_fn=config.muon_lr_scale)  # fmt: skip
        largest = max(params, key=lambda p: p.numel())
        for group in self.param_groups:
            group["ns_dtype"] = newton_schulz_dtype(largest.device.type, *largest.shape)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102 - torch.optim.Optimizer's
        if closure is not None:
            raise ValueError("Muon takes no closure")
        for group in self.param_groups:
            dtype, momentum = getattr(torch, group["ns_dtype"]), group["momentum"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buffer = state["momentum_buffer"].lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalise(update, group["ns_steps"], dtype, group["ns_coefficients"], group["eps"])
                rows, cols = p.shape
                scale = 0.2 * math.sqrt(max(rows, cols)) if group["adjust_lr_fn"] == "match_rms_adamw" else \
                    math.sqrt(max(1, rows / cols))  # fmt: skip
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * scale)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the given matrices and AdamW on every other parameter, stepped as one optimiser.

    Its groups are the two inner optimisers' own group dicts, and its state is theirs (their parameters are
    disjoint): the schedule, the checkpoint and the float16 scaler see one optimiser, each inner step reads what
    they set. Each group's "optimizer" key says which inner optimiser steps it.
    """

    def __init__(self, matrices: list[nn.Parameter], others: list[dict], config: OptimConfig) -> None:
        # Either side may be empty (LoRA trains only block matrices): PyTorch refuses an optimiser of no parameters.
        self.inner: list[torch.optim.Optimizer] = []
        if matrices:
            self.inner.append(self._mark(Muon(matrices, config), MUON))
        if any(group["params"] for group in others):
            self.inner.append(self._mark(adamw([g for g in others if g["params"]], config)[0], ADAMW))
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
            inner.param_groups = [g for g in self.param_groups if g["optimizer"] == kind]
            inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102 - torch.optim.Optimizer's
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        for inner in self.inner:
            inner.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102 - torch.optim.Optimizer's
        super().load_state_dict(state_dict)
        self._share()


def make_optimizer(model: nn.Module, config: OptimConfig) -> tuple[torch.optim.Optimizer, bool]:
    """(optimizer, fused): AdamW over everything, or MuonAdamW; fused when it can skip a non-finite step itself."""
    if config.name == ADAMW:
        return adamw(param_groups(model, config.weight_decay), config)
    matrices = block_matrices(model)
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
