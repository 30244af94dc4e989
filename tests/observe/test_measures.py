"""Measures of what a model does with its context: the logit lens, head contributions, the ICL score and the
induction test, checked against computations made independently of gptkit.observe.measures and on models built by
hand whose answer is known."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import VARIANTS

import gptkit
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT, Trace
from gptkit.observe.measures import (
    attention_from,
    chance_induction_score,
    early_late_losses,
    head_contributions,
    icl_score,
    induction_score_of,
    induction_test,
    lens_predictions,
    logit_lens,
    logit_lens_top,
    position_losses,
    sequence_losses,
    top_heads,
)
from gptkit.tokenizer import ByteTokenizer

# --- the logit lens -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "original-decoder"])
def test_logit_lens_last_stage_is_the_models_own_log_softmax(name):
    config = ModelConfig(**VARIANTS[name])
    model = GPT(config).eval()
    ids = torch.randint(0, config.vocab_size, (11,))
    lens = logit_lens(model, ids)
    assert lens.shape == (config.n_layer + 1, 11, config.vocab_size)
    with torch.no_grad():
        own = model(ids[None])[0].log_softmax(-1)
    torch.testing.assert_close(lens[-1], own, atol=1e-5, rtol=0)
    assert not torch.allclose(lens[0], own, atol=1e-3)  # the embedding alone predicts something else
    torch.testing.assert_close(lens.exp().sum(-1), torch.ones(config.n_layer + 1, 11))
    torch.testing.assert_close(logit_lens(model, ids, first=7), lens[:, 7:])  # the last positions only


def test_logit_lens_of_a_hugging_face_model_matches_transformers_hidden_states():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=48, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():  # random LayerNorm gains and biases: a lens that skipped or doubled ln_f would show
        for module in hf.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.3)
                module.bias.normal_(0.0, 0.3)
    model = gptkit.gpt_from_hf_model(hf)
    ids = torch.randint(0, 97, (13,))
    with torch.no_grad():
        states = hf(ids[None], output_hidden_states=True).hidden_states  # n_layer + 1; the last is after ln_f
        assert len(states) == 4
        want = [hf.lm_head(hf.transformer.ln_f(h[0])) for h in states[:-1]] + [hf.lm_head(states[-1][0])]
        want = torch.stack(want).log_softmax(-1)
    lens = gptkit.logit_lens(model, ids)
    assert lens.shape == want.shape == (4, 13, 97)
    for layer in range(4):
        torch.testing.assert_close(lens[layer], want[layer], atol=1e-5, rtol=0, msg=f"stage {layer}")


def test_lens_predictions_read_top_tokens_and_the_final_prediction():
    lens = torch.tensor([[[0.7, 0.2, 0.1]], [[0.1, 0.3, 0.6]]]).log()  # 2 stages, 1 position, 3 tokens
    top, top_prob, final_prob = lens_predictions(lens)
    assert top.tolist() == [[0], [2]]
    torch.testing.assert_close(top_prob, torch.tensor([[0.7], [0.6]]))
    torch.testing.assert_close(final_prob, torch.tensor([[0.1], [0.6]]))  # token 2 is the eventual prediction


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_the_lens_reduced_stage_by_stage_equals_the_whole_lens_reduced(name):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**VARIANTS[name])).eval()
    ids = torch.randint(0, model.config.vocab_size, (12,))
    whole = logit_lens(model, ids)
    top, top_prob, final_prob = lens_predictions(whole)
    reduced = logit_lens_top(model, ids, k=3)
    assert torch.equal(reduced.tokens[..., 0], top)
    torch.testing.assert_close(reduced.probs[..., 0], top_prob)
    torch.testing.assert_close(reduced.prediction_probs, final_prob)
    torch.testing.assert_close(reduced.probs, whole.exp().topk(3, dim=-1).values)


# --- head contributions -------------------------------------------------------------------------------------


def _direct(vector: torch.Tensor, model: GPT, scale: torch.Tensor, token: int) -> torch.Tensor:
    """What a piece of the final residual stream adds to a logit through the linearised final norm and the head."""
    if isinstance(model.norm_f, torch.nn.LayerNorm):
        vector = vector - vector.mean()
    return (vector * scale * model.norm_f.weight) @ model.lm_head.weight[token]


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "untied-head-bias"])
def test_head_contributions_and_the_other_direct_paths_add_up_to_the_logit(name):
    """The final residual stream is the embedding plus each layer's attention (its heads + the output bias) and MLP
    outputs; with the final norm's scale fixed, their direct effects must add up to the logit exactly, and each
    layer's heads must add up to that layer's attention output (taken from the model by hooks)."""
    config = ModelConfig(**VARIANTS[name])
    model = GPT(config).eval()
    with torch.no_grad():  # non-trivial norm gains and biases
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm, gptkit.model.RMSNorm)):
                module.weight.normal_(1.0, 0.3)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.1)
    ids = torch.randint(0, config.vocab_size, (9,))
    outputs: dict[str, list[torch.Tensor]] = {"attn": [], "mlp": []}
    hooks = [
        block.attn.register_forward_hook(lambda m, i, o: outputs["attn"].append(o[0, -1])) for block in model.blocks
    ] + [block.mlp.register_forward_hook(lambda m, i, o: outputs["mlp"].append(o[0, -1])) for block in model.blocks]
    trace = Trace()
    with torch.no_grad():
        logits = model(ids[None], trace=trace)[0, -1]
    for hook in hooks:
        hook.remove()
    token = int(logits.argmax())
    contributions = head_contributions(model, ids)
    assert contributions.shape == (config.n_layer, config.n_head)
    final = trace.hidden_states[config.n_layer][0, -1]
    centred = final - final.mean() if isinstance(model.norm_f, torch.nn.LayerNorm) else final
    scale = torch.rsqrt(centred.pow(2).mean() + config.norm_eps)
    with torch.no_grad():
        total = _direct(trace.hidden_states[0][0, -1], model, scale, token)  # the embeddings
        for layer in range(config.n_layer):
            attn_bias = model.blocks[layer].attn.proj.bias
            bias_part = _direct(attn_bias, model, scale, token) if attn_bias is not None else 0.0
            layer_attn = _direct(outputs["attn"][layer], model, scale, token)
            torch.testing.assert_close(contributions[layer].sum() + bias_part, layer_attn, atol=1e-4, rtol=1e-4)
            total = total + layer_attn + _direct(outputs["mlp"][layer], model, scale, token)
        if getattr(model.norm_f, "bias", None) is not None:
            total = total + model.norm_f.bias @ model.lm_head.weight[token]
        if model.lm_head.bias is not None:
            total = total + model.lm_head.bias[token]
    torch.testing.assert_close(total, logits[token], atol=1e-4, rtol=1e-4)
    # the heads differ: one number per head, not a layer total spread evenly
    assert contributions.std() > 0


def test_head_contributions_alone_make_the_logit_when_no_other_path_reaches_it():
    """Embeddings and MLPs kept out of the head's view, no biases: the heads' sum is the logit itself."""
    config = ModelConfig(
        vocab_size=40,
        block_size=16,
        n_layer=2,
        n_head=4,
        n_embd=32,
        norm="rmsnorm",
        attn_bias=False,
        mlp_bias=False,
        tie_embeddings=False,
    )
    model = GPT(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.proj.weight.zero_()
        # the embeddings live in dimensions 0..15 only, the LM head reads 16..31 only; the heads write 16..31
        model.tok_emb.weight[:, 16:] = 0
        model.pos_emb.weight[:, 16:] = 0
        model.lm_head.weight[:, :16] = 0
        model.lm_head.weight.mul_(20)
        for block in model.blocks:
            block.attn.proj.weight[:16] = 0
            block.attn.qkv.weight[:, 16:] = 0  # heads read the embeddings' dimensions only
    ids = torch.randint(0, 40, (10,))
    with torch.no_grad():
        logits = model(ids[None])[0, -1]
    contributions = head_contributions(model, ids, token=7)
    torch.testing.assert_close(contributions.sum(), logits[7], atol=1e-4, rtol=1e-4)
    assert contributions.abs().sum() > 0.1


def test_head_contributions_refuse_a_post_norm_model_and_a_bad_position():
    with pytest.raises(InputError, match="pre-norm"):
        head_contributions(GPT(ModelConfig(**VARIANTS["original-decoder"])), [1, 2, 3])
    with pytest.raises(InputError, match="outside"):
        head_contributions(GPT(ModelConfig(**VARIANTS["gpt2"])), [1, 2, 3], position=3)


# --- induction -----------------------------------------------------------------------------------------------


def test_induction_score_of_constructed_attention_patterns():
    L = 6
    perfect = torch.zeros(1, 1, 2 * L, 2 * L)
    for i in range(2 * L):
        perfect[0, 0, i, i - L + 1 if i >= L else 0] = 1.0  # the second copy reads the token after its match
    uniform = torch.ones(2 * L, 2 * L).tril()
    uniform = (uniform / uniform.sum(-1, keepdim=True))[None, None]
    previous = torch.zeros(1, 1, 2 * L, 2 * L)
    previous[0, 0, torch.arange(2 * L), (torch.arange(2 * L) - 1).clamp_min(0)] = 1.0  # a previous-token head
    scores = induction_score_of([torch.cat([perfect, uniform, previous], dim=1)], L)
    assert scores.shape == (1, 3)
    assert scores[0, 0] == pytest.approx(1.0)
    assert scores[0, 1] == pytest.approx(chance_induction_score(L))
    assert scores[0, 2] == pytest.approx(0.0)
    assert chance_induction_score(L) == pytest.approx(np.mean([1 / (i + 1) for i in range(L + 1, 2 * L)]))


def test_heads_that_attend_uniformly_score_the_chance_level():
    config = ModelConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
    model = GPT(config)
    with torch.no_grad():  # zero queries and keys: every score is 0, so each row is uniform over its keys
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * config.n_embd] = 0
            block.attn.qkv.bias[: 2 * config.n_embd] = 0
    scores = gptkit.induction_scores(model)
    assert scores.shape == (2, 4)
    torch.testing.assert_close(scores, torch.full((2, 4), chance_induction_score(16)), atol=1e-6, rtol=0)
    assert not torch.allclose(induction_scores_of_random(config), scores, atol=1e-4)  # random q, k are not uniform


def induction_scores_of_random(config: ModelConfig) -> torch.Tensor:
    torch.manual_seed(1)
    model = GPT(config)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(50)
    return gptkit.induction_scores(model)


def induction_model(vocab: int = 256, block: int = 32, gain: float = 20.0) -> GPT:
    """A two-layer attention-only induction circuit built by hand (Olsson et al. 2022). The residual stream holds
    one-hot subspaces: the token (0..V), the position (V..V+T), the previous token (V+T..2V+T) and the output
    (2V+T..3V+T). Layer 1 is a previous-token head: the query of position i matches the key of position i - 1 and
    copies that token into the previous-token subspace. Layer 2 is the induction head: the query (the current
    token) matches keys whose previous token is the same, and copies their token into the output subspace, which
    the LM head reads."""
    V, T = vocab, block
    tok, pos, prev, out = 0, V, V + T, 2 * V + T
    d = 3 * V + T
    config = ModelConfig(
        vocab_size=V,
        block_size=T,
        n_layer=2,
        n_head=1,
        n_embd=d,
        ffn_hidden=4,
        norm="rmsnorm",
        attn_bias=False,
        mlp_bias=False,
        tie_embeddings=False,
    )
    model = GPT(config).eval()
    eye_v = torch.eye(V)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [b.norm1 for b in model.blocks] + [b.norm2 for b in model.blocks] + [model.norm_f]:
            norm.weight.fill_(1.0)
        model.tok_emb.weight[:, tok : tok + V] = eye_v
        model.pos_emb.weight[:, pos : pos + T] = torch.eye(T)
        first, second = (b.attn.qkv.weight.view(3, d, d) for b in model.blocks)  # (q, k, v) x (out, in)
        for i in range(T):
            first[0, i, pos + i] = gain  # query: my position
            if i + 1 < T:
                first[1, i + 1, pos + i] = 1.0  # key: the position after mine, so that i + 1 finds i
        first[2, prev : prev + V, tok : tok + V] = eye_v  # value: my token, written as "the previous token"
        second[0, :V, tok : tok + V] = gain * eye_v  # query: my token
        second[1, :V, prev : prev + V] = eye_v  # key: my previous token
        second[2, out : out + V, tok : tok + V] = eye_v  # value: my token, written as the output
        for block in model.blocks:
            block.attn.proj.weight.copy_(torch.eye(d))
        model.lm_head.weight[:, out : out + V] = 10 * eye_v
    return model


def test_a_hand_built_induction_circuit_scores_near_one():
    model = induction_model()
    result = induction_test(model)
    chance = chance_induction_score(result.length)
    assert result.scores.shape == (2, 1)
    assert result.scores[1, 0] > 0.9  # the induction head (a repeated token in a random half splits its weight)
    assert result.scores[0, 0] < 0.1  # the previous-token head looks one back, not at the induction target
    assert result.scores[1, 0] > 20 * chance
    assert result.first_half_loss > 3.0  # random tokens: nothing to copy yet
    assert result.repeated_half_loss < 0.5 * result.first_half_loss  # the repeat is copied from the first copy
    assert top_heads(result.scores, 1) == [(1, 0, pytest.approx(float(result.scores[1, 0])))]  # from 0


def test_icl_score_is_negative_for_the_induction_circuit_and_zero_for_a_context_blind_model():
    model = induction_model()
    period = torch.randperm(256)[:6]  # a pattern of 6 distinct tokens, repeated: copyable after one period
    tokens = period.repeat(60).numpy()
    losses = position_losses(model, tokens)
    assert losses.shape == (32,)
    early, late = early_late_losses(losses)
    score = gptkit.icl_score(model, tokens)
    assert score == pytest.approx(late - early)
    assert early > 3.0 and late < 0.5 and score < -3.0
    blind = GPT(ModelConfig(vocab_size=50, block_size=40, n_layer=2, n_head=2, n_embd=16, position="none"))
    with torch.no_grad():
        for block in blind.blocks:
            block.attn.proj.weight.zero_()
            block.attn.proj.bias.zero_()
    # no attention output and no positions: every position predicts from its own token alone, and on alternating
    # tokens the early and late spans hold as many of each token
    alternating = np.tile([3, 17], 200)
    assert icl_score(blind, alternating) == pytest.approx(0.0, abs=1e-5)


def test_measures_refuse_too_little_input():
    model = GPT(ModelConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(InputError, match="at least block_size \\+ 1 = 17 tokens"):
        icl_score(model, np.arange(10))
    with pytest.raises(InputError, match="2 to block_size / 2 = 8"):
        induction_test(model, length=9)
    with pytest.raises(InputError, match="one non-empty sequence"):
        logit_lens(model, [])
    with pytest.raises(InputError, match="at least 2 tokens"):
        sequence_losses(model, [3])


def test_sequence_losses_and_attention_from_the_last_position():
    model = GPT(ModelConfig(**VARIANTS["gpt2"])).eval()
    ids = torch.randint(0, model.config.vocab_size, (12,))
    with torch.no_grad():
        logits = model(ids[None])[0]
    want = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
    torch.testing.assert_close(sequence_losses(model, ids), want, atol=1e-5, rtol=0)
    attention = attention_from(model, ids)
    assert attention.shape == (model.config.n_layer, 12)
    torch.testing.assert_close(attention.sum(-1), torch.ones(model.config.n_layer))


def test_the_measures_are_public():
    for name in [
        "icl_score",
        "induction_scores",
        "induction_test",
        "logit_lens",
        "head_contributions",
        "position_losses",
        "chance_induction_score",
    ]:
        assert callable(getattr(gptkit, name)) and name in dir(gptkit)


# --- gptkit eval --icl ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def induction_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_model_dir(induction_model(vocab=257), tmp_path_factory.mktemp("induction"), tokenizer=ByteTokenizer())


def test_eval_icl_prints_the_icl_score_and_the_induction_test(induction_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("abcdefg" * 20)  # repeats every 7 characters: the circuit copies it once it has seen it
    assert main(["eval", str(induction_dir), "--input", str(text), "--icl"]) == 0
    out = capsys.readouterr().out
    assert "ICL score -" in out and "late loss" in out and "early loss" in out and "64 windows of 32 tokens" in out
    assert "induction test (16 random tokens repeated)" in out
    assert "strongest induction heads (layer, head, score): L1H0 0.9" in out  # from 0
    assert f"uniform attention scores {chance_induction_score(16):.3f}" in out
    assert main(["eval", str(induction_dir), "--input", str(text), "--icl", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["icl_score"] == pytest.approx(summary["late_loss"] - summary["early_loss"])
    assert summary["icl_score"] < -3.0 and 0 <= summary["icl_stderr"] < 1.0
    induction = summary["induction"]
    assert induction["top_heads"][0]["layer"] == 1 and induction["top_heads"][0]["score"] > 0.9  # from 0
    assert np.asarray(induction["scores"]).shape == (2, 1)
    assert induction["repeated_half_loss"] < induction["first_half_loss"]
    assert induction["chance"] == pytest.approx(chance_induction_score(16))


def test_eval_icl_errors_are_one_line(induction_dir, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("only twenty tokens..")
    assert main(["eval", str(induction_dir), "--input", str(short), "--icl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 20 tokens; --icl needs at least block_size + 1 = 33" in err
    assert main(["eval", str(induction_dir), "--input", str(short), "--icl", "--kv-cache", "int8"]) == 2
    assert "drop --kv-cache" in capsys.readouterr().err
    assert main(["eval", str(induction_dir), "--input", str(short), "--icl", "--icl-windows", "0"]) == 2
    assert "--icl-windows must be >= 1, got 0" in capsys.readouterr().err
    assert math.isfinite(chance_induction_score(16))
