"""RoPE scaling between ModelConfig and GGUF's "<arch>.rope.scaling.*" keys, as llama.cpp computes it: none, linear
and YaRN both ways (Llama 3's rule goes as the rope_freqs tensor, hparams.rope_divisors); what llama.cpp computes
otherwise (dynamic NTK, Phi-3's long/short longrope pair, YaRN's ramp moved) is refused, naming the field.

llama.cpp's YaRN (ggml/src/ggml-cpu/ops.cpp rope_yarn, ggml/src/ggml.c ggml_rope_yarn_corr_dims,
src/llama-context.cpp) is Hugging Face's _compute_yarn_parameters with its defaults: the ramp's ends are the
dimensions turning beta_fast = 32 and beta_slow = 1 times over rope.scaling.original_context_length (default:
context_length), floored and ceiled, clamped to [0, rotary_dim - 1]; the frequencies below it are divided by
rope.scaling.factor; cos and sin are multiplied by 1 + 0.1 ln(factor) (1 where factor <= 1) times
rope.scaling.attn_factor (default 1), the one factor gptkit's attention_factor holds. The gptkit architectures'
graphs read none of the yarn_beta_fast, yarn_beta_slow, yarn_ext_factor or yarn_attn_factor keys (grok and mistral3
do), so a file whose value differs from what llama.cpp computes is refused rather than read either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from gptkit.config import ModelConfig, RopeScaling
from gptkit.formats.gguf.archs import Arch
from gptkit.formats.gguf.vocab import GGUFError
from gptkit.positions import YARN_BETA_FAST, YARN_BETA_SLOW, scaling_attention_factor

# What llama.cpp computes for each yarn_* key these architectures leave unread (src/llama-hparams.h and
# src/llama-context.cpp: ext_factor 1 under YaRN); yarn_attn_factor is compared with the factor it computes.
IGNORED_YARN_KEYS = {
    "rope.scaling.yarn_beta_fast": YARN_BETA_FAST,
    "rope.scaling.yarn_beta_slow": YARN_BETA_SLOW,
    "rope.scaling.yarn_ext_factor": 1.0,
}


def scaling_keys(scaling: RopeScaling | None, block_size: int) -> dict[str, Any]:
    """The rope.scaling.* keys (without "<arch>.") of a linear or yarn rule; none for the others."""
    if scaling is None or scaling.rope_type not in ("linear", "yarn"):
        return {}
    if scaling.rope_type == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": scaling.factor}
    form = yarn_as_read(scaling, block_size)
    keys: dict[str, Any] = {"rope.scaling.type": "yarn", "rope.scaling.factor": form.factor}
    keys["rope.scaling.original_context_length"] = form.original_max_position_embeddings
    if form.attention_factor is not None:
        keys["rope.scaling.attn_factor"] = form.attention_factor / _derived_attention(form)
    return keys


def yarn_as_read(scaling: RopeScaling, block_size: int) -> RopeScaling:
    """A yarn rule in the form reading its keys gives: the attention factor a number (mscale's ratio computed), or
    None where it is the one derived from the factor; the ramp's defaults implicit (rope_refusal refuses others)."""
    plain = RopeScaling("yarn", scaling.factor, scaling.original_max_position_embeddings)
    attention = scaling_attention_factor(scaling, block_size)
    if math.isclose(attention, _derived_attention(plain), rel_tol=1e-7):
        return plain
    return dataclasses.replace(plain, attention_factor=attention)


def _derived_attention(scaling: RopeScaling) -> float:
    """YaRN's attention factor from its factor alone: 0.1 ln(factor) + 1 (llama.cpp's get_mscale, HF's too)."""
    return scaling_attention_factor(dataclasses.replace(scaling, attention_factor=None, mscale=None), 0)


def read_scaling(arch: Arch, get: Callable[..., Any], block_size: int) -> RopeScaling | None:
    """The rule a file's rope.scaling.* keys give llama.cpp's graph, or a GGUFError naming the key gptkit cannot
    read as llama.cpp computes it."""
    kind = get("rope.scaling.type", "linear")  # llama.cpp's default (src/llama-model.cpp)
    factor = float(get("rope.scaling.factor", 0.0)) or 1.0  # 0 or absent: freq_scale 1
    attn = float(get("rope.scaling.attn_factor", 1.0))
    if kind not in ("none", "linear", "yarn"):
        why = "longrope's are Phi-3's rope_factors_long/short tensors, which gptkit does not map"
        raise GGUFError(
            f"metadata '{arch.name}.rope.scaling.type' is {kind!r}; gptkit reads none, linear, yarn ({why})"
        )
    if kind != "yarn":
        for key in (*IGNORED_YARN_KEYS, "rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor"):
            if get(key, 0.0) and not (key == "rope.scaling.attn_factor" and attn == 1.0):
                why = "gptkit reads it with yarn scaling only"
                raise GGUFError(f"metadata '{arch.name}.{key}' is {get(key)!r} with {kind!r} RoPE scaling: {why}")
        return RopeScaling("linear", factor=factor) if kind == "linear" and factor != 1.0 else None
    original = int(get("rope.scaling.original_context_length", block_size))
    plain = RopeScaling("yarn", factor, original)
    attention = attn * _derived_attention(plain)
    for key, computed in (*IGNORED_YARN_KEYS.items(), ("rope.scaling.yarn_attn_factor", attention)):
        value = get(key, computed)
        if not math.isclose(float(value), computed, rel_tol=1e-6):
            raise GGUFError(
                f"metadata '{arch.name}.{key}' is {value!r}, but llama.cpp's {arch.name} reads no such key (it "
                f"computes {computed:.6g}); gptkit does not guess which the file means"
            )
    return plain if attn == 1.0 else dataclasses.replace(plain, attention_factor=attention)


def sliding_refusal(arch: Arch, kind: str) -> str | None:
    """Why llama.cpp's arch computes sliding layers' RoPE under this scaling rule otherwise than gptkit, or None."""
    if arch.name == "olmo2":  # src/models/olmo2.cpp: sliding layers rotate with freq_scale 1 and no attn_factor
        return "llama.cpp's olmo2 leaves its sliding layers unscaled"
    if arch.name == "gemma3" and kind == "yarn":  # freq_scale_swa 1, but the cancelled yarn attn_factor applies
        return "llama.cpp's gemma3 scales its sliding layers' cos and sin by 1 / (0.1 ln(factor) + 1)"
    return None


def rope_refusal(config: ModelConfig, arch: Arch) -> str | None:
    """Why config's RoPE scaling cannot be written as arch, or None: the rules and parameters llama.cpp's graph does
    not compute."""
    scaling = config.rope_scaling
    if scaling is None:
        return None
    kind = scaling.rope_type
    sliding = any(config.layer_window(i) is not None for i in range(config.n_layer))
    if kind == "dynamic":
        return "rope_scaling 'dynamic' cannot be written as GGUF: llama.cpp computes no dynamic NTK scaling"
    if kind == "longrope" and not arch.rope_freqs:
        why = f"llama.cpp's {arch.name} reads no rope_freqs divisors (Phi-3's rope_factors_long/short: not written)"
        return f"rope_scaling 'longrope' cannot be written as GGUF: {why}"
    if kind == "longrope" and scaling.long_factor != scaling.short_factor:
        why = f"llama.cpp's {arch.name} holds one set of divisors (rope_freqs), not a long and a short one"
        return f"rope_scaling.long_factor cannot be written as GGUF: {why}"
    if kind == "longrope" and scaling_attention_factor(scaling, config.block_size) != 1.0:
        why = f"llama.cpp's {arch.name} scales cos and sin by none with rope_freqs divisors (set attention_factor 1)"
        return f"rope_scaling 'longrope' cannot be written as GGUF: {why}"
    if sliding and sliding_refusal(arch, kind):
        return f"rope_scaling {kind!r} cannot be written as GGUF: {sliding_refusal(arch, kind)}"
    if kind != "yarn":
        return None
    for name, default in (("beta_fast", YARN_BETA_FAST), ("beta_slow", YARN_BETA_SLOW)):
        value = getattr(scaling, name)
        if value is not None and value != default:
            why = f"llama.cpp's {arch.name} takes {default:g} (it reads no yarn_{name} key)"
            return f"rope_scaling.{name} {value!r} cannot be written as GGUF: {why}"
    if scaling.truncate is False:
        why = "llama.cpp rounds YaRN's ramp ends to whole dimensions (ggml_rope_yarn_corr_dims)"
        return f"rope_scaling.truncate False cannot be written as GGUF: {why}"
    return None
