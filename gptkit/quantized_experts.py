"""A mixture of experts' (E, out, in) expert stacks (gptkit.moe.ExpertWeights) quantised per expert as the dense
layers are (gptkit.quantization): Int8Experts (int8 rows) and Int4Experts (Q4_0 blocks in groups of 8 rows), with
expert() and grouped() as ExpertWeights has, so that MoEFeedForward and the fused decode step take either."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit.errors import ConfigError
from gptkit.int8_rows import dequantized_weight, quantize_weight
from gptkit.native import ops
from gptkit.q4_blocks import Q4_BLOCK, Q4_GROUP, dequantize_q4, group_q4, quantize_q4, ungroup_q4


def _groupeddequantized_weight(stack: nn.Module, x: Tensor, ends: Tensor, row_expert: Tensor) -> Tensor:
    """gptkit.moe.grouped_linear over a quantised stack for inference (prefill): rows ends[e-1]:ends[e] of x (R, in)
    times expert e's dequantised weight, one expert at a time, so that only one expert's float copy exists at once."""
    bounds = [0, *ends.tolist()]
    parts = [
        F.linear(x[start:end], stack.dequantized_expert(e, x.dtype))
        for e, (start, end) in enumerate(zip(bounds, bounds[1:]))
        if end > start  # an expert no row chose is not dequantised
    ]
    out = torch.cat(parts)  # (R, out)
    return out if stack.bias is None else out + stack.bias.to(x.dtype)[row_expert]


class Int8Experts(nn.Module):
    """A MoE layer's expert stack (gptkit.moe.ExpertWeights) in int8: weight (E, out, in) with one scale per output
    row (E, out), each expert as an Int8Linear would hold it; bias (E, out) in float."""

    def __init__(
        self, n_experts: int, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(n_experts, out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(n_experts, out_features, dtype=dtype))
        self.register_buffer("bias", torch.zeros(n_experts, out_features, dtype=dtype) if bias else None)

    @classmethod
    def from_experts(cls, experts: nn.Module) -> Int8Experts:
        """The int8 copy of a float expert stack (same device; scales and bias in its dtype)."""
        n, out, width = experts.weight.shape
        dtype = experts.weight.dtype
        module = cls(n, width, out, experts.bias is not None, dtype).to(experts.weight.device)
        q, scales = quantize_weight(experts.weight.reshape(n * out, width))  # per row: per expert and output
        module.weight.copy_(q.view(n, out, width))
        module.scales.copy_(scales.view(n, out).to(dtype))
        if experts.bias is not None:
            module.bias.copy_(experts.bias.detach())
        return module

    def dequantized_expert(self, e: int, dtype: torch.dtype) -> Tensor:
        """Expert e's (out, in) float weight."""
        return dequantized_weight(self.weight[e], self.scales[e], dtype)

    def expert(self, x: Tensor, e: int) -> Tensor:
        """x (M, in) through expert e alone by the int8 kernel (Int8Linear's few-row product) where it runs."""
        bias = None if self.bias is None else self.bias[e]
        y = ops.int8_linear(x, self.weight[e], self.scales[e], bias)
        if y is None:
            y = F.linear(x, self.dequantized_expert(e, x.dtype), None if bias is None else bias.to(x.dtype))
        return y

    def grouped(self, x: Tensor, ends: Tensor, row_expert: Tensor) -> Tensor:
        """ExpertWeights.grouped for inference: each expert's rows through its dequantised weight."""
        return _groupeddequantized_weight(self, x, ends, row_expert)

    def extra_repr(self) -> str:
        return f"experts={self.weight.size(0)}, in_features={self.in_features}, out_features={self.out_features}, int8"


