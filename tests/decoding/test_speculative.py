"""Speculative decoding: greedy output equals the target's own greedy output for any draft and k."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY, VARIANTS

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.decoding.api import complete, generate_ids
from gptkit.decoding.options import DecodeOptions
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.speculative import speculative_generate
from gptkit.errors import ConfigError
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.tokenizer import CharTokenizer

GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


def sharpened(config: ModelConfig) -> GPT:
    """A random model with larger logits than the default init, so that greedy choices are far from ties."""
    model = GPT(config).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(20)  # scales the logits (of a pre-norm model) without touching a tied embedding
    return model


def always_wrong_draft(config: ModelConfig, token: int) -> GPT:
    """A draft that proposes `token` whatever it sees (an untied head with a one-hot bias)."""
    draft_config = ModelConfig(
        **dict(
            TINY,
            vocab_size=config.vocab_size,
            n_layer=1,
            n_embd=16,
            n_head=2,
            tie_embeddings=False,
            lm_head_bias=True,
            block_size=config.block_size,
        )
    )
    draft = GPT(draft_config).eval()
    with torch.no_grad():
        draft.lm_head.weight.zero_()
        draft.lm_head.bias.zero_()
        draft.lm_head.bias[token] = 10.0
    return draft


@pytest.mark.parametrize(("variant", "k"), [("gpt2", 1), ("gpt2", 4), ("llama-gqa", 2), ("llama-gqa", 5)])
def test_greedy_output_equals_target_greedy(variant, k, device):
    config = ModelConfig(**dict(VARIANTS[variant], block_size=64))
    target = sharpened(config).to(device)
    prompt = [3, 1, 4, 1, 5]
    want = generate_ids(target, prompt, max_new_tokens=24, temperature=0)
    unused = next(t for t in range(config.vocab_size) if t not in want)
    drafts = {
        "random": sharpened(ModelConfig(**dict(VARIANTS[variant], block_size=64, n_layer=1))).to(device),
        "target itself": target,
        "always wrong": always_wrong_draft(config, unused).to(device),
    }
    for name, draft in drafts.items():
        request = Request(prompt, GREEDY)
        stats = speculative_generate(target, draft, request, k=k)
        assert request.generated == want, name
        assert request.finish_reason == "length"
        if name == "always wrong":
            assert stats.accepted == 0 and stats.proposed > 0
            assert stats.target_passes == 24 - 1  # one token per pass after the prefill's
        if name == "target itself":
            assert stats.acceptance_rate == 1.0
            assert stats.target_passes < 24 // k + 2  # k + 1 tokens per pass


def test_complete_with_draft_stops_at_eos_and_reports_stats():
    config = ModelConfig(**dict(TINY, block_size=64))
    target = sharpened(config)
    prompt = [7, 8, 9, 1, 5, 2]
    plain = generate_ids(target, prompt, max_new_tokens=20, temperature=0)
    cut = next(i for i, t in enumerate(plain) if t not in plain[:i] and i >= 2)  # eos's first appearance
    eos = plain[cut]
    want = complete(target, [prompt, [1, 2]], GREEDY, eos_id=eos)
    got = complete(target, [prompt, [1, 2]], GREEDY, eos_id=eos, options=DecodeOptions(draft=target, draft_k=4))
    assert [[c.ids for c in row] for row in got.completions] == [[c.ids for c in row] for row in want.completions]
    assert got.completions[0][0].finish_reason == "eos" and got.completions[0][0].ids == plain[:cut]
    timing = got.timing.to_dict()
    assert timing["acceptance_rate"] == 1.0 and timing["draft_proposed"] > 0


def test_draft_errors_are_clear():
    target = GPT(ModelConfig(**TINY))
    other_vocab = GPT(ModelConfig(**dict(TINY, vocab_size=60)))
    with pytest.raises(ConfigError, match="vocabulary"):
        generate_ids(target, [1, 2], max_new_tokens=3, draft=other_vocab)
    with pytest.raises(ConfigError, match="k >= 1"):
        generate_ids(target, [1, 2], max_new_tokens=3, draft=target, draft_k=0)
    with pytest.raises(ConfigError, match="repetition_penalty"):
        generate_ids(target, [1, 2], max_new_tokens=3, draft=target, repetition_penalty=1.3)


def test_learned_positions_past_block_size_fall_back_to_plain_decoding(caplog):
    target = sharpened(ModelConfig(**TINY))  # block_size 16
    prompt = [1, 2, 3, 4, 5, 6]
    want = generate_ids(target, prompt, max_new_tokens=20, temperature=0)
    with caplog.at_level("WARNING", logger="gptkit"):
        assert generate_ids(target, prompt, max_new_tokens=20, temperature=0, draft=target) == want
    assert "decoding without the draft" in caplog.text  # never silently


def _joint(model: GPT, prompt: list[int], vocab: int) -> torch.Tensor:
    """Exact P(t1, t2) of two sampled tokens after prompt (temperature 1)."""
    with torch.no_grad():
        first = model(torch.tensor([prompt]))[0, -1].softmax(-1)
        second = torch.stack([model(torch.tensor([prompt + [t]]))[0, -1].softmax(-1) for t in range(vocab)])
    return first[:, None] * second


def test_sampling_follows_the_target_distribution():
    """Two sampled tokens through draft + accept/reject, against the target's exact joint distribution."""
    vocab, prompt = 4, [1, 2]
    target = sharpened(ModelConfig(**dict(TINY, vocab_size=vocab, block_size=32)))
    with torch.no_grad():
        target.norm_f.weight.mul_(0.15)  # logits about 3x the default init: a skewed but spread distribution
    draft = GPT(ModelConfig(**dict(TINY, vocab_size=vocab, block_size=32, n_layer=1))).eval()  # near uniform
    exact = _joint(target, prompt, vocab)
    assert 0.5 * float((_joint(draft, prompt, vocab) - exact).abs().sum()) > 0.2  # the draft alone would fail
    params = SamplingParams(max_new_tokens=3, temperature=1.0)  # token 2 comes from the draft + check
    counts = torch.zeros(vocab, vocab)
    n = 800
    for i in range(n):
        request = Request(prompt, params, seed=i)
        speculative_generate(target, draft, request, k=1)
        counts[request.generated[0], request.generated[1]] += 1
    assert 0.5 * float((counts / n - exact).abs().sum()) < 0.1


def test_cli_generate_with_draft(tmp_path, capsys):
    tokenizer = CharTokenizer.train(["abcdefghij klmnop"])
    config = ModelConfig(**dict(TINY, vocab_size=tokenizer.vocab_size, block_size=64))
    target_dir = save_model_dir(sharpened(config), tmp_path / "target", tokenizer)
    draft_config = ModelConfig(**dict(TINY, vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1))
    draft_dir = save_model_dir(sharpened(draft_config), tmp_path / "draft", tokenizer)
    args = ["--prompt", "abc", "--max-new-tokens", "12", "--temperature", "0", "--json"]
    assert main(["generate", str(target_dir), *args]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", str(target_dir), "--draft", str(draft_dir), "--draft-k", "3", *args]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["ids"] == plain["ids"] and spec["text"] == plain["text"]
    assert 0 <= spec["timing"]["acceptance_rate"] <= 1 and spec["timing"]["target_passes"] >= 1
    assert (
        main(
            [
                "generate",
                str(target_dir),
                "--draft",
                str(draft_dir),
                "--prompt",
                "abc",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == plain["text"][:5].strip()
