"""The fused CPU decode step: a whole decode step of the model in one native call (gptkit/csrc/step.cpp).

The eager step (step.decode_one_token) costs a batch-1 token about a thousand operator dispatches and the Python
between them, a third of a small model's step on a CPU, on top of reading the weights. The fused step runs every
layer in one OpenMP region with only barriers between the stages (native.ops' products, norms, rotary positions,
attention over the cache, activations and residuals), so a step costs little more than streaming the weights.

It covers the models `gptkit convert --to-gguf` writes and more: pre-norm, sandwich or sublayer-post blocks with
LayerNorm or RMSNorm (with a gain offset), plain or parallel residuals (scaled or not), GELU (tanh or erf), ReLU,
SwiGLU or GeGLU (dense, or a mixture of experts: gptkit.moe's router, top k, renormalised or not, a shared expert
and its gate, each row reading only its routed experts' weights, csrc/moe_step.h), learned, rotary or no positions
(RoPE per layer from gptkit.positions: scaled, partial, a local base for sliding layers, none in NoPE layers), grouped-query attention with any head_dim up to MAX_HEAD_DIM, q/k
norms per head or over the width, a score scale and soft-cap, sliding-window layers (their KV cache a ring), scaled
embeddings and logits, soft-capped logits, biases anywhere, a tied or own LM head with or without a bias, a padded
vocabulary (the step computes every row of the head; the padded logits are dropped); fp32 or bf16 weights, int8 or
int4 layers and expert stacks; an fp32, bf16 or int8 KV cache;
any number of rows; served LoRA adapters (gptkit.multi_lora's AdapterSet layers), each row its own; rows sharing
a cache row at distinct positions (slots: how lookup's proposals ride in a batch's step, gptkit.decoding.lookup_rows;
refused where they would wrap a sliding-window ring). A model holding
any module, parameter or buffer the step does not compute (a training adapter around a layer, a module or parameter
added to a block) is refused by what it holds, whatever its configuration says.
Anything else decodes with the eager step, and the reason is logged once. Like gptkit's CPU kernels it is used
where a measurement on this machine finds it faster than the eager step (native.library.measured: at one row, and for
batches past MAX_ROWS at each of WIDE_ROWS in turn) and where the kernels' library is loaded (a first build runs in
the background: until it ends, the eager step). A row's logits are the same to the bit whatever rows decode beside
it (csrc/kernels.h).
Its arithmetic is fp32 between the products (a bf16 model's activations are not rounded to bf16 between layers): an fp32
model's logits agree with the eager step's within 1e-4 (tests/decoding/test_fused.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
from torch import Tensor, nn

from gptkit.config import ModelConfig
from gptkit.decoding.step import base, decode_one_token, inference
from gptkit.errors import InputError
from gptkit.kv_cache import KVCache
from gptkit.model import GPT, Block, CausalSelfAttention, FeedForward, Linear, RMSNorm
from gptkit.moe import ExpertWeights, MoEFeedForward
from gptkit.multi_lora import AdapterSet, adapter_sets, adapters_version, row_adapters
from gptkit.native import library, ops
from gptkit.native.choices import faster
from gptkit.positions import layer_rope, scaled_frequencies, scaling_attention_factor
from gptkit.quantization import QUANTIZED_EXPERTS, Int4Experts, Int4Linear, Int8Experts, Int8Linear

log = logging.getLogger("gptkit.decoding")

MAX_ROWS = ops.GEMV_MAX_ROWS  # rows a fused step takes wherever it is chosen (its weights' reading bound)
# Past MAX_ROWS a step's products are bound by arithmetic, where PyTorch's GEMM may win: the fused step takes a batch of
# up to WIDE_ROWS[i] rows where it measured faster than the eager step at WIDE_ROWS[0..i] rows, timed on the first
# batch that needs it. A larger batch decodes with the eager step.
WIDE_ROWS = (16, 32, 64, 128)
MAX_HEAD_DIM = 512
NORMS = {"layernorm": 0, "rmsnorm": 1}
ACTIVATIONS = {"gelu_tanh": 0, "gelu": 1, "relu": 2, "swiglu": 3, "geglu": 4}
POSITIONS = {"learned": 0, "rope": 1, "none": 2}
NORM_POSITIONS = {"pre": 0, "sandwich": 1, "sublayer_post": 2}
QK_NORMS = {"head": 1, "width": 2}  # 0: no q/k norms
# RoPE rules whose frequencies follow the length of each pass (the step reads one table made in advance).
PER_PASS_ROPE = ("dynamic", "longrope")
_LOGGED: set[str] = set()


# The modules the step computes, by exact type (a subclass may compute something else); a norm by config.norm.
_COMPUTED = (
    GPT,
    Block,
    CausalSelfAttention,
    FeedForward,
    nn.ModuleList,
    nn.Embedding,
    nn.Dropout,
    Linear,
    nn.Linear,
    Int8Linear,
    Int4Linear,
    AdapterSet,
    MoEFeedForward,
    ExpertWeights,
    Int8Experts,
    Int4Experts,
)
_NORM_TYPES = {"layernorm": nn.LayerNorm, "rmsnorm": RMSNorm}


def uncovered(model: GPT) -> str | None:
    """Why the fused step cannot run model, or None when it can."""
    config = model.config
    if config.norm_position not in NORM_POSITIONS:
        return f"{config.norm_position}-norm blocks"
    if config.position not in POSITIONS:
        return f"{config.position} positions"
    if config.activation not in ACTIVATIONS:
        return f"the {config.activation} activation"
    if config.rope_scaling is not None and config.rope_scaling.rope_type in PER_PASS_ROPE:
        return f"{config.rope_scaling.rope_type} RoPE scaling (its frequencies change with the length)"
    if config.head_dim > MAX_HEAD_DIM:
        return f"heads of {config.head_dim} values (at most {MAX_HEAD_DIM})"
    dtype = model.tok_emb.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} weights"
    return _unknown_part(model) or _layer_dtypes(model, dtype) or _misplaced_adapter(model)


def _unknown_part(model: GPT) -> str | None:
    """The first module of a type the step does not compute, or parameter or buffer it does not read, named by path."""
    computed = _COMPUTED + (_NORM_TYPES[model.config.norm],) + ((RMSNorm,) if model.config.qk_norm else ())
    for name, module in model.named_modules():
        if type(module) not in computed:
            return f"{name or 'the model'} ({type(module).__name__})"
    read = {id(t) for t in _read(model) + _expert_tensors(model)}
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in read:
                return f"the {kind} {name}, which it does not read"
    return None


def _adapted_layers(model: GPT) -> list[nn.Module]:
    """The block layers a served adapter may update, in the order the native step numbers them (csrc/step.cpp's
    Adapted: per block q/k/v, output projection, MLP up, MLP down)."""
    layers = []
    for block in model.blocks:
        dense = not isinstance(block.mlp, MoEFeedForward)  # (a MoE block takes no adapter on its feed-forward)
        layers += [block.attn.qkv, block.attn.proj, block.mlp.fc if dense else None, block.mlp.proj if dense else None]
    return layers


def _misplaced_adapter(model: GPT) -> str | None:
    """A served adapter's layer where the step does not apply updates (anywhere but the block layers above)."""
    placed = {id(layer) for layer in _adapted_layers(model)}
    for name, layer in adapter_sets(model).items():
        if id(layer) not in placed:
            return f"an adapter on {name}"
    return None


