"""Mixture-of-experts decoding at the memory floor: the eager few-token path (gptkit.moe.routed_experts) reads only
the routed experts' weights and gives the grouped path's result; the fused CPU step (gptkit/csrc/moe_step.h) takes
MoE layers, batch-invariant and equal to the eager step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptkit import moe
from gptkit.config import ModelConfig
from gptkit.layers import activate
from gptkit.model import FeedForward


def moe_config(**overrides: object) -> ModelConfig:
    """A tiny MoE config: 8 experts, top-2, SwiGLU experts of hidden 8."""
    fields = dict(
        vocab_size=32,
        block_size=16,
        n_layer=2,
        n_head=2,
        n_embd=16,
        activation="swiglu",
        mlp_bias=False,
        n_experts=8,
        n_experts_per_token=2,
        moe_ffn_hidden=8,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def make_layer(config: ModelConfig, seed: int = 0) -> moe.MoEFeedForward:
    torch.manual_seed(seed)
    shared = None
    if config.moe_shared_hidden is not None:
        shared = FeedForward(dataclasses.replace(config, ffn_hidden=config.moe_shared_hidden))
    layer = moe.MoEFeedForward(config, shared)
    with torch.no_grad():  # larger than GPT's init, so that outputs and their differences are not tiny
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer.eval()


def every_expert(layer: moe.MoEFeedForward, flat: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then each token's router-weighted sum over its top k: the definition."""
    weights, chosen = moe.route(layer.router(flat).float(), layer.k, layer.renormalize)
    gate = torch.zeros(flat.size(0), layer.n_experts).scatter(1, chosen, weights)  # (N, E)
    outputs = []
    for e in range(layer.n_experts):
        h = flat @ layer.fc.weight[e].T + (layer.fc.bias[e] if layer.fc.bias is not None else 0.0)
        y = activate(h, layer.activation) @ layer.proj.weight[e].T
        outputs.append(y + (layer.proj.bias[e] if layer.proj.bias is not None else 0.0))
    out = (torch.stack(outputs, 1) * gate[..., None]).sum(1)
    if layer.shared is not None:
        shared = layer.shared(flat)
        out = out + (torch.sigmoid(layer.shared_gate(flat)) * shared if layer.shared_gate is not None else shared)
    return out


FAMILIES = {
    "mixtral": {},
    "qwen2-moe": dict(moe_shared_hidden=12, moe_shared_gate=True, moe_renormalize=False),
    "biased-gelu": dict(activation="gelu", mlp_bias=True, n_experts_per_token=3),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tokens", [1, 2])
def test_few_tokens_compute_only_their_experts_and_equal_every_expert(family, tokens, monkeypatch) -> None:
    layer = make_layer(moe_config(**FAMILIES[family]))
    monkeypatch.setattr(layer, "experts", lambda *_: pytest.fail("the grouped path ran for a decode step"))
    read = []
    real = moe.linear
    monkeypatch.setattr(moe, "linear", lambda x, w, b=None: read.append(w.data_ptr()) or real(x, w, b))
    x = torch.randn(1, tokens, layer.router.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = layer(x)
        expected = every_expert(layer, x[0])
    # Tolerance: fp32 rounding of sums of 16 products of values ~0.5 (measured differences ~1e-7).
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    routed = set(moe.route(layer.router(x[0]).float(), layer.k, True)[1].reshape(-1).tolist())
    starts = {layer.fc.weight[e].data_ptr(): e for e in range(layer.n_experts)}
    assert {starts[p] for p in read if p in starts} == routed  # no other expert's weights were read


def test_the_grouped_path_still_runs_with_autograd_or_many_tokens(monkeypatch) -> None:
    layer = make_layer(moe_config())
    monkeypatch.setattr(layer, "routed_experts", lambda *_: pytest.fail("the few-token path ran"))
    x = torch.randn(1, 2, 16)
    layer(x)  # autograd on: training's grouped products
    with torch.no_grad():
        layer(torch.randn(1, 5, 16))  # 10 routed slots past 8 experts


def test_a_decoded_tokens_output_does_not_depend_on_its_batch_mates() -> None:
    layer = make_layer(moe_config(n_experts=8, n_experts_per_token=2, moe_shared_hidden=12))
    g = torch.Generator().manual_seed(2)
    token = torch.randn(16, generator=g)
    outputs = []
    with torch.no_grad():
        for size, place in ((1, 0), (2, 0), (2, 1), (4, 3)):
            batch = torch.randn(1, size, 16, generator=g)
            batch[0, place] = token
            outputs.append(layer(batch)[0, place])
    assert all(torch.equal(out, outputs[0]) for out in outputs)
