"""Hugging Face weight layouts: which gptkit tensor is which HF tensor (renamed, transposed or fused), per family.

One description of each layout drives import and export alike (see reading.py and writing.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

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
    """Rows of gate and up inside gptkit's fused gated input projection (SwiGLU, GeGLU)."""
    return (config.ffn_hidden, config.ffn_hidden)


def _per_head_qkv_order(config: ModelConfig) -> Tensor:
    """For each row of gptkit's [q; k; v], its row in GPT-NeoX's query_key_value, which stacks q, k, v per head."""
    heads, hd = config.n_head, config.head_dim
    theirs = torch.arange(3 * heads * hd).view(heads, 3, hd)  # (head, q/k/v, dim): NeoX's row numbers
    return theirs.transpose(0, 1).reshape(-1)  # (q/k/v, head, dim) flattened: gptkit's row order


@dataclass(frozen=True)
class BlockTensor:
    """One gptkit module of a block and the HF module(s) holding it."""

    ours: str  # module path inside blocks.{i}
    theirs: tuple[str, ...]  # module paths inside the HF layer; several are stacked row-wise in this order
    transposed: bool = False  # GPT-2's Conv1D stores weights as (in, out)
    rows: Callable[[ModelConfig], tuple[int, ...]] | None = None  # row split when theirs has several modules
    order: Callable[[ModelConfig], Tensor] | None = None  # HF's row of each of ours, when HF orders rows otherwise
    # Mixture of experts: which layers hold it (all, the MoE layers, the dense ones), and whether theirs names one
    # expert's modules with {e}: ours (E, out, in) stacks every expert's, in expert order, each as theirs stacks them.
    layers: str = "all"
    per_expert: bool = False

    def applies(self, config: ModelConfig, index: int) -> bool:
        """Whether layer index holds this tensor: all layers, or only the MoE (or only the dense) ones."""
        return self.layers == "all" or (self.layers == "moe") == config.is_moe_layer(index)

    def their_modules(self, config: ModelConfig) -> tuple[str, ...]:
        """theirs, with {e} filled in for every expert when per_expert."""
        if not self.per_expert:
            return self.theirs
        return tuple(name.format(e=e) for e in range(config.n_experts) for name in self.theirs)


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
    buffers: tuple[str, ...] = ()  # per-layer non-weights older checkpoints carry, safe to skip
    head: str = "lm_head"  # the untied LM head's name in files (transformers' in-memory models call it lm_head)


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

