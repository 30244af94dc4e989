"""Hugging Face weight layouts: which gptkit tensor is which HF tensor (renamed, transposed or fused), per family.

One description of each layout drives import and export alike (see reading.py and writing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gptkit.config import ModelConfig
from gptkit.errors import GptkitError
from gptkit.model import GPT
from gptkit.weights import model_state


class ConversionError(GptkitError):
    """A checkpoint or model that cannot be converted exactly; the message names the setting or tensor."""


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
