"""A GGUF file's hyperparameters ("<arch>.*" metadata) and the ModelConfig they describe, both ways, with llama.cpp's
defaults and fixed constants (src/models/*.cpp, src/llama-hparams.h); and the architecture that writes a config.

Writing checks that reading the keys back gives the config (up to the forms that compute alike: a Gemma norm's gain
offset folded into its weights, a default score scale left implicit, Llama 3's rule as per-frequency divisors), and
refuses, naming the first field that differs, what llama.cpp would compute otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gptkit.config import ModelConfig, RopeScaling
from gptkit.formats.gguf.archs import ARCHS, Arch
from gptkit.formats.gguf.rope import read_scaling, rope_refusal, scaling_keys, sliding_refusal, yarn_as_read
from gptkit.formats.gguf.vocab import GGUFError
from gptkit.positions import base_frequencies, scaled_frequencies

FLOAT_KEYS = frozenset(
    {"attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa"}
    | {"rope.scaling.factor", "attn_logit_softcapping", "final_logit_softcapping", "attention.scale"}
    | {"embedding_scale", "residual_scale", "logit_scale", "rope.scaling.attn_factor"}
)
# Fields that do not change what a model computes (or that the file holds elsewhere): not compared.
UNCOMPARED = ("dropout", "zero_init_proj", "vocab_multiple", "vocab_size", "attn_bias", "mlp_bias", "norm_bias")
UNCOMPARED += ("moe_aux_loss", "moe_z_loss")  # training losses: nothing a forward computes
WHY = {
    "lm_head_bias": "llama.cpp's architectures have no output bias",
    "moe_layer_step": "every layer of llama.cpp's expert architectures has experts",
    "moe_dense_layers": "every layer of llama.cpp's expert architectures has experts",
}


def decimal(value: Any) -> float:
    """A float32 from the file as the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def decimal_or_value(value: Any) -> Any:
    """A float as decimal gives it; any other value (a string, an integer) as it is."""
    return decimal(value) if isinstance(value, float) else value


def config_keys(config: ModelConfig, arch: Arch) -> dict[str, Any]:
    """The "<arch>." metadata (keys without the prefix) describing config in arch."""
    keys: dict[str, Any] = {
        "context_length": config.block_size,
        "embedding_length": config.n_embd,
        "block_count": config.n_layer,
        "feed_forward_length": config.ffn_hidden,
        "attention.head_count": config.n_head,
    }
    if arch.name != "gpt2":
        keys["attention.head_count_kv"] = config.n_kv_head
        keys["attention.key_length"] = keys["attention.value_length"] = config.head_dim
    keys["attention.layer_norm_epsilon" if config.norm == "layernorm" else "attention.layer_norm_rms_epsilon"] = (
        config.norm_eps
    )
    if config.position == "rope":
        keys["rope.freq_base"] = config.rope_theta
        keys["rope.dimension_count"] = config.rotary_dim
        keys.update(scaling_keys(config.rope_scaling, config.block_size))
    if config.rope_local_theta is not None:
        keys["rope.freq_base_swa"] = config.rope_local_theta
    if config.sliding_window is not None:
        keys["attention.sliding_window"] = config.sliding_window
        keys["attention.sliding_window_pattern"] = [config.layer_window(i) is not None for i in range(config.n_layer)]
    if config.attn_softcap is not None:
        keys["attn_logit_softcapping"] = config.attn_softcap
    if config.logit_softcap is not None:
        keys["final_logit_softcapping"] = config.logit_softcap
    if arch.name == "granite":
        keys["attention.scale"] = config.attn_scale or 1 / math.sqrt(config.head_dim)
        keys["embedding_scale"] = config.embedding_scale or 1.0
        keys["residual_scale"] = config.residual_scale
        keys["logit_scale"] = 1 / config.logit_scale  # llama.cpp divides the logits by it
    if arch.name == "gptneox":
        keys["use_parallel_residual"] = config.parallel_residual
    if config.n_experts is not None:
        keys["expert_count"], keys["expert_used_count"] = config.n_experts, config.n_experts_per_token
        keys["expert_feed_forward_length"] = config.expert_hidden
        if config.moe_shared_hidden is not None:
            keys["expert_shared_feed_forward_length"] = config.moe_shared_hidden
    return {key: value for key, value in keys.items() if key in arch.keys}


