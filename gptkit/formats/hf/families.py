"""The Hugging Face model families gptkit converts: for each, its weight layout, the config.json keys that map one to
one onto ModelConfig fields, the fields every model of the family has, and its config class's defaults.

The defaults are those of transformers 5's configuration_*.py, for the keys a config.json may omit. What a family
computes beyond the one-to-one keys (RoPE, windows, scales) is read and written in config_map.py, rope.py and
windows.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gptkit.formats.hf.experts import (
    read_mixtral,
    read_olmoe,
    read_qwen2_moe,
    read_qwen3_moe,
    write_mixtral,
    write_olmoe,
    write_qwen2_moe,
    write_qwen3_moe,
)
from gptkit.formats.hf.extras import (
    Reader,
    Writer,
    read_gemma,
    read_granite,
    read_smollm3,
    write_gemma,
    write_granite,
    write_smollm3,
)
from gptkit.formats.hf.layouts import (
    GEMMA2,
    GEMMA3,
    GPT2,
    GPT_NEOX,
    GRANITE,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    OLMO2,
    OLMOE,
    PHI3,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    SMOLLM3,
    Layout,
)

# HF activation names that compute exactly gptkit's (transformers' activations.py): the tanh forms differ
# only in how the constant sqrt(2/pi) is written.
GELU_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
}
SWIGLU_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}
# Gemma gates with the tanh GELU; gptkit's geglu is exactly that.
GEGLU_ACTIVATIONS = {name: "geglu" for name, ours in GELU_ACTIVATIONS.items() if ours == "gelu_tanh"}

_CORE_KEYS = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "block_size",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "num_key_value_heads": "n_kv_head",
    "hidden_size": "n_embd",
    "intermediate_size": "ffn_hidden",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}
_BIAS_KEYS = {"attention_bias": "attn_bias", "mlp_bias": "mlp_bias"}
_GEMMA_KEYS = {
    **_CORE_KEYS,
    "attention_bias": "attn_bias",
    "attn_logit_softcapping": "attn_softcap",
    "final_logit_softcapping": "logit_softcap",
}
_ROPE_MODEL = {
    "norm": "rmsnorm",
    "norm_bias": False,  # RMSNorm has none
    "norm_position": "pre",
    "position": "rope",
    "activation": "swiglu",
    "lm_head_bias": False,
}
_NO_ACTIVATION = {key: value for key, value in _ROPE_MODEL.items() if key != "activation"}  # GPT-NeoX names one
_GEMMA_FIXED = {
    **_ROPE_MODEL,
    "norm_position": "sandwich",
    "activation": "geglu",
    "norm_gain_offset": 1.0,
    "mlp_bias": False,
}


WindowRule = Literal["none", "all", "qwen", "layer_types", "smollm3"]


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family, as far as the config mapping needs it."""

    layout: Layout
    keys: dict[str, str]  # config.json key -> ModelConfig field, the same value on both sides
    fixed: dict[str, Any]  # ModelConfig fields every model of the family has
    defaults: dict[str, Any]  # the config class's defaults for keys a config.json may omit
    activations: dict[str, str] = field(default_factory=lambda: SWIGLU_ACTIVATIONS)  # HF name -> gptkit activation
    activation_key: str = "hidden_act"
    windows: WindowRule = "none"  # which layers attend in a window, and how config.json says so (windows.py)
    partial_rotary: bool = False  # the family's RoPE honours partial_rotary_factor (else it must be 1)
    per_layer_rope: bool = False  # rope_parameters may be nested by layer type (Gemma 3)
    head_dim_key: bool = True  # the modeling code reads head_dim from config.json (GPT-NeoX derives it)
    theta_key: str = "rope_theta"  # the top-level key of RoPE's base, read when rope_parameters lacks it
    partial_key: str = "partial_rotary_factor"  # likewise for the rotated fraction of each head
    default_partial: float = 1.0  # the rotated fraction when config.json names none
    rope_aliases: dict[str, str] = field(default_factory=dict)  # early rope_type names the config class renames
    rope_types: frozenset[str] | None = None  # the scaling rules the config class accepts (None: all of them)
    window_period: int | None = None  # layer_types by default: a full layer every this many (None: config's key)
    read_extra: Reader | None = None  # the family's settings beyond one key per field (extras.py)
    write_extra: Writer | None = None

    @property
    def model_type(self) -> str:
        """The family's model_type in config.json."""
        return self.layout.model_type


