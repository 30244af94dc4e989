"""Shared fixtures: tiny configurations of every architecture variant in SPEC section 1."""

from __future__ import annotations

import os

import pytest
import torch

from gptkit.config import ModelConfig

TINY = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)

# One entry per variant worth telling apart; together they cover every value of every enum field.
VARIANTS: dict[str, dict] = {
    "gpt2": dict(TINY),
    "llama-gqa": dict(TINY, norm="rmsnorm", position="rope", activation="swiglu", n_kv_head=2, attn_bias=False,
                      mlp_bias=False, norm_bias=False, tie_embeddings=False),
    "original-decoder": dict(TINY, norm_position="post", position="sinusoidal", activation="relu"),
    "gpt1-style": dict(TINY, norm_position="post", position="learned", activation="gelu"),
    "mqa-no-position": dict(TINY, n_kv_head=1, position="none"),
    "nanogpt-no-bias": dict(TINY, attn_bias=False, mlp_bias=False, norm_bias=False, activation="gelu"),
    "untied-head-bias": dict(TINY, tie_embeddings=False, lm_head_bias=True, ffn_hidden=40),
    "rmsnorm-post-rope": dict(TINY, norm="rmsnorm", norm_position="post", position="rope", rope_theta=500.0),
}  # fmt: skip


# The models here are tiny: one thread beats two (no thread hand-offs per small op), and the subprocesses the
# tests start inherit the setting through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant_config(request) -> ModelConfig:
    return ModelConfig(**VARIANTS[request.param])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
