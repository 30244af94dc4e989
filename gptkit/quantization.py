"""Weight-only quantisation of every Linear: int8 with one scale per output channel, or int4 as llama.cpp's Q4_0.

Each matmul reads one byte per weight (int8) or 18 bytes per 32 (int4: 4-bit values and one fp16 scale per block
of 32) instead of two or four, which is what bounds decoding on a CPU. Activations stay in the model's float dtype
(fp32 or bf16) between the products. The embedding table stays in float (a lookup reads a few rows only); a tied
LM head gets its own quantised copy. A mixture of experts' (E, out, in) expert stacks take the same formats per
expert (gptkit.quantized_experts: Int8Experts, Int4Experts); its routers stay float, as llama.cpp keeps them.

int4 is Q4_0 exactly (gptkit.q4_blocks: llama.cpp's ggml-quants.c, quantize_row_q4_0_ref), so `gptkit convert --to-gguf --type q4_0` repacks these bits without rounding again. A layer whose input width is not a
multiple of 32 (no whole blocks) is quantised to int8 instead. The few-row int4 product (decoding) rounds its
activations to int8 per block of 32 as llama.cpp does (native.ops.q4_linear); many rows run as a float GEMM over
the dequantised weight.

A quantised model saves as a gptkit model directory whose config.json carries "quantization": "int8" or "int4" and
whose model.safetensors holds int8 (or packed uint8) `*.weight` and their `*.scales` tensors;
gptkit.formats.quantized writes and reads such a directory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit.errors import ConfigError
from gptkit.int8_rows import QUANT_MAX, dequantized_weight, quantize_weight
from gptkit.model import GPT
from gptkit.moe import moe_layers
from gptkit.native import library, ops
from gptkit.q4_blocks import Q4_BLOCK, Q4_GROUP, dequantize_q4, group_q4, quantize_q4, ungroup_q4
from gptkit.quantized_experts import QUANTIZED_EXPERTS, Int4Experts, Int8Experts, int4_or_int8_experts

QUANTIZATION_METHODS = ("int8", "int4")
# Above this many rows (tokens) a matmul is compute-bound: dequantising the weight once and running the float GEMM
# is faster there than PyTorch's int8 kernel, which is built for the few rows of decoding.
KERNEL_MAX_ROWS = 32
# PyTorch 2.13's CPU kernel returns garbage (or crashes) when in_features is not a multiple of 16 (found by trying
# 17..208), and crashes on weights not aligned as torch allocates them (a safetensors memory map is not).
KERNEL_K_MULTIPLE = 16


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


def gemm_dtype(x: Tensor) -> torch.dtype:
    """The dtype a quantised layer's many-row product runs in: x's, or bf16 for fp32 inference on a CPU whose bf16
    GEMM the kernels' measurement found the faster (native.choices: bf16_upcast False; 2.6x fp32's on a 2-core AVX512-BF16
    EPYC). The weights are the quantised ones either way; the activations round to bf16 for the product, about
    what the few-row kernels' int8 rounding costs."""
    fast = x.device.type == "cpu" and not torch.is_grad_enabled() and not library.choices().get("bf16_upcast", True)
    return torch.bfloat16 if x.dtype == torch.float32 and fast else x.dtype


