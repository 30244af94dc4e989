"""RoPE settings between a Hugging Face config.json and ModelConfig: base, partial rotation, scaling rule, and Gemma 3's
second base for its sliding layers.

transformers 5 reads `rope_parameters` (for Gemma 3 nested by layer type), filling what the dict lacks from the
top-level keys (rope_theta, partial_rotary_factor, GPT-NeoX's rotary_emb_base and rotary_pct) and then the config
class's defaults; an older `rope_scaling` replaces the dict whole (for Gemma 3 it updates the full-attention entry).
This module reads both the same way and writes `rope_parameters` as transformers 5 does.
"""

from __future__ import annotations

from typing import Any

from gptkit.config import ROPE_REQUIRED, ModelConfig, RopeScaling
from gptkit.errors import ConfigError
from gptkit.formats.hf.families import Family
from gptkit.formats.hf.layouts import ConversionError

DEFAULT_THETA = 10000.0
# Gemma 3's bases when config.json names none (Gemma3TextConfig.default_theta).
GEMMA3_GLOBAL_THETA, GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0
LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


def _refuse(source: str, setting: str, why: str) -> ConversionError:
    return ConversionError(f"{source}: {setting} is not supported: {why}")


def read_rope(hf: dict[str, Any], family: Family, source: str, head_dim: int, has_sliding: bool) -> dict[str, Any]:
    """The ModelConfig fields rope_theta, rotary_dim, rope_scaling and rope_local_theta of an HF config."""
    if family.per_layer_rope:
        return _read_per_layer(hf, source, head_dim, has_sliding)
    theta = hf.get(family.theta_key, family.defaults.get(family.theta_key, DEFAULT_THETA))
    partial = hf.get(family.partial_key, family.default_partial)
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise _refuse(source, f"rope_parameters {params!r}", "gptkit reads one RoPE dict for all layers")
    theta, partial, scaling = _read_params(params, hf, family, source, theta, partial)
    if partial != 1.0 and not family.partial_rotary:
        raise _refuse(source, "RoPE setting 'partial_rotary_factor'", f"{family.model_type} rotates the full head")
    return {"rope_theta": theta, "rotary_dim": int(head_dim * partial), "rope_scaling": scaling}


def _read_per_layer(hf: dict[str, Any], source: str, head_dim: int, has_sliding: bool) -> dict[str, Any]:
    """Gemma 3: full layers take the global base with the scaling rule; sliding ones their own base, unscaled."""
    params = hf.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPE_KEYS):
        raise _refuse(source, f"rope_parameters {params!r}", "Gemma 3 nests them by full_attention/sliding_attention")
    full = dict(params.get("full_attention") or {})
    sliding = dict(params.get("sliding_attention") or {})
    full.update(hf.get("rope_scaling") or {})
    full_theta = hf.get("rope_theta", GEMMA3_GLOBAL_THETA)
    local_theta = hf.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)
    theta, partial, scaling = _read_params(full, hf, None, source, full_theta, 1.0)
    local, local_partial, local_scaling = _read_params(sliding, hf, None, source, local_theta, 1.0)
    if (partial, local_partial) != (1.0, 1.0):
        raise _refuse(source, "RoPE setting 'partial_rotary_factor'", "Gemma 3 rotates the full head")
    fields = {"rope_theta": theta, "rotary_dim": head_dim, "rope_scaling": scaling, "rope_local_theta": None}
    if has_sliding and (local, local_scaling) != (theta, scaling):
        if local_scaling is not None:
            why = "gptkit's sliding layers take their own base without scaling, or the full layers' RoPE"
            raise _refuse(source, f"RoPE scaling {local_scaling.rope_type!r} on sliding layers", why)
        fields["rope_local_theta"] = local
    return fields


def _read_params(
    params: dict[str, Any], hf: dict[str, Any], family: Family | None, source: str, theta: Any, partial: Any
) -> tuple[float, float, RopeScaling | None]:
    """(base, partial rotary factor, scaling rule) of one RoPE dict, its missing entries taken from the defaults."""
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", "default")
    params.pop("type", None)
    theta = params.pop("rope_theta", theta)
    partial = params.pop("partial_rotary_factor", partial)
    if family is not None:
        rope_type = family.rope_aliases.get(rope_type, rope_type)
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConversionError(f"{source}: {name} {value!r} is not a positive number; fix it in config.json")
    if rope_type == "default":
        if params:
            raise _refuse(source, f"RoPE setting {min(params)!r}", "plain RoPE takes only rope_theta")
        return float(theta), float(partial), None
    if rope_type not in ROPE_REQUIRED:
        why = f"gptkit implements default, {', '.join(ROPE_REQUIRED)}"
        raise _refuse(source, f"RoPE scaling {rope_type!r}", why)
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers' standardize_rope_params: a top-level value wins (Phi3Config always has one, by default
        # 4096), then the dict's, then the context.
        original = hf.get("original_max_position_embeddings")
        if original is None and family is not None:
            original = family.defaults.get("original_max_position_embeddings")
        if original is None:
            original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        params["original_max_position_embeddings"] = original
    try:
        scaling = RopeScaling.from_dict({"rope_type": rope_type, **params})
    except ConfigError as err:
        raise ConversionError(f"{source}: {err}") from None
    return float(theta), float(partial), scaling


def write_rope(config: ModelConfig, family: Family) -> dict[str, Any]:
    """The config.json entries of config's RoPE for family, or a ConversionError naming what family cannot hold."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        kind = config.rope_scaling.rope_type
        if family.rope_types is not None and kind not in family.rope_types:
            raise ConversionError(
                f"rope_scaling {kind!r} cannot be exported as {family.model_type}: its config takes "
                f"{', '.join(sorted(family.rope_types))} only"
            )
        params.update(config.rope_scaling.to_dict())
    if config.rotary_dim != config.head_dim:
        factor = config.rotary_dim / config.head_dim
        if not family.partial_rotary or int(config.head_dim * factor) != config.rotary_dim:
            raise ConversionError(
                f"rotary_dim {config.rotary_dim} cannot be exported as {family.model_type}: it rotates the full head "
                "(phi3 and gpt_neox rotate part of it)"
            )
        params["partial_rotary_factor"] = factor
    elif family.partial_rotary:
        params["partial_rotary_factor"] = 1.0
    if not family.per_layer_rope:
        entries = {"rope_theta": config.rope_theta, "rope_parameters": params}
        if "original_max_position_embeddings" in family.defaults:  # Phi-3's top-level value overrides the dict's
            original = params.get("original_max_position_embeddings", config.block_size)
            entries["original_max_position_embeddings"] = original
        return entries
    sliding = dict(params)
    if config.rope_local_theta is not None:
        sliding = {"rope_type": "default", "rope_theta": config.rope_local_theta}
    return {"rope_parameters": {"full_attention": params, "sliding_attention": sliding}}
