"""Conversion between gptkit models and Hugging Face GPT-2 / Llama-family checkpoints, in both directions.

Llama-style models export as Llama, or as Qwen3 with qk_norm; GPT-2 and Llama, Mistral, Qwen2 and Qwen3 import.

One description of each Hugging Face layout (which gptkit tensor is which HF tensor, transposed or fused)
drives import and export alike; the config mapping is one table per family, read in one direction and
written in the other. Whatever a checkpoint holds that gptkit cannot compute exactly is refused with a
ConversionError naming the setting, never approximated.

transformers itself is not needed for directories; only gpt_from_hf_model / hf_model_from_gpt import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from gptkit.atomic import atomic_write_text
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError, GptkitError
from gptkit.formats.hf.tokenizer import write_hf_tokenizer
from gptkit.model import GPT
from gptkit.tensors import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, ModelDirError, read_config_json, save_tensors
from gptkit.tokenizer import tokenizer_or_none
from gptkit.weights import load_state_into, model_state, real_vocab_state

log = logging.getLogger(__name__)

BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
HINT_KEY = "gptkit_config"  # export stores the full gptkit config here, so that a round trip is lossless

# Fields an exported HF config cannot carry but which do not change what the model computes: dropout is
# training-only, and a bias flag only says whether a bias that HF stores as zeros exists at all.
# zero_init_proj only says how training started.
HINT_FIELDS = ("dropout", "attn_bias", "mlp_bias", "norm_bias", "zero_init_proj")


class ConversionError(GptkitError):
    """A checkpoint or model that cannot be converted exactly; the message names the setting or tensor."""


# ---------------------------------------------------------------------------------------------------------
# Weight layouts: where each gptkit tensor lives in a Hugging Face state dict.


def _qkv_rows(config: ModelConfig) -> tuple[int, ...]:
    """Rows of q, k and v inside gptkit's fused attention projection."""
    hd = config.head_dim
    return (config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd)


def _gate_up_rows(config: ModelConfig) -> tuple[int, ...]:
    """Rows of gate and up inside gptkit's fused SwiGLU input projection."""
    return (config.ffn_hidden, config.ffn_hidden)


@dataclass(frozen=True)
class BlockTensor:
    """One gptkit module of a block and the HF module(s) holding it."""

    ours: str  # module path inside blocks.{i}
    theirs: tuple[str, ...]  # module paths inside the HF layer; several are stacked row-wise in this order
    transposed: bool = False  # GPT-2's Conv1D stores weights as (in, out)
    rows: Callable[[ModelConfig], tuple[int, ...]] | None = None  # row split when theirs has several modules


@dataclass(frozen=True)
class Layout:
    """How one HF architecture names and stores a decoder-only transformer's tensors."""

    architecture: str  # the class name in config.json's "architectures"
    model_type: str
    base: str  # prefix of the body's tensors, e.g. "model."
    embed: str
    positions: str | None
    layers: str
    final_norm: str
    block: tuple[BlockTensor, ...]
    no_bias: frozenset[str] = frozenset()  # block modules whose bias HF never stores (it is zero)
    forced: tuple[tuple[str, Any], ...] = ()  # ModelConfig fields the architecture fixes, whatever the config says
    buffers: tuple[str, ...] = ()  # per-layer non-weights older checkpoints carry, safe to skip


GPT2 = Layout(
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    base="transformer.",
    embed="wte",
    positions="wpe",
    layers="h",
    final_norm="ln_f",
    block=(
        BlockTensor("norm1", ("ln_1",)),
        BlockTensor("attn.qkv", ("attn.c_attn",), transposed=True),
        BlockTensor("attn.proj", ("attn.c_proj",), transposed=True),
        BlockTensor("norm2", ("ln_2",)),
        BlockTensor("mlp.fc", ("mlp.c_fc",), transposed=True),
        BlockTensor("mlp.proj", ("mlp.c_proj",), transposed=True),
    ),
    buffers=("attn.bias", "attn.masked_bias"),  # the causal mask old GPT-2 checkpoints saved as a tensor
)