def config_from_keys(
    arch: Arch, get: Callable[..., Any], vocab_size: int, tie: bool, divisors: list[float] | None
) -> ModelConfig:
    """The ModelConfig that arch's keys (get(key, default), a GGUFError where required and absent) describe;
    divisors: a rope_freqs tensor's values."""
    n_head, n_embd, n_layer = int(get("attention.head_count")), int(get("embedding_length")), int(get("block_count"))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"'{arch.name}.attention.value_length' differs from key_length; gptkit needs them equal")
    fields: dict[str, Any] = dict(arch.fixed)
    fields.update(
        vocab_size=vocab_size,
        block_size=int(get("context_length")),
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=int(get("attention.head_count_kv", n_head)),
        n_embd=n_embd,
        head_dim=head_dim,
        ffn_hidden=int(get("feed_forward_length")),
        tie_embeddings=tie or arch.extras.get("tied", False),  # Gemma's graph reads the embedding as output
        lm_head_bias=False,
    )
    if fields["norm"] == "layernorm":
        fields["norm_eps"] = decimal(get("attention.layer_norm_epsilon"))
    else:
        fields["norm_eps"] = decimal(get("attention.layer_norm_rms_epsilon"))
    if fields["position"] == "rope":
        fields.update(_rope_fields(arch, get, head_dim, fields["block_size"], divisors))
    fields.update(_window_fields(arch, get, n_layer))
    scaling = fields.get("rope_scaling")
    if scaling is not None and "sliding" in fields.get("layer_types", ()) and sliding_refusal(arch, scaling.rope_type):
        why = sliding_refusal(arch, scaling.rope_type)
        raise GGUFError(f"metadata '{arch.name}.rope.scaling.type' {scaling.rope_type!r} with sliding layers: {why}")
    fields.update(_arch_fields(arch, get, fields))
    fields.update(_expert_fields(arch, get, fields["ffn_hidden"]))
    return ModelConfig(**fields)


def _rope_fields(
    arch: Arch, get: Callable[..., Any], head_dim: int, block_size: int, divisors: list[float] | None
) -> dict[str, Any]:
    """rope_theta, rotary_dim and rope_scaling (linear or yarn keys, or a rope_freqs tensor's per-frequency
    divisors)."""
    out: dict[str, Any] = {"rope_theta": decimal(get("rope.freq_base", 10000.0))}
    out["rotary_dim"] = int(get("rope.dimension_count", head_dim))
    if arch.interleaved and out["rotary_dim"] != head_dim:
        raise GGUFError(
            f"'{arch.name}.rope.dimension_count' is {out['rotary_dim']}, not the head size {head_dim}: gptkit does not "
            "read partial rotary in llama.cpp's interleaved RoPE"
        )
    scaling = read_scaling(arch, lambda key, default=None: decimal_or_value(get(key, default)), block_size)
    if scaling is not None:
        out["rope_scaling"] = scaling
    if divisors is not None:
        if "rope_scaling" in out:
            raise GGUFError("the file has both rope_freqs.weight and rope.scaling keys; gptkit reads one of them")
        factors = tuple(float(d) for d in divisors)  # llama.cpp divides each frequency by its factor, nothing else
        out["rope_scaling"] = RopeScaling("longrope", None, block_size, short_factor=factors, long_factor=factors)
        out["rope_scaling"] = dataclasses.replace(out["rope_scaling"], attention_factor=1.0)
    if arch.name == "smollm3":
        every = arch.extras["no_rope_every"]
        out["nope_layers"] = [i for i in range(int(get("block_count"))) if (i + 1) % every == 0] or None
    return out


