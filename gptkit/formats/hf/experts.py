"""The mixture-of-experts families' config.json entries (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and ModelConfig's
n_experts and moe_* fields, in both directions (a reader and a writer per family, as in extras.py).

Each routes a token to its num_experts_per_tok most probable experts of softmax(router logits), as gptkit.moe does:
Mixtral always divides their weights by their sum, the others when norm_topk_prob says so.
"""

from __future__ import annotations

from typing import Any

from gptkit.config import ModelConfig
from gptkit.formats.hf.extras import Get
from gptkit.formats.hf.layouts import ConversionError


def _expert_count(hf: dict[str, Any], get: Get, key: str) -> int:
    """The number of experts: under key, or under the other name the config classes map onto it."""
    other = "num_experts" if key == "num_local_experts" else "num_local_experts"
    return hf[other] if key not in hf and other in hf else get(key)


def _routed(config: ModelConfig, family: str, every_layer: bool) -> None:
    """Refuse a config that is no mixture of experts, or whose experts family cannot place."""
    if config.n_experts is None:
        raise ConversionError(f"a dense model cannot be exported as {family}, a mixture of experts")
    if every_layer and not all(config.is_moe_layer(i) for i in range(config.n_layer)):
        raise ConversionError(
            f"moe_layer_step and moe_dense_layers cannot be exported as {family}: every layer of it has experts "
            "(qwen2_moe and qwen3_moe keep some layers dense)"
        )
    if every_layer and config.expert_hidden != config.ffn_hidden:
        raise ConversionError(
            f"moe_ffn_hidden {config.moe_ffn_hidden} cannot be exported as {family}: its experts' hidden size is "
            "intermediate_size (set ffn_hidden to it and moe_ffn_hidden to null, or export as qwen3_moe)"
        )


def read_mixtral(hf: dict[str, Any], get: Get, fields: dict[str, Any], source: str) -> dict[str, Any]:
    """Mixtral: num_local_experts experts of intermediate_size in every layer, top-k renormalised."""
    return {"n_experts": _expert_count(hf, get, "num_local_experts"), "n_experts_per_token": get("num_experts_per_tok")}


def write_mixtral(config: ModelConfig) -> dict[str, Any]:
    """Mixtral's expert entries; router_jitter_noise 0 (its noise is a training-time perturbation gptkit has not)."""
    _routed(config, "mixtral", every_layer=True)
    if config.moe_shared_hidden is not None:
        raise ConversionError("moe_shared_hidden cannot be exported as mixtral: only qwen2_moe has a shared expert")
    return {
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.n_experts_per_token,
        "router_jitter_noise": 0.0,
    }


def read_olmoe(hf: dict[str, Any], get: Get, fields: dict[str, Any], source: str) -> dict[str, Any]:
    """OLMoE: num_experts experts of intermediate_size in every layer, renormalised as norm_topk_prob says."""
    if get("clip_qkv") is not None:
        why = "gptkit does not clip q, k and v"
        raise ConversionError(f"{source}: clip_qkv {get('clip_qkv')} is not supported: {why}")
    return {
        "n_experts": _expert_count(hf, get, "num_experts"),
        "n_experts_per_token": get("num_experts_per_tok"),
        "moe_renormalize": bool(get("norm_topk_prob")),
    }


def write_olmoe(config: ModelConfig) -> dict[str, Any]:
    """OLMoE's expert entries."""
    _routed(config, "olmoe", every_layer=True)
    if config.moe_shared_hidden is not None:
        raise ConversionError("moe_shared_hidden cannot be exported as olmoe: only qwen2_moe has a shared expert")
    return {
        "num_experts": config.n_experts,
        "num_experts_per_tok": config.n_experts_per_token,
        "norm_topk_prob": config.moe_renormalize,
        "clip_qkv": None,
    }


def read_qwen3_moe(hf: dict[str, Any], get: Get, fields: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen3-MoE (and Qwen2-MoE's routed experts): experts of moe_intermediate_size in layers i with
    (i + 1) % decoder_sparse_step == 0 outside mlp_only_layers, dense MLPs of intermediate_size elsewhere."""
    if get("use_sliding_window"):
        why = "gptkit reads windows of the Qwen MoE families' attention nowhere yet"
        raise ConversionError(f"{source}: use_sliding_window=true is not supported: {why}")
    hidden = get("moe_intermediate_size")
    out = {
        "n_experts": _expert_count(hf, get, "num_experts"),
        "n_experts_per_token": get("num_experts_per_tok"),
        "moe_ffn_hidden": None if hidden == fields["ffn_hidden"] else hidden,
        "moe_renormalize": bool(get("norm_topk_prob")),
        "moe_layer_step": get("decoder_sparse_step"),
        "moe_dense_layers": list(get("mlp_only_layers") or []) or None,
    }
    return out


def read_qwen2_moe(hf: dict[str, Any], get: Get, fields: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen2-MoE: Qwen3-MoE's routing plus, in each MoE layer, a shared expert gated by sigmoid(x w)."""
    shared = {"moe_shared_hidden": get("shared_expert_intermediate_size"), "moe_shared_gate": True}
    return {**read_qwen3_moe(hf, get, fields, source), **shared}


def _write_qwen_moe(config: ModelConfig, family: str) -> dict[str, Any]:
    _routed(config, family, every_layer=False)
    return {
        "num_experts": config.n_experts,
        "num_experts_per_tok": config.n_experts_per_token,
        "moe_intermediate_size": config.expert_hidden,
        "norm_topk_prob": config.moe_renormalize,
        "decoder_sparse_step": config.moe_layer_step,
        "mlp_only_layers": list(config.moe_dense_layers or []),
        "use_sliding_window": False,
    }


def write_qwen2_moe(config: ModelConfig) -> dict[str, Any]:
    """Qwen2-MoE's expert entries, its shared expert's size among them."""
    if config.moe_shared_hidden is None:
        raise ConversionError(
            "a mixture of experts without a shared expert cannot be exported as qwen2_moe (every layer of it has one):"
            " export as qwen3_moe, mixtral or olmoe"
        )
    return {**_write_qwen_moe(config, "qwen2_moe"), "shared_expert_intermediate_size": config.moe_shared_hidden}


def write_qwen3_moe(config: ModelConfig) -> dict[str, Any]:
    """Qwen3-MoE's expert entries."""
    if config.moe_shared_hidden is not None:
        raise ConversionError("moe_shared_hidden cannot be exported as qwen3_moe: only qwen2_moe has a shared expert")
    return _write_qwen_moe(config, "qwen3_moe")
