"""A run's training precision: train.dtype auto made concrete, and where attention runs under a CPU's bf16."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gptkit.devices import measured_cpu_matmul_flops
from gptkit.distributed import World, any_rank
from gptkit.plan import TRAIN_DTYPES

# train.dtype auto trains in bfloat16 on a CPU whose bf16 products measure at least this many times its fp32 ones.
# The casts autocast adds and bf16's slower elementwise kernels eat part of the gain: on the CPU record's step
# (configs/shakespeare-char-cpu-muon.yaml, 2-core AVX512-BF16 EPYC, bf16 products 2.1x fp32) the products went from
# 11.8 to 6.1 ms and the casts and GELU's backward added 1.9 ms, so bf16 pays from about 1.3x; 1.5 leaves a margin.
CPU_BF16_MIN_SPEEDUP = 1.5


@dataclass(frozen=True)
class Precision:
    """How a run trains: dtype (autocast's, or float32) and whether attention runs in fp32 under it."""

    dtype: str
    fp32_attention: bool = False

    def state(self, device: torch.device) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run trains alike (choose_precision's saved)."""
        return {"device": device.type, "dtype": self.dtype, "fp32_attention": self.fp32_attention}


def choose_precision(requested: str, device: torch.device, world: World, attention_shape: tuple[int, int, int, int],
                     saved: Any = None) -> Precision:  # fmt: skip
    """The precision of a run asked for requested (train.dtype): auto made training_dtype's choice, and under a
    CPU's bf16 attention in fp32 where that measures faster at attention_shape (batch, heads, block, head_dim). Each
    measurement is taken alike on every rank (any_rank: every rank must call this); saved, a checkpoint's
    Precision.state on the same kind of device, is kept instead, so that a resumed run replays exactly."""
    saved = saved if isinstance(saved, dict) and saved.get("device") == device.type else {}
    dtype = requested
    if requested == "auto" and saved.get("dtype") in TRAIN_DTYPES:
        dtype = saved["dtype"]
    elif requested == "auto":
        dtype = training_dtype("auto", device)
        if device.type == "cpu":  # a measurement: every rank takes bf16 if any measured it faster
            dtype = "bfloat16" if any_rank(world, dtype == "bfloat16", device) else "float32"
    if device.type != "cpu" or dtype != "bfloat16":
        return Precision(dtype)
    if saved.get("dtype") == "bfloat16" and isinstance(saved.get("fp32_attention"), bool):
        return Precision(dtype, saved["fp32_attention"])
    return Precision(dtype, any_rank(world, attention_faster_in_fp32(*attention_shape), device))



def training_dtype(requested: str, device: torch.device) -> str:
    """The dtype a run trains in: the requested one, or for auto the fastest that trains alike: bfloat16 on a GPU
    that has it (float16, with its scaler, on an older one), on a CPU whose bf16 products are CPU_BF16_MIN_SPEEDUP
    times its fp32 ones (measured here), else float32."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type == "cpu":
        speedup = measured_cpu_matmul_flops(torch.bfloat16) / measured_cpu_matmul_flops(torch.float32)
        return "bfloat16" if speedup >= CPU_BF16_MIN_SPEEDUP else "float32"
    return "float32"


def attention_faster_in_fp32(batch: int, n_head: int, block_size: int, head_dim: int, rounds: int = 3) -> bool:
    """Whether causal attention, forward and backward, runs faster in fp32 than in bf16 on this CPU at this shape
    (best of rounds, over at most a few sequences: the rate per sequence is what differs).

    PyTorch 2.13's CPU flash-attention backward in bf16 is slow at short contexts: 5.1 ms against 1.9 in fp32 at
    12 x 4 heads x 64 x 32 on a 2-core AVX512-BF16 EPYC, but 203 against 246 ms at 4 x 12 x 1024 x 64.
    """
    own = torch.Generator().manual_seed(0)  # the global RNG stays untouched: resumed runs replay it exactly
    rows = min(batch, max(1, math.ceil(16 / n_head)))  # enough heads to keep every thread of a small CPU busy
    q, k, v, grad = torch.randn(4, rows, n_head, block_size, head_dim, generator=own).bfloat16()
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def seconds(dtype: torch.dtype) -> float:  # from bf16 inputs to bf16 gradients, casts included
        best = math.inf
        for _ in range(rounds + 1):  # the first call sets up the kernel's buffers
            start = time.perf_counter()
            out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
            out.to(torch.bfloat16).backward(grad)
            best = min(best, time.perf_counter() - start)
        return best

    return seconds(torch.float32) < seconds(torch.bfloat16)