def _window_fields(arch: Arch, get: Callable[..., Any], n_layer: int) -> dict[str, Any]:
    """sliding_window and layer_types, from the window and its pattern (a list of flags, or a period n: layer i
    slides iff i % n < n - 1, llama.cpp's set_swa_pattern)."""
    window = int(get("attention.sliding_window", 0))
    if not arch.window_pattern or window == 0:
        return {}  # llama.cpp's phi3 reads the key and disables its window (src/models/phi3.cpp)
    pattern = get("attention.sliding_window_pattern", arch.window_pattern)
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern][:n_layer]
    else:
        sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n_layer)]
    return {"sliding_window": window, "layer_types": ["sliding" if s else "full" for s in sliding]}


def _arch_fields(arch: Arch, get: Callable[..., Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The fields one architecture's graph sets: Gemma's scales and soft-caps, Granite's multipliers, GPT-NeoX's
    parallel residual."""
    out: dict[str, Any] = {}
    if arch.name in ("gemma2", "gemma3"):
        out["embedding_scale"] = math.sqrt(fields["n_embd"])  # llama.cpp scales the embeddings by sqrtf(n_embd)
        if fields["n_layer"] == arch.extras["wide_scale_layers"]:
            out["attn_scale"] = 1 / math.sqrt(fields["n_embd"] // fields["n_head"])
        final = decimal(get("final_logit_softcapping", 30.0 if arch.name == "gemma2" else 0.0))
        out["logit_softcap"] = final or None
        if arch.name == "gemma2":
            out["attn_softcap"] = decimal(get("attn_logit_softcapping", 50.0)) or None
        else:
            out["rope_local_theta"] = decimal(get("rope.freq_base_swa", 10000.0))
            out["rope_theta"] = decimal(get("rope.freq_base", 10000.0))
    if arch.name == "granite":
        scale = decimal(get("attention.scale", 0.0))
        out["attn_scale"] = scale if scale and scale != decimal(1 / math.sqrt(fields["head_dim"])) else None
        out["embedding_scale"] = decimal(get("embedding_scale", 0.0)) or None
        out["residual_scale"] = decimal(get("residual_scale", 0.0)) or 1.0
        out["logit_scale"] = 1 / decimal(get("logit_scale"))
    if arch.name == "gptneox":
        out["parallel_residual"] = bool(get("use_parallel_residual"))
    return out


def _expert_fields(arch: Arch, get: Callable[..., Any], ffn_hidden: int) -> dict[str, Any]:
    """n_experts and the moe_* fields of an architecture with experts (none where expert_count is absent or 0),
    with llama.cpp's defaults for the hidden sizes (src/llama-model.cpp: an expert's n_ff / n_expert_used, the
    shared expert's n_ff; the tensors' shapes are checked against them on loading)."""
    if "expert_count" not in arch.keys or not int(get("expert_count", 0)):
        return {}
    out: dict[str, Any] = {"n_experts": int(get("expert_count")), "n_experts_per_token": int(get("expert_used_count"))}
    out["moe_renormalize"] = arch.renormalize
    if "expert_feed_forward_length" in arch.keys:
        hidden = int(get("expert_feed_forward_length", ffn_hidden // out["n_experts_per_token"]))
        out["moe_ffn_hidden"] = hidden if hidden != ffn_hidden else None
    if arch.shared_expert:
        out["moe_shared_hidden"] = int(get("expert_shared_feed_forward_length", ffn_hidden))
        out["moe_shared_gate"] = True
    return out


# ----------------------------------------------------------------------------------------------- writing's check


def rope_divisors(config: ModelConfig) -> list[float] | None:
    """The per-frequency divisors (float32) a rope_freqs tensor holds for config's RoPE scaling (Llama 3's rule,
    or divisors already), or None where the scaling is written as keys or absent."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type not in ("llama3", "longrope"):
        return None
    base = base_frequencies(config.rope_theta, config.rotary_dim).double()
    scaled = scaled_frequencies(config.rope_theta, config.rotary_dim, scaling, config.block_size).double()
    return (base / scaled).float().tolist()


