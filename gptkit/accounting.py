"""Parameter, compute and memory accounting from a ModelConfig alone (docs/spec.md section 2)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from gptkit.config import GATED, ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameter counts by part of the model; tied weights are counted once, under token_embedding."""

    token_embedding: int
    position_embedding: int
    attention: int  # all blocks
    mlp: int  # all blocks
    norms: int  # all blocks plus the final norm (and the q/k norms of qk_norm, the post-norms of sandwich)
    lm_head: int  # 0 when tied, except for a head bias
    total: int

    def to_dict(self) -> dict[str, int]:
        """The counts as a plain dict."""
        return asdict(self)


def attention_params(config: ModelConfig) -> int:
    """Parameters of one block's attention: fused Q, K, V projection and the output projection."""
    qkv_width = (config.n_head + 2 * config.n_kv_head) * config.head_dim
    attn_width = config.n_head * config.head_dim
    biases = (qkv_width + config.n_embd) if config.attn_bias else 0
    return config.n_embd * qkv_width + attn_width * config.n_embd + biases


def mlp_params(config: ModelConfig) -> int:
    """Parameters of one block's feed-forward network."""
    fc_width = config.ffn_hidden * (2 if config.activation in GATED else 1)
    biases = (fc_width + config.n_embd) if config.mlp_bias else 0
    return config.n_embd * fc_width + config.ffn_hidden * config.n_embd + biases


def expert_params(config: ModelConfig) -> int:
    """Parameters of one routed expert of a mixture-of-experts layer (gptkit.moe): its fc and proj, with biases."""
    hidden = config.expert_hidden
    fc_width = hidden * (2 if config.activation in GATED else 1)
    biases = (fc_width + config.n_embd) if config.mlp_bias else 0
    return config.n_embd * fc_width + hidden * config.n_embd + biases


def layer_mlp_params(config: ModelConfig, index: int) -> int:
    """Parameters of layer index's feed-forward: dense, or a mixture of experts' router, experts and shared expert
    (with its gate)."""
    if not config.is_moe_layer(index):
        return mlp_params(config)
    shared = 0
    if config.moe_shared_hidden is not None:
        shared = mlp_params(dataclasses.replace(config, ffn_hidden=config.moe_shared_hidden))
        shared += config.n_embd if config.moe_shared_gate else 0
    return config.n_embd * config.n_experts + config.n_experts * expert_params(config) + shared


def inactive_params(config: ModelConfig) -> int:
    """Parameters a token does not use: the routed experts outside its top k, in every MoE layer (0 when dense)."""
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layer))
    if not moe_layers:
        return 0
    return moe_layers * (config.n_experts - config.n_experts_per_token) * expert_params(config)


def active_params(config: ModelConfig) -> int:
    """The parameters one token uses: the total less the experts its router did not choose (the total when dense)."""
    return param_breakdown(config).total - inactive_params(config)


def norm_params(config: ModelConfig) -> int:
    """Parameters of one normalisation layer: a gain, plus a shift for LayerNorm with norm_bias."""
    has_shift = config.norm == "layernorm" and config.norm_bias
    return config.n_embd * (2 if has_shift else 1)


def block_norm_count(config: ModelConfig) -> int:
    """Norms over the width in one block: two, four with sandwich norms (before and after each sublayer)."""
    return 4 if config.norm_position == "sandwich" else 2


def qk_norm_params(config: ModelConfig) -> int:
    """Gains of one block's q and k norms: a head's width each (scope head) or all of q's and k's (scope width)."""
    if not config.qk_norm:
        return 0
    if config.qk_norm_scope == "width":
        return (config.n_head + config.n_kv_head) * config.head_dim
    return 2 * config.head_dim


def param_breakdown(config: ModelConfig) -> ParamBreakdown:
    """The exact parameter count by part, equal to the numel of GPT(config)'s distinct parameters (a padded
    vocabulary's rows included: they are held, trained and saved)."""
    vocab = config.padded_vocab_size
    token_embedding = vocab * config.n_embd
    position_embedding = config.block_size * config.n_embd if config.position == "learned" else 0
    attention = config.n_layer * attention_params(config)
    mlp = sum(layer_mlp_params(config, i) for i in range(config.n_layer))
    norms = config.n_layer * block_norm_count(config) + (0 if config.norm_position == "post" else 1)
    norms = norms * norm_params(config) + config.n_layer * qk_norm_params(config)
    lm_head = (0 if config.tie_embeddings else vocab * config.n_embd) + (vocab if config.lm_head_bias else 0)
    total = token_embedding + position_embedding + attention + mlp + norms + lm_head
    return ParamBreakdown(token_embedding, position_embedding, attention, mlp, norms, lm_head, total)


def matmul_params(config: ModelConfig) -> int:
    """Parameters that take part in the per-token arithmetic: all but lookup-only embeddings (norms and biases too).

    The LM head always multiplies (when tied, through the token embedding); position tables and an untied
    token embedding are only looked up.
    """
    parts = param_breakdown(config)
    lookup_only = parts.position_embedding + (0 if config.tie_embeddings else parts.token_embedding)
    return parts.total - lookup_only


def decode_weight_bytes(config: ModelConfig, bytes_per_weight: float) -> float:
    """The weight bytes one decoded token reads at batch 1, at bytes_per_weight: each parameter it multiplies by,
    once (matmul_params less the experts its routers did not choose); the rows it looks up left out."""
    return (matmul_params(config) - inactive_params(config)) * bytes_per_weight


def forward_flops_per_token(config: ModelConfig, context: int | None = None) -> int:
    """FLOPs of one forward pass per token: 2 N plus 4 L T d for QK^T and AV (PaLM, Chowdhery et al. 2022, app. B),
    with min(T, W) in place of T for a layer with sliding window W.

    N counts the real vocabulary only: a padded LM head's extra rows are multiplied, but they are no useful work; and
    only the experts a token chose: the active parameters of a mixture of experts.
    """
    T = config.block_size if context is None else context
    # A layer with sliding window W scores min(T, W) keys per query.
    keys = sum(kv_positions(config, i, T) for i in range(config.n_layer))
    attention = 4 * keys * config.n_head * config.head_dim
    # A mixture of experts multiplies by the k experts each token chose, not by all of them.
    return 2 * (matmul_params(dataclasses.replace(config, vocab_multiple=1)) - inactive_params(config)) + attention


def training_flops_per_token(config: ModelConfig, context: int | None = None) -> int:
    """FLOPs of forward plus backward per token: three forward passes, i.e. 6 N + 12 L T d."""
    return 3 * forward_flops_per_token(config, context)


# An int8 KV cache keeps one fp32 scale beside each head's vector of head_dim values (gptkit.kv_cache).
KV_SCALE_BYTES = {"int8": 4}


def kv_cache_bytes(config: ModelConfig, batch_size: int, context: int, dtype: str = "float16") -> int:
    """2 (keys and values) x B x n_kv_head x (head_dim x bytes per element + a scale's bytes for int8), summed
    over the layers' positions: T for a full layer, min(T, W) for one with sliding window W (its ring)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    positions = sum(kv_positions(config, i, context) for i in range(config.n_layer))
    vectors = 2 * batch_size * positions * config.n_kv_head
    return vectors * (config.head_dim * DTYPE_BYTES[dtype] + KV_SCALE_BYTES.get(dtype, 0))


def kv_positions(config: ModelConfig, layer_index: int, context: int) -> int:
    """Positions layer layer_index's KV cache holds for a context of `context` tokens (gptkit.kv_cache)."""
    window = config.layer_window(layer_index)
    return context if window is None else min(context, window)