_LLAMA_BLOCK = (
    BlockTensor("norm1", ("input_layernorm",)),
    BlockTensor("attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), rows=_qkv_rows),
    BlockTensor("attn.proj", ("self_attn.o_proj",)),
    BlockTensor("norm2", ("post_attention_layernorm",)),
    BlockTensor("mlp.fc", ("mlp.gate_proj", "mlp.up_proj"), rows=_gate_up_rows),
    BlockTensor("mlp.proj", ("mlp.down_proj",)),
)
_LLAMA_LIKE = dict(base="model.", embed="embed_tokens", positions=None, layers="layers", final_norm="norm",
                   block=_LLAMA_BLOCK, buffers=("self_attn.rotary_emb.inv_freq",))  # fmt: skip
LLAMA = Layout(architecture="LlamaForCausalLM", model_type="llama", **_LLAMA_LIKE)
MISTRAL = Layout(architecture="MistralForCausalLM", model_type="mistral",
                 forced=(("attn_bias", False), ("mlp_bias", False)), **_LLAMA_LIKE)  # fmt: skip
# Qwen2 has biases on q, k, v but none on the output projection: gptkit holds that one as zeros.
QWEN2 = Layout(architecture="Qwen2ForCausalLM", model_type="qwen2", no_bias=frozenset({"attn.proj"}),
               forced=(("attn_bias", True), ("mlp_bias", False)), **_LLAMA_LIKE)  # fmt: skip

# Qwen3: Llama's layout, biases on all four attention projections or none, and an RMSNorm over head_dim on each
# head's q and k before RoPE (gptkit's qk_norm).
_QWEN3_BLOCK = _LLAMA_BLOCK + (BlockTensor("attn.q_norm", ("self_attn.q_norm",)),
                               BlockTensor("attn.k_norm", ("self_attn.k_norm",)))  # fmt: skip
QWEN3 = Layout(architecture="Qwen3ForCausalLM", model_type="qwen3", forced=(("mlp_bias", False), ("qk_norm", True)),
               **dict(_LLAMA_LIKE, block=_QWEN3_BLOCK))  # fmt: skip

LAYOUTS = {layout.architecture: layout for layout in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3)}


@dataclass(frozen=True)
class Rule:
    """One gptkit tensor and the HF tensors it is made of."""

    ours: str
    shape: tuple[int, ...]  # gptkit's shape
    theirs: tuple[str, ...]  # empty: HF stores nothing, the tensor is zero
    their_shapes: tuple[tuple[int, ...], ...]
    transposed: bool


def weight_rules(config: ModelConfig, layout: Layout, base: str | None = None) -> list[Rule]:
    """The mapping of every tensor gptkit saves for config onto layout's names and shapes."""
    base = layout.base if base is None else base
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in model_state(GPT(config)).items()}
    modules: list[tuple[str, tuple[str, ...], BlockTensor | None]] = [("tok_emb", (base + layout.embed,), None)]
    if layout.positions is not None:
        modules.append(("pos_emb", (base + layout.positions,), None))
    for i in range(config.n_layer):
        layer = f"{base}{layout.layers}.{i}."
        modules += [(f"blocks.{i}.{b.ours}", tuple(layer + t for t in b.theirs), b) for b in layout.block]
    modules += [("norm_f", (base + layout.final_norm,), None), ("lm_head", ("lm_head",), None)]
    rules = []
    for module, theirs, spec in modules:
        for param in ("weight", "bias"):
            ours = f"{module}.{param}"
            if ours not in shapes:
                continue  # e.g. no biases, or the tied head stored once as tok_emb.weight
            shape = stored = shapes[ours]
            transposed = spec is not None and spec.transposed and param == "weight"
            if transposed:
                stored = (shape[1], shape[0])
            if spec is not None and param == "bias" and spec.ours in layout.no_bias:
                rules.append(Rule(ours, shape, (), (), False))
                continue
            rows = spec.rows(config) if spec is not None and spec.rows is not None else (stored[0],)
            their_shapes = tuple((r, *stored[1:]) for r in rows)
            rules.append(Rule(ours, shape, tuple(f"{t}.{param}" for t in theirs), their_shapes, transposed))
    return rules


