"""llama.cpp's GGUF architectures as gptkit maps them: what each one's graph fixes (norms, activation, block layout,
RoPE pair order, how it weighs its experts), which "<arch>.*" metadata keys it reads, and its tensor names.

The graphs are llama.cpp's src/models/*.cpp; the names and keys its gguf-py constants and convert_hf_to_gguf.py.
llama.cpp rotates interleaved pairs (x_2i, x_2i+1) in the llama-like architectures (its rope type NORM) and
rotate-half pairs (x_i, x_i+d/2), as gptkit and Hugging Face do, in the others (NEOX): for the first kind the rows of
the q and k weights are reordered per head, as llama.cpp's converter does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from gptkit.config import ModelConfig

# Keys any architecture below reads (after "<arch>."): the shapes.
SHAPE_KEYS = frozenset(
    {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count"}
    | {"attention.head_count_kv", "attention.key_length", "attention.value_length", "vocab_size"}
)
ROPE_KEYS = frozenset(
    {"rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor"}
    | {"rope.scaling.original_context_length", "rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor"}
    | {"rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_ext_factor"}
)  # the yarn ones: gptkit.formats.gguf.rope reads them
RMS = frozenset({"attention.layer_norm_rms_epsilon"})
WINDOW_KEYS = frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})
EXPERT_KEYS = frozenset({"expert_count", "expert_used_count"})
QWEN_EXPERT_KEYS = EXPERT_KEYS | {"expert_feed_forward_length"}
# Metadata accepted unread: the file's description (general.*) and the tokenizer's keys, which change no logit
# (vocab reads the tokens, merges, types, pre-tokenizer and end-of-text id).
TOKENIZER_KEYS = frozenset(
    {
        *("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"),
        *("tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"),
        *("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.padding_token_id"),
        *("tokenizer.ggml.unknown_token_id", "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eot_token_id"),
        *("tokenizer.ggml.eom_token_id", "tokenizer.chat_template"),
    }
)
_NO_BIASES = {"attn_bias": False, "mlp_bias": False, "norm_bias": False}
_LLAMA_FIXED = {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "norm_position": "pre", **_NO_BIASES}
_GEMMA_FIXED = {**_LLAMA_FIXED, "activation": "geglu", "norm_position": "sandwich"}


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture: the ModelConfig fields its graph fixes, the keys it reads, its tensor layout."""

    name: str
    fixed: dict[str, Any]  # fields every model of the architecture has (biases: True where it has the tensors)
    keys: frozenset[str]  # the "<arch>." metadata keys read
    interleaved: bool = False  # llama.cpp's rope type NORM: q/k rows reordered per head
    fused_qkv: bool = False  # one attn_qkv tensor ([q; k; v] rows) instead of attn_q, attn_k, attn_v
    fused_gate_up: bool = False  # a gated MLP's [gate; up] as one ffn_up (Phi-3)
    no_proj_bias: bool = False  # q/k/v have biases, the output projection none (Qwen2)
    rope_freqs: bool = False  # reads a rope_freqs tensor: per-frequency divisors (Llama 3's scaling)
    window_pattern: int = 0  # llama.cpp's default: layer i is sliding iff i % n < n - 1 (0: no sliding layers)
    extras: dict[str, Any] = field(default_factory=dict)  # per-architecture constants (tied: no output tensor)
    # Whether llama.cpp's graph requires output.weight (it falls back to token_embd only where the tensor is
    # optional): a tied model's head is then written as a copy of the embedding.
    needs_output: bool = False
    # With experts: whether llama.cpp's graph divides the top-k weights by their sum (build_moe_ffn's norm_w, fixed
    # per architecture in src/models/*.cpp; no key says it) and gates a shared expert by sigmoid(x w) (Qwen2-MoE).
    renormalize: bool = True
    shared_expert: bool = False