def _layer_dtypes(model: GPT, dtype: torch.dtype) -> str | None:
    """A float layer whose weight's dtype is not the embeddings' (the step reads one float format)."""
    for name, module in model.named_modules():
        if type(module) in (Linear, nn.Linear, ExpertWeights) and module.weight.dtype != dtype:
            return f"its {name} layer's {module.weight.dtype} weight beside {dtype} embeddings"
    return None


class FusedStep(Protocol):
    """A Step that may also put several rows in one cache row (slots: each row's cache row, int64; None: row b's
    own), at distinct positions: a lookup proposal checked beside its request's own token; and may read each row's
    first positions from another cache row that holds the same bits there (shared: (rows, 2) int64, a cache row and
    a length per row; None: none), so that rows sharing a prompt's prefix read one copy of it (csrc/step.cpp)."""

    def __call__(
        self,
        model: GPT,
        tokens: Tensor,
        cache: KVCache,
        positions: Tensor | int,
        slots: Tensor | None = None,
        shared: Tensor | None = None,
    ) -> Tensor: ...


def step_for(model: GPT) -> FusedStep | None:
    """decode_one_token through the fused step for model, or None where it does not apply on this machine now."""
    model = base(model)
    if not isinstance(model, GPT) or next(model.parameters()).device.type != "cpu":
        return None
    if not library.load(wait=False):
        return None
    reason = uncovered(model)
    if reason is not None:
        if reason not in _LOGGED:
            _LOGGED.add(reason)
            log.warning("decoding with the eager step: the fused CPU step does not cover %s", reason)
        return None
    if not library.measured("fused_step", _faster_than_eager):
        return None
    plan, planned = _plan(model), adapters_version(model)
    vocab = model.config.vocab_size

    def fused(
        model: GPT,
        tokens: Tensor,
        cache: KVCache,
        positions: Tensor | int,
        slots: Tensor | None = None,
        shared: Tensor | None = None,
    ) -> Tensor:
        nonlocal plan, planned
        rows = tokens.size(0)
        if not covers(rows):
            return _eager(model, tokens, cache, positions, slots)
        if isinstance(positions, int):
            positions = torch.full((rows,), positions, dtype=torch.long)
        if adapters_version(model) != planned:  # an adapter served or removed since the plan
            if _misplaced_adapter(model) is not None:
                return _eager(model, tokens, cache, positions, slots)
            plan, planned = _plan(model), adapters_version(model)
        with torch.profiler.record_function("gptkit::fused_step"):  # one named entry in a profile (a few us)
            logits = plan.step(
                tokens.reshape(rows),
                positions.to(torch.long).contiguous(),
                cache.keys,
                cache.values,
                cache.key_scales,
                cache.value_scales,
                _row_adapters(model, rows),
                _NO_SLOTS if slots is None else slots.to(torch.long).contiguous(),
                _NO_SLOTS if shared is None else shared.to(torch.long).contiguous(),
            )
        return logits[:, :vocab] if logits.size(-1) != vocab else logits  # (rows, V): a padded head's rows dropped

    return fused


