"""A run's training precision: train.dtype auto made concrete, and where attention runs under a CPU's bf16.

Both choices change a run's numbers from its first step, so neither depends on a timing: one taken while other
programs load the machine chose bf16 for one run and float32 for the same command minutes later. They follow
from what the hardware has (a CPU's bf16 instructions, a GPU's bf16 support) and the run's shape, so that one
command on one machine gives one run; a checkpoint keeps them (a resume replays them), and config.yaml and
`gptkit info` of a checkpoint say what was chosen and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gptkit.distributed import World, any_rank
from gptkit.native.cpu import cpu_flags
from gptkit.plan import TRAIN_DTYPES

# The /proc/cpuinfo flags of x86 CPUs with bf16 matmul instructions that PyTorch's CPU matmul (oneDNN) uses: AMX
# (Sapphire Rapids on) and AVX512-BF16 (Cooper Lake, Zen 4 on). On the CPU record's 2-core AVX512-BF16 EPYC bf16
# products measured 2.1x fp32 and the record's step trained 1.3x faster in bf16 after autocast's casts
# (configs/shakespeare-char-cpu-muon.yaml); without them bf16 is emulated, about 1 GFLOP/s on an AVX2-only CPU.
BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")
# Under a CPU's bf16 autocast, attention runs in fp32 up to this context. PyTorch 2.13's CPU flash-attention
# backward in bf16 is slow at short contexts: on a 2-core AVX512-BF16 EPYC, 5.1 ms against 1.9 in fp32 at 12 x 4
# heads x 64 x 32, but 203 against 246 ms at 4 x 12 x 1024 x 64. The crossing lies between the two measured
# contexts; 256 is their geometric middle (not measured itself).
FP32_ATTENTION_MAX_CONTEXT = 256


@dataclass(frozen=True)
class Precision:
    """How a run trains: dtype (autocast's, or float32), whether attention runs in fp32 under it, and why."""

    dtype: str
    fp32_attention: bool = False
    reason: str = ""

    def state(self, device: torch.device) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run trains alike (choose_precision's saved)."""
        return {
            "device": device.type,
            "dtype": self.dtype,
            "fp32_attention": self.fp32_attention,
            "reason": self.reason,
        }

    def describe(self) -> str:
        """One line for config.yaml and `gptkit info`: the dtype, attention's, and why."""
        attention = ", attention in float32" if self.fp32_attention else ""
        return f"{self.dtype}{attention}" + (f" ({self.reason})" if self.reason else "")


def choose_precision(
    requested: str, device: torch.device, world: World, attention_shape: tuple[int, int, int, int], saved: Any = None
) -> Precision:
    """The precision of a run asked for requested (train.dtype): auto made training_dtype's choice, and under a
    CPU's bf16 attention in fp32 at contexts up to FP32_ATTENTION_MAX_CONTEXT (attention_shape: batch, heads,
    block, head_dim). saved, a checkpoint's Precision.state on the same kind of device, is kept instead, so that a
    resumed run replays exactly. Every rank must call this (any_rank): ranks on unlike machines agree."""
    saved = saved if isinstance(saved, dict) and saved.get("device") == device.type else {}
    kept = saved.get("reason") if isinstance(saved.get("reason"), str) else "kept from the checkpoint"
    dtype, reasons = requested, []
    if requested == "auto" and saved.get("dtype") in TRAIN_DTYPES:
        dtype = saved["dtype"]
        reasons.append(kept)  # the checkpoint's own reason, as its run chose (however many resumes ago)
    elif requested == "auto":
        dtype, why = training_dtype_and_reason(device)
        if device.type == "cpu":  # every rank takes bf16 if any has it
            dtype = "bfloat16" if any_rank(world, dtype == "bfloat16", device) else "float32"
        reasons.append(f"train.dtype auto: {why}")
    if device.type != "cpu" or dtype != "bfloat16":
        return Precision(dtype, reason="; ".join(reasons))
    if saved.get("dtype") == "bfloat16" and isinstance(saved.get("fp32_attention"), bool):
        return Precision(dtype, saved["fp32_attention"], kept)
    block = attention_shape[2]
    fp32 = any_rank(world, attention_in_fp32(block), device)
    side = "<=" if fp32 else ">"
    reasons.append(
        f"attention in {'float32' if fp32 else 'bfloat16'}: context {block} {side} {FP32_ATTENTION_MAX_CONTEXT}"
    )
    return Precision(dtype, fp32, "; ".join(reasons))


def training_dtype(requested: str, device: torch.device) -> str:
    """The dtype a run trains in: the requested one, or for auto training_dtype_and_reason's."""
    return requested if requested != "auto" else training_dtype_and_reason(device)[0]


def training_dtype_and_reason(device: torch.device) -> tuple[str, str]:
    """The dtype train.dtype auto trains in, and why in words: bfloat16 on a GPU that has it (float16, with its
    scaler, on an older one) and on a CPU with bf16 matmul instructions (BF16_MATMUL_FLAGS), else float32."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "this GPU supports bfloat16"
        return "float16", "this GPU lacks bfloat16"
    if device.type != "cpu":
        return "float32", f"no mixed precision on {device.type}"
    flags = cpu_flags()
    found = [flag for flag in BF16_MATMUL_FLAGS if flag in flags]
    if found:
        return "bfloat16", f"this CPU lists {found[0]} (bf16 matmul in hardware)"
    return "float32", f"this CPU lists none of {', '.join(BF16_MATMUL_FLAGS)} (bf16 matmul would be emulated)"


def attention_in_fp32(block_size: int) -> bool:
    """Whether causal attention runs in fp32 under a CPU's bf16 autocast at this context (a rule, not a timing:
    FP32_ATTENTION_MAX_CONTEXT says where it comes from)."""
    return block_size <= FP32_ATTENTION_MAX_CONTEXT