class _DequantizedProduct(torch.autograd.Function):
    """x @ W^T for a frozen weight stored in fewer bits, with a gradient for x only. W is made afresh for the product
    and again for the backward pass, so that autograd keeps the stored weight (a byte or two per weight) rather than
    a float copy: what training adapters over a low-precision base needs."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, scales: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight, scales)
        return F.linear(x, dequantized_weight(weight, scales, x.dtype))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        weight, scales = ctx.saved_tensors
        return grad @ dequantized_weight(weight, scales, grad.dtype), None, None


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
            y = ops.int8_linear(x2, self.weight, self.scales, self.bias)
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
            gemm = gemm_dtype(x2)  # int8 values are exact in bf16: the scales apply after the product
            return F.linear(x2.to(gemm), self.weight.to(gemm)).to(dtype) * self.scales.to(dtype)
        compute = _compute_dtype(x2.device.type, dtype) if self.in_features % KERNEL_K_MULTIPLE == 0 else None
        if compute is not None:
            y = torch._weight_int8pack_mm(x2.to(compute).contiguous(), self.weight, self.scales.to(compute))
            return y.to(dtype)
        return F.linear(x2, self.weight.to(dtype)) * self.scales.to(dtype)  # correct everywhere, no bandwidth saving

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int4Linear(nn.Module):
    """y = x @ W^T + bias with W held as Q4_0 blocks (quantize_q4); the q4 kernel for few rows on a CPU.

    In memory the blocks sit in groups of 8 rows (group_q4), so that the kernel reads 8 rows' bytes in one stream;
    state dicts hold them as plain rows (quantize_q4's layout), which saved quantised models and GGUF files share.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if in_features % Q4_BLOCK:
            raise ConfigError(f"int4 needs an input width that is a multiple of {Q4_BLOCK}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        groups, blocks = -(-out_features // Q4_GROUP), in_features // Q4_BLOCK
        self.register_buffer("weight", torch.zeros(groups, blocks, Q4_GROUP * Q4_BLOCK // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(groups, blocks, Q4_GROUP, dtype=torch.float16))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        """The Q4_0 copy of a float Linear (same device; bias in its dtype)."""
        return cls.from_q4(*quantize_q4(linear.weight), linear.bias)

    @classmethod
    def from_q4(cls, packed: Tensor, scales: Tensor, bias: Tensor | None) -> Int4Linear:
        """A layer over existing Q4_0 data (quantize_q4's, or a GGUF file's): packed (N, K / 2) uint8, fp16 scales
        (N, K / 32); on packed's device, bias in its own dtype."""
        dtype = torch.float32 if bias is None else bias.dtype
        module = cls(packed.size(1) * 2, packed.size(0), bias is not None, dtype).to(packed.device)
        module.weight, module.scales = group_q4(packed, scales.to(torch.float16))
        if bias is not None:
            module.bias.copy_(bias.detach())
        return module

    def plain(self) -> tuple[Tensor, Tensor]:
        """The blocks as rows: packed (N, K / 2) uint8 and fp16 scales (N, K / 32), quantize_q4's layout."""
        return ungroup_q4(self.weight, self.scales, self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) float weight the blocks stand for (on a CPU by the kernels' one-pass op where built)."""
        native = ops.dequantize_q4(self.weight, self.scales, self.out_features, dtype)
        return native if native is not None else dequantize_q4(*self.plain(), dtype)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"], destination[prefix + "scales"] = self.plain()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        weight, scales = state_dict.get(prefix + "weight"), state_dict.get(prefix + "scales")
        plain = (self.out_features, self.in_features // 2), (self.out_features, self.in_features // Q4_BLOCK)
        if weight is not None and scales is not None and (tuple(weight.shape), tuple(scales.shape)) == plain:
            state_dict[prefix + "weight"], state_dict[prefix + "scales"] = group_q4(weight, scales.to(torch.float16))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _apply(self, fn: Any, recurse: bool = True) -> Int4Linear:
        """Moved and cast as any module is, except that the fp16 block scales move as their bits: a cast to the
        model's dtype (bf16) would round them, and Q4_0 defines them in fp16."""
        scales = self.scales
        super()._apply(fn, recurse)
        self.scales = fn(scales.view(torch.int16)).view(torch.float16)
        return self

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = None
        if not torch.is_grad_enabled():
            y = ops.q4_linear(x2, self.weight, self.scales, self.bias, self.out_features)
        if y is None:  # many rows, autograd or another device: a float product over the dequantised weight
            gemm = gemm_dtype(x2)
            y = F.linear(x2.to(gemm), self.dequantized(gemm)).to(x.dtype)
            y = y if self.bias is None else y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 (Q4_0 blocks of 32)"


def int4_or_int8(linear: nn.Linear) -> nn.Module:
    """Int4Linear where the input width holds whole blocks of 32, else Int8Linear."""
    if linear.in_features % Q4_BLOCK:
        return Int8Linear.from_linear(linear)
    return Int4Linear.from_linear(linear)


def _check_method(method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ConfigError(f"unknown quantisation {method!r}; choose one of: {', '.join(QUANTIZATION_METHODS)}")


def swap_linears(model: nn.Module, make: Any, keep: frozenset[int] = frozenset()) -> None:
    """Replace every nn.Linear below model by make(linear), except those whose id is in keep."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if id(child) not in keep:
                setattr(model, name, make(child))
        else:
            swap_linears(child, make, keep)


def _quantize_experts(model: nn.Module, method: str) -> frozenset[int]:
    """Quantise each MoE layer's expert stacks in place; the ids of its routers and shared gates, which stay float
    (llama.cpp keeps routers in f32: a rounded router logit can change which experts a token takes)."""
    make = Int8Experts.from_experts if method == "int8" else int4_or_int8_experts
    keep = set()
    for layer in moe_layers(model):
        layer.fc, layer.proj = make(layer.fc), make(layer.proj)
        keep |= {id(layer.router)} | ({id(layer.shared_gate)} if layer.shared_gate is not None else set())
    return frozenset(keep)


def dequantized_state(model: nn.Module) -> dict[str, Tensor]:
    """model's state dict with every quantised layer's weight as the float weight it stands for (no scales)."""
    model = getattr(model, "_orig_mod", model)
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            del state[f"{name}.scales"]
            state[f"{name}.weight"] = (
                dequantized_weight(module.weight, module.scales, torch.float32)
                if isinstance(module, Int8Linear)
                else module.dequantized()
            )
        elif isinstance(module, QUANTIZED_EXPERTS):
            del state[f"{name}.scales"]
            experts = range(module.weight.size(0))
            state[f"{name}.weight"] = torch.stack([module.dequantized_expert(e, torch.float32) for e in experts])
    return state


def is_quantized(model: nn.Module) -> bool:
    """Whether model holds any Int8Linear or Int4Linear (or a quantised expert stack)."""
    quantized = (Int8Linear, Int4Linear, *QUANTIZED_EXPERTS)
    return any(isinstance(m, quantized) for m in getattr(model, "_orig_mod", model).modules())


def quantization_method(model: nn.Module) -> str | None:
    """ "int4" where any layer is Int4Linear, "int8" where any is Int8Linear, else None."""
    modules = list(getattr(model, "_orig_mod", model).modules())
    if any(isinstance(m, (Int4Linear, Int4Experts)) for m in modules):
        return "int4"
    return "int8" if any(isinstance(m, (Int8Linear, Int8Experts)) for m in modules) else None


@torch.no_grad()
def quantize(model: GPT, method: str = "int8", include_head: bool = True) -> GPT:
    """Quantise model's Linear weights in place (int8 per output channel, or int4 Q4_0 blocks) and return it, in
    eval mode. A mixture of experts' expert stacks are quantised alike (Int8Experts, Int4Experts); its routers and
    shared-expert gates stay float.

    include_head=False keeps the LM head in float (LoRA training over an int8 base: the fused loss reads it).
    """
    _check_method(method)
    base = getattr(model, "_orig_mod", model)
    if is_quantized(base):
        raise ConfigError("this model is already quantised")
    keep = _quantize_experts(base, method)
    make = Int8Linear.from_linear if method == "int8" else int4_or_int8
    swap_linears(base if include_head else base.blocks, make, keep)
    return model.eval()
