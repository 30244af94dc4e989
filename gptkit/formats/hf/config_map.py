"""The config mapping between Hugging Face config.json files and gptkit's ModelConfig, in both directions.

Each family (families.py) names its one-to-one keys, the fields it fixes and its config class's defaults; RoPE
(rope.py), windows (windows.py) and the families' own settings (extras.py) are read and written beside them.
Whatever a config describes that gptkit cannot compute exactly is refused with a ConversionError naming the setting,
never approximated; an export is refused unless its config.json reads back as the model's own config.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.formats.hf.families import (
    FAMILIES,
    GEMMA2_FAMILY,
    GEMMA3_FAMILY,
    GPT2_FAMILY,
    GPT_NEOX_FAMILY,
    GRANITE_FAMILY,
    LLAMA_FAMILY,
    MISTRAL_FAMILY,
    MIXTRAL_FAMILY,
    OLMO2_FAMILY,
    OLMOE_FAMILY,
    PHI3_FAMILY,
    QWEN2_FAMILY,
    QWEN2_MOE_FAMILY,
    QWEN3_FAMILY,
    QWEN3_MOE_FAMILY,
    SMOLLM3_FAMILY,
    Family,
)
from gptkit.formats.hf.layouts import LAYOUTS, ConversionError, Layout
from gptkit.formats.hf.rope import read_rope, write_rope
from gptkit.formats.hf.windows import read_windows, write_windows
from gptkit.tensors import CONFIG_FILE

log = logging.getLogger(__name__)

HINT_KEY = "gptkit_config"  # export stores the full gptkit config here, so that a round trip is lossless

# Fields an exported HF config cannot carry but which do not change what the model computes: dropout is
# training-only, and a bias flag only says whether a bias that HF stores as zeros exists at all.
# zero_init_proj only says how training started.
HINT_FIELDS = ("dropout", "attn_bias", "mlp_bias", "norm_bias", "zero_init_proj")
_SCALES = "granite has embedding, residual, attention and logit multipliers"
# Why a field's value has no counterpart in a family: which families have one.
WHY = {
    "norm": "LayerNorm exports as gpt2 (learned positions) or gpt_neox (rope); the other families use RMSNorm",
    "norm_position": "sandwich exports as gemma2 or gemma3_text, sublayer_post as olmo2; the others are pre-norm",
    "position": "GPT-2 has learned positions and the other families RoPE; nothing else maps",
    "activation": "gpt2 and gpt_neox have gelu, gelu_tanh, relu and relu2, gemma2 and gemma3_text geglu, the others "
    "swiglu",
    "lm_head_bias": "no Hugging Face family gptkit converts has a bias on the LM head",
    "logit_softcap": "of transformers' architectures only Gemma 2 and 3 soft-cap their logits, and they differ from "
    "GPT-2 and Llama in more (norms after each sublayer, scaled embeddings)",
    "attn_softcap": "only gemma2 and gemma3_text soft-cap attention scores",
    "qk_norm": "qwen3 and gemma3_text norm each head's q and k, olmo2 the whole of q and k; gpt2 has no q/k norms",
    "qk_norm_scope": "olmo2 norms q and k over their whole width, qwen3 and gemma3_text per head",
    "parallel_residual": "only gpt_neox adds attention and MLP to the same residual",
    "nope_layers": "only smollm3 leaves RoPE out of some layers",
    "rope_local_theta": "only gemma3_text gives its sliding layers a RoPE base of their own",
    "norm_gain_offset": "only gemma2 and gemma3_text multiply by (1 + w) in their RMSNorms",
    "embedding_scale": _SCALES + " (gemma2 and gemma3_text scale by sqrt(hidden_size))",
    "residual_scale": _SCALES,
    "attn_scale": _SCALES + " (gemma2 and gemma3_text a query_pre_attn_scalar)",
    "logit_scale": _SCALES,
    "n_experts": "mixtral, qwen2_moe, qwen3_moe and olmoe have experts, the other families dense MLPs",
    "moe_renormalize": "mixtral always renormalises its top-k weights; qwen2_moe, qwen3_moe and olmoe say whether",
    "moe_shared_gate": "qwen2_moe gates its shared expert by sigmoid(x w); no other family has a shared expert",
}
_UNSCALED = (None, 1.0, None, 1.0)  # embedding_scale, residual_scale, attn_scale, logit_scale of a plain model
# The family an export picks by default: the first whose signature setting the config has, else llama.
_BY_SETTING: tuple[tuple[Callable[[ModelConfig], bool], Family], ...] = (
    # A mixture of experts: a shared expert (Qwen2-MoE), q/k norms over the width (OLMoE) or per head (Qwen3-MoE),
    # else Mixtral.
    (lambda c: c.n_experts is not None and c.moe_shared_hidden is not None, QWEN2_MOE_FAMILY),
    (lambda c: c.n_experts is not None and c.qk_norm and c.qk_norm_scope == "width", OLMOE_FAMILY),
    (lambda c: c.n_experts is not None and c.qk_norm, QWEN3_MOE_FAMILY),
    (lambda c: c.n_experts is not None, MIXTRAL_FAMILY),
    (lambda c: c.position == "learned", GPT2_FAMILY),
    (lambda c: c.parallel_residual or c.norm == "layernorm", GPT_NEOX_FAMILY),
    (lambda c: c.norm_position == "sandwich" and c.qk_norm, GEMMA3_FAMILY),
    (lambda c: c.norm_position == "sandwich", GEMMA2_FAMILY),
    (lambda c: c.norm_position == "sublayer_post", OLMO2_FAMILY),
    (lambda c: c.nope_layers is not None, SMOLLM3_FAMILY),
    (lambda c: (c.embedding_scale, c.residual_scale, c.attn_scale, c.logit_scale) != _UNSCALED, GRANITE_FAMILY),
    (lambda c: c.rotary_dim != c.head_dim, PHI3_FAMILY),
    (lambda c: c.qk_norm, QWEN3_FAMILY),
    (lambda c: c.layer_types is not None, QWEN2_FAMILY),
    (lambda c: c.sliding_window is not None, MISTRAL_FAMILY),
)


def detect_family(hf: dict[str, Any], source: str, class_name: str | None = None) -> Family:
    """The family of an HF config (its architectures entry, or the model class), refusing unknown ones."""
    architectures = [class_name] if class_name else hf.get("architectures") or []
    if not architectures and hf.get("model_type") in FAMILIES:  # a config written without a model class
        return FAMILIES[hf["model_type"]]
    if len(architectures) == 1 and architectures[0] in LAYOUTS:
        layout = LAYOUTS[architectures[0]]
        if hf.get("model_type", layout.model_type) == layout.model_type:
            return FAMILIES[layout.model_type]
    found = architectures[0] if architectures else f"model_type {hf.get('model_type')!r}"
    raise ConversionError(
        f"{source}: architecture {found} is not supported; gptkit converts {', '.join(LAYOUTS)} (and only those, "
        "since any other layout might compute something else)"
    )


def detect_layout(hf: dict[str, Any], source: str, class_name: str | None = None) -> Layout:
    """The weight layout of an HF config, refusing unknown architectures."""
    return detect_family(hf, source, class_name).layout


def _refuse(source: str, setting: str, why: str) -> ConversionError:
    return ConversionError(f"{source}: {setting} is not supported: {why}")


def _getter(hf: dict[str, Any], family: Family, source: str) -> Callable[[str], Any]:
    """hf[key], else the family default, else a ConversionError naming the key."""

    def get(key: str) -> Any:
        if key in hf:
            return hf[key]
        if key in family.defaults:
            return family.defaults[key]
        raise ConversionError(f"{source}: {CONFIG_FILE} lacks {key!r}")

    return get


def _activation(family: Family, get: Callable[[str], Any], source: str) -> str:
    act = get(family.activation_key)
    if act not in family.activations:
        have = ", ".join(family.activations)
        raise _refuse(source, f"{family.activation_key} {act!r}", f"gptkit computes {family.model_type} with {have}")
    return family.activations[act]


def _gpt2_fields(hf: dict[str, Any], get: Callable[[str], Any], source: str) -> dict[str, Any]:
    """GPT-2's fields beyond its one-to-one keys, refusing its switches gptkit does not compute."""
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
    drops = {k: float(get(k)) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        log.warning("%s: dropouts %s differ; gptkit has one rate and uses resid_pdrop", source, drops)
    return {"attn_bias": True, "mlp_bias": True, "norm_bias": True, "dropout": drops["resid_pdrop"]}


def _rope_family_fields(
    hf: dict[str, Any], family: Family, get: Callable[[str], Any], fields: dict[str, Any], source: str
) -> dict[str, Any]:
    """The fields of a RoPE family beyond its one-to-one keys: head size, windows, RoPE, the family's own."""
    width, heads = fields["n_embd"], fields["n_head"]
    head_dim = hf.get("head_dim") or family.defaults.get("head_dim")
    derived = width // heads if isinstance(width, int) and isinstance(heads, int) and heads else None
    if not family.head_dim_key and head_dim not in (None, derived):
        why = f"{family.model_type}'s heads are hidden_size/num_attention_heads = {derived} wide"
        raise _refuse(source, f"head_dim {head_dim}", why)
    out: dict[str, Any] = {"head_dim": head_dim or derived, "dropout": 0.0}
    out.update(read_windows(hf, family, get, fields["n_layer"], source))
    out.update(read_rope(hf, family, source, out["head_dim"], out["sliding_window"] is not None))
    if family.read_extra is not None:
        out.update(family.read_extra(hf, get, {**fields, **out}, source))
    if float(hf.get("attention_dropout") or 0.0):
        why = "gptkit's dropout would also drop residuals"
        log.warning("%s: attention_dropout %s not carried over (%s)", source, hf["attention_dropout"], why)
    return out


def config_from_hf(hf: dict[str, Any], layout: Layout, source: str) -> ModelConfig:
    """The gptkit ModelConfig computing exactly what the HF config describes, or a ConversionError."""
    family = FAMILIES[layout.model_type]
    get = _getter(hf, family, source)
    fields = dict(family.fixed)
    fields["activation"] = _activation(family, get, source)
    for key, field in family.keys.items():
        if key == "num_key_value_heads" and hf.get(key) is None:
            continue  # a None kv-head count means one per query head, as in ModelConfig
        fields[field] = get(key)
    if family is GPT2_FAMILY:
        fields.update(_gpt2_fields(hf, get, source))
    else:
        fields.update(_rope_family_fields(hf, family, get, fields, source))
    try:
        return ModelConfig(**fields)
    except ConfigError as err:
        raise ConversionError(f"{source}: {err}") from None


def export_family(config: ModelConfig, name: str | None = None) -> Family:
    """The family an export writes: the named one (a model_type), else the one config's settings call for."""
    if name is not None:
        if name not in FAMILIES:
            raise ConversionError(f"unknown Hugging Face family {name!r}; choose one of {', '.join(FAMILIES)}")
        return FAMILIES[name]
    if config.position in ("sinusoidal", "none"):
        raise ConversionError(f"position {config.position!r} cannot be exported: {WHY['position']}")
    return next((family for has, family in _BY_SETTING if has(config)), LLAMA_FAMILY)


def _hf_activation(config: ModelConfig, family: Family) -> str:
    """The HF name of config's activation in family: the family's default name when it is one, else the first."""
    default = family.defaults.get(family.activation_key)
    if family.activations.get(default) == config.activation:
        return default
    names = [name for name, ours in family.activations.items() if ours == config.activation]
    if not names:
        raise ConversionError(
            f"activation {config.activation!r} cannot be exported as {family.model_type}: {WHY['activation']}"
        )
    return names[0]


def _gpt2_entries(config: ModelConfig) -> dict[str, Any]:
    """GPT-2's entries beyond its one-to-one keys, refusing what GPT-2 cannot compute."""
    if config.qk_norm:
        raise ConversionError(f"qk_norm cannot be exported as gpt2 (learned positions): {WHY['qk_norm']}")
    if config.n_kv_head != config.n_head:
        raise ConversionError(
            f"n_kv_head {config.n_kv_head} cannot be exported as gpt2: GPT-2 has no grouped-query attention"
        )
    drops = {key: config.dropout for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    return {**drops, "n_ctx": config.block_size}  # n_ctx: GPT-2's original configs have it, llama.cpp reads it


def _rope_entries(config: ModelConfig, family: Family) -> dict[str, Any]:
    """A RoPE family's entries beyond its one-to-one keys: head size, RoPE, windows, the family's own."""
    entries: dict[str, Any] = {"attention_dropout": 0.0}
    if family.head_dim_key:
        entries["head_dim"] = config.head_dim
    entries.update(write_rope(config, family))
    entries.update(write_windows(config, family))
    if family.write_extra is not None:
        entries.update(family.write_extra(config))
    return entries


def hf_config_from_gptkit(
    config: ModelConfig, eos_id: int | list[int] | None = None, family_name: str | None = None
) -> dict[str, Any]:
    """The HF config.json computing exactly what config does, as family_name (a model_type) or the family config's
    settings call for; a ConversionError names the first setting the family cannot hold."""
    family = export_family(config, family_name)
    for field, value in family.fixed.items():
        if getattr(config, field) != value and field not in HINT_FIELDS:
            raise ConversionError(
                f"{field} {getattr(config, field)!r} cannot be exported as {family.model_type} "
                f"(which needs {value!r}): {WHY.get(field, 'every model of the family has it')}"
            )
    hf: dict[str, Any] = {"architectures": [family.layout.architecture], "model_type": family.model_type}
    hf[family.activation_key] = _hf_activation(config, family)
    hf.update({key: getattr(config, field) for key, field in family.keys.items()})
    hf.update(_gpt2_entries(config) if family is GPT2_FAMILY else _rope_entries(config, family))
    hf.update(bos_token_id=None, eos_token_id=eos_id, pad_token_id=None)
    _check_reads_back(config, hf, family)
    return hf


def _check_reads_back(config: ModelConfig, hf: dict[str, Any], family: Family) -> None:
    """Refuse an export whose config.json would read back as another model, naming the first field that differs."""
    try:
        back = config_from_hf(hf, family.layout, "export")
    except ConversionError as err:
        raise ConversionError(f"cannot export as {family.model_type}: {err}") from None
    for field in dataclasses.fields(ModelConfig):
        name = field.name
        if name in HINT_FIELDS or name == "vocab_multiple" or getattr(back, name) == getattr(config, name):
            continue
        unheld = f"{family.model_type}'s config.json has no setting for it (it reads back as {getattr(back, name)!r})"
        why = WHY.get(name, unheld)
        raise ConversionError(f"{name} {getattr(config, name)!r} cannot be exported as {family.model_type}: {why}")


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