_QKV = BlockTensor("attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), rows=_qkv_rows)
_O = BlockTensor("attn.proj", ("self_attn.o_proj",))
_GATE_UP = BlockTensor("mlp.fc", ("mlp.gate_proj", "mlp.up_proj"), rows=_gate_up_rows)
_DOWN = BlockTensor("mlp.proj", ("mlp.down_proj",))
_QK_NORMS = (BlockTensor("attn.q_norm", ("self_attn.q_norm",)), BlockTensor("attn.k_norm", ("self_attn.k_norm",)))
_INPUT_NORM = BlockTensor("norm1", ("input_layernorm",))
_LLAMA_BLOCK = (_INPUT_NORM, _QKV, _O, BlockTensor("norm2", ("post_attention_layernorm",)), _GATE_UP, _DOWN)
# Gemma 2 and 3: a norm before and after each sublayer (gptkit's sandwich).
_GEMMA_BLOCK = (
    _INPUT_NORM,
    _QKV,
    _O,
    BlockTensor("norm1_post", ("post_attention_layernorm",)),
    BlockTensor("norm2", ("pre_feedforward_layernorm",)),
    BlockTensor("norm2_post", ("post_feedforward_layernorm",)),
    _GATE_UP,
    _DOWN,
)
# OLMo 2: norms on the sublayer outputs only (gptkit's sublayer_post), q/k norms over the whole width.
_OLMO2_BLOCK = (
    _QKV,
    _O,
    BlockTensor("norm1", ("post_attention_layernorm",)),
    BlockTensor("norm2", ("post_feedforward_layernorm",)),
    _GATE_UP,
    _DOWN,
    *_QK_NORMS,
)
# Phi-3: q, k, v in one projection and gate, up in another, in gptkit's own row order.
_PHI3_BLOCK = (
    _INPUT_NORM,
    BlockTensor("attn.qkv", ("self_attn.qkv_proj",)),
    _O,
    BlockTensor("norm2", ("post_attention_layernorm",)),
    BlockTensor("mlp.fc", ("mlp.gate_up_proj",)),
    _DOWN,
)
_NEOX_BLOCK = (
    _INPUT_NORM,
    BlockTensor("attn.qkv", ("attention.query_key_value",), order=_per_head_qkv_order),
    BlockTensor("attn.proj", ("attention.dense",)),
    BlockTensor("norm2", ("post_attention_layernorm",)),
    BlockTensor("mlp.fc", ("mlp.dense_h_to_4h",)),
    BlockTensor("mlp.proj", ("mlp.dense_4h_to_h",)),
)
_ROTARY_BUFFER = ("self_attn.rotary_emb.inv_freq",)  # saved by transformers before 4.36


def _llama_like(architecture: str, model_type: str, block: tuple[BlockTensor, ...] = _LLAMA_BLOCK) -> Layout:
    """A layout with Llama's names outside the blocks (model.embed_tokens, model.layers, model.norm, lm_head)."""
    return Layout(
        architecture, model_type, "model.", "embed_tokens", None, "layers", "norm", block, buffers=_ROTARY_BUFFER
    )


LLAMA = _llama_like("LlamaForCausalLM", "llama")
MISTRAL = _llama_like("MistralForCausalLM", "mistral")
# Qwen2 has biases on q, k, v but none on the output projection: gptkit holds that one as zeros.
QWEN2 = dataclasses.replace(_llama_like("Qwen2ForCausalLM", "qwen2"), no_bias=frozenset({"attn.proj"}))
# Qwen3: an RMSNorm over head_dim on each head's q and k before RoPE (gptkit's qk_norm).
QWEN3 = _llama_like("Qwen3ForCausalLM", "qwen3", _LLAMA_BLOCK + _QK_NORMS)
GEMMA2 = _llama_like("Gemma2ForCausalLM", "gemma2", _GEMMA_BLOCK)
GEMMA3 = _llama_like("Gemma3ForCausalLM", "gemma3_text", _GEMMA_BLOCK + _QK_NORMS)
PHI3 = _llama_like("Phi3ForCausalLM", "phi3", _PHI3_BLOCK)
SMOLLM3 = _llama_like("SmolLM3ForCausalLM", "smollm3")
OLMO2 = _llama_like("Olmo2ForCausalLM", "olmo2", _OLMO2_BLOCK)
GRANITE = _llama_like("GraniteForCausalLM", "granite")
GPT_NEOX = Layout(
    "GPTNeoXForCausalLM",
    "gpt_neox",
    "gpt_neox.",
    "embed_in",
    None,
    "layers",
    "final_layer_norm",
    _NEOX_BLOCK,
    buffers=("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"),
    head="embed_out",  # transformers 5 still writes GPT-NeoX's head under its original name
)


# Mixtures of experts, as save_pretrained writes them (transformers 5 fuses each layer's experts into 3-D tensors in
# memory, gate_up_proj and down_proj, but writes and reads one module per expert).
def _moe_mlp(moe: str, gate: str, up: str, down: str) -> tuple[BlockTensor, ...]:
    """A layer's router and experts under moe (e.g. "mlp"), and the dense MLP of the layers without experts."""

    def gate_up_rows(config: ModelConfig) -> tuple[int, ...]:
        return (config.expert_hidden,) * 2 * config.n_experts

    def down_rows(config: ModelConfig) -> tuple[int, ...]:
        return (config.n_embd,) * config.n_experts

    return (
        dataclasses.replace(_GATE_UP, layers="dense"),
        dataclasses.replace(_DOWN, layers="dense"),
        BlockTensor("mlp.router", (f"{moe}.gate",), layers="moe"),
        BlockTensor(
            "mlp.fc",
            (f"{moe}.experts.{{e}}.{gate}", f"{moe}.experts.{{e}}.{up}"),
            rows=gate_up_rows,
            layers="moe",
            per_expert=True,
        ),
        BlockTensor("mlp.proj", (f"{moe}.experts.{{e}}.{down}",), rows=down_rows, layers="moe", per_expert=True),
    )


def _shared_rows(config: ModelConfig) -> tuple[int, ...]:
    return (config.moe_shared_hidden, config.moe_shared_hidden)


_MOE_NORMS = (_INPUT_NORM, _QKV, _O, BlockTensor("norm2", ("post_attention_layernorm",)))
_QWEN_MOE_MLP = _moe_mlp("mlp", "gate_proj", "up_proj", "down_proj")
# Qwen2-MoE: a shared expert beside the routed ones, its output gated by sigmoid(shared_expert_gate x).
_SHARED_EXPERT = (
    BlockTensor(
        "mlp.shared.fc", ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), rows=_shared_rows, layers="moe"
    ),
    BlockTensor("mlp.shared.proj", ("mlp.shared_expert.down_proj",), layers="moe"),
    BlockTensor("mlp.shared_gate", ("mlp.shared_expert_gate",), layers="moe"),
)
MIXTRAL = _llama_like("MixtralForCausalLM", "mixtral", _MOE_NORMS + _moe_mlp("block_sparse_moe", "w1", "w3", "w2"))
QWEN2_MOE = dataclasses.replace(
    _llama_like("Qwen2MoeForCausalLM", "qwen2_moe", _MOE_NORMS + _QWEN_MOE_MLP + _SHARED_EXPERT),
    no_bias=frozenset({"attn.proj"}),
)
QWEN3_MOE = _llama_like("Qwen3MoeForCausalLM", "qwen3_moe", _MOE_NORMS + _QWEN_MOE_MLP + _QK_NORMS)
OLMOE = _llama_like("OlmoeForCausalLM", "olmoe", _MOE_NORMS + _QWEN_MOE_MLP + _QK_NORMS)