ARCHS = {
    arch.name: arch
    for arch in (
        Arch(
            "gpt2",
            {"position": "learned", "norm": "layernorm", "activation": "gelu_tanh", "norm_position": "pre"}
            | {"attn_bias": True, "mlp_bias": True, "norm_bias": True},
            SHAPE_KEYS | {"attention.layer_norm_epsilon"},
            fused_qkv=True,
            needs_output=True,  # optional in llama.cpp's gpt2, but its converter writes GPT-2's tied head twice
        ),
        Arch("llama", _LLAMA_FIXED, SHAPE_KEYS | ROPE_KEYS | RMS | EXPERT_KEYS, interleaved=True, rope_freqs=True),
        Arch("qwen2", _LLAMA_FIXED | {"attn_bias": True}, SHAPE_KEYS | ROPE_KEYS | RMS, no_proj_bias=True),
        Arch("qwen3", _LLAMA_FIXED | {"qk_norm": True}, SHAPE_KEYS | ROPE_KEYS | RMS),
        Arch(
            "smollm3", _LLAMA_FIXED, SHAPE_KEYS | ROPE_KEYS | RMS, interleaved=True, extras={"no_rope_every": 4}
        ),  # llama.cpp fixes SmolLM3's NoPE layers: every 4th (its n_no_rope_layer_step)
        Arch(
            "granite",
            _LLAMA_FIXED,
            SHAPE_KEYS | ROPE_KEYS | RMS | {"attention.scale", "embedding_scale", "residual_scale", "logit_scale"},
            interleaved=True,
            rope_freqs=True,
        ),
        Arch(
            "phi3",
            _LLAMA_FIXED,
            SHAPE_KEYS | ROPE_KEYS | RMS | {"attention.sliding_window", "rope.scaling.original_context_length"},
            fused_qkv=True,
            fused_gate_up=True,
        ),
        Arch(
            "gptneox",
            {"norm": "layernorm", "activation": "gelu_tanh", "position": "rope", "norm_position": "pre"}
            | {"attn_bias": True, "mlp_bias": True, "norm_bias": True},
            SHAPE_KEYS | ROPE_KEYS | {"attention.layer_norm_epsilon", "use_parallel_residual"},
            fused_qkv=True,
            needs_output=True,
        ),
        Arch(
            "olmo2",
            dict(_LLAMA_FIXED, norm_position="sublayer_post", qk_norm=True, qk_norm_scope="width"),
            SHAPE_KEYS | ROPE_KEYS | RMS | WINDOW_KEYS,
            window_pattern=4,
            needs_output=True,
        ),
        Arch(
            "gemma2",
            _GEMMA_FIXED,
            SHAPE_KEYS | ROPE_KEYS | RMS | WINDOW_KEYS | {"attn_logit_softcapping", "final_logit_softcapping"},
            window_pattern=2,
            extras={
                "wide_scale_layers": 46,
                "tied": True,
            },  # Gemma 2 27B: scores scaled by n_embd / n_head, not head_dim
        ),
        Arch(
            "gemma3",
            _GEMMA_FIXED | {"qk_norm": True},
            SHAPE_KEYS | RMS | WINDOW_KEYS | ROPE_KEYS | {"rope.freq_base_swa"} | {"final_logit_softcapping"},
            window_pattern=6,
            extras={"wide_scale_layers": 62, "tied": True},  # Gemma 3 27B, as above
        ),
        # Mixtures of experts (Mixtral is llama with experts); llama.cpp's qwen2moe and olmoe keep the softmax's
        # own top-k weights, its llama and qwen3moe renormalise them.
        Arch(
            "qwen2moe",
            _LLAMA_FIXED | {"attn_bias": True},
            SHAPE_KEYS | ROPE_KEYS | RMS | QWEN_EXPERT_KEYS | {"expert_shared_feed_forward_length"},
            no_proj_bias=True,
            renormalize=False,
            shared_expert=True,
            needs_output=True,
        ),
        Arch("qwen3moe", _LLAMA_FIXED | {"qk_norm": True}, SHAPE_KEYS | ROPE_KEYS | RMS | QWEN_EXPERT_KEYS),
        Arch(
            "olmoe",
            _LLAMA_FIXED | {"qk_norm": True, "qk_norm_scope": "width"},
            SHAPE_KEYS | ROPE_KEYS | RMS | EXPERT_KEYS,
            renormalize=False,
            needs_output=True,
            extras={"model_wide_k_norm": True},  # attn_k_norm is {n_embd}: keys as wide as the model, no GQA
        ),
    )
}
# An expert layer's tensors that map one to one; llama.cpp's converter keeps the two routers in float32.
EXPERT_TENSORS = {
    "mlp.router": "ffn_gate_inp",
    "mlp.proj": "ffn_down_exps",
    "mlp.shared.proj": "ffn_down_shexp",
    "mlp.shared_gate": "ffn_gate_inp_shexp",
}
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")


