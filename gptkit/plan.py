"""Size a training run before it starts: parameters, FLOPs, compute-optimal tokens, memory and wall time.

Parameter counts, FLOPs per token and KV-cache bytes come from gptkit.accounting (docs/spec.md section 2); this module
adds the memory of training (weights, gradients, AdamW state, activations) and the Chinchilla rule of thumb.

Activation memory follows what autograd actually keeps for gptkit's GPT (gptkit.model), per token and layer:
- each norm keeps its input and per-row statistics (LayerNorm: mean and 1/std; RMSNorm: 1/rms plus its
  normalised output), and the linear after it keeps its input (the norm's output);
- the fused qkv projection's output is kept while a view of it is an input to scaled_dot_product_attention; RoPE
  makes new q and k tensors, grouped-query attention makes repeated k and v tensors of full width;
- SDPA's fused kernels keep their output and a log-sum-exp per head instead of the T x T weights;
- the output projection reads SDPA's output in place (same storage);
- the MLP keeps ffn values per token for ReLU (its output), 2 ffn for GELU (input and output) and 4 ffn for
  SwiGLU (the [gate; up] output, SiLU(gate) and the product);
- the head keeps the final norm's tensors, the logits and their log-softmax, and backward adds two
  vocabulary-sized gradients (of the log-probabilities and of the logits) while the logits are still held.
tests/model/test_plan.py checks these counts against the tensors autograd saves and a measured peak.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from gptkit.accounting import (
    DTYPE_BYTES,
    attention_params,
    block_norm_count,
    kv_cache_bytes,
    matmul_params,
    mlp_params,
    param_breakdown,
    training_flops_per_token,
)
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError

# Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models"): about 20 tokens per parameter.
CHINCHILLA_TOKENS_PER_PARAM = 20
GIB = 2**30
TRAIN_DTYPES = ("float32", "bfloat16", "float16")
FP32 = DTYPE_BYTES["float32"]


@dataclass
class PlanSettings:
    """What the user plans: a run's size, precision and hardware; None means "derive it"."""

    tokens: int | None = field(
        default=None,
        metadata={"metavar": "D", "help": "training tokens (default: compute-optimal, 20 per parameter)"},
    )
    batch_size: int = field(default=8, metadata={"metavar": "B", "help": "sequences per optimiser step on one device"})
    block_size: int | None = field(
        default=None, metadata={"metavar": "T", "help": "training context (default: the model's block_size)"}
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "float32, or bfloat16/float16 autocast mixed precision", "choices": TRAIN_DTYPES},
    )
    optimizer: str = field(
        default="adamw",
        metadata={
            "help": "adamw, or muon (on the blocks' matrices, AdamW on the rest): the optimiser state it keeps",
            "choices": ("adamw", "muon"),
        },
    )
    device_memory: float | None = field(default=None, metadata={"metavar": "GiB", "help": "memory of one device"})
    flops: float | None = field(
        default=None, metadata={"metavar": "TFLOP/s", "help": "peak TFLOP/s of one device at dtype"}
    )
    mfu: float = field(
        default=0.4, metadata={"metavar": "MFU", "help": "model FLOPs utilisation: the share of peak a run reaches"}
    )
    budget: float | None = field(
        default=None,
        metadata={
            "metavar": "FLOP",
            "help": "a FLOP budget to size a compute-optimal model for (default: this run's FLOPs)",
        },
    )
    kv_context: int | None = field(
        default=None, metadata={"metavar": "T", "help": "inference context for the KV cache (default: the training T)"}
    )
    kv_batch: int = field(default=1, metadata={"metavar": "B", "help": "inference batch for the KV cache"})
    kv_cache: str | None = field(
        default=None,
        metadata={
            "help": "the KV cache's elements: int8 (a scale per token and head), or by default the training dtype",
            "choices": ("int8",),
        },
    )

    def validate(self, config: ModelConfig) -> None:
        """Raise ConfigError naming the first setting this model cannot take."""
        for name in ("tokens", "batch_size", "block_size", "kv_context", "kv_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("device_memory", "flops", "budget"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name.replace('_', '-')} must be > 0, got {value}")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.dtype not in TRAIN_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(TRAIN_DTYPES)}; got {self.dtype!r}")
        for name in ("block_size", "kv_context"):
            value = getattr(self, name)
            if config.position == "learned" and value is not None and value > config.block_size:
                raise ConfigError(
                    f"{name.replace('_', '-')} {value} exceeds the {config.block_size} learned positions of this model"
                )


@dataclass(frozen=True)
class Memory:
    """Bytes of one training step on one device, by part."""

    weights: int
    gradients: int
    optimizer: int  # AdamW: two fp32 moments per parameter; Muon: one momentum buffer per block matrix
    autocast_copies: int  # low-precision copies of the weights that autocast keeps during forward
    optimizer_step: int  # temporaries of AdamW's multi-tensor step, alive only after the activations are freed
    activations: int  # without checkpointing, including the head's logits
    activations_checkpointed: int  # checkpointing every block: block inputs plus one block's tensors
    total: int
    total_checkpointed: int