def ignorable_names(config: ModelConfig, layout: Layout, base: str) -> set[str]:
    """HF tensors an import may skip: per-layer buffers of older checkpoints, the second name of a tied head.

    A tied config's lm_head.weight is only skipped when it equals the embedding (see untied_if_head_differs).
    """
    names = {f"{base}{layout.layers}.{i}.{b}" for i in range(config.n_layer) for b in layout.buffers}
    if config.tie_embeddings:
        names.add("lm_head.weight")
    return names


def import_tensor(rule: Rule, get: Callable[[str], Tensor], source: str) -> Tensor:
    """Build one gptkit tensor from the HF tensors of rule, checking every shape."""
    parts = []
    for name, shape in zip(rule.theirs, rule.their_shapes):
        tensor = get(name)
        if not tensor.is_floating_point():
            raise ConversionError(
                f"{source}: tensor {name!r} has dtype {tensor.dtype}; weights must be floating point "
                "(re-save the checkpoint with float weights)"
            )
        if tuple(tensor.shape) != shape:
            found = tuple(tensor.shape)
            raise ConversionError(f"{source}: tensor {name!r} has shape {found}, the config needs {shape}")
        parts.append(tensor)
    tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
    return tensor.t().contiguous() if rule.transposed else tensor


def export_tensor(rule: Rule, tensor: Tensor) -> dict[str, Tensor]:
    """The HF tensors of rule, cut from one gptkit tensor."""
    if not rule.theirs:
        if torch.count_nonzero(tensor):
            raise ConversionError(f"tensor {rule.ours!r} is not zero, but the target layout stores no such tensor")
        return {}
    if rule.transposed:
        tensor = tensor.t()
    parts = tensor.split([shape[0] for shape in rule.their_shapes]) if len(rule.theirs) > 1 else (tensor,)
    return dict(zip(rule.theirs, parts))


def with_biases(state: dict[str, Tensor], source: ModelConfig, target: ModelConfig) -> dict[str, Tensor]:
    """state (of a source-config model) for a target config that differs only in which biases exist.

    Biases target has and source lacks are added as zeros; biases source has and target lacks must be zero
    and are dropped. Both are the same function, so nothing about the model changes.
    """
    with torch.device("meta"):
        wanted = {name: t for name, t in model_state(GPT(target)).items()}
    dropped = set(state) - set(wanted)
    for name in sorted(dropped):
        if torch.count_nonzero(state[name]):
            raise ConversionError(f"tensor {name!r} is not zero, so the config without it would differ")
    reference = state["tok_emb.weight"]
    return {
        name: state[name] if name in state else torch.zeros(t.shape, dtype=reference.dtype, device=reference.device)
        for name, t in wanted.items()
    }


# ---------------------------------------------------------------------------------------------------------
# Config mapping. Each family: HF key <-> ModelConfig field, the fields HF fixes, and family defaults for
# keys a config.json may omit (the defaults of transformers' config classes).

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
_FAMILY = ("learned positions export as GPT-2 (LayerNorm; gelu, gelu_tanh, relu or relu2), rope as Llama or Qwen3 "
           "(RMSNorm, swiglu)")
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


# ---------------------------------------------------------------------------------------------------------
# Reading HF weights.


