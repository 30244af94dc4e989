"""The config mapping between Hugging Face config.json files and gptkit's ModelConfig, in both directions.

Each family: HF key <-> ModelConfig field, the fields HF fixes, and family defaults for keys a config.json may omit
(the defaults of transformers' config classes). Whatever a config describes that gptkit cannot compute exactly is
refused with a ConversionError naming the setting, never approximated.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.formats.hf.layouts import GPT2, LAYOUTS, LLAMA, QWEN2, QWEN3, ConversionError, Layout
from gptkit.tensors import CONFIG_FILE

log = logging.getLogger(__name__)

HINT_KEY = "gptkit_config"  # export stores the full gptkit config here, so that a round trip is lossless

# Fields an exported HF config cannot carry but which do not change what the model computes: dropout is
# training-only, and a bias flag only says whether a bias that HF stores as zeros exists at all.
# zero_init_proj only says how training started.
HINT_FIELDS = ("dropout", "attn_bias", "mlp_bias", "norm_bias", "zero_init_proj")

GPT2_KEYS = {
    "vocab_size": "vocab_size", "n_positions": "block_size", "n_layer": "n_layer", "n_head": "n_head",
    "n_embd": "n_embd", "n_inner": "ffn_hidden", "layer_norm_epsilon": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}  # fmt: skip
LLAMA_KEYS = {
    "vocab_size": "vocab_size", "max_position_embeddings": "block_size", "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head", "hidden_size": "n_embd",
    "intermediate_size": "ffn_hidden", "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings",
    "attention_bias": "attn_bias", "mlp_bias": "mlp_bias",
}  # fmt: skip
# What every model of the family computes; export refuses a gptkit config that differs (bias flags aside:
# a missing bias exports exactly as zeros, see with_biases).
GPT2_FIXED = dict(norm="layernorm", norm_position="pre", position="learned", lm_head_bias=False)
LLAMA_FIXED = dict(norm="rmsnorm", norm_position="pre", position="rope", activation="swiglu", lm_head_bias=False)
_FAMILY = (
    "learned positions export as GPT-2 (LayerNorm; gelu, gelu_tanh, relu or relu2), rope as Llama or Qwen3 "
    "(RMSNorm, swiglu)"
)
WHY = {
    "norm": _FAMILY,
    "norm_position": "Hugging Face GPT-2 and Llama are pre-norm only",
    "position": "GPT-2 has learned positions and Llama RoPE; nothing else maps",
    "activation": _FAMILY,
    "lm_head_bias": "neither GPT-2 nor Llama has a bias on the LM head",
    "logit_softcap": "of transformers' architectures only Gemma 2 soft-caps its logits, and it differs from GPT-2 and "
    "Llama in more (norms after each sublayer, scaled embeddings, capped attention scores)",
    "qk_norm": "GPT-2 has no q/k norms (Qwen3, with rope, RMSNorm and swiglu, has them)",
}
# Defaults of transformers' config classes (transformers 5.x configuration_*.py) for keys a file may omit.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_positions=1024, n_inner=None, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                 activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "llama": dict(max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  mlp_bias=False, hidden_act="silu"),
    "mistral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    hidden_act="silu", sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  hidden_act="silu", head_dim=128, use_sliding_window=False, sliding_window=4096,
                  max_window_layers=28),
}  # fmt: skip
# HF activation names that compute exactly gptkit's (transformers' activations.py): the tanh forms differ
# only in how the constant sqrt(2/pi) is written.
GPT2_ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "gelu_python_tanh": "gelu_tanh", "relu": "relu", "relu2": "relu2",
}  # fmt: skip
GPT2_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "relu2": "relu2"}  # export


def detect_layout(hf: dict[str, Any], source: str, class_name: str | None = None) -> Layout:
    """The layout of an HF config (its architectures entry, or the model class), refusing unknown ones."""
    architectures = [class_name] if class_name else hf.get("architectures") or []
    if not architectures:  # a config written without a model class: go by model_type
        by_type = {layout.model_type: layout for layout in LAYOUTS.values()}
        if hf.get("model_type") in by_type:
            return by_type[hf["model_type"]]
    if len(architectures) == 1 and architectures[0] in LAYOUTS:
        layout = LAYOUTS[architectures[0]]
        if hf.get("model_type", layout.model_type) == layout.model_type:
            return layout
    found = architectures[0] if architectures else f"model_type {hf.get('model_type')!r}"
    raise ConversionError(
        f"{source}: architecture {found} is not supported; gptkit converts {', '.join(LAYOUTS)} (and only those, "
        "since any other layout might compute something else)"
    )


def _get(hf: dict[str, Any], key: str, layout: Layout, source: str) -> Any:
    """hf[key], else the family default, else a ConversionError naming the key."""
    if key in hf:
        return hf[key]
    defaults = FAMILY_DEFAULTS[layout.model_type]
    if key in defaults:
        return defaults[key]
    raise ConversionError(f"{source}: {CONFIG_FILE} lacks {key!r}")


def _refuse(source: str, setting: str, why: str) -> ConversionError:
    return ConversionError(f"{source}: {setting} is not supported: {why}")


def _rope_theta(hf: dict[str, Any], source: str) -> float:
    """RoPE's base, refusing any scaling or partial rotation gptkit does not implement."""
    # transformers 5.x reads rope_parameters, but a (legacy) rope_scaling replaces it whole when both are set;
    # a scaled RoPE under either key is refused, so that no reading of the file hides one.
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else None
        if rope_type not in (None, "default"):
            raise _refuse(source, f"RoPE scaling {rope_type!r}", "gptkit implements plain RoPE only")
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise _refuse(source, f"rope_parameters {params!r}", "gptkit needs one plain RoPE for all layers")
    # Entries the dict lacks come from the top-level keys, then transformers' defaults, as transformers fills them.
    top_level = {"rope_theta": hf.get("rope_theta", 10000.0)}
    top_level["partial_rotary_factor"] = hf.get("partial_rotary_factor", 1.0)
    params = {**top_level, **params}
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra or params["partial_rotary_factor"] != 1.0:
        setting = extra[0] if extra else "partial_rotary_factor"
        raise _refuse(source, f"RoPE setting {setting!r}", "gptkit rotates the full head with plain RoPE")
    theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConversionError(f"{source}: rope_theta {theta!r} is not a number; fix it in {CONFIG_FILE}")
    return float(theta)


