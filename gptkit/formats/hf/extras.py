"""The settings of single families that are not one config.json key per ModelConfig field: Gemma's scales, Granite's
multipliers, SmolLM3's NoPE layers. Each family has a reader (config.json -> fields) and a writer (the reverse)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gptkit.config import ModelConfig
from gptkit.formats.hf.layouts import ConversionError

Get = Callable[[str], Any]  # a config.json value, else the family default, else a ConversionError naming the key
Reader = Callable[[dict[str, Any], Get, dict[str, Any], str], dict[str, Any]]  # (hf, get, fields so far, source)
Writer = Callable[[ModelConfig], dict[str, Any]]


def read_gemma(hf: dict[str, Any], get: Get, fields: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 2/3: embeddings times sqrt(hidden_size), scores times query_pre_attn_scalar**-0.5, causal only."""
    if get("use_bidirectional_attention"):
        why = "gptkit's attention is causal"
        raise ConversionError(f"{source}: use_bidirectional_attention=true is not supported: {why}")
    scalar = get("query_pre_attn_scalar")
    # transformers computes both as Python floats, as here; query_pre_attn_scalar == head_dim is gptkit's default.
    attn_scale = None if scalar == fields["head_dim"] else scalar**-0.5
    return {"embedding_scale": fields["n_embd"] ** 0.5, "attn_scale": attn_scale}


def write_gemma(config: ModelConfig) -> dict[str, Any]:
    """Gemma's query_pre_attn_scalar, refusing an embedding or attention scale Gemma cannot hold."""
    if config.embedding_scale != config.n_embd**0.5:
        raise ConversionError(
            f"embedding_scale {config.embedding_scale!r} cannot be exported as Gemma: it scales embeddings by "
            f"sqrt(hidden_size) = {config.n_embd**0.5!r}"
        )
    if config.attn_scale is None:
        return {"query_pre_attn_scalar": config.head_dim}
    scalar = round(config.attn_scale**-2)
    if scalar**-0.5 != config.attn_scale:
        raise ConversionError(
            f"attn_scale {config.attn_scale!r} cannot be exported as Gemma: its scale is an integer's "
            "query_pre_attn_scalar**-0.5"
        )
    return {"query_pre_attn_scalar": scalar}


def read_granite(hf: dict[str, Any], get: Get, fields: dict[str, Any], source: str) -> dict[str, Any]:
    """Granite's four multipliers; its logits are divided by logits_scaling."""
    embedding, attention = get("embedding_multiplier"), get("attention_multiplier")
    return {
        "embedding_scale": None if embedding == 1.0 else embedding,
        "residual_scale": get("residual_multiplier"),
        # The whole score scale, not a factor on 1/sqrt(head_dim); that value is gptkit's default (None).
        "attn_scale": None if attention == fields["head_dim"] ** -0.5 else attention,
        "logit_scale": 1.0 / get("logits_scaling"),
    }


def write_granite(config: ModelConfig) -> dict[str, Any]:
    """Granite's multipliers for config's scales."""
    return {
        "embedding_multiplier": 1.0 if config.embedding_scale is None else config.embedding_scale,
        "residual_multiplier": config.residual_scale,
        "attention_multiplier": config.head_dim**-0.5 if config.attn_scale is None else config.attn_scale,
        "logits_scaling": 1.0 / config.logit_scale,
    }


def no_rope_flags(hf: dict[str, Any], get: Get, n_layer: int) -> list[Any]:
    """SmolLM3's no_rope_layers: per layer 1 where it applies RoPE, 0 where not (by default every fourth layer)."""
    if hf.get("no_rope_layers") is not None:
        return hf["no_rope_layers"]
    interval = get("no_rope_layer_interval")
    return [int((i + 1) % interval != 0) for i in range(n_layer)]


def read_smollm3(hf: dict[str, Any], get: Get, fields: dict[str, Any], source: str) -> dict[str, Any]:
    """SmolLM3's NoPE layers: those whose no_rope_layers entry is 0."""
    flags = no_rope_flags(hf, get, fields["n_layer"])
    if not isinstance(flags, list) or len(flags) != fields["n_layer"] or not all(f in (0, 1) for f in flags):
        raise ConversionError(f"{source}: no_rope_layers must hold a 0 or 1 per layer; got {flags!r}")
    nope = [i for i, flag in enumerate(flags) if not flag]
    return {"nope_layers": nope or None}


def write_smollm3(config: ModelConfig) -> dict[str, Any]:
    """SmolLM3's no_rope_layers for config's NoPE layers."""
    nope = set(config.nope_layers or ())
    return {"no_rope_layers": [0 if i in nope else 1 for i in range(config.n_layer)]}
