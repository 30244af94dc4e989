"""Induction and ablation measures on a model whose induction circuit is built by hand, and the phase change located
on a synthetic ICL curve."""

from __future__ import annotations

import math

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.model import GPT
from gptkit.observe.ablation import ablation_study, mean_ablated
from gptkit.observe.measures import chance_induction_score, induction_test
from gptkit.observe.phase_change import MIN_FALL, phase_change_step

V, L = 32, 8  # vocabulary, and the length of each copy of the induction test's sequences
TOKENS, POSITIONS, PREVIOUS, COPIED = 0, V, V + 2 * L, 2 * V + 2 * L  # where each subspace of the residual starts


def induction_model() -> GPT:
    """Two layers of two heads, built by hand as Olsson et al. describe an induction circuit. Layer 0 head 0, a
    previous-token head, attends from each position to the one before it (by position) and writes that token into
    a "previous token" subspace. Layer 1 head 0, the induction head, attends from each position to the positions
    whose previous token is its own token (query: the token; key: the previous token) and writes the token found
    there into a subspace the LM head reads: it predicts what followed the current token last time, at any
    distance. Every other head reads and writes nothing (uniform attention), and the MLPs are zero."""
    config = ModelConfig(
        vocab_size=V,
        block_size=2 * L,
        n_layer=2,
        n_head=2,
        n_embd=3 * V + 2 * L,
        dropout=0.0,
        tie_embeddings=False,
        attn_bias=False,
        mlp_bias=False,
    )
    model = GPT(config).eval()
    hd, sharp, gain = config.head_dim, 5.0, 10.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
        model.tok_emb.weight[torch.arange(V), TOKENS + torch.arange(V)] = 1.0
        model.pos_emb.weight[torch.arange(2 * L), POSITIONS + torch.arange(2 * L)] = 1.0
        previous = model.blocks[0].attn  # rows of qkv: q of heads 0, 1; k of heads 0, 1; v of heads 0, 1
        for p in range(2 * L):
            previous.qkv.weight[p, POSITIONS + p] = sharp  # query at position p: unit p
            if p + 1 < 2 * L:
                previous.qkv.weight[2 * hd + p + 1, POSITIONS + p] = sharp  # key at position p: unit p + 1
        induction = model.blocks[1].attn
        for t in range(V):
            previous.qkv.weight[4 * hd + t, TOKENS + t] = 1.0  # value: the token
            previous.proj.weight[PREVIOUS + t, t] = 1.0  # into the previous-token subspace (as large as a token:
            #                                                the next norm must not shrink the token beside it)
            induction.qkv.weight[t, TOKENS + t] = sharp  # query: the current token
            induction.qkv.weight[2 * hd + t, PREVIOUS + t] = sharp  # key: the previous token
            induction.qkv.weight[4 * hd + t, TOKENS + t] = 1.0  # value: the token there
            induction.proj.weight[COPIED + t, t] = gain  # into the subspace the LM head reads
            model.lm_head.weight[t, COPIED + t] = 1.5  # logits a dozen nats apart: sure, not infinitely
    return model


def expected_induction_score(batch: int = 8, seed: int = 0) -> float:
    """What an exact induction head scores on induction_test's sequences: at each scored position, an equal share
    of its attention on every position whose previous token is its own token (the first copy's match among them;
    position 0, which has no previous token, attends to itself and so reads its own)."""
    half = torch.randint(0, V, (batch, L), generator=torch.Generator().manual_seed(seed))
    shares = []
    for row in torch.cat([half, half], dim=1).tolist():
        for i in range(L + 1, 2 * L):
            matches = [j for j in range(i + 1) if row[max(j - 1, 0)] == row[i]]
            shares.append(1 / len(matches))
    return sum(shares) / len(shares)


def test_a_hand_built_induction_head_scores_what_it_should_and_the_empty_heads_chance():
    test = induction_test(induction_model(), length=L)
    assert test.scores[1, 0].item() == pytest.approx(expected_induction_score(), abs=1e-4)
    assert test.scores[1, 0].item() > 0.85  # (not 1: a token seen twice shares the attention between successors)
    assert test.scores[0, 1].item() == pytest.approx(chance_induction_score(L), rel=1e-5)  # uniform attention
    assert test.scores[1, 1].item() == pytest.approx(chance_induction_score(L), rel=1e-5)
    # It copies, and only from its context: the repeated half costs ln 2 where the token came twice in the first copy
    # (two successors share the attention), next to nothing elsewhere.
    assert test.repeated_half_loss < 1.0 and test.first_half_loss > 3.0


def test_ablating_the_induction_head_destroys_copying_and_an_empty_head_changes_nothing():
    model = induction_model()
    study = ablation_study(model, induction_test(model, length=L).scores)
    assert (study["layer"], study["head"]) == (1, 0) and study["icl_change"] is None  # (no text given)
    assert study["repeat_change"] > 1.0  # nats: its mean over the batch no longer says which token comes next
    assert study["layer_heads"][1]["repeat_change"] == 0.0  # its output is zero: its mean is the same
    with mean_ablated(model, 0, 0):  # the previous-token head it reads through
        assert induction_test(model, length=L).repeated_half_loss > 2.0
    assert induction_test(model, length=L).repeated_half_loss < 1.0  # the hook is gone after the block


def test_the_ablation_is_paired_on_text_too():
    model = induction_model()
    tokens = torch.randint(0, V, (4000,), generator=torch.Generator().manual_seed(1)).numpy()
    study = ablation_study(model, induction_test(model, length=L).scores, tokens)
    assert study["layer_heads"][1]["icl_change"] == 0.0 and study["icl_change"] is not None


def test_a_head_outside_the_model_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^no head 2 in layer 0: the model has 2 layers of 2 heads"):
        with mean_ablated(induction_model(), 0, 2):
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
