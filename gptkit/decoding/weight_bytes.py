"""The weight bytes one decoded token reads at batch 1, counted from the tensors a model holds: what bounds a decode
step's rate on a CPU (benchmarks/bench_kernels.py and benchmarks/llama_cpp_shapes.py divide a read bandwidth by it).

gptkit.accounting.decode_weight_bytes counts the same parameters from a config at one width per weight; this count
takes each tensor's own width instead: a quantised model's routers stay fp32, int8 layers read an fp32 or bf16 scale
per row and Q4_0 an fp16 scale per 32 weights."""

from __future__ import annotations

from torch import nn

from gptkit.moe import MoEFeedForward
from gptkit.quantization import Bfloat16Linear, Int4Linear, Int8Linear

MATRICES = (nn.Linear, Bfloat16Linear, Int8Linear, Int4Linear)


def _held_bytes(module: nn.Module) -> int:
    """The bytes of a layer's or expert stack's weight and, where it has them, its scales (biases, a row each, are
    left out)."""
    scales = getattr(module, "scales", None)
    return module.weight.nbytes + (scales.nbytes if scales is not None else 0)


def step_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one token's decode step reads: every matrix it multiplies by, as the model holds it (the LM
    head included; the embedding rows it looks up left out), and of each expert stack the share of the
    n_experts_per_token experts a token's router chooses."""
    model = getattr(model, "_orig_mod", model)
    total = 0
    for layer in model.modules():
        if isinstance(layer, MATRICES):
            total += _held_bytes(layer)
        elif isinstance(layer, MoEFeedForward):
            for stack in (layer.fc, layer.proj):
                total += _held_bytes(stack) // layer.n_experts * layer.k  # an expert: a slice of the leading dim
    return total