def _grouped_stack(packed: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """group_q4 per expert: (E, out, in / 2) bytes and (E, out, in / 32) scales as (E, groups, blocks, 128) and fp16
    (E, groups, blocks, 8)."""
    grouped = [group_q4(p, s.to(torch.float16)) for p, s in zip(packed, scales)]
    return torch.stack([g[0] for g in grouped]), torch.stack([g[1] for g in grouped])


class Int4Experts(nn.Module):
    """A MoE layer's expert stack in Q4_0 (quantize_q4), each expert as an Int4Linear holds it: weight (E, groups,
    blocks, 128) uint8 and fp16 scales (E, groups, blocks, 8) in groups of 8 rows, state dicts in plain rows (E, out,
    in / 2) and (E, out, in / 32), the bits a GGUF file's q4_0 expert tensor holds."""

    def __init__(
        self, n_experts: int, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if in_features % Q4_BLOCK:
            raise ConfigError(f"int4 needs an input width that is a multiple of {Q4_BLOCK}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        groups, blocks = -(-out_features // Q4_GROUP), in_features // Q4_BLOCK
        self.register_buffer(
            "weight", torch.zeros(n_experts, groups, blocks, Q4_GROUP * Q4_BLOCK // 2, dtype=torch.uint8)
        )
        self.register_buffer("scales", torch.zeros(n_experts, groups, blocks, Q4_GROUP, dtype=torch.float16))
        self.register_buffer("bias", torch.zeros(n_experts, out_features, dtype=dtype) if bias else None)

    @classmethod
    def from_experts(cls, experts: nn.Module) -> Int4Experts:
        """The Q4_0 copy of a float expert stack (same device; bias in its dtype)."""
        n, out, width = experts.weight.shape
        module = cls(n, width, out, experts.bias is not None, experts.weight.dtype).to(experts.weight.device)
        packed, scales = quantize_q4(experts.weight.reshape(n * out, width))  # (E * out, in / 2), (E * out, in / 32)
        module._set_plain(packed.view(n, out, -1), scales.view(n, out, -1))
        if experts.bias is not None:
            module.bias.copy_(experts.bias.detach())
        return module

    def _set_plain(self, packed: Tensor, scales: Tensor) -> None:
        """Hold plain rows (E, out, in / 2) and fp16 scales (E, out, in / 32) in groups of 8 rows."""
        self.weight, self.scales = _grouped_stack(packed, scales)

    def plain(self) -> tuple[Tensor, Tensor]:
        """The blocks as rows: packed (E, out, in / 2) uint8 and fp16 scales (E, out, in / 32)."""
        rows = [ungroup_q4(w, s, self.out_features) for w, s in zip(self.weight, self.scales)]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def dequantized_expert(self, e: int, dtype: torch.dtype) -> Tensor:
        """Expert e's (out, in) float weight."""
        native = ops.dequantize_q4(self.weight[e], self.scales[e], self.out_features, dtype)
        return (
            native
            if native is not None
            else dequantize_q4(*ungroup_q4(self.weight[e], self.scales[e], self.out_features), dtype)
        )

    def expert(self, x: Tensor, e: int) -> Tensor:
        """x (M, in) through expert e alone by the q4 kernel (Int4Linear's few-row product) where it runs."""
        bias = None if self.bias is None else self.bias[e]
        y = ops.q4_linear(x, self.weight[e], self.scales[e], bias, self.out_features)
        if y is None:
            y = F.linear(x, self.dequantized_expert(e, x.dtype), None if bias is None else bias.to(x.dtype))
        return y

    def grouped(self, x: Tensor, ends: Tensor, row_expert: Tensor) -> Tensor:
        """ExpertWeights.grouped for inference: each expert's rows through its dequantised weight."""
        return _groupeddequantized_weight(self, x, ends, row_expert)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"], destination[prefix + "scales"] = self.plain()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        weight, scales = state_dict.get(prefix + "weight"), state_dict.get(prefix + "scales")
        n = self.weight.size(0)
        plain = (n, self.out_features, self.in_features // 2), (n, self.out_features, self.in_features // Q4_BLOCK)
        if weight is not None and scales is not None and (tuple(weight.shape), tuple(scales.shape)) == plain:
            state_dict[prefix + "weight"], state_dict[prefix + "scales"] = _grouped_stack(weight, scales)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _apply(self, fn: Any, recurse: bool = True) -> Int4Experts:
        """Moved and cast as any module is, except the fp16 block scales, which move as their bits (Int4Linear's)."""
        scales = self.scales
        super()._apply(fn, recurse)
        self.scales = fn(scales.view(torch.int16)).view(torch.float16)
        return self

    def extra_repr(self) -> str:
        return f"experts={self.weight.size(0)}, in_features={self.in_features}, out_features={self.out_features}, int4"


QUANTIZED_EXPERTS = (Int8Experts, Int4Experts)


def int4_or_int8_experts(experts: nn.Module) -> nn.Module:
    """Int4Experts where the input width holds whole blocks of 32, else Int8Experts (as int4_or_int8)."""
    if experts.weight.size(2) % Q4_BLOCK:
        return Int8Experts.from_experts(experts)
    return Int4Experts.from_experts(experts)