def _eager(model: GPT, tokens: Tensor, cache: KVCache, positions: Tensor | int, slots: Tensor | None) -> Tensor:
    """The eager step where the fused one does not take the rows (which must then each have a cache row of its own;
    a shared prefix is read from the row itself, which holds the same bits)."""
    if slots is not None:
        raise InputError(f"rows sharing cache rows need the fused step, which does not take these {tokens.size(0)}")
    return decode_one_token(model, tokens, cache, positions)


def row_limit(rows: int) -> int:
    """The most rows a step of `rows` rows (which covers() takes) may grow to without timing another batch size:
    MAX_ROWS, or the size of WIDE_ROWS that holds it."""
    return next((wide for wide in (MAX_ROWS, *WIDE_ROWS) if wide >= rows), rows)


def covers(rows: int) -> bool:
    """Whether a batch of `rows` rows decodes through the fused step (where step_for gave one): up to MAX_ROWS
    always, more up to the first of WIDE_ROWS that the step did not measure faster at (timed once per machine)."""
    if rows <= MAX_ROWS:
        return True
    for wide in WIDE_ROWS:
        if not library.measured(f"fused_step_{wide}_rows", functools.partial(_faster_than_eager, wide)):
            return False
        if rows <= wide:
            return True
    return False


def _read(model: GPT, gains: bool = False) -> list[Tensor]:
    """The model's tensors the step reads, in the order DecodeStep takes them (_NONE where one is absent); with
    gains, each RMSNorm's gain as it multiplies (its gain offset added, a new fp32 tensor) in place of its weight."""
    _norm = functools.partial(_norm_tensors, gains=gains)
    tensors = [model.tok_emb.weight, model.pos_emb.weight if model.pos_emb is not None else _NONE]
    for block in model.blocks:
        tensors += [
            *_norm(block.norm1),
            *_linear(block.attn.qkv),
            *_linear(block.attn.proj),
            *_norm(block.norm2),
            *_dense_mlp(block.mlp),
        ]
        tensors += [*_norm(block.norm1_post), *_norm(block.norm2_post)]
        tensors += [_norm(block.attn.q_norm)[0], _norm(block.attn.k_norm)[0]]
    return tensors + [*_norm(model.norm_f), *_linear(model.lm_head)]


