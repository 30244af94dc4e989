"""llama.cpp's Q4_0 block format (ggml-quants.c, quantize_row_q4_0_ref): per block of 32 weights the one of largest
magnitude m sets d = m / -8, each weight becomes q = min(15, floor(w / d + 8.5)) in 0..15, and w ~ d (q - 8). The
plain rows here are GGUF's layout; the grouped form (8 rows interleaved) is the one the q4 kernel reads
(csrc/kernels.h). gptkit.quantization's int4 layers and expert stacks hold these bits."""

from __future__ import annotations

import torch
from torch import Tensor

Q4_BLOCK = 32  # weights per Q4_0 block (llama.cpp's QK4_0)
Q4_GROUP = 8  # rows Int4Linear interleaves in memory (csrc/kernels.h's kQ4Group)


def quantize_q4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """llama.cpp's Q4_0 of a (N, K) weight, K a multiple of 32: (packed uint8 (N, K / 2), fp16 scales (N, K / 32)).

    Byte j of a block's 16 holds element j in its low nibble and element j + 16 in its high one, as in GGUF.
    """
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // Q4_BLOCK, Q4_BLOCK)  # (N, blocks, 32)
    largest = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))  # the first of largest magnitude, with its sign
    d = largest / -8.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = (w * inverse + 8.5).floor().clamp(0, 15).to(torch.uint8)  # (N, blocks, 32)
    packed = q[..., :16] | (q[..., 16:] << 4)  # (N, blocks, 16)
    return packed.reshape(n, k // 2), d[..., 0].to(torch.float16)


def dequantize_q4(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (N, K) weight d (q - 8) that quantize_q4's output stands for."""
    n = packed.size(0)
    blocks = packed.reshape(n, -1, Q4_BLOCK // 2)  # (N, blocks, 16)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).to(torch.float32) - 8.0  # (N, blocks, 32)
    return (q * scales.float()[..., None]).reshape(n, -1).to(dtype)


def group_q4(packed: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_q4's (N, K / 2) and (N, K / 32) in groups of 8 rows, the q4 kernel's layout (csrc/kernels.h): bytes
    (ceil(N / 8), K / 32, 128) and scales (ceil(N / 8), K / 32, 8), rows past N zero."""
    n, half = packed.shape
    pad, blocks = -n % Q4_GROUP, half // (Q4_BLOCK // 2)
    packed = torch.cat([packed, packed.new_zeros(pad, half)])
    scales = torch.cat([scales, scales.new_zeros(pad, blocks)])
    groups = (n + pad) // Q4_GROUP
    grouped = packed.view(groups, Q4_GROUP, blocks, 2, 8).permute(0, 2, 3, 1, 4)  # (G, blocks, half, row, byte)
    grouped_scales = scales.view(groups, Q4_GROUP, blocks).transpose(1, 2)  # (G, blocks, row)
    return grouped.reshape(groups, blocks, -1).contiguous(), grouped_scales.contiguous()


def ungroup_q4(grouped: Tensor, grouped_scales: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """group_q4 undone: the first rows rows as (rows, K / 2) bytes and (rows, K / 32) scales."""
    groups, blocks, _ = grouped.shape
    packed = grouped.view(groups, blocks, 2, Q4_GROUP, 8).permute(0, 3, 1, 2, 4)  # (G, row, blocks, half, byte)
    scales = grouped_scales.transpose(1, 2)  # (G, row, blocks)
    return packed.reshape(-1, blocks * 16)[:rows].contiguous(), scales.reshape(-1, blocks)[:rows].contiguous()