@dataclass(frozen=True)
class Plan:
    """Everything `gptkit plan` reports."""

    params: int
    tokens: int
    tokens_source: str  # "given" or "compute-optimal"
    block_size: int
    batch_size: int
    steps: int  # optimiser steps of batch_size x block_size tokens
    training_flops: float
    training_flops_6nd: float  # the 6 N D rule alone, for comparison
    compute_optimal_tokens: int
    budget_flops: float
    budget_optimal_params: int
    budget_optimal_tokens: int
    memory: Memory
    fits: bool | None  # None when no device memory was given
    fits_checkpointed: bool | None
    kv_cache: dict[str, Any]  # context, batch, dtype, bytes, windowed_layers, window
    wall_seconds: float | None  # None when no FLOP/s was given
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """All figures as a JSON-able dict."""
        return asdict(self)


def compute_optimal_tokens(params: int) -> int:
    """Chinchilla's compute-optimal training tokens: about 20 per parameter."""
    return CHINCHILLA_TOKENS_PER_PARAM * params


def compute_optimal_size(budget_flops: float) -> tuple[int, int]:
    """(parameters N, tokens D) spending budget_flops with C = 6 N D and D = 20 N, so N = sqrt(C / 120)."""
    params = math.sqrt(budget_flops / (6 * CHINCHILLA_TOKENS_PER_PARAM))
    return round(params), round(CHINCHILLA_TOKENS_PER_PARAM * params)


def _norm_bytes(config: ModelConfig, compute: int) -> int:
    """Per token: what one norm and the linear reading its output keep for backward."""
    d = config.n_embd
    if config.norm == "rmsnorm":  # written out in gptkit.model: keeps input, 1/rms and the normalised fp32 tensor
        kept = FP32 * (2 * d + 1)
    else:  # fused layer_norm keeps its input and two statistics per row
        kept = FP32 * (d + 2)
    return kept + compute * d  # the following linear's input


def _attention_bytes(config: ModelConfig, compute: int) -> int:
    """Per token: what one attention sublayer keeps for backward (SDPA with a fused kernel)."""
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    rope = config.position == "rope"
    # RoPE makes new q and k tensors; v stays a view of the fused qkv output, which it keeps alive. Grouped
    # heads add nothing: SDPA reads the shared key/value heads in place (enable_gqa).
    rotated = q + kv if rope else 0
    elements = rotated + (q + 2 * kv) + q  # + the fused qkv output + SDPA's output
    return compute * elements + FP32 * config.n_head  # log-sum-exp per head


def _mlp_bytes(config: ModelConfig, compute: int) -> int:
    """Per token: what one feed-forward sublayer keeps for backward."""
    per_hidden = {"relu": 1, "relu2": 2, "gelu": 2, "gelu_tanh": 2, "swiglu": 4, "geglu": 4}[config.activation]
    return compute * per_hidden * config.ffn_hidden


def layer_activation_bytes(config: ModelConfig, dtype: str = "float32") -> int:
    """Bytes one block keeps per token for backward (dropout 0)."""
    compute = DTYPE_BYTES[dtype]
    dropout_masks = 2 * config.n_embd if config.dropout > 0 else 0  # two residual-branch masks, one byte each
    norms = block_norm_count(config) * _norm_bytes(config, compute)
    return norms + _attention_bytes(config, compute) + _mlp_bytes(config, compute) + dropout_masks


def head_activation_bytes(config: ModelConfig, dtype: str = "float32") -> int:
    """Bytes per token outside the blocks: ids, targets, the final norm, logits and the loss's tensors."""
    compute = DTYPE_BYTES[dtype]
    ids_and_targets = 2 * 8  # int64
    if config.norm_position == "pre":
        norm = _norm_bytes(config, compute)
    else:  # post-norm: the first block's qkv reads the embedding sum (the last norm is counted in its block)
        norm = compute * config.n_embd
    # logits (held by the caller), their fp32 log-softmax, and in backward the two fp32 gradients
    vocab = (compute + 3 * FP32) * config.padded_vocab_size
    return ids_and_targets + norm + vocab


def block_matrix_params(config: ModelConfig) -> int:
    """Parameters in the blocks' weight matrices (what optim.name muon gives Muon; biases and norms excluded)."""
    unbiased = dataclasses.replace(config, attn_bias=False, mlp_bias=False)
    return config.n_layer * (attention_params(unbiased) + mlp_params(unbiased))


