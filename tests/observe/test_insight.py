"""gptkit inspect: the data behind each picture, valid PNGs, and an index.html that shows them."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import VARIANTS
from matplotlib.image import imread

from gptkit.accounting import param_breakdown
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.formats.modeldir import save_model_dir
from gptkit.loading import load
from gptkit.model import GPT
from gptkit.observe.prompt import (
    attention_maps,
    causal_mask,
    hidden_state_norms,
    layer_similarity,
    next_token_distributions,
    parameter_parts,
    prompt_insight,
    token_label,
    token_labels,
    token_probabilities,
)
from gptkit.observe.report import write_report
from gptkit.tokenizer import ByteTokenizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "original-decoder"])
def test_attention_rows_sum_to_one_and_upper_triangle_is_zero(name):
    config = ModelConfig(**VARIANTS[name])
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (12,)).tolist()
    insight = prompt_insight(model, ids)
    maps = attention_maps(insight)
    assert len(maps) == config.n_layer
    for weights in maps:
        assert weights.shape == (config.n_head, 12, 12)
        assert torch.allclose(weights.sum(-1), torch.ones(config.n_head, 12), atol=1e-5)
        assert torch.all(weights.triu(diagonal=1) == 0)
        assert torch.all(weights[:, 0, 0] == 1)  # the first token can only attend to itself


def test_hidden_states_norms_and_similarity():
    config = ModelConfig(**VARIANTS["gpt2"])
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (9,)).tolist()
    insight = prompt_insight(model, ids)
    assert len(insight.hidden_states) == len(insight.state_labels) == config.n_layer + 2  # + embedding, final norm
    norms = hidden_state_norms(insight.hidden_states)
    assert norms.shape == (config.n_layer + 2, 9)
    assert norms[1, 4] == pytest.approx(float(insight.hidden_states[1][4].norm()))
    sim = layer_similarity(insight.hidden_states)
    assert torch.allclose(sim, sim.T, atol=1e-6) and torch.allclose(sim.diagonal(), torch.ones(len(sim)), atol=1e-5)
    direct = F.cosine_similarity(insight.hidden_states[0][-1], insight.hidden_states[2][-1], dim=0)
    assert sim[0, 2] == pytest.approx(float(direct), abs=1e-5)
    # the final logits are the model's own
    assert torch.allclose(insight.logits, model(torch.tensor([ids]))[0], atol=1e-5)
    post = ModelConfig(**VARIANTS["original-decoder"])
    assert len(prompt_insight(GPT(post), ids).hidden_states) == post.n_layer + 1  # no final norm


def test_next_token_distributions_follow_temperature():
    logits = torch.randn(50)
    dists = next_token_distributions(logits)
    assert list(dists) == [0.5, 1.0, 2.0]
    entropies = []
    for t, probs in dists.items():
        assert probs.sum() == pytest.approx(1.0, abs=1e-5)
        assert torch.allclose(probs, torch.softmax(logits / t, dim=-1))
        entropies.append(float(-(probs * probs.log()).sum()))
    assert entropies[0] < entropies[1] < entropies[2]  # a higher temperature flattens the distribution
    assert torch.equal(dists[0.5].argsort(), dists[2.0].argsort())  # but keeps the order


def test_token_probabilities_are_those_of_the_actual_next_tokens():
    logits = torch.randn(5, 20)
    ids = [3, 7, 1, 19, 0]
    probs = token_probabilities(logits, ids)
    expected = torch.exp(-F.cross_entropy(logits[:4], torch.tensor(ids[1:]), reduction="none"))
    assert torch.allclose(probs, expected, atol=1e-6)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_parts_add_up_to_the_model(name):
    config = ModelConfig(**VARIANTS[name])
    parts = parameter_parts(config)
    assert sum(count for _, count in parts) == param_breakdown(config).total
    assert sum(count for _, count in parts) == sum(p.numel() for p in GPT(config).parameters())
    labels = [label for label, _ in parts]
    assert all(f"layer {i} attention" in labels and f"layer {i} MLP" in labels for i in range(config.n_layer))


def test_causal_mask_and_token_labels():
    mask = causal_mask(4)
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]
    assert token_label(" the\n") == "\u2423the\\n"
    assert token_label("$x$") == "\\$x\\$"  # no mathtext
    assert token_label("\x00") == "\\x00"
    assert len(token_label("a" * 40)) == 12
    assert token_labels(ByteTokenizer(), list("é✓".encode())) == ["<C3>", "<A9>", "<E2>", "<9C>", "<93>"]
    assert token_labels(ByteTokenizer(), [ord("a"), 256]) == ["a", token_label("<|endoftext|>")]


def check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    assert image.std() > 0  # not a blank canvas


@pytest.fixture(scope="module")
def gelu_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=32, activation="gelu")
    return save_model_dir(GPT(config), tmp_path_factory.mktemp("gelu"), tokenizer=ByteTokenizer())


def test_report_pictures_are_valid_pngs_referenced_by_index(gelu_dir, tmp_path, capsys):
    prompt = "<b>To be</b> & $not$ to be"
    assert main(["inspect", str(gelu_dir), "--prompt", prompt, "--out", str(tmp_path / "out")]) == 0
    assert "index.html" in capsys.readouterr().out
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    expected = {
        "parameters.png",
        "attention_layer0.png",
        "attention_layer1.png",
        "hidden_norms.png",
        "layer_similarity.png",
        "next_token.png",
        "causal_mask.png",
        "activation.png",
        "logit_lens.png",
        "head_contributions.png",
        "icl.png",
        "induction.png",
    }
    assert set(pngs) == expected
    for name in pngs:
        check_png(tmp_path / "out" / name)
    page = (tmp_path / "out" / "index.html").read_text()
    assert sorted(re.findall(r'<img src="([^"]+)"', page)) == pngs  # relative links, one per picture
    assert "&lt;b&gt;To be&lt;/b&gt; &amp; $not$ to be" in page and "<b>To be" not in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere


def test_the_attention_drawn_is_the_models_own_softmax_of_queries_and_keys(gelu_dir, tmp_path, monkeypatch):
    """The numbers attention_layer0.png is drawn from, against layer 0's attention computed directly from the
    weights: softmax(q k^T / sqrt(d_k)) under the causal mask, q and k from the normed embeddings (no trace)."""
    import gptkit.observe.report as report

    drawn = {}
    real = report.draw_attention

    def recording(weights: torch.Tensor, labels: list[str], layer: int):
        drawn[layer] = weights.clone()
        return real(weights, labels, layer)

    monkeypatch.setattr(report, "draw_attention", recording)
    prompt = "To be, or not to be: that is the question"
    assert main(["inspect", str(gelu_dir), "--prompt", prompt, "--out", str(tmp_path), "--max-tokens", "8"]) == 0
    model, tokenizer = load(gelu_dir)
    ids = torch.tensor(tokenizer.encode(prompt))
    T, H, C = len(ids), model.config.n_head, model.config.n_embd
    with torch.no_grad():
        x = model.blocks[0].norm1(model.tok_emb(ids) + model.pos_emb(torch.arange(T)))  # pre-norm, learned positions
        q, k, _ = (x @ model.blocks[0].attn.qkv.weight.T + model.blocks[0].attn.qkv.bias).split(C, dim=-1)
        q, k = (t.view(T, H, C // H).transpose(0, 1) for t in (q, k))  # (H, T, d_k)
        scores = (q @ k.transpose(1, 2) / math.sqrt(C // H)).masked_fill(~torch.ones(T, T).bool().tril(), -math.inf)
    want = scores.softmax(dim=-1)[:, -8:, -8:]  # the last 8 positions are drawn
    assert drawn.keys() == {0, 1} and drawn[0].shape == (H, 8, 8)  # layers numbered from 0
    torch.testing.assert_close(drawn[0], want, atol=1e-6, rtol=0)


def test_long_prompt_is_capped_and_captioned(tmp_path):
    config = ModelConfig(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_embd=16, activation="relu")
    prompt = "x" * 30  # 30 byte tokens: 16 fit the context, the last 6 are drawn
    pictures = write_report(GPT(config), ByteTokenizer(), prompt, tmp_path, max_tokens=6)
    attention = next(p for p in pictures if p.file == "attention_layer0.png")
    assert "last 6 of the 16 positions" in attention.caption
    assert "first 14 tokens were dropped" in attention.caption
    assert "activation.png" not in {p.file for p in pictures}  # a ReLU model gets no activation picture
    assert len(pictures) == 10  # parameters, attention, norms, similarity, next token, mask and the four below
    assert [p.file for p in pictures][-4:] == ["logit_lens.png", "head_contributions.png", "icl.png", "induction.png"]
    check_png(tmp_path / "attention_layer0.png")


def test_cli_errors_are_one_line(gelu_dir, tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert main(["inspect", str(gelu_dir), "--prompt", "", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "does not exist" in err and "empty" in err


def test_report_writes_the_logit_lens_contributions_icl_and_induction_numbers(gelu_dir, tmp_path):
    """Each new picture has its JSON beside it, with the shapes drawn and the numbers of gptkit.observe.measures."""
    from gptkit.observe.ablation import mean_ablated
    from gptkit.observe.measures import (
        chance_induction_score,
        head_contributions,
        induction_scores,
        induction_test,
        logit_lens,
    )

    model, tokenizer = load(gelu_dir)
    prompt = "To be, or not to be: that is the question"
    pictures = write_report(model, tokenizer, prompt, tmp_path, max_tokens=8)
    by_file = {p.file: p for p in pictures}
    for name in ["logit_lens", "head_contributions", "icl", "induction"]:
        check_png(tmp_path / f"{name}.png")
        assert by_file[f"{name}.png"].data == f"{name}.json"
    page = (tmp_path / "index.html").read_text()
    assert '<a href="logit_lens.json">' in page and '<a href="induction.json">' in page
    ids = tokenizer.encode(prompt)
    L, H = model.config.n_layer, model.config.n_head

    lens = json.loads((tmp_path / "logit_lens.json").read_text())
    assert lens["rows"] == ["embedding", "layer 0", "layer 1"]  # numbered from 0, as the playground
    assert lens["positions"] == list(range(len(ids) - 8, len(ids)))
    final_prob = np.asarray(lens["final_prediction_probability"])
    assert np.asarray(lens["top_token_ids"]).shape == final_prob.shape == (L + 1, 8)
    want = logit_lens(model, ids)[:, -8:].exp()  # (L + 1, 8, V)
    final = want[-1].argmax(-1)
    assert lens["top_token_ids"] == want.argmax(-1).tolist()
    np.testing.assert_allclose(final_prob, want.gather(-1, final.expand(L + 1, -1)[..., None])[..., 0], atol=1e-6)
    np.testing.assert_allclose(lens["final_prediction_probability"][-1], lens["top_probability"][-1], atol=1e-7)
    assert "final norm" in by_file["logit_lens.png"].caption

    contributions = json.loads((tmp_path / "head_contributions.json").read_text())
    assert np.asarray(contributions["contributions"]).shape == (L, H)
    np.testing.assert_allclose(contributions["contributions"], head_contributions(model, ids), atol=1e-6)
    assert contributions["token_id"] == int(final[-1]) and contributions["position"] == len(ids) - 1

    icl = json.loads((tmp_path / "icl.json").read_text())
    assert icl["prompt"] == "To To\nbe, be,\nor or\nnot not\nto " and icl["expected_answer"] == "to"
    T = len(tokenizer.encode(icl["prompt"]))
    assert np.asarray(icl["attention_from_last"]).shape == (L, T) and len(icl["tokens"]) == T
    np.testing.assert_allclose(np.asarray(icl["attention_from_last"]).sum(-1), np.ones(L), atol=1e-5)
    assert icl["losses_over"] == "prompt" and len(icl["position_losses"]) == T - 1
    assert "the expected answer is 'to'" in by_file["icl.png"].caption

    induction = json.loads((tmp_path / "induction.json").read_text())
    assert np.asarray(induction["scores"]).shape == (L, H) and induction["length"] == 32
    np.testing.assert_allclose(induction["scores"], induction_scores(model), atol=1e-6)
    assert induction["chance"] == pytest.approx(chance_induction_score(32))
    assert f"{chance_induction_score(32):.3f} (the chance level)" in by_file["induction.png"].caption
    ablation = induction["ablation"]  # the strongest head, and each head of its layer, mean-ablated
    strongest = np.unravel_index(np.argmax(induction["scores"]), (L, H))
    assert (ablation["layer"], ablation["head"]) == tuple(int(i) for i in strongest)
    assert [h["head"] for h in ablation["layer_heads"]] == list(range(H))
    with mean_ablated(model, ablation["layer"], ablation["head"]):
        ablated = induction_test(model).repeated_half_loss
    assert ablation["repeat_change"] == pytest.approx(ablated - induction["repeated_half_loss"], abs=1e-6)
    assert f"{ablation['repeat_change']:+.3f}" in by_file["induction.png"].caption


def test_post_norm_report_skips_head_contributions_with_a_note(tmp_path):
    config = ModelConfig(**dict(VARIANTS["original-decoder"], vocab_size=257))
    pictures = write_report(GPT(config), ByteTokenizer(), "hello there world", tmp_path, icl_prompt="a b\nc d\na")
    files = [p.file for p in pictures]
    assert "head_contributions.png" not in files and not (tmp_path / "head_contributions.json").exists()
    assert {"logit_lens.png", "icl.png", "induction.png"} <= set(files)
    lens = next(p for p in pictures if p.file == "logit_lens.png")
    assert "Head contributions are not drawn" in lens.caption and "post-norm" in lens.caption
    icl = json.loads((tmp_path / "icl.json").read_text())
    assert icl["prompt"] == "a b\nc d\na" and icl["expected_answer"] is None


def test_default_icl_prompt_uses_what_the_tokenizer_encodes():
    from gptkit.observe.prompt import default_icl_prompt
    from gptkit.tokenizer import CharTokenizer

    assert default_icl_prompt("one two", ByteTokenizer()) == ("one one\ntwo ", "two")
    assert default_icl_prompt("a b c d e f g", ByteTokenizer())[0] == "a a\nb b\nc c\nd d\ne "  # 4 demonstrations
    # a char vocabulary without spaces or newlines: the prompt's characters, no separators it cannot encode
    chars = CharTokenizer.train(["abc"])
    text, answer = default_icl_prompt("abc", chars)
    assert (text, answer) == ("aabbc", "c") and chars.encode(text)
    assert default_icl_prompt("aaa", ByteTokenizer()) == ("aaa aaa\naaa ", "aaa")  # one word copies itself
    with pytest.raises(InputError, match="--icl-prompt"):
        default_icl_prompt(" \n ", ByteTokenizer())


def test_inspect_cli_takes_a_few_shot_prompt_and_data_for_the_loss_curve(tmp_path, capsys):
    from helpers import write_char_data_dir

    from gptkit.tokenizer import load_tokenizer

    data = write_char_data_dir(tmp_path, 6000)
    tokenizer = load_tokenizer(data)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=16)
    model_dir = save_model_dir(GPT(config), tmp_path / "model", tokenizer=tokenizer)
    out = tmp_path / "out"
    assert (
        main(["inspect", str(model_dir), "--out", str(out), "--data", str(data), "--icl-prompt", "ab ab\ncd cd\nef"])
        == 0
    )
    icl = json.loads((out / "icl.json").read_text())
    assert icl["losses_over"] == "data" and len(icl["position_losses"]) == 32
    assert icl["icl_score"] == pytest.approx(icl["late_loss"] - icl["early_loss"])
    assert icl["prompt"] == "ab ab\ncd cd\nef"
    assert main(["inspect", str(model_dir), "--out", str(out), "--icl-prompt", "\u00e9"]) == 2  # not in the vocabulary
    assert capsys.readouterr().err.count("\n") == 1