LAYOUTS = {
    layout.architecture: layout
    for layout in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, SMOLLM3, OLMO2, GPT_NEOX, GRANITE)
    + (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)
}


@dataclass(frozen=True)
class Rule:
    """One gptkit tensor and the HF tensors it is made of."""

    ours: str
    shape: tuple[int, ...]  # gptkit's shape
    theirs: tuple[str, ...]  # empty: HF stores nothing, the tensor is zero
    their_shapes: tuple[tuple[int, ...], ...]
    transposed: bool
    order: Tensor | None = None  # HF's row of each of gptkit's rows, when HF orders them otherwise


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
        for b in layout.block:
            if b.applies(config, i):
                modules.append((f"blocks.{i}.{b.ours}", tuple(layer + t for t in b.their_modules(config)), b))
    modules += [("norm_f", (base + layout.final_norm,), None), ("lm_head", (layout.head,), None)]
    rules = []
    for module, theirs, spec in modules:
        for param in ("weight", "bias"):
            ours = f"{module}.{param}"
            if ours not in shapes:
                continue  # e.g. no biases, or the tied head stored once as tok_emb.weight
            shape = stored = shapes[ours]
            if len(shape) == 3:  # experts' (E, out, in): HF's tensors stacked row-wise, expert by expert
                stored = (shape[0] * shape[1], shape[2])
            transposed = spec is not None and spec.transposed and param == "weight"
            if transposed:
                stored = (shape[1], shape[0])
            if spec is not None and param == "bias" and spec.ours in layout.no_bias:
                rules.append(Rule(ours, shape, (), (), False))
                continue
            rows = spec.rows(config) if spec is not None and spec.rows is not None else (stored[0],)
            their_shapes = tuple((r, *stored[1:]) for r in rows)
            order = spec.order(config) if spec is not None and spec.order is not None else None
            rules.append(Rule(ours, shape, tuple(f"{t}.{param}" for t in theirs), their_shapes, transposed, order))
    return rules


def ignorable_names(config: ModelConfig, layout: Layout, base: str) -> set[str]:
    """HF tensors an import may skip: per-layer buffers of older checkpoints, the second name of a tied head.

    A tied config's head is only skipped when it equals the embedding (see untied_if_head_differs).
    """
    names = {f"{base}{layout.layers}.{i}.{b}" for i in range(config.n_layer) for b in layout.buffers}
    if config.tie_embeddings:
        names.add(f"{layout.head}.weight")
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
    if rule.order is not None:
        tensor = tensor[rule.order]
    if len(rule.shape) == 3:
        return tensor.reshape(rule.shape)  # (E * out, in) -> (E, out, in)
    return tensor.t().contiguous() if rule.transposed else tensor


def export_tensor(rule: Rule, tensor: Tensor) -> dict[str, Tensor]:
    """The HF tensors of rule, cut from one gptkit tensor."""
    if not rule.theirs:
        if torch.count_nonzero(tensor):
            raise ConversionError(f"tensor {rule.ours!r} is not zero, but the target layout stores no such tensor")
        return {}
    if rule.transposed:
        tensor = tensor.t()
    if tensor.dim() == 3:
        tensor = tensor.flatten(0, 1)  # (E, out, in) -> (E * out, in): every expert's rows in turn
    if rule.order is not None:
        tensor = tensor[torch.argsort(rule.order)]
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