def architecture(config: ModelConfig) -> Arch:
    """The llama.cpp architecture computing exactly what config does, or a GGUFError naming the first field that
    none computes."""
    arch = ARCHS[_candidate(config)]
    divisors = rope_divisors(config) if arch.rope_freqs else None
    keys = config_keys(config, arch)

    def get(key: str, default: Any = None) -> Any:
        value = keys.get(key, default)
        if value is None:
            raise GGUFError(f"no {arch.name}.{key}")
        return value

    refusal = rope_refusal(config, arch)
    if refusal is not None:
        raise GGUFError(refusal)
    expected = config_from_keys(arch, get, config.vocab_size, config.tie_embeddings, divisors)
    ours = comparable(config, divisors)
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(ours, f.name), getattr(expected, f.name)
        if f.name == "activation" and (mine, theirs) == ("gelu", "gelu_tanh"):
            continue  # written as the approximation: export_gguf measures the change (gelu.py), and states it
        if f.name not in UNCOMPARED and not _same(mine, theirs):
            why = WHY.get(f.name) or f"llama.cpp's {arch.name} computes {f.name} {theirs!r}"
            raise GGUFError(f"{f.name} {getattr(config, f.name)!r} cannot be written as GGUF: {why}")
    for f in ("attn_bias", "mlp_bias"):
        if getattr(config, f) and not arch.fixed.get(f, False):
            raise GGUFError(f"{f} True cannot be written as GGUF: llama.cpp's {arch.name} has no such biases")
    if arch.extras.get("model_wide_k_norm") and config.n_kv_head * config.head_dim != config.n_embd:
        raise GGUFError(
            f"n_kv_head {config.n_kv_head} cannot be written as GGUF: llama.cpp's {arch.name} norms the keys with a "
            f"weight as wide as the model (n_embd {config.n_embd}), which grouped-query keys "
            f"({config.n_kv_head} x {config.head_dim}) are not; set n_kv_head = n_head = n_embd / head_dim"
        )
    return arch


def comparable(config: ModelConfig, divisors: list[float] | None) -> ModelConfig:
    """config in the form reading a file gives: norm gains with their offset folded in, a default score scale
    implicit, Llama 3's rule as its divisors, a yarn rule with its factor explicit."""
    changes: dict[str, Any] = {"norm_gain_offset": 0.0}
    # llama.cpp computes 1/sqrt(head_dim) in float32 when attention.scale is absent (Gemma 3's 256**-0.5 at
    # head_dim 256, Llama's default): a scale equal to it up to double rounding is that default, anything else is
    # compared as a field (and refused where the architecture cannot take it)
    if config.attn_scale is not None and math.isclose(config.attn_scale, 1 / math.sqrt(config.head_dim)):
        changes["attn_scale"] = None
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn":
        changes["rope_scaling"] = yarn_as_read(config.rope_scaling, config.block_size)
    if divisors is not None:
        factors = tuple(divisors)
        changes["rope_scaling"] = RopeScaling(
            "longrope", None, config.block_size, attention_factor=1.0, short_factor=factors, long_factor=factors
        )
    return dataclasses.replace(config, **changes)


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to float32's precision (the file holds float32)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, RopeScaling) and isinstance(b, RopeScaling):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(RopeScaling))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _candidate(config: ModelConfig) -> str:
    """The one architecture that could compute config, by its distinctive switch (checked in full afterwards)."""
    if config.n_experts is not None:
        if config.moe_shared_hidden is not None:
            return "qwen2moe"
        if config.qk_norm:
            return "olmoe" if config.qk_norm_scope == "width" else "qwen3moe"
        return "llama"  # Mixtral
    if config.position == "learned":
        return "gpt2"
    if config.parallel_residual or config.norm == "layernorm":
        return "gptneox"
    if config.norm_position == "sandwich":
        return "gemma3" if config.qk_norm else "gemma2"
    if config.norm_position == "sublayer_post":
        return "olmo2"
    if config.nope_layers:
        return "smollm3"
    scales = (config.embedding_scale, config.attn_scale, config.residual_scale, config.logit_scale)
    if scales != (None, None, 1.0, 1.0):
        return "granite"
    if config.qk_norm:
        return "qwen3"
    if config.attn_bias:
        return "qwen2"
    if config.rotary_dim != config.head_dim:
        return "phi3"
    return "llama"


def divisors_tensor(divisors: list[float]) -> torch.Tensor:
    """rope_freqs.weight's data."""
    return torch.tensor(divisors, dtype=torch.float32)
