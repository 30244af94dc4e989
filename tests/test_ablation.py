"""Induction and ablation measures on a model whose head copies by construction, and the phase change located on a
synthetic ICL curve."""

from __future__ import annotations

import math

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.model import GPT
from gptkit.observe.ablation import ablation_study, mean_ablated
from gptkit.observe.measures import chance_induction_score, induction_test
from gptkit.observe.phase_change import MIN_FALL, phase_change_step

V, L = 8, 8  # vocabulary, and the length of each copy of the induction test's sequences


def copying_model() -> GPT:
    """One layer, two heads, built by hand: head 0 attends from each position i to i - L + 1 (on a sequence
    repeated after L tokens, the token after the current token's first occurrence) and writes that token's one-hot
    into a subspace the LM head reads: an exact induction head on the test's sequences. Head 1 reads nothing
    (uniform attention) and writes nothing. The residual stream: token one-hots in dims 0-7, position one-hots in
    8-23, the copied token in 24-31."""
    config = ModelConfig(vocab_size=V, block_size=2 * L, n_layer=1, n_head=2, n_embd=32, dropout=0.0,
                         tie_embeddings=False, attn_bias=False, mlp_bias=False)  # fmt: skip
    model = GPT(config).eval()
    hd, sharp, gain = config.head_dim, 3.0, 10.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
        model.tok_emb.weight[torch.arange(V), torch.arange(V)] = 1.0
        model.pos_emb.weight[torch.arange(2 * L), V + torch.arange(2 * L)] = 1.0
        qkv = model.blocks[0].attn.qkv.weight  # rows: q of heads 0, 1; k of heads 0, 1; v of heads 0, 1
        for p in range(2 * L):
            qkv[p, V + p] = sharp  # head 0's query at position p: unit p
        for j in range(L + 1):
            qkv[2 * hd + j + L - 1, V + j] = sharp  # head 0's key at position j: unit j + L - 1
        for t in range(V):
            qkv[4 * hd + t, t] = 1.0  # head 0's value: the token
            model.blocks[0].attn.proj.weight[24 + t, t] = gain  # into the copy subspace
            model.lm_head.weight[t, 24 + t] = gain / 2  # which the LM head reads
    return model


def test_a_hand_built_induction_head_scores_one_and_the_empty_head_scores_chance():
    test = induction_test(copying_model(), length=L)
    assert test.scores[0, 0].item() > 0.999
    assert test.scores[0, 1].item() == pytest.approx(chance_induction_score(L), rel=1e-5)  # uniform attention
    assert test.repeated_half_loss < 0.01 and test.first_half_loss > 1.0  # it copies, and only from its context


def test_ablating_the_induction_head_destroys_copying_and_the_empty_head_changes_nothing():
    model = copying_model()
    scores = induction_test(model, length=L).scores
    study = ablation_study(model, scores)
    assert (study["layer"], study["head"]) == (0, 0) and study["icl_change"] is None  # (no text given)
    assert study["repeat_change"] > 1.0  # nats: its mean over the batch no longer says which token comes next
    assert study["layer_heads"][1]["repeat_change"] == 0.0  # its output is zero: its mean is the same
    with mean_ablated(model, 0, 0):
        assert induction_test(model, length=L).repeated_half_loss > 1.0
    assert induction_test(model, length=L).repeated_half_loss < 0.01  # the hook is gone after the block


def test_the_ablation_is_paired_on_text_too():
    model = copying_model()
    tokens = torch.randint(0, V, (4000,), generator=torch.Generator().manual_seed(1)).numpy()
    study = ablation_study(model, induction_test(model, length=L).scores, tokens)
    assert study["layer_heads"][1]["icl_change"] == 0.0 and study["icl_change"] is not None


def test_a_head_outside_the_model_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^no head 2 in layer 0: the model has 1 layers of 2 heads"):
        with mean_ablated(copying_model(), 0, 2):
            pass


def test_the_phase_change_is_where_a_synthetic_icl_curve_falls_fastest():
    steps = list(range(0, 1001, 50))
    curve = [(s, -0.8 / (1 + math.exp(-(s - 600) / 40))) for s in steps]  # a sigmoid fall centred on step 600
    assert phase_change_step(curve) == 600
    assert phase_change_step(curve[:8]) is None  # up to step 350 it has barely begun (< MIN_FALL)
    flat = [(s, 0.02 * math.sin(s)) for s in steps]  # noise only
    assert phase_change_step(flat) is None
    assert phase_change_step([(0, 0.0), (100, -2 * MIN_FALL)]) == 50  # two evaluations: between them
    assert phase_change_step([(0, 0.0)]) is None
