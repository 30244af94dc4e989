"""The small modules every block is built from: the CPU-aware Linear and the configured norms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit.config import GATED, ModelConfig
from gptkit.native import ops


class Linear(nn.Linear):
    """nn.Linear whose inference on a CPU takes gptkit's faster products where measured faster (native.ops.linear)."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g, computed in fp32 as Llama does; g = gain_offset + weight (Gemma: 1 + w)."""

    def __init__(self, dim: int, eps: float, gain_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.gain_offset = gain_offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - gain_offset))  # the gain starts at 1

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gain_offset:
            # Gemma multiplies by its gain in fp32 and casts after; Llama casts first.
            return (normed * (self.gain_offset + self.weight.float())).type_as(x)
        return self.weight * normed.type_as(x)


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """The configured normalisation over dim values (default: the model width)."""
    dim = config.n_embd if dim is None else dim
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps, config.norm_gain_offset)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)


def activate(h: Tensor, activation: str) -> Tensor:
    """The feed-forward activation of ModelConfig.activation on h (..., fc width); a gated one halves the width."""
    if activation in GATED:
        gate, up = h.chunk(2, dim=-1)
        return (F.silu(gate) if activation == "swiglu" else F.gelu(gate, approximate="tanh")) * up
    if activation == "relu":
        return F.relu(h)
    if activation == "relu2":
        return F.relu(h).square()
    if activation == "gelu":
        return F.gelu(h)
    return F.gelu(h, approximate="tanh")
