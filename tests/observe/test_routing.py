"""gptkit.observe.routing: the routing picture's data against a hand computation, the specialisation measure on a
constructed routing, inspect's routing picture (for an MoE model only) and the expert-load panel of loss.png."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.model import GPT
from gptkit.observe.routing import (
    draw_load_history,
    expert_load,
    gate_matrix,
    load_history,
    routing_of,
    specialisation,
    token_kinds,
)


def tiny_moe(n_layer: int = 2, **fields: object) -> GPT:
    """A 2-layer MoE of 4 experts, top 2, with random weights (seeded)."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=32,
        block_size=16,
        n_layer=n_layer,
        n_head=2,
        n_embd=16,
        n_experts=4,
        n_experts_per_token=2,
        moe_ffn_hidden=8,
        **fields,
    )
    model = GPT(config)
    for layer in model.blocks:  # a router of std 0.02 would route every token almost uniformly: make choices clear
        torch.nn.init.normal_(layer.mlp.router.weight, std=1.0)
    return model.eval()


def test_routing_matches_hand_computation() -> None:
    model = tiny_moe()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    inputs = []  # each MoE layer's input, caught independently of the router hook routing_of uses
    hooks = [block.mlp.register_forward_hook(lambda _m, args, _o: inputs.append(args[0][0])) for block in model.blocks]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    routing = routing_of(model, ids)
    assert routing.blocks == [0, 1] and routing.experts.shape == (2, len(ids), 2)
    for layer, x in enumerate(inputs):
        probs = (x @ model.blocks[layer].mlp.router.weight.T).detach().softmax(-1)  # (T, E)
        for t in range(len(ids)):
            ranked = sorted(range(4), key=lambda e: (-float(probs[t, e]), e))[:2]  # ties to the lower expert
            top = probs[t, ranked]
            assert routing.experts[layer, t].tolist() == ranked
            # Renormalised over the top 2 (moe_renormalize's default); float32 sums: 1e-6 is a few ulps of 1.
            torch.testing.assert_close(routing.weights[layer, t], top / top.sum(), atol=1e-6, rtol=0)
    gates = gate_matrix(routing)
    assert gates.shape == (2, len(ids), 4) and torch.allclose(gates.sum(-1), torch.ones(2, len(ids)))
    assert expert_load(routing).sum(dim=1).tolist() == [2 * len(ids)] * 2


def test_routing_runs_windows_of_the_context() -> None:
    model = tiny_moe(n_layer=1)
    ids = list(range(20))  # longer than block_size 16: two windows
    routing = routing_of(model, ids)
    assert routing.experts.shape == (1, 20, 2)
    assert torch.equal(routing.experts[:, 16:], routing_of(model, ids[16:]).experts)


def test_a_dense_model_has_no_routing() -> None:
    from gptkit.errors import InputError

    with pytest.raises(InputError, match="no mixture-of-experts layers"):
        routing_of(GPT(ModelConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)), [1, 2])


def test_specialisation_on_a_constructed_routing() -> None:
    texts = ["A", "b", ",", "\n", "c", ".", "D", "e"]
    kinds = token_kinds(texts)
    assert kinds["punctuation"].tolist() == [False, False, True, False, False, True, False, False]
    assert kinds["capital"].tolist() == [True, False, False, False, False, False, True, False]
    # One layer, top 1: expert 0 takes the punctuation, expert 1 the capitals, expert 2 the rest, expert 3 nothing.
    experts = torch.tensor([[[1], [2], [0], [2], [2], [0], [1], [2]]])  # (L=1, N=8, k=1)
    result = specialisation(experts, kinds, n_experts=4)
    assert result["text_share"]["punctuation"] == 2 / 8
    assert result["share"][0]["punctuation"] == [1.0, 0.0, 0.0, None]
    assert result["share"][0]["newline"] == [0.0, 0.0, 0.25, None]
    assert result["top"][0]["punctuation"] == {"expert": 0, "share": 1.0, "lift": 4.0}
    assert result["top"][0]["capital"] == {"expert": 1, "share": 1.0, "lift": 4.0}
    assert result["top"][0]["newline"] == {"expert": 2, "share": 0.25, "lift": 2.0}
    assert "space" not in result["top"][0]  # no space in the text: no lift to measure


def test_load_history_and_its_panel() -> None:
    from matplotlib.figure import Figure

    history = [
        {"step": 0, "loss": 4.0},
        {"step": 10, "moe_tokens_per_expert": [[4, 4, 4, 4], [8, 8, 0, 0]]},
        {"step": 20, "moe_tokens_per_expert": [[16, 0, 0, 0], [4, 4, 4, 4]]},
    ]
    steps, relative = load_history(history)
    assert steps.tolist() == [10, 20]
    np.testing.assert_array_equal(relative[0], [[1, 1, 1, 1], [2, 2, 0, 0]])
    np.testing.assert_array_equal(relative[1], [[4, 0, 0, 0], [1, 1, 1, 1]])
    draw_load_history(Figure().add_subplot(), history)  # draws without error


def test_loss_png_has_the_load_panel_for_moe_runs_only(tmp_path) -> None:
    from matplotlib.image import imread

    from gptkit.observe.training import plot_run

    dense = [{"step": s, "loss": 3.0 - s / 100, "val_loss": 3.0 - s / 100} for s in (0, 10, 20)]
    moe = [dict(r, moe_tokens_per_expert=[[5, 3], [4, 4]]) for r in dense]
    plot_run(dense, tmp_path / "dense.png")
    plot_run(moe, tmp_path / "moe.png")
    assert imread(tmp_path / "moe.png").shape[0] > imread(tmp_path / "dense.png").shape[0]  # one more panel


class CharTokenizer:
    """A 32-character vocabulary, enough for write_report."""

    chars = "abcdefghijklmnopqrstuvwxyzABC ,\n"

    def encode(self, text: str) -> list[int]:
        return [self.chars.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def token_bytes(self, i: int) -> bytes:
        return self.chars[i].encode()


@pytest.mark.parametrize("moe", [True, False])
def test_inspect_draws_routing_for_moe_models_only(tmp_path, moe: bool) -> None:
    from gptkit.observe.report import write_report

    torch.manual_seed(0)
    model = tiny_moe() if moe else GPT(ModelConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    pictures = write_report(model.eval(), CharTokenizer(), "abc, Bac\nab", tmp_path, max_tokens=6)
    files = {p.file for p in pictures}
    assert ("routing.png" in files) == moe and (tmp_path / "routing.png").exists() == moe
    if moe:
        data = json.loads((tmp_path / "routing.json").read_text())
        assert data["tokens"] == list("Bac\nab") and len(data["experts"][0]) == 6  # the last 6 positions
        assert data["experts"] == routing_of(model, CharTokenizer().encode("abc, Bac\nab")).experts[:, 5:].tolist()