def _sliding_window(hf: dict[str, Any], layout: Layout) -> int | None:
    """The attention window some layer uses (Mistral, Qwen2), or None when every layer attends to all positions."""
    window = hf.get("sliding_window", FAMILY_DEFAULTS[layout.model_type].get("sliding_window"))
    if layout in (QWEN2, QWEN3):
        # Qwen2 and Qwen3 configs commonly carry a sliding_window that use_sliding_window=false switches off.
        if not _get(hf, "use_sliding_window", layout, ""):
            return None
        layer_types = hf.get("layer_types")
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        if layer_types is None and hf.get("num_hidden_layers", 0) <= _get(hf, "max_window_layers", layout, ""):
            return None
    return window


def config_from_hf(hf: dict[str, Any], layout: Layout, source: str) -> ModelConfig:
    """The gptkit ModelConfig computing exactly what the HF config describes, or a ConversionError."""
    if layout is GPT2:
        keys, fields = GPT2_KEYS, dict(GPT2_FIXED, attn_bias=True, mlp_bias=True, norm_bias=True)
        for key, why in (
            ("scale_attn_by_inverse_layer_idx", "gptkit scales every layer's attention by 1/sqrt(head_dim) only"),
            ("add_cross_attention", "gptkit is decoder-only, without cross-attention"),
        ):
            if hf.get(key, False):
                raise _refuse(source, f"{key}=true", why)
        if not hf.get("scale_attn_weights", True):
            raise _refuse(source, "scale_attn_weights=false", "gptkit always scales attention by 1/sqrt(head_dim)")
        # reorder_and_upcast_attn is accepted: it only changes how fp16 training rounds (transformers applies
        # it in eager attention only); the function computed is the same, and gptkit's scores are fp32 anyway.
        act = _get(hf, "activation_function", layout, source)
        if act not in GPT2_ACTIVATIONS:
            raise _refuse(source, f"activation_function {act!r}", f"gptkit has {', '.join(GPT2_ACTIVATIONS)}")
        fields["activation"] = GPT2_ACTIVATIONS[act]
        drops = {k: float(_get(hf, k, layout, source)) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        if len(set(drops.values())) > 1:
            log.warning("%s: dropouts %s differ; gptkit has one rate and uses resid_pdrop", source, drops)
        fields["dropout"] = drops["resid_pdrop"]
    else:
        keys, fields = LLAMA_KEYS, dict(LLAMA_FIXED, norm_bias=False)
        act = _get(hf, "hidden_act", layout, source)
        if act not in ("silu", "swish"):
            raise _refuse(source, f"hidden_act {act!r}", "gptkit's gated feed-forward is SwiGLU (silu) only")
        fields["rope_theta"] = _rope_theta(hf, source)
        heads, width = hf.get("num_attention_heads"), hf.get("hidden_size")
        head_dim = hf.get("head_dim", FAMILY_DEFAULTS[layout.model_type].get("head_dim"))  # Qwen3's default: 128
        if head_dim is not None and isinstance(heads, int) and isinstance(width, int) and heads:
            if head_dim * heads != width:
                why = f"gptkit's head size is hidden_size/num_attention_heads = {width // heads}"
                raise _refuse(source, f"head_dim {head_dim}", why)
        if float(hf.get("attention_dropout") or 0.0):
            log.warning("%s: attention_dropout %s not carried over (gptkit's dropout would also drop residuals)",
                        source, hf["attention_dropout"])  # fmt: skip
        fields["dropout"] = 0.0
    forced = dict(layout.forced)
    for key, field in keys.items():
        if field in forced or (key == "num_key_value_heads" and hf.get(key) is None):
            continue  # a None kv-head count means one per query head, as in ModelConfig
        fields[field] = _get(hf, key, layout, source)
    fields.update(forced)
    try:
        config = ModelConfig(**fields)
    except ConfigError as err:
        raise ConversionError(f"{source}: {err}") from None
    if layout is not GPT2:
        # Even a window as long as max_position_embeddings binds: gptkit runs RoPE models past block_size.
        window = _sliding_window(hf, layout)
        if window is not None:
            why = f"each token attends only to the last {window} positions; gptkit's attention is full causal"
            raise _refuse(source, f"sliding_window {window}", why + " at any length")
    return config


def hf_config_from_gptkit(config: ModelConfig, eos_id: int | list[int] | None = None) -> dict[str, Any]:
    """The HF config.json (GPT-2, Llama or Qwen3) computing exactly what config does, or a ConversionError."""
    if config.logit_softcap is not None:
        raise ConversionError(f"logit_softcap {config.logit_softcap!r} cannot be exported: {WHY['logit_softcap']}")
    if config.position in ("sinusoidal", "none"):
        raise ConversionError(f"position {config.position!r} cannot be exported: {WHY['position']}")
    gpt2 = config.position == "learned"
    if gpt2 and config.qk_norm:
        raise ConversionError(f"qk_norm cannot be exported as gpt2 (learned positions): {WHY['qk_norm']}")
    if gpt2:
        layout, keys, fixed = GPT2, GPT2_KEYS, GPT2_FIXED
    else:
        layout, keys, fixed = QWEN3 if config.qk_norm else LLAMA, LLAMA_KEYS, LLAMA_FIXED
    for field, value in fixed.items():
        if getattr(config, field) != value:
            raise ConversionError(
                f"{field} {getattr(config, field)!r} cannot be exported as {layout.model_type} "
                f"(which needs {value!r}): {WHY[field]}"
            )
    hf: dict[str, Any] = {"architectures": [layout.architecture], "model_type": layout.model_type}
    if gpt2:
        if config.activation not in GPT2_ACTIVATION_NAMES:
            raise ConversionError(
                f"activation {config.activation!r} cannot be exported as gpt2 (learned positions): GPT-2 has "
                f"{', '.join(GPT2_ACTIVATION_NAMES)}; Llama (swiglu) needs position rope"
            )
        if config.n_kv_head != config.n_head:
            raise ConversionError(
                f"n_kv_head {config.n_kv_head} cannot be exported as gpt2: GPT-2 has no grouped-query attention"
            )
        hf.update(activation_function=GPT2_ACTIVATION_NAMES[config.activation], resid_pdrop=config.dropout,
                  embd_pdrop=config.dropout, attn_pdrop=config.dropout)  # fmt: skip
        config = dataclasses.replace(config, attn_bias=True, mlp_bias=True, norm_bias=True)  # as zeros
        hf["n_ctx"] = config.block_size  # GPT-2's original configs have it, and llama.cpp's converter reads it
    else:
        hf.update(hidden_act="silu", rope_theta=config.rope_theta, head_dim=config.head_dim, attention_dropout=0.0,
                  rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})  # fmt: skip
        if layout is QWEN3:  # full attention in every layer; Qwen3's MLP has no biases (zeros are dropped)
            keys = {key: field for key, field in keys.items() if key != "mlp_bias"}
            hf.update(use_sliding_window=False, sliding_window=None)
    for key, field in keys.items():
        hf[key] = getattr(config, field)
    hf.update(bos_token_id=None, eos_token_id=eos_id, pad_token_id=None)
    return hf


def config_with_hint(derived: ModelConfig, hf: dict[str, Any]) -> ModelConfig:
    """The gptkit config an export recorded, when it agrees with the HF config on everything that computes."""
    hint = hf.get(HINT_KEY)
    if not isinstance(hint, dict):
        return derived
    try:
        recorded = ModelConfig.from_dict(hint)
    except ConfigError:
        return derived
    for field in dataclasses.fields(ModelConfig):
        if field.name not in HINT_FIELDS and getattr(recorded, field.name) != getattr(derived, field.name):
            return derived  # the HF config was edited since export: it is the authority
    return recorded
