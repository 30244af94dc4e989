"""llama.cpp's GGUF architectures as gptkit maps them: which one computes a ModelConfig, the tensor names, the
q/k row order, and the metadata keys the reader maps (any other is refused)."""

from __future__ import annotations

import torch

from gptkit.config import ModelConfig
from gptkit.formats.gguf.vocab import GGUFError

LLAMA_FUSED = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")  # llama's tensors that gptkit holds fused
# Reading refuses any metadata key it does not map (a key dropped is a model computed otherwise: Llama 3's RoPE
# scaling, a sliding window). Accepted unread: the file's description (general.*) and the tokenizer's keys, which
# change no logit (vocab reads the tokens, merges, types, pre-tokenizer and end-of-text id).
TOKENIZER_KEYS = frozenset(
    {
        *("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"),
        *("tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"),
        *("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.padding_token_id"),
        *("tokenizer.ggml.unknown_token_id", "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eot_token_id"),
        *("tokenizer.ggml.eom_token_id", "tokenizer.chat_template"),
    }
)
# The hyperparameters _config reads, per architecture (the key after "<arch>.").
SHAPE_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")
ARCH_KEYS = {
    "gpt2": frozenset({*SHAPE_KEYS, "attention.layer_norm_epsilon", "vocab_size"}),
    "llama": frozenset(
        {
            *SHAPE_KEYS,
            *("attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length"),
            *("attention.value_length", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "vocab_size"),
        }
    ),
}


def architecture(config: ModelConfig) -> str:
    """The llama.cpp architecture computing exactly what config does, or a GGUFError saying why none does."""

    def refuse(field: str, why: str) -> GGUFError:
        return GGUFError(f"{field} {getattr(config, field)!r} cannot be written as GGUF: {why}")

    if config.norm_position != "pre":
        raise refuse("norm_position", "llama.cpp's gpt2 and llama normalise before attention and MLP (pre-norm)")
    if config.lm_head_bias:
        raise refuse("lm_head_bias", "llama.cpp's gpt2 and llama have no output bias")
    if config.logit_softcap is not None:
        raise refuse(
            "logit_softcap",
            "llama.cpp's gpt2 and llama do not soft-cap their logits (only its gemma2 does, which differs in more)",
        )
    if config.qk_norm:
        raise refuse("qk_norm", "llama.cpp's gpt2 and llama have no q/k norms")
    if config.position == "learned":
        if config.norm != "layernorm":
            raise refuse("norm", "llama.cpp's gpt2 (learned positions) uses LayerNorm")
        if config.activation == "gelu":
            raise refuse(
                "activation",
                "llama.cpp computes GELU as its tanh approximation in every architecture "
                "(no erf GELU); train with --model.activation gelu_tanh to export to llama.cpp",
            )
        if config.activation != "gelu_tanh":
            raise refuse("activation", "llama.cpp's gpt2 computes GELU's tanh approximation (gelu_tanh)")
        if config.n_kv_head != config.n_head:
            raise refuse("n_kv_head", "llama.cpp's gpt2 has no grouped-query attention")
        return "gpt2"
    if config.position == "rope":
        for field, value, why in (("norm", "rmsnorm", "RMSNorm"), ("activation", "swiglu", "SwiGLU")):
            if getattr(config, field) != value:
                raise refuse(field, f"llama.cpp's llama (RoPE) uses {why}")
        for field in ("attn_bias", "mlp_bias"):
            if getattr(config, field):
                raise refuse(field, "llama.cpp's llama has no biases in its projections")
        return "llama"
    raise refuse("position", "llama.cpp computes learned positions (gpt2) or RoPE (llama) only")


def tensor_names(config: ModelConfig, arch: str) -> dict[str, str]:
    """gptkit's tensor name -> GGUF's, for the names that map one to one (q/k/v and gate/up are split)."""
    names = {
        "tok_emb.weight": "token_embd.weight",
        "norm_f.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_block = {"norm1": "attn_norm", "attn.proj": "attn_output", "norm2": "ffn_norm", "mlp.proj": "ffn_down"}
    if arch == "gpt2":
        names.update({"pos_emb.weight": "position_embd.weight", "norm_f.bias": "output_norm.bias"})
        per_block.update({"attn.qkv": "attn_qkv", "mlp.fc": "ffn_up"})
    for i in range(config.n_layer):
        for ours, theirs in per_block.items():
            for part in ("weight", "bias") if arch == "gpt2" else ("weight",):
                names[f"blocks.{i}.{ours}.{part}"] = f"blk.{i}.{theirs}.{part}"
    return names


def rope_rows(weight: torch.Tensor, heads: int, to_gguf: bool) -> torch.Tensor:
    """A q or k weight's rows reordered within each head between rotate-half pairs (gptkit, Hugging Face) and
    llama.cpp's interleaved pairs (to_gguf), or back."""
    rows = weight.shape[0]
    half = rows // heads // 2
    if to_gguf:  # per head: [first halves; second halves] -> pairs side by side
        return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
