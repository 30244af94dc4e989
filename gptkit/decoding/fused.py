"""The fused CPU decode step: a whole decode step of the model in one native call (gptkit/csrc/step.cpp).

The eager step (step.decode_one_token) costs a batch-1 token about a thousand operator dispatches and the Python
between them, a third of a small model's step on a CPU, on top of reading the weights. The fused step runs every
layer in one OpenMP region with only barriers between the stages (cpu_kernels' products, norms, rotary positions,
attention over the cache, activations and residuals), so a step costs little more than streaming the weights.

It covers the models `gptkit convert --to-gguf` writes and more: pre-norm blocks with LayerNorm or RMSNorm, GELU
(tanh or erf), ReLU or SwiGLU, learned, rotary or no positions, grouped-query attention, biases anywhere, a tied or
own LM head with or without a bias, a padded vocabulary (the step computes every row of the head; the padded
logits are dropped); fp32 or bf16 weights, int8 or int4 layers; an fp32, bf16 or int8 KV cache;
1 to MAX_ROWS rows. Anything else decodes with the eager step, and the reason is logged once. Like gptkit's CPU
kernels it is used where a measurement on this machine finds it faster than the eager step (cpu_kernels.measured)
and where the kernels' library is loaded (a first build runs in the background: until it ends, the eager step).
Its arithmetic is fp32 between the products (a bf16 model's activations are not rounded to bf16 between layers): an fp32
model's logits agree with the eager step's within 1e-4 (tests/test_fused.py).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from gptkit import cpu_kernels
from gptkit.config import ModelConfig
from gptkit.decoding.step import Step, base, decode_one_token, inference
from gptkit.kv_cache import KVCache
from gptkit.model import GPT, Linear
from gptkit.quantization import Int4Linear, Int8Linear

log = logging.getLogger("gptkit.decoding")

MAX_ROWS = cpu_kernels.GEMV_MAX_ROWS  # rows of one fused step; a larger batch decodes with the eager step
MAX_HEAD_DIM = 512
NORMS = {"layernorm": 0, "rmsnorm": 1}
ACTIVATIONS = {"gelu_tanh": 0, "gelu": 1, "relu": 2, "swiglu": 3}
POSITIONS = {"learned": 0, "rope": 1, "none": 2}
_LOGGED: set[str] = set()


def uncovered(model: GPT) -> str | None:
    """Why the fused step cannot run model, or None when it can."""
    config = model.config
    if config.norm_position != "pre":
        return "post-norm blocks"
    if config.position not in POSITIONS:
        return f"{config.position} positions"
    if config.activation not in ACTIVATIONS:
        return f"the {config.activation} activation"
    if config.qk_norm:
        return "q/k norms (qk_norm)"
    if config.logit_softcap is not None:
        return "soft-capped logits (logit_softcap)"
    if config.head_dim > MAX_HEAD_DIM:
        return f"heads of {config.head_dim} values (at most {MAX_HEAD_DIM})"
    dtype = model.tok_emb.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} weights"
    layers = [("lm_head", model.lm_head)] + [(f"blocks.{i}.{name}", layer) for i, block in enumerate(model.blocks)
                                             for name, layer in (("attn.qkv", block.attn.qkv),
                                                                 ("attn.proj", block.attn.proj),
                                                                 ("mlp.fc", block.mlp.fc),
                                                                 ("mlp.proj", block.mlp.proj))]  # fmt: skip
    for name, layer in layers:
        if isinstance(layer, (Int8Linear, Int4Linear)):
            continue
        if type(layer) not in (Linear, nn.Linear):
            return f"its {name} layer, a {type(layer).__name__}"
        if layer.weight.dtype != dtype:
            return f"its {name} layer's {layer.weight.dtype} weight beside {dtype} embeddings"
    return None


def step_for(model: GPT) -> Step | None:
    """decode_one_token through the fused step for model, or None where it does not apply on this machine now."""
    model = base(model)
    if not isinstance(model, GPT) or next(model.parameters()).device.type != "cpu":
        return None
    if not cpu_kernels.load(wait=False):
        return None
    reason = uncovered(model)
    if reason is not None:
        if reason not in _LOGGED:
            _LOGGED.add(reason)
            log.warning("decoding with the eager step: the fused CPU step does not cover %s", reason)
        return None
    if not cpu_kernels.measured("fused_step", _faster_than_eager):
        return None
    plan = _plan(model)
    vocab = model.config.vocab_size

    def fused(model: GPT, tokens: Tensor, cache: KVCache, positions: Tensor | int) -> Tensor:
        rows = tokens.size(0)
        if rows > MAX_ROWS:
            return decode_one_token(model, tokens, cache, positions)
        if isinstance(positions, int):
            positions = torch.full((rows,), positions, dtype=torch.long)
        with torch.profiler.record_function("gptkit::fused_step"):  # one named entry in a profile (a few us)
            logits = plan.step(tokens.reshape(rows), positions.to(torch.long).contiguous(), cache.keys, cache.values,
                               cache.key_scales, cache.value_scales)  # fmt: skip
        return logits[:, :vocab] if logits.size(-1) != vocab else logits  # (rows, V): a padded head's rows dropped

    return fused


def _plan(model: GPT) -> torch.ScriptObject:
    """The native step over model's weights (shared, not copied; norms and biases as fp32 copies)."""
    config = model.config
    dtype = model.tok_emb.weight.dtype
    settings = [config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.head_dim, config.ffn_hidden,
                config.padded_vocab_size, NORMS[config.norm], ACTIVATIONS[config.activation],
                POSITIONS[config.position], int(dtype == torch.bfloat16)]  # fmt: skip
    tensors = [model.tok_emb.weight, model.pos_emb.weight if model.pos_emb is not None else _NONE]
    for block in model.blocks:
        tensors += [*_norm(block.norm1), *_linear(block.attn.qkv), *_linear(block.attn.proj), *_norm(block.norm2),
                    *_linear(block.mlp.fc), *_linear(block.mlp.proj)]  # fmt: skip
    tensors += [*_norm(model.norm_f), *_linear(model.lm_head)]
    tensors = [t.detach() for t in tensors]
    if not model.__dict__.get("_gptkit_huge_pages"):  # once per model: its weights stream faster from 2 MiB pages
        model.__dict__["_gptkit_huge_pages"] = True
        cpu_kernels.back_with_huge_pages(tensors)
    return torch.classes.gptkit.DecodeStep(settings, [config.norm_eps, config.rope_theta], tensors)


_NONE = torch.empty(0)


def _norm(norm: nn.Module) -> list[Tensor]:
    return [norm.weight, norm.bias if getattr(norm, "bias", None) is not None else _NONE]


def _linear(layer: nn.Module) -> list[Tensor]:
    bias = layer.bias if layer.bias is not None else _NONE
    if isinstance(layer, (Int8Linear, Int4Linear)):
        return [layer.weight, layer.scales, bias]
    return [layer.weight, _NONE, bias]


@torch.no_grad()
def _faster_than_eager() -> bool:
    """Whether 16 batch-1 steps of a small random model (4 layers, 512 wide) run faster fused than eager here."""
    config = ModelConfig(vocab_size=4096, block_size=64, n_layer=4, n_head=8, n_embd=512)
    model = GPT(config).eval()
    cache = KVCache(config, 1, 64)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    plan = _plan(model)
    positions = [torch.tensor([p]) for p in range(16)]
    with inference(model):
        return cpu_kernels.faster(
            lambda: [plan.step(tokens[0], p, cache.keys, cache.values, [], []) for p in positions],
            lambda: [decode_one_token(model, tokens, cache, p) for p in range(16)], rounds=3)