def _dense_mlp(mlp: nn.Module) -> list[Tensor]:
    """A dense MLP's fc and down tensors: a MoE layer's shared expert's, or _NONE for one without."""
    dense = mlp.shared if isinstance(mlp, MoEFeedForward) else mlp
    return [*_linear(dense.fc), *_linear(dense.proj)] if dense is not None else [_NONE] * 6


def _expert_tensors(model: GPT) -> list[Tensor]:
    """Each MoE layer's router, expert stacks (weight, scales of an int8 or int4 stack, bias) and shared gate, in
    layer order (csrc's kMoeTensors per MoE layer)."""
    tensors = []
    for block in model.blocks:
        mlp = block.mlp
        if isinstance(mlp, MoEFeedForward):
            stacks = [
                [e.weight, e.scales if isinstance(e, QUANTIZED_EXPERTS) else _NONE, _NONE if e.bias is None else e.bias]
                for e in (mlp.fc, mlp.proj)
            ]
            gate = _linear(mlp.shared_gate) if mlp.shared_gate is not None else [_NONE] * 3
            tensors += [*_linear(mlp.router), *stacks[0], *stacks[1], *gate]
    return tensors


def _moe_settings(config: ModelConfig) -> tuple[list[int], list[int]]:
    """csrc/step_layout.h's kExperts..kExpertHidden (zeros for a dense model), and per layer the dense MLP's hidden
    size (a MoE layer's shared expert's, 0 for none) and whether it is a mixture of experts."""
    moe = [config.is_moe_layer(i) for i in range(config.n_layer)]
    shared = config.moe_shared_hidden or 0
    experts = [config.n_experts, config.n_experts_per_token, int(config.moe_renormalize), config.expert_hidden]
    hidden = [shared if is_moe else config.ffn_hidden for is_moe in moe]
    return (experts if config.n_experts else [0, 0, 0, 0]), hidden + [int(is_moe) for is_moe in moe]


def _plan(model: GPT) -> torch.ScriptObject:
    """The native step over model's weights (shared, not copied; norms and biases as fp32 copies)."""
    config = model.config
    dtype = model.tok_emb.weight.dtype
    settings = [
        config.n_layer,
        config.n_embd,
        config.n_head,
        config.n_kv_head,
        config.head_dim,
        config.ffn_hidden,
        config.padded_vocab_size,
        NORMS[config.norm],
        ACTIVATIONS[config.activation],
        POSITIONS[config.position],
        int(dtype == torch.bfloat16),
    ]
    qk_norm = QK_NORMS[config.qk_norm_scope] if config.qk_norm else 0
    rotary = config.rotary_dim if config.position == "rope" else 0  # (a head of any width rotates nothing)
    settings += [NORM_POSITIONS[config.norm_position], int(config.parallel_residual), qk_norm, rotary]
    experts, per_layer = _moe_settings(config)
    settings += experts
    settings += [config.layer_window(i) or 0 for i in range(config.n_layer)]  # csrc/step.cpp: 0 is full attention
    settings += per_layer
    tensors = [t.detach() for t in _read(model, gains=True)]
    expert_tensors = [t.detach() for t in _expert_tensors(model)]
    if not model.__dict__.get("_gptkit_huge_pages"):  # once per model: its weights stream faster from 2 MiB pages
        model.__dict__["_gptkit_huge_pages"] = True
        ops.back_with_huge_pages(tensors + expert_tensors)
    tensors += _rope_tables(config) + expert_tensors
    plan = torch.classes.gptkit.DecodeStep(settings, _numbers(config, dtype), tensors)
    _add_adapters(plan, model)
    return plan


def _numbers(config: ModelConfig, dtype: torch.dtype) -> list[float]:
    """The step's numbers in csrc/step.cpp's Number order (a soft-cap of 0: none; an attention scale of 0: the
    default 1/sqrt(head_dim))."""
    # The eager model rounds the embedding scale to the weights' dtype first (as Gemma does).
    embedding_scale = 1.0
    if config.embedding_scale is not None:
        embedding_scale = torch.tensor(config.embedding_scale, dtype=dtype).item()
    attention = [config.attn_scale or 0.0, config.attn_softcap or 0.0]
    logits = [config.logit_scale, config.logit_softcap or 0.0]
    return [config.norm_eps, embedding_scale, config.residual_scale, *attention, *logits]