@contextlib.contextmanager
def open_weights(path: Path) -> Iterator[tuple[dict[str, Callable[[], Tensor]], str]]:
    """Lazy loaders for every tensor of an HF directory, by name, and a description of where they come from.

    Reads model.safetensors, sharded safetensors (index json) or pytorch_model.bin (weights_only, never pickle
    code); a tensor is read only when its loader is called, so conversion never holds two copies of the model.
    """
    with contextlib.ExitStack() as stack:
        if (path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file():
            files = _shards(path, WEIGHTS_FILE, INDEX_FILE)
            loaders: dict[str, Callable[[], Tensor]] = {}
            for file in files:
                try:
                    handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                except FileNotFoundError:
                    raise ModelDirError(f"{file} does not exist (listed in {path / INDEX_FILE})") from None
                except (SafetensorError, OSError, ValueError) as err:
                    raise ModelDirError(
                        f"{file} is not a readable safetensors file (truncated or corrupt?): {_one_line(err)}"
                    ) from None
                for name in handle.keys():
                    loaders[name] = _safetensors_loader(handle, name, file)
            yield loaders, str(path)
        elif (path / BIN_FILE).is_file() or (path / BIN_INDEX_FILE).is_file():
            state: dict[str, Tensor] = {}
            for file in _shards(path, BIN_FILE, BIN_INDEX_FILE):
                state.update(_torch_load(file))
            yield {name: (lambda t=t: t) for name, t in state.items()}, str(path)
        else:
            raise ModelDirError(f"{path} has no {WEIGHTS_FILE}, {INDEX_FILE}, {BIN_FILE} or {BIN_INDEX_FILE}")


def _shards(path: Path, single: str, index: str) -> list[Path]:
    """The weight files of a directory: the single file, or every file its index names."""
    if (path / single).is_file():
        return [path / single]
    try:
        weight_map = json.loads((path / index).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ModelDirError(f"cannot read {path / index}: {err}") from None


def _safetensors_loader(handle: Any, name: str, file: Path) -> Callable[[], Tensor]:
    def load() -> Tensor:
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            why = _one_line(err)
            raise ModelDirError(f"{file}: cannot read tensor {name!r} (truncated or corrupt?): {why}") from None

    return load


def _torch_load(file: Path) -> dict[str, Tensor]:
    """A pytorch_model.bin state dict, with weights_only=True so that no pickled code runs."""
    import pickle

    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise ModelDirError(
            f"{file} is not a readable PyTorch weights file (truncated, corrupt or not weights-only?): {_one_line(err)}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
        raise ModelDirError(f"{file} does not hold a flat dict of tensors")
    return state


def _one_line(err: BaseException) -> str:
    """The first line of an error's message (library messages can span several)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _base_prefix(layout: Layout, names: set[str]) -> str:
    """The body prefix actually used: OpenAI's original GPT-2 files name tensors without "transformer."."""
    if layout.base + layout.embed + ".weight" not in names and layout.embed + ".weight" in names:
        return ""
    return layout.base


def state_from_hf(
    config: ModelConfig,
    layout: Layout,
    loaders: dict[str, Callable[[], Tensor]],
    source: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """gptkit's state dict for config, built tensor by tensor from HF tensors in one dtype; names any bad tensor."""
    base = _base_prefix(layout, set(loaders))
    rules = weight_rules(config, layout, base)
    needed = {name for rule in rules for name in rule.theirs}
    for rule in rules:
        for name in rule.theirs:
            if name not in loaders:
                raise ConversionError(f"{source} lacks tensor {name!r} (needed for {rule.ours})")
    extra = sorted(set(loaders) - needed - ignorable_names(config, layout, base))
    if extra:
        raise ConversionError(
            f"{source} has tensor {extra[0]!r} that {layout.architecture} with this config does not use "
            f"({len(extra)} such); refusing rather than dropping weights"
        )
    device = torch.device(device) if device is not None else torch.device("cpu")
    state = {}
    for rule in rules:
        if rule.theirs:
            tensor = import_tensor(rule, lambda name: loaders[name](), source)
        else:  # HF never stores this bias; it is zero
            tensor = torch.zeros(rule.shape)
        # One dtype for the whole model, as transformers loads it: a mixed file (bf16 weights, fp32 norms) would
        # fail at forward. Unless one is requested, the token embedding's (the first rule; the bulk's dtype).
        dtype = tensor.dtype if dtype is None else dtype
        state[rule.ours] = tensor.to(device=device, dtype=dtype)
    return state


def untied_if_head_differs(
    config: ModelConfig,
    layout: Layout,
    loaders: dict[str, Callable[[], Tensor]],
    source: str,
    dtype: torch.dtype | None = None,
) -> ModelConfig:
    """config, untied when it ties the head but the file holds an lm_head.weight that is not the embedding."""
    embed = _base_prefix(layout, set(loaders)) + layout.embed + ".weight"
    if not config.tie_embeddings or "lm_head.weight" not in loaders or embed not in loaders:
        return config
    head, embedding = loaders["lm_head.weight"](), loaders[embed]()
    dtype = embedding.dtype if dtype is None else dtype  # compared as imported, like transformers after loading
    if head.shape == embedding.shape and torch.equal(head.to(dtype), embedding.to(dtype)):
        return config
    # transformers then keeps both tensors (with a warning): the model computes with the file's head.
    log.warning("%s: lm_head.weight differs from the embedding although the config ties them; keeping both", source)
    return dataclasses.replace(config, tie_embeddings=False)


def model_from_hf_state(
    hf: dict[str, Any],
    loaders: dict[str, Callable[[], Tensor]],
    source: str,
    class_name: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> GPT:
    """The GPT equal to an HF model given as its config dict and its tensors (lazily loaded)."""
    layout = detect_layout(hf, source, class_name)
    derived = untied_if_head_differs(config_from_hf(hf, layout, source), layout, loaders, source, dtype)
    state = state_from_hf(derived, layout, loaders, source, dtype, device)
    config = config_with_hint(derived, hf)
    if config != derived:
        try:
            state = with_biases(state, derived, config)
        except ConversionError:
            config = derived  # the recorded config dropped a bias that is no longer zero: keep it
    with torch.device("meta"):
        model = GPT(config)
    return load_state_into(model, state, source).eval()


def load_hf(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[GPT, Any]:
    """(model, tokenizer) from a local Hugging Face checkpoint directory; tokenizer is None without tokenizer.json."""
    path = Path(path)
    hf = read_config_json(path)
    detect_layout(hf, str(path))  # refuse an unknown architecture before touching the weights
    with open_weights(path) as (loaders, source):
        model = model_from_hf_state(hf, loaders, source, dtype=dtype, device=device)
    tokenizer = tokenizer_or_none(path)
    if tokenizer is not None:
        # An id past the tokenizer's vocabulary (a padded embedding's) could never be decoded anyway.
        tokenizer.add_eos_ids(i for i in hf_eos_ids(path, hf) if 0 <= i < tokenizer.vocab_size)
    return model, tokenizer


def hf_eos_ids(path: Path, hf: dict[str, Any]) -> list[int]:
    """The eos_token_id(s) that end generation: generation_config.json's (what `generate` reads), else config's."""
    source = hf
    file = path / GENERATION_CONFIG_FILE
    if file.is_file():
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ModelDirError(f"cannot read {file}: {err}") from None
        if isinstance(data, dict) and data.get("eos_token_id") is not None:
            source = data
    ids = source.get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def gpt_from_hf_model(hf_model: Any) -> GPT:
    """The GPT equal to an in-memory transformers model (GPT2LMHeadModel or a Llama-family *ForCausalLM)."""
    state = hf_model.state_dict()
    loaders = {name: (lambda t=t: t.detach().clone()) for name, t in state.items()}  # no storage shared
    param = next(hf_model.parameters())
    return model_from_hf_state(
        hf_model.config.to_dict(), loaders, type(hf_model).__name__, class_name=type(hf_model).__name__,
        device=param.device,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Writing HF checkpoints.


def hf_checkpoint(model: GPT, tokenizer: Any | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The HF config.json dict and state dict equal to model, or a ConversionError saying why none is."""
    module = getattr(model, "_orig_mod", model)
    config: ModelConfig = module.config
    eos_ids = list(tokenizer.eos_ids) if tokenizer is not None else []
    hf = hf_config_from_gptkit(config, eos_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids or None)
    layout = LAYOUTS[hf["architectures"][0]]
    target = config_from_hf(hf, layout, "export")  # the config HF's model will have (e.g. with zero biases)
    state = with_biases(real_vocab_state(model_state(module), config), config, target)  # a padded head's rows cut
    hf_state: dict[str, Tensor] = {}
    for rule in weight_rules(target, layout):
        hf_state.update(export_tensor(rule, state[rule.ours]))
    dtype = str(state["tok_emb.weight"].dtype).removeprefix("torch.")
    hf.update(dtype=dtype, torch_dtype=dtype)
    hf[HINT_KEY] = dataclasses.replace(config, vocab_multiple=1).to_dict()  # HF holds the real rows only
    return hf, hf_state


# transformers' sequence-classification class for each causal-LM class gptkit writes.
CLASSIFIER_ARCHITECTURES = {"GPT2LMHeadModel": "GPT2ForSequenceClassification",
                            "LlamaForCausalLM": "LlamaForSequenceClassification",
                            "MistralForCausalLM": "MistralForSequenceClassification",
                            "Qwen2ForCausalLM": "Qwen2ForSequenceClassification",
                            "Qwen3ForCausalLM": "Qwen3ForSequenceClassification"}  # fmt: skip


def hf_classifier_checkpoint(hf: dict[str, Any], hf_state: dict[str, Tensor], labels: list[str], score: Tensor,
                             pad_id: int | None) -> tuple[dict[str, Any], dict[str, Tensor]]:  # fmt: skip
    """A causal LM's config and state turned into its *ForSequenceClassification: the same body, and a linear
    head without bias (score) that transformers reads at each row's last token that is not pad_id."""
    architecture = CLASSIFIER_ARCHITECTURES.get(hf["architectures"][0])
    if architecture is None:
        raise ConversionError(f"transformers has no sequence classifier for {hf['architectures'][0]} here")
    hf = dict(hf, architectures=[architecture], id2label=dict(enumerate(labels)),
              label2id={label: i for i, label in enumerate(labels)}, pad_token_id=pad_id,
              problem_type="single_label_classification")  # fmt: skip
    state = {name: tensor for name, tensor in hf_state.items() if name != "lm_head.weight"}
    state["score.weight"] = score.detach().to(next(iter(hf_state.values())).dtype)
    return hf, state


def hf_block_modules(config: ModelConfig) -> tuple[dict[str, list[tuple[str, int | None]]], bool]:
    """Where each gptkit block layer ("blocks.0.attn.qkv") lives in the exported HF model: its modules, each with
    the rows of the layer's output it takes (None: all), and whether they store weights transposed (Conv1D)."""
    hf = hf_config_from_gptkit(config)
    layout = LAYOUTS[hf["architectures"][0]]
    modules = {}
    for i in range(config.n_layer):
        layer = f"{layout.base}{layout.layers}.{i}."
        for spec in layout.block:
            rows = spec.rows(config) if spec.rows is not None else (None,)
            modules[f"blocks.{i}.{spec.ours}"] = [(layer + their, r) for their, r in zip(spec.theirs, rows)]
    return modules, any(spec.transposed for spec in layout.block)


def hf_model_from_gpt(model: GPT) -> Any:
    """An in-memory transformers model (GPT2LMHeadModel, LlamaForCausalLM or Qwen3ForCausalLM) computing what model
    does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, hf_state = hf_checkpoint(model)
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")}
    hf_config = AutoConfig.for_model(hf["model_type"], **fields)
    hf_config.architectures = hf["architectures"]
    reference = hf_state[next(iter(hf_state))]
    hf_model = AutoModelForCausalLM.from_config(hf_config).to(device=reference.device, dtype=reference.dtype)
    result = hf_model.load_state_dict(hf_state, strict=False)
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        name = missing[0] if missing else result.unexpected_keys[0]
        raise ConversionError(f"the transformers model and the exported state disagree on tensor {name!r}")
    return hf_model.eval()


def export_hf(
    model: GPT,
    out_dir: str | Path,
    tokenizer: Any | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    head: tuple[list[str], Tensor] | None = None,
) -> Path:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files) equal to the model.

    tokenizer_config is the model's tokenizer_config.json (chat template, special-token names): the export renders
    chats as gptkit does, with the model's own template or gptkit's default (gptkit.formats.hf.tokenizer); head (labels,
    score weight) writes a sequence classifier instead of a causal LM, padding with the end-of-text id. A model
    directory is exported by gptkit.export_hf (gptkit.loading.export_hf), which loads it and calls this.
    """
    if isinstance(model, (str, Path)):
        raise ConfigError(f"export_hf takes a GPT; export the directory {model} with gptkit.export_hf")
    hf, hf_state = hf_checkpoint(model, tokenizer)
    if head is not None:
        pad_id = tokenizer.eos_id if tokenizer is not None else None
        hf, hf_state = hf_classifier_checkpoint(hf, hf_state, head[0], head[1], pad_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(hf_state, out / WEIGHTS_FILE, metadata={"format": "pt"})
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out, tokenizer_config)
    atomic_write_text(out / CONFIG_FILE, json.dumps(hf, indent=2) + "\n")
    return out