class Piece(NamedTuple):
    """One GGUF tensor of a gptkit tensor it holds in pieces: its name, its rows, the heads whose rows are reordered
    for interleaved RoPE (0: none), and the dimension the pieces stack along (1 for experts' (E, rows, in))."""

    name: str
    rows: int
    heads: int = 0
    dim: int = 0


def tensor_names(config: ModelConfig, arch: Arch) -> dict[str, str]:
    """gptkit's tensor name -> GGUF's, for the tensors that map one to one (weights and biases alike); attn.qkv and
    mlp.fc are in split_tensors unless the architecture keeps them fused."""
    names = {
        "tok_emb.weight": "token_embd.weight",
        "pos_emb.weight": "position_embd.weight",
        "norm_f.weight": "output_norm.weight",
        "norm_f.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
    }
    per_block = {
        "norm1": "attn_norm",
        "norm2": "ffn_norm",
        "norm1_post": "post_attention_norm",
        "norm2_post": "post_ffw_norm",
        "attn.proj": "attn_output",
        "attn.q_norm": "attn_q_norm",
        "attn.k_norm": "attn_k_norm",
        "mlp.proj": "ffn_down",
    }
    if config.norm_position == "sublayer_post":  # OLMo 2 normalises each sublayer's output only
        per_block.update({"norm1": "post_attention_norm", "norm2": "post_ffw_norm"})
        del per_block["norm1_post"], per_block["norm2_post"]
    if arch.fused_qkv:
        per_block["attn.qkv"] = "attn_qkv"
    if config.activation not in ("swiglu", "geglu") or arch.fused_gate_up:
        per_block["mlp.fc"] = "ffn_up"
    for i in range(config.n_layer):
        block = per_block | EXPERT_TENSORS if config.is_moe_layer(i) else per_block
        for ours, theirs in block.items():
            for part in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{part}"] = f"blk.{i}.{theirs}.{part}"
    return names


def router_names(config: ModelConfig) -> set[str]:
    """The GGUF names of the routers' weights, which are written in float32 whatever the file type."""
    return {f"blk.{i}.{name}.weight" for i in range(config.n_layer) if config.is_moe_layer(i) for name in ROUTERS}


def split_tensors(config: ModelConfig, arch: Arch) -> dict[str, list[Piece]]:
    """gptkit's fused tensors that GGUF holds in pieces: name -> its pieces, stacked in order."""
    hd, split = config.head_dim, {}
    q, kv = config.n_head * hd, config.n_kv_head * hd
    heads = (config.n_head, config.n_kv_head) if arch.interleaved else (0, 0)
    gated = config.activation in ("swiglu", "geglu")
    for i in range(config.n_layer):
        for part in ("weight", "bias"):
            if not arch.fused_qkv:
                split[f"blocks.{i}.attn.qkv.{part}"] = [
                    Piece(f"blk.{i}.attn_q.{part}", q, heads[0]),
                    Piece(f"blk.{i}.attn_k.{part}", kv, heads[1]),
                    Piece(f"blk.{i}.attn_v.{part}", kv),
                ]
            if config.is_moe_layer(i) and gated:  # experts' fc (E, [gate; up], d), their bias (E, [gate; up])
                hidden = config.expert_hidden
                split[f"blocks.{i}.mlp.fc.{part}"] = [
                    Piece(f"blk.{i}.ffn_gate_exps.{part}", hidden, dim=1),
                    Piece(f"blk.{i}.ffn_up_exps.{part}", hidden, dim=1),
                ]
                if config.moe_shared_hidden is not None:
                    split[f"blocks.{i}.mlp.shared.fc.{part}"] = [
                        Piece(f"blk.{i}.ffn_gate_shexp.{part}", config.moe_shared_hidden),
                        Piece(f"blk.{i}.ffn_up_shexp.{part}", config.moe_shared_hidden),
                    ]
            elif gated and not arch.fused_gate_up:
                split[f"blocks.{i}.mlp.fc.{part}"] = [
                    Piece(f"blk.{i}.ffn_gate.{part}", config.ffn_hidden),
                    Piece(f"blk.{i}.ffn_up.{part}", config.ffn_hidden),
                ]
    return split


def rope_rows(weight: torch.Tensor, heads: int, to_gguf: bool) -> torch.Tensor:
    """A q or k weight's rows reordered within each head between rotate-half pairs (gptkit, Hugging Face) and
    llama.cpp's interleaved pairs (to_gguf), or back."""
    rows = weight.shape[0]
    half = rows // heads // 2
    if to_gguf:  # per head: [first halves; second halves] -> pairs side by side
        return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
