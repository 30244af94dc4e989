"""Named architectures: published shapes, each a dict of ModelConfig fields (ModelConfig.preset builds one).

The published families' parameter counts are checked against their config.json files in tests/model/test_presets.py.
"""

from __future__ import annotations

import math
from typing import Any

_GPT2 = dict(vocab_size=50257, block_size=1024, activation="gelu_tanh", norm="layernorm", position="learned")
_LLAMA = dict(
    norm="rmsnorm",
    norm_eps=1e-5,
    position="rope",
    activation="swiglu",
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    tie_embeddings=False,
)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, rope_theta=500000.0)
_LLAMA3_ROPE = dict(
    rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
# Meta-Llama-3-8B's and Llama-3.1-8B's layers (the 3.1 model reads further by a longer context and RoPE scaling).
_LLAMA3_8B = dict(_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336)
# Mistral-7B-v0.1's shape, which Mixtral-8x7B keeps with a mixture of experts for each layer's MLP.
_MISTRAL_7B = dict(
    _LLAMA, vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336
)
# Qwen3's dense and mixture-of-experts models alike: heads 128 wide apart from the width, q/k norms, base 1e6.
_QWEN3 = dict(
    _LLAMA,
    vocab_size=151936,
    block_size=40960,
    head_dim=128,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    qk_norm=True,
)
_NANOGPT_CHAR = dict(
    vocab_size=65,
    activation="gelu",
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    position="learned",
)

# Former names, still read (a run's saved config.yaml names its preset): the old name -> the preset's name now.
# "llama-tiny" (llama2.c's 15M story model) read as one with the test-sized "tiny-llama"; it is named as its 110M
# sibling is.
RENAMED = {"llama-tiny": "llama-15m"}

# Sizes from the papers and model cards they are named after.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(_GPT2, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(_GPT2, n_layer=48, n_head=25, n_embd=1600),
    # Llama-style family: the first two follow llama2.c's story models (with GQA), then TinyLlama and Llama 2 7B.
    "llama-15m": dict(
        _LLAMA, vocab_size=32000, block_size=512, n_layer=6, n_head=6, n_kv_head=2, n_embd=288, ffn_hidden=768
    ),
    "llama-110m": dict(
        _LLAMA, vocab_size=32000, block_size=1024, n_layer=12, n_head=12, n_kv_head=4, n_embd=768, ffn_hidden=2048
    ),
    "tinyllama-1.1b": dict(
        _LLAMA, vocab_size=32000, block_size=2048, n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, ffn_hidden=5632
    ),
    "llama2-7b": dict(_LLAMA, vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, ffn_hidden=11008),
    # Vaswani et al. 2017 base model as a decoder only (shared 37k vocabulary, tied embeddings).
    "transformer-decoder": dict(
        vocab_size=37000,
        block_size=512,
        n_layer=6,
        n_head=8,
        n_embd=512,
        ffn_hidden=2048,
        activation="relu",
        norm_position="post",
        position="sinusoidal",
        dropout=0.1,
    ),
    # Radford et al. 2018: 12 layers, 768 wide, 512 context, 40,478 BPE tokens, GELU, learned positions.
    "gpt1-style": dict(
        vocab_size=40478,
        block_size=512,
        n_layer=12,
        n_head=12,
        n_embd=768,
        activation="gelu",
        norm_position="post",
        position="learned",
        dropout=0.1,
    ),
    # nanoGPT's character-level Shakespeare models: the GPU recipe and its README's CPU override.
    "shakespeare-char": dict(_NANOGPT_CHAR, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),
    "shakespeare-char-cpu": dict(_NANOGPT_CHAR, block_size=64, n_layer=4, n_head=4, n_embd=128),
    # Small models for demos and tests: seconds to train on a laptop CPU.
    "tiny": dict(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=64),
    "tiny-llama": dict(_LLAMA, vocab_size=256, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=64),
    # GPT-3 Small (Brown et al. 2020, table 2.1): GPT-2's layout at context 2048, dense and locally banded attention
    # alternating. The paper gives no band width: 256 is GPT-Neo's window_size (EleutherAI's open replication of the
    # alternation, first layer dense), a band an eighth of the context.
    "gpt3-small": dict(
        _GPT2,
        block_size=2048,
        n_layer=12,
        n_head=12,
        n_embd=768,
        sliding_window=256,
        layer_types=["full", "sliding"] * 6,
    ),
    # Meta Llama 3 (meta-llama/Meta-Llama-3-8B, Llama-3.1-8B, Llama-3.2-1B config.json): 128,256 tokens, base 500000.
    "llama3-8b": dict(_LLAMA3_8B, block_size=8192),
    "llama3.1-8b": dict(_LLAMA3_8B, block_size=131072, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
    "llama3.2-1b": dict(
        _LLAMA3,
        block_size=131072,
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        ffn_hidden=8192,
        tie_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
    ),
    # mistralai/Mistral-7B-v0.1: every layer within a window of 4096.
    "mistral-7b": dict(_MISTRAL_7B, sliding_window=4096),
    # Qwen/Qwen3-0.6B: tied.
    "qwen3-0.6b": dict(_QWEN3, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, ffn_hidden=3072, tie_embeddings=True),
    # google/gemma-3-1b-pt: 5 local layers (window 512, base 10000) to 1 global (base 1e6), sandwich norms with
    # gains 1 + w, GeGLU, embeddings times sqrt(1152), scores times query_pre_attn_scalar^-0.5 = 256^-0.5.
    "gemma3-1b": dict(
        _LLAMA,
        vocab_size=262144,
        block_size=32768,
        n_layer=26,
        n_head=4,
        n_kv_head=1,
        n_embd=1152,
        head_dim=256,
        ffn_hidden=6912,
        activation="geglu",
        norm_eps=1e-6,
        norm_position="sandwich",
        norm_gain_offset=1.0,
        qk_norm=True,
        embedding_scale=math.sqrt(1152),
        attn_scale=256**-0.5,
        rope_theta=1000000.0,
        rope_local_theta=10000.0,
        sliding_window=512,
        tie_embeddings=True,
        layer_types=[("full" if (i + 1) % 6 == 0 else "sliding") for i in range(26)],
    ),
    # HuggingFaceTB/SmolLM3-3B: no RoPE in every 4th layer (no_rope_layer_interval 4), base 5e6, tied.
    "smollm3-3b": dict(
        _LLAMA,
        vocab_size=128256,
        block_size=65536,
        n_layer=36,
        n_head=16,
        n_kv_head=4,
        n_embd=2048,
        ffn_hidden=11008,
        norm_eps=1e-6,
        rope_theta=5000000.0,
        tie_embeddings=True,
        nope_layers=list(range(3, 36, 4)),
    ),
    # Mixtures of experts (tests/fixtures/moe_configs.json holds the config.json fields these follow).
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of hidden 14336 in every layer, top-2 renormalised.
    "mixtral-8x7b": dict(_MISTRAL_7B, rope_theta=1000000.0, n_experts=8, n_experts_per_token=2),
    # Qwen/Qwen3-30B-A3B: 128 experts of hidden 768, top-8 renormalised (norm_topk_prob).
    "qwen3-30b-a3b": dict(
        _QWEN3,
        n_layer=48,
        n_head=32,
        n_kv_head=4,
        n_embd=2048,
        ffn_hidden=6144,
        n_experts=128,
        n_experts_per_token=8,
        moe_ffn_hidden=768,
    ),
    # allenai/OLMoE-1B-7B-0924: 64 experts of hidden 1024, top-8 not renormalised, q/k norms over the whole width.
    "olmoe-1b-7b": dict(
        _LLAMA,
        vocab_size=50304,
        block_size=4096,
        n_layer=16,
        n_head=16,
        n_embd=2048,
        ffn_hidden=1024,
        qk_norm=True,
        qk_norm_scope="width",
        n_experts=64,
        n_experts_per_token=8,
        moe_renormalize=False,
    ),
    # A character-level mixture of experts for the bundled corpus: shakespeare-char-cpu's shape with 8 experts of
    # hidden 128, top 2, and the balance and z losses on.
    "moe-tiny": dict(
        _NANOGPT_CHAR,
        block_size=64,
        n_layer=4,
        n_head=4,
        n_embd=128,
        activation="swiglu",
        n_experts=8,
        n_experts_per_token=2,
        moe_ffn_hidden=128,
        moe_aux_loss=0.01,
        moe_z_loss=0.001,
    ),
}