_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0}
_GEMMA_DEFAULTS = {
    **_LLAMA_DEFAULTS,
    "tie_word_embeddings": True,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}

GPT2_FAMILY = Family(
    GPT2,
    keys={
        "vocab_size": "vocab_size",
        "n_positions": "block_size",
        "n_layer": "n_layer",
        "n_head": "n_head",
        "n_embd": "n_embd",
        "n_inner": "ffn_hidden",
        "layer_norm_epsilon": "norm_eps",
        "tie_word_embeddings": "tie_embeddings",
    },
    fixed={"norm": "layernorm", "norm_position": "pre", "position": "learned", "lm_head_bias": False},
    defaults={
        "n_positions": 1024,
        "n_inner": None,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
    },
    activations=GELU_ACTIVATIONS,
    activation_key="activation_function",
)
LLAMA_FAMILY = Family(
    LLAMA,
    keys={**_CORE_KEYS, **_BIAS_KEYS},
    fixed=_ROPE_MODEL,
    defaults={**_LLAMA_DEFAULTS, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
)
MISTRAL_FAMILY = Family(
    MISTRAL,
    keys=_CORE_KEYS,
    fixed={**_ROPE_MODEL, "attn_bias": False, "mlp_bias": False},
    defaults={**_LLAMA_DEFAULTS, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    windows="all",
)
_QWEN_DEFAULTS = {
    **_LLAMA_DEFAULTS,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
QWEN2_FAMILY = Family(
    QWEN2,
    keys=_CORE_KEYS,
    fixed={**_ROPE_MODEL, "attn_bias": True, "mlp_bias": False},
    defaults=_QWEN_DEFAULTS,
    windows="qwen",
)
QWEN3_FAMILY = Family(
    QWEN3,
    keys={**_CORE_KEYS, "attention_bias": "attn_bias"},
    fixed={**_ROPE_MODEL, "mlp_bias": False, "qk_norm": True},
    defaults={**_QWEN_DEFAULTS, "attention_bias": False, "head_dim": 128},
    windows="qwen",
)
GEMMA2_FAMILY = Family(
    GEMMA2,
    keys=_GEMMA_KEYS,
    fixed=_GEMMA_FIXED,
    defaults={
        **_GEMMA_DEFAULTS,
        "max_position_embeddings": 8192,
        "use_bidirectional_attention": None,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    activations=GEGLU_ACTIVATIONS,
    activation_key="hidden_activation",
    windows="layer_types",
    window_period=2,
    read_extra=read_gemma,
    write_extra=write_gemma,
)
GEMMA3_FAMILY = Family(
    GEMMA3,
    keys=_GEMMA_KEYS,
    fixed={**_GEMMA_FIXED, "qk_norm": True},
    defaults={
        **_GEMMA_DEFAULTS,
        "max_position_embeddings": 131072,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "sliding_window_pattern": 6,
    },
    activations=GEGLU_ACTIVATIONS,
    activation_key="hidden_activation",
    windows="layer_types",
    per_layer_rope=True,
    read_extra=read_gemma,
    write_extra=write_gemma,
)
PHI3_FAMILY = Family(
    PHI3,
    keys=_CORE_KEYS,
    fixed={**_ROPE_MODEL, "attn_bias": False, "mlp_bias": False},
    defaults={
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
    },
    windows="all",
    partial_rotary=True,
    rope_aliases={"su": "longrope", "yarn": "longrope"},  # Phi3Config's reading of its early LongRoPE names
    rope_types=frozenset({"longrope"}),  # Phi3Config.validate_rope refuses the others
)
SMOLLM3_FAMILY = Family(
    SMOLLM3,
    keys={**_CORE_KEYS, **_BIAS_KEYS},
    fixed=_ROPE_MODEL,
    defaults={
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 32768,
        "rope_theta": 2000000.0,  # SmolLM3Config.default_theta
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "no_rope_layer_interval": 4,
    },
    windows="smollm3",
    read_extra=read_smollm3,
    write_extra=write_smollm3,
)
OLMO2_FAMILY = Family(
    OLMO2,
    keys={**_CORE_KEYS, "attention_bias": "attn_bias"},
    fixed={
        **_ROPE_MODEL,
        "norm_position": "sublayer_post",
        "mlp_bias": False,
        "qk_norm": True,
        "qk_norm_scope": "width",
    },
    defaults={**_LLAMA_DEFAULTS, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "attention_bias": False},
)
GPT_NEOX_FAMILY = Family(
    GPT_NEOX,
    keys={
        **{key: ours for key, ours in _CORE_KEYS.items() if key not in ("num_key_value_heads", "rms_norm_eps")},
        "layer_norm_eps": "norm_eps",
        "attention_bias": "attn_bias",
        "use_parallel_residual": "parallel_residual",
    },
    fixed={**_NO_ACTIVATION, "norm": "layernorm", "norm_bias": True, "mlp_bias": True},
    defaults={
        "max_position_embeddings": 2048,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "gelu",
        "attention_bias": True,
        "use_parallel_residual": True,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    },
    activations=GELU_ACTIVATIONS,
    partial_rotary=True,
    head_dim_key=False,
    theta_key="rotary_emb_base",  # GPTNeoXConfig reads only these two top-level names
    partial_key="rotary_pct",
    default_partial=0.25,
)
GRANITE_FAMILY = Family(
    GRANITE,
    keys={**_CORE_KEYS, **_BIAS_KEYS},
    fixed=_ROPE_MODEL,
    defaults={
        **_LLAMA_DEFAULTS,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "embedding_multiplier": 1.0,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 1.0,
    },
    read_extra=read_granite,
    write_extra=write_granite,
)

# Mixtures of experts (gptkit.moe; their config entries in experts.py).
_MOE_DEFAULTS = {**_LLAMA_DEFAULTS, "output_router_logits": False}
MIXTRAL_FAMILY = Family(
    MIXTRAL,
    keys=_CORE_KEYS,
    fixed={**_ROPE_MODEL, "attn_bias": False, "mlp_bias": False, "moe_renormalize": True},
    defaults={
        **_MOE_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    windows="all",
    read_extra=read_mixtral,
    write_extra=write_mixtral,
)
_QWEN_MOE_DEFAULTS = {
    **_MOE_DEFAULTS,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": None,
}
QWEN2_MOE_FAMILY = Family(
    QWEN2_MOE,
    keys={**_CORE_KEYS, "qkv_bias": "attn_bias"},
    fixed={**_ROPE_MODEL, "mlp_bias": False, "moe_shared_gate": True},
    defaults={
        **_QWEN_MOE_DEFAULTS,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "qkv_bias": True,
    },
    read_extra=read_qwen2_moe,
    write_extra=write_qwen2_moe,
)
QWEN3_MOE_FAMILY = Family(
    QWEN3_MOE,
    keys={**_CORE_KEYS, "attention_bias": "attn_bias"},
    fixed={**_ROPE_MODEL, "mlp_bias": False, "qk_norm": True},
    defaults={
        **_QWEN_MOE_DEFAULTS,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "attention_bias": False,
    },
    read_extra=read_qwen3_moe,
    write_extra=write_qwen3_moe,
)
OLMOE_FAMILY = Family(
    OLMOE,
    keys={**_CORE_KEYS, "attention_bias": "attn_bias"},
    fixed={**_ROPE_MODEL, "mlp_bias": False, "qk_norm": True, "qk_norm_scope": "width"},
    defaults={
        **_MOE_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "intermediate_size": 2048,
        "attention_bias": False,
        "clip_qkv": None,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
    read_extra=read_olmoe,
    write_extra=write_olmoe,
)

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        GPT2_FAMILY,
        LLAMA_FAMILY,
        MISTRAL_FAMILY,
        QWEN2_FAMILY,
        QWEN3_FAMILY,
        GEMMA2_FAMILY,
        GEMMA3_FAMILY,
        PHI3_FAMILY,
        SMOLLM3_FAMILY,
        OLMO2_FAMILY,
        GPT_NEOX_FAMILY,
        GRANITE_FAMILY,
        MIXTRAL_FAMILY,
        QWEN2_MOE_FAMILY,
        QWEN3_MOE_FAMILY,
        OLMOE_FAMILY,
    )
}
# Defaults of transformers' config classes for keys a config.json may omit, by model_type.
FAMILY_DEFAULTS = {model_type: family.defaults for model_type, family in FAMILIES.items()}