def _rope_tables(config: ModelConfig) -> list[Tensor]:
    """Each layer's RoPE inverse frequencies (n_layer, rotary_dim / 2) and cos/sin factor (n_layer,), fp32, from
    gptkit.positions; a factor of 0 marks a layer without RoPE."""
    half = config.rotary_dim // 2 if config.position == "rope" else 0
    freqs, factors = torch.zeros(config.n_layer, half), torch.zeros(config.n_layer)
    for index in range(config.n_layer):
        rope = layer_rope(config, index) if config.position == "rope" else None
        if rope is not None:
            base, scaling = rope
            freqs[index] = scaled_frequencies(base, config.rotary_dim, scaling, config.block_size)
            factors[index] = 1.0 if scaling is None else scaling_attention_factor(scaling, config.block_size)
    return [freqs, factors]


def _add_adapters(plan: torch.ScriptObject, model: GPT) -> None:
    """Each served adapter's updates of the block layers, by adapter number, into the native step."""
    layers = _adapted_layers(model)
    for slot in sorted({k for layer in adapter_sets(model).values() for k in layer.updates}):
        tensors, scales = [], []
        for layer in layers:
            update = layer.updates.get(slot) if isinstance(layer, AdapterSet) else None
            a, b, scale = update if update is not None else (_NONE, _NONE, 0.0)
            tensors += [a.contiguous(), b.contiguous()]
            scales.append(scale)
        plan.set_adapter(slot, tensors, scales)


def _row_adapters(model: GPT, rows: int) -> Tensor:
    """Each row's adapter number for the forward under way (multi_lora.rows_using; 0: the base), or an empty
    tensor when no row has one."""
    chosen = row_adapters(model)
    if chosen is None:
        return _NO_ADAPTERS
    if chosen.numel() != rows:
        raise InputError(f"rows_using named adapters for {chosen.numel()} rows, the step has {rows}")
    return chosen.contiguous()


_NONE = torch.empty(0)
_NO_ADAPTERS = torch.empty(0, dtype=torch.long)
_NO_SLOTS = torch.empty(0, dtype=torch.long)  # each row its own cache row (slots), no shared prefix (shared)


def _norm_tensors(norm: nn.Module | None, gains: bool) -> list[Tensor]:
    """A norm's weight (with gains: as it multiplies, an RMSNorm's gain offset added) and shift, _NONE for what it
    lacks."""
    if norm is None:
        return [_NONE, _NONE]
    gain = norm.weight
    if gains and isinstance(norm, RMSNorm) and norm.gain_offset:
        gain = norm.weight.float() + norm.gain_offset  # as RMSNorm computes it: (offset + w) in fp32
    return [gain, norm.bias if getattr(norm, "bias", None) is not None else _NONE]


def _linear(layer: nn.Module) -> list[Tensor]:
    layer = layer.base if isinstance(layer, AdapterSet) else layer  # (its updates: _add_adapters)
    bias = layer.bias if layer.bias is not None else _NONE
    if isinstance(layer, (Int8Linear, Int4Linear)):
        return [layer.weight, layer.scales, bias]
    return [layer.weight, _NONE, bias]


@torch.no_grad()
def _faster_than_eager(rows: int = 1) -> bool:
    """Whether decode steps of a small random model (4 layers, 512 wide) run faster fused than eager here: 16 steps
    of one row from position 0; of more rows, about 64 rows' worth (at least 2 steps) past position 96, where a
    batch decodes after prompts of about a hundred tokens (the eager step's attention costs more there)."""
    config = ModelConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=512)
    model = GPT(config).eval()
    start, count = (0, 16) if rows == 1 else (96, max(2, 64 // rows))
    cache = KVCache(config, rows, 64 if rows == 1 else 128)
    tokens = torch.zeros(rows, 1, dtype=torch.long)
    plan = _plan(model)
    positions = [torch.full((rows,), p) for p in range(start, start + count)]
    with inference(model):
        return faster(
            lambda: [
                plan.step(tokens[:, 0], p, cache.keys, cache.values, [], [], _NO_ADAPTERS, _NO_SLOTS, _NO_SLOTS)
                for p in positions
            ],
            lambda: [decode_one_token(model, tokens, cache, p) for p in range(start, start + count)],
            rounds=3,
        )
