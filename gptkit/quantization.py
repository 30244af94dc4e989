"""Int8 weight-only quantisation: every Linear's weight as int8 with one scale per output channel.

Activations stay in the model's float dtype (fp32 or bf16); each matmul reads one byte per weight instead of two or
four, which is what bounds decoding on a CPU. The embedding table stays in float (a lookup reads a few rows only);
a tied LM head gets its own int8 copy.

A quantised model saves as a gptkit model directory whose config.json carries "quantization": "int8" and whose
model.safetensors holds int8 `*.weight` and float `*.scales` tensors; gptkit.formats.quantized writes and reads such a directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit import cpu_kernels
from gptkit.errors import ConfigError
from gptkit.model import GPT

METHODS = ("int8",)
QUANT_MAX = 127  # symmetric int8: -127..127, so that negating a weight never overflows
# Above this many rows (tokens) a matmul is compute-bound: dequantising the weight once and running the float GEMM
# is faster there than PyTorch's int8 kernel, which is built for the few rows of decoding.
KERNEL_MAX_ROWS = 32
# PyTorch 2.13's CPU kernel returns garbage (or crashes) when in_features is not a multiple of 16 (found by trying
# 17..208), and crashes on weights not aligned as torch allocates them (a safetensors memory map is not).
KERNEL_K_MULTIPLE = 16


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: (int8 weight (out, in), float scales (out,)) with w ~ q * scale."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / QUANT_MAX
    q = torch.round(w / scales[:, None]).clamp(-QUANT_MAX, QUANT_MAX).to(torch.int8)
    return q, scales


_KERNEL_OK: dict[tuple[str, torch.dtype], bool] = {}


def _kernel_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._weight_int8pack_mm runs here for this activation dtype and matches the plain product.

    Probed once per (device type, dtype) in eager code; a compiled graph only reads the recorded answer.
    """
    key = (device_type, dtype)
    if key not in _KERNEL_OK and not torch.compiler.is_compiling():
        _KERNEL_OK[key] = _probe_kernel(device_type, dtype)
    return _KERNEL_OK.get(key, False)


def probe_kernels(device_type: str) -> None:
    """Record which activation dtypes the int8 kernel takes on this device (before any compiled call)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        _kernel_works(device_type, dtype)


def _probe_kernel(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    try:
        x = torch.randn(3, 64, device=device_type).to(dtype)
        w = torch.randint(-QUANT_MAX, QUANT_MAX + 1, (32, 64), dtype=torch.int8, device=device_type)
        s = torch.rand(32, device=device_type).to(dtype)
        got = torch._weight_int8pack_mm(x, w, s).float()
    except (RuntimeError, NotImplementedError):
        return False
    want = (x.float() @ w.float().t()) * s.float()
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))


def _compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype | None:
    """The activation dtype to run the int8 kernel in, or None for the dequantising fallback.

    On CPU the kernel's fp32-activation path is unvectorised (about a tenth of its bf16 speed measured here), so
    fp32 activations are rounded to bf16 for the matmul only; the int8 weights dominate the error either way.
    """
    if device_type == "cpu" and dtype == torch.float32 and _kernel_works(device_type, torch.bfloat16):
        return torch.bfloat16
    return dtype if _kernel_works(device_type, dtype) else None


def _dequantized(weight: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """A stored weight (int8 with per-channel scales, or bf16 alone) as a float weight of dtype."""
    return weight.to(dtype) if scales is None else weight.to(dtype) * scales.to(dtype)[:, None]


class _DequantizedProduct(torch.autograd.Function):
    """x @ W^T for a frozen weight stored in fewer bits, with a gradient for x only. W is made afresh for the product
    and again for the backward pass, so that autograd keeps the stored weight (a byte or two per weight) rather than
    a float copy: what training adapters over a low-precision base needs."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, scales: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight, scales)
        return F.linear(x, _dequantized(weight, scales, x.dtype))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        weight, scales = ctx.saved_tensors
        return grad @ _dequantized(weight, scales, grad.dtype), None, None


class Bfloat16Linear(nn.Module):
    """A frozen linear layer whose weight is stored in bfloat16 and multiplied in the activations' dtype: half the
    memory of fp32 weights, at fp32's speed where bf16 products are slow (CPUs without AVX512-BF16 or AMX)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            y = _DequantizedProduct.apply(x, self.weight, None)
        else:
            y = F.linear(x, self.weight.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 weight"


class Int8Linear(nn.Module):
    """y = (x @ q^T) * scales + bias with q int8 (out, in); PyTorch's int8 weight-only kernel where it runs."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=dtype))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The quantised copy of a float Linear (same device; scales and bias in its dtype)."""
        dtype = linear.weight.dtype
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype).to(linear.weight.device)
        q, scales = quantize_weight(linear.weight)
        probe_kernels(linear.weight.device.type)
        module.weight.copy_(q)
        module.scales.copy_(scales.to(dtype))
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.is_grad_enabled() and x2.requires_grad:  # training adapters over this layer: x needs a gradient
            y = _DequantizedProduct.apply(x2, self.weight, self.scales)
        else:  # decoding on a CPU: the kernel adds the bias too
            y = cpu_kernels.int8_linear(x2, self.weight, self.scales, self.bias)
            if y is not None:
                return y.view(*x.shape[:-1], self.out_features)
            y = self._pytorch_product(x2)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _pytorch_product(self, x2: Tensor) -> Tensor:
        """(x2 @ q^T) * scales by PyTorch's int8 kernel where it runs, else by dequantising."""
        dtype = x2.dtype
        if x2.size(0) > KERNEL_MAX_ROWS:  # prefill: compute-bound, where a float GEMM beats the int8 kernel
            return cpu_kernels.linear(x2, self.weight.to(dtype) * self.scales.to(dtype)[:, None])
        compute = _compute_dtype(x2.device.type, dtype) if self.in_features % KERNEL_K_MULTIPLE == 0 else None
        if compute is not None:
            y = torch._weight_int8pack_mm(x2.to(compute).contiguous(), self.weight, self.scales.to(compute))
            return y.to(dtype)
        return F.linear(x2, self.weight.to(dtype)) * self.scales.to(dtype)  # correct everywhere, no bandwidth saving

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"unknown quantisation {method!r}; choose one of: {', '.join(METHODS)}")


def swap_linears(model: nn.Module, make: Any) -> None:
    """Replace every nn.Linear below model by make(linear)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
        else:
            swap_linears(child, make)


def is_quantized(model: nn.Module) -> bool:
    """Whether model holds any Int8Linear."""
    return any(isinstance(m, Int8Linear) for m in getattr(model, "_orig_mod", model).modules())


@torch.no_grad()
def quantize(model: GPT, method: str = "int8", include_head: bool = True) -> GPT:
    """Quantise model's Linear weights in place (int8, per output channel) and return it, in eval mode.

    include_head=False keeps the LM head in float (LoRA training over an int8 base: the fused loss reads it).
    """
    _check_method(method)
    base = getattr(model, "_orig_mod", model)
    if is_quantized(base):
        raise ConfigError("this model is already quantised")
    swap_linears(base if include_head else base.blocks, Int8Linear.from_linear)
    return model.eval()
