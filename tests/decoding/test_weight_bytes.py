"""gptkit.decoding.weight_bytes: the weight bytes one decoded token reads, counted from a tiny MoE model's tensors in
fp32, bf16, int8 and int4 against a hand computation (issue 55: the quantised expert stacks were left out of
benchmarks/llama_cpp_shapes.py's count)."""

from __future__ import annotations

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.decoding.weight_bytes import step_weight_bytes
from gptkit.model import GPT
from gptkit.quantization import quantize

# 2 layers, 64 wide, heads of 16 (4 query, 2 kv), 4 experts of hidden 32 of which a token takes 2, a vocabulary of 256
# and an untied head: every input width a multiple of 32, so that int4 quantises every matrix.
CONFIG = dict(
    vocab_size=256,
    block_size=16,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    norm="rmsnorm",
    position="rope",
    activation="swiglu",
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    tie_embeddings=False,
    n_experts=4,
    n_experts_per_token=2,
    moe_ffn_hidden=32,
)
# By hand, per layer: q/k/v (64 + 2 * 32 rows of 64) and the output projection (64 rows of 64); of the experts, the 2
# routed ones' [gate; up] (64 rows of 64) and down (64 rows of 32); the router (4 rows of 64). The head: 256 rows of 64.
DENSE_WEIGHTS = 2 * (128 * 64 + 64 * 64) + 256 * 64  # 40960
DENSE_ROWS = 2 * (128 + 64) + 256  # 640
ROUTED_WEIGHTS = 2 * 2 * (64 * 64 + 64 * 32)  # 24576
ROUTED_ROWS = 2 * 2 * (64 + 64)  # 512
ROUTER_WEIGHTS = 2 * 4 * 64  # 512
MATMUL_WEIGHTS = DENSE_WEIGHTS + ROUTED_WEIGHTS + ROUTER_WEIGHTS
EXPECTED = {
    "fp32": 4 * MATMUL_WEIGHTS,
    "bf16": 2 * MATMUL_WEIGHTS,
    # a byte per weight and an fp32 scale per row; the routers stay fp32
    "int8": (DENSE_WEIGHTS + ROUTED_WEIGHTS) + 4 * (DENSE_ROWS + ROUTED_ROWS) + 4 * ROUTER_WEIGHTS,
    # Q4_0: 16 bytes of nibbles and a 2-byte fp16 scale per 32 weights; the routers stay fp32
    "int4": (DENSE_WEIGHTS + ROUTED_WEIGHTS) // 32 * 18 + 4 * ROUTER_WEIGHTS,
}


def tiny_model(precision: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CONFIG)).eval()
    if precision == "bf16":
        return model.to(torch.bfloat16)
    return quantize(model, precision) if precision in ("int8", "int4") else model


@pytest.mark.parametrize("precision", list(EXPECTED))
def test_a_tiny_moe_models_step_reads_the_hand_counted_bytes(precision) -> None:
    assert step_weight_bytes(tiny_model(precision)) == EXPECTED[precision]


def test_a_tied_head_is_counted_once_and_the_embedding_rows_not_at_all() -> None:
    untied = tiny_model("fp32")
    tied = GPT(ModelConfig(**dict(CONFIG, tie_embeddings=True))).eval()
    assert step_weight_bytes(tied) == step_weight_bytes(untied)  # the head's matrix, whichever holds it