def training_memory(
    config: ModelConfig, batch_size: int, block_size: int, dtype: str = "float32", optimizer_name: str = "adamw"
) -> Memory:
    """Peak bytes of a training step: weights, gradients and optimiser state, plus activations or the step's
    temporaries (whichever is larger), summed as if all were alive at once."""
    n = param_breakdown(config).total
    weights = gradients = FP32 * n  # fp32 master weights in every mode here
    # Muon keeps one momentum buffer per block matrix (its Newton-Schulz temporaries are one batch's of same-shape
    # matrices, at most gptkit.optim.MAX_BATCH_ELEMENTS entries or one matrix, in its Newton-Schulz dtype);
    # AdamW two moments for every parameter it steps.
    matrices = block_matrix_params(config) if optimizer_name == "muon" else 0
    optimizer = FP32 * matrices + 2 * FP32 * (n - matrices)
    autocast_copies = DTYPE_BYTES[dtype] * matmul_params(config) if dtype != "float32" else 0
    tokens = batch_size * block_size
    layer, head = layer_activation_bytes(config, dtype), head_activation_bytes(config, dtype)
    activations = tokens * (config.n_layer * layer + head)
    block_inputs = FP32 * config.n_embd  # the residual stream stays fp32 under autocast
    checkpointed = tokens * (config.n_layer * block_inputs + layer + head)
    # AdamW's foreach step holds about one fp32 temporary per parameter (measured on CPU); it runs after backward
    # has freed the activations, so the peak takes whichever of the two is larger.
    step = FP32 * (n - matrices)
    fixed = weights + gradients + optimizer + autocast_copies
    return Memory(
        weights,
        gradients,
        optimizer,
        autocast_copies,
        step,
        activations,
        checkpointed,
        fixed + max(activations, step),
        fixed + max(checkpointed, step),
    )


def make_plan(config: ModelConfig, settings: PlanSettings) -> Plan:
    """Every figure of `gptkit plan` for config under settings."""
    settings.validate(config)
    n = param_breakdown(config).total
    block_size = settings.block_size or config.block_size
    optimal = compute_optimal_tokens(n)
    tokens = settings.tokens if settings.tokens is not None else optimal
    flops = float(training_flops_per_token(config, block_size)) * tokens
    budget = settings.budget if settings.budget is not None else flops
    budget_params, budget_tokens = compute_optimal_size(budget)
    memory = training_memory(config, settings.batch_size, block_size, settings.dtype, settings.optimizer)
    limit = settings.device_memory * GIB if settings.device_memory is not None else None
    kv_context = settings.kv_context or block_size
    # Inference usually runs in the training precision's compute dtype, unless the cache is quantised.
    kv_dtype = settings.kv_cache or settings.dtype
    kv = {
        "context": kv_context,
        "batch": settings.kv_batch,
        "dtype": kv_dtype,
        "bytes": kv_cache_bytes(config, settings.kv_batch, kv_context, kv_dtype),
        # Layers holding at most sliding_window positions (the bytes above count min(context, W) for them).
        "windowed_layers": sum(config.layer_window(i) is not None for i in range(config.n_layer)),
        "window": config.sliding_window,
    }
    wall = flops / (settings.flops * 1e12 * settings.mfu) if settings.flops is not None else None
    return Plan(
        params=n,
        tokens=tokens,
        tokens_source="given" if settings.tokens is not None else "compute-optimal",
        block_size=block_size,
        batch_size=settings.batch_size,
        steps=math.ceil(tokens / (settings.batch_size * block_size)),
        training_flops=flops,
        training_flops_6nd=6.0 * n * tokens,
        compute_optimal_tokens=optimal,
        budget_flops=budget,
        budget_optimal_params=budget_params,
        budget_optimal_tokens=budget_tokens,
        memory=memory,
        fits=memory.total <= limit if limit is not None else None,
        fits_checkpointed=memory.total_checkpointed <= limit if limit is not None else None,
        kv_cache=kv,
        wall_seconds=wall,
        notes=_notes(config, settings),
    )


def _notes(config: ModelConfig, settings: PlanSettings) -> list[str]:
    """The caveats that apply to this plan."""
    notes = [
        "memory total sums weights, gradients, AdamW moments and the larger of activations and the optimiser "
        "step's temporaries as if all were alive at once (an upper bound); it excludes the framework's own "
        "overhead (CUDA context, allocator caching: often 0.5-1 GiB on a GPU)",
    ]
    if settings.dtype == "float32":
        notes.append(
            "mixed precision (--dtype bfloat16/float16) keeps fp32 weights, gradients and AdamW moments "
            "(16 bytes per parameter) plus autocast's low-precision weight copies, and stores matmul outputs in "
            "16 bits (fewer activation bytes)"
        )
    else:
        notes.append(
            f"{settings.dtype} autocast: fp32 master weights, gradients and AdamW moments; matmul outputs in "
            f"{settings.dtype}, norms and the residual stream in fp32 (activation bytes are approximate)"
        )
    if config.dropout > 0:
        notes.append(
            "dropout > 0: attention without a fused dropout kernel (e.g. on CPU) keeps B x heads x T x T "
            "weights per layer, not counted here"
        )
    if settings.flops is None:
        notes.append("pass --flops (peak TFLOP/s of the device) to estimate the wall time")
    return notes
