"""AdamW over decayed and undecayed parameter groups, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from gptkit.train_config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (linear weights, embeddings) decay; vectors (biases, norm gains) do not."""
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() yields a tied weight once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, config: OptimConfig) -> tuple[torch.optim.AdamW, bool]:
    """(AdamW, fused): the fused kernel where this device has one (it can skip a step without a host sync)."""
    groups = param_groups(model, config.weight_decay)
    betas = (config.beta1, config.beta2)
    try:
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, fused=True), True
    except RuntimeError:  # no fused kernel for this device or dtype
        return torch.optim.AdamW(groups, lr=config.lr, betas=betas, foreach=True), False


def lr_at(step: int, config: OptimConfig, max_steps: int) -> float:
    """The learning rate of update number `step` (0-based): linear warm-up, then cosine to min_lr or constant.

    The same curve as nanoGPT's get_lr (lr * (step+1)/(warmup+1), then a half cosine from lr to min_lr over
    decay_steps, min_lr after), so its recipes reproduce.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / (config.warmup_steps + 1)
    if config.schedule == "constant":
        return config.lr
    decay_steps = config.decay_steps if config.decay_steps is not None else max_steps
    if step >= decay_steps:
        return config.min_lr
    progress = (step - config.warmup_steps) / max(decay_steps - config.warmup_steps, 1)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)
