"""Int8 weight-only quantisation: every Linear's weight as int8 with one scale per output channel.

Activations stay in the model's float dtype (fp32 or bf16); each matmul reads one byte per weight instead of two or
four, which is what bounds decoding on a CPU. The embedding table stays in float (a lookup reads a few rows only);
a tied LM head gets its own int8 copy.

A quantised model saves as a gptkit model directory whose config.json carries "quantization": "int8" and whose
model.safetensors holds int8 `*.weight` and float `*.scales` tensors; load_quantized_dir() builds it back directly.
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


class _Int8Product(torch.autograd.Function):
    """x @ (q * scales)^T with a gradient for x only. The weight is dequantised for the product and again for the
    backward pass, so that autograd keeps the int8 weight (a byte per weight) rather than a float copy."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
        ctx.save_for_backward(q, scales)
        return F.linear(x, q.to(x.dtype) * scales.to(x.dtype)[:, None])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        q, scales = ctx.saved_tensors
        return grad @ (q.to(grad.dtype) * scales.to(grad.dtype)[:, None]), None, None


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
            y = _Int8Product.apply(x2, self.weight, self.scales)
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


def _swap_linears(model: nn.Module, make: Any) -> None:
    """Replace every nn.Linear below model by make(linear)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
        else:
            _swap_linears(child, make)


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
    _swap_linears(base if include_head else base.blocks, Int8Linear.from_linear)
    return model.eval()


def save_quantized_dir(model: GPT, path: str | Path, tokenizer: Any | None = None) -> Path:
    """Write a quantised model as a gptkit model directory that load_quantized_dir (and modeldir.load) read back."""
    from gptkit.modeldir import WEIGHTS_FILE, save_tensors, write_config_and_tokenizer

    base = getattr(model, "_orig_mod", model)
    if not is_quantized(base):
        raise ConfigError("the model is not quantised; call gptkit.quantize(model, 'int8') first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(base.state_dict(), path / WEIGHTS_FILE, metadata={"format": "pt", "quantization": "int8"})
    write_config_and_tokenizer(path, base.config, tokenizer, {"quantization": "int8"})
    return path


def quantization_of(path: str | Path) -> str | None:
    """The quantisation a gptkit model directory was saved with ("int8"), or None for a float one."""
    from gptkit.modeldir import read_config_json

    method = read_config_json(path).get("quantization")
    if method is not None:
        _check_method(method)
    return method


def load_quantized_dir(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GPT:
    """Build the quantised GPT saved by save_quantized_dir directly from its int8 tensors, in eval mode."""
    from gptkit.modeldir import ModelDirError, load_tensors, read_model_config, weight_files

    path = Path(path)
    method = quantization_of(path)
    if method is None:
        raise ModelDirError(f"{path} holds a float model; load it with gptkit.load and quantise it")
    config = read_model_config(path)
    device = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, Tensor] = {}
    for file in weight_files(path):
        state.update(load_tensors(file, device))
    # Floats converted (or copied), int8 weights copied: out of the memory map into aligned, writable memory.
    state = {name: t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
             for name, t in state.items()}  # fmt: skip
    with torch.device("meta"):
        model = GPT(config)
        _swap_linears(model, lambda lin: Int8Linear(lin.in_features, lin.out_features, lin.bias is not None))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ModelDirError(f"{path}: tensor {name!r} is {'missing' if missing else 'unexpected'} for this config")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape) or (expected[name].dtype == torch.int8) != (
            tensor.dtype == torch.int8
        ):
            raise ModelDirError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} / dtype {tensor.dtype}, "
                                f"the config needs {tuple(expected[name].shape)} / {expected[name].dtype}")  # fmt: skip
    model.load_state_dict(state, strict=True, assign=True)
    probe_kernels(device.type)
    return model.eval()
