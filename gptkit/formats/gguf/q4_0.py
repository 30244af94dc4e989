"""GGUF's Q4_0 blocks and gptkit's int4 layers (gptkit.quantization.Int4Linear holds the same blocks)."""

from __future__ import annotations

import numpy as np
import torch


def q4_0_blocks(packed: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Int4Linear's (packed (N, K / 2), fp16 scales (N, K / 32)) as GGUF's Q4_0 rows: per block of 32, the fp16
    scale's two bytes, then the 16 bytes of nibbles (N, K / 32 * 18)."""
    n, blocks = scales.shape
    d = scales.numpy().astype("<f2").view(np.uint8).reshape(n, blocks, 2)
    qs = packed.numpy().reshape(n, blocks, 16)
    return np.concatenate([d, qs], axis=-1).reshape(n, blocks * 18)


def q4_0_parts(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q4_0 rows (N, K / 32 * 18) back as Int4Linear's packed nibbles and fp16 scales."""
    n = blocks.shape[0]
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, -1, 18)
    scales = np.ascontiguousarray(raw[..., :2]).view("<f2").reshape(n, -1)
    packed = np.ascontiguousarray(raw[..., 2:]).reshape(n, -1)
    return torch.from_numpy(packed.copy()), torch.from_numpy(scales.astype(np.float16))
