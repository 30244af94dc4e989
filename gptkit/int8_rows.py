"""gptkit's int8 weights: symmetric, one fp scale per output row (Int8Linear and each expert of Int8Experts)."""

from __future__ import annotations

import torch
from torch import Tensor

QUANT_MAX = 127  # symmetric int8: -127..127, so that negating a weight never overflows


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: (int8 weight (out, in), float scales (out,)) with w ~ q * scale."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / QUANT_MAX
    q = torch.round(w / scales[:, None]).clamp(-QUANT_MAX, QUANT_MAX).to(torch.int8)
    return q, scales


def dequantized_weight(weight: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """A stored weight (int8 with per-channel scales, or bf16 alone) as a float weight of dtype."""
    return weight.to(dtype) if scales is None else weight.to(dtype) * scales.to(dtype)[:, None]
