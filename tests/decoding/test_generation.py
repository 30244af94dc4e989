import io
import json
import sys

import pytest
import torch
from helpers import VARIANTS
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import gptkit
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.decoding.api import complete, generate, generate_ids, stream
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.beam import beam_search
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import decode_one_token, prefill
from gptkit.errors import ConfigError, InputError
from gptkit.formats.hf import gpt_from_hf_model
from gptkit.formats.modeldir import save_model_dir
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.tokenizer import EOT, ByteTokenizer, CharTokenizer


def uncached_greedy(model: GPT, prompt: list[int], steps: int) -> list[int]:
    """The reference: a full forward pass per token, cropped to block_size for learned positions only."""
    ids, out = list(prompt), []
    for _ in range(steps):
        context = ids[-model.config.block_size :] if model.config.position == "learned" else ids
        token = int(model(torch.tensor([context], device=model.lm_head.weight.device))[0, -1].argmax())
        ids.append(token)
        out.append(token)
    return out


def char_tokenizer(eot: bool = True) -> CharTokenizer:
    """The 50 ids of the tiny test models: 49 characters and the end-of-text token, or 50 characters."""
    chars = "abcdefghijklmnopqrstuvwxyz.,;:!? \nABCDEFGHIJKLMNO" + ("" if eot else "P")
    return CharTokenizer(list(chars), specials=[EOT] if eot else [])


def tiny(name: str = "gpt2", device: torch.device | str = "cpu") -> GPT:
    return GPT(ModelConfig(**VARIANTS[name])).eval().to(device)


# ----- the cache and the two model calls -----


def test_cached_logits_equal_full_forward_every_step(variant_config, device):
    model = GPT(variant_config).eval().to(device)
    prompts = [torch.randint(0, 50, (6,)).tolist(), torch.randint(0, 50, (3,)).tolist()]
    cache = KVCache(variant_config, batch_size=2, max_len=16, device=device)
    ids = torch.zeros(2, 6, dtype=torch.long)
    ids[0], ids[1, :3] = torch.tensor(prompts[0]), torch.tensor(prompts[1])
    logits = prefill(model, ids.to(device), cache, torch.tensor([6, 3], device=device))
    positions = torch.tensor([6, 3], device=device)
    for step in range(10):  # row 0 fills all 16 positions
        for row, seq in enumerate(prompts):
            full = model(torch.tensor([seq], device=device))[0, -1]
            torch.testing.assert_close(logits[row], full, atol=1e-5, rtol=1e-5, msg=f"step {step} row {row}")
        if step == 9:
            break
        tokens = logits.argmax(-1)
        for row, seq in enumerate(prompts):
            seq.append(int(tokens[row]))
        logits = decode_one_token(model, tokens[:, None], cache, positions)
        positions = positions + 1


def test_greedy_equals_uncached_argmax_rollout(variant_config):
    model = GPT(variant_config).eval()
    prompt = torch.randint(0, 50, (5,)).tolist()
    # 5 + 20 tokens pass block_size 16: learned positions slide a window, the others keep every token.
    assert generate_ids(model, prompt, max_new_tokens=20, temperature=0) == uncached_greedy(model, prompt, 20)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_batched_equals_one_by_one(name, device):
    model = tiny(name, device)
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (1, 7, 14, 3)]
    batched = generate_ids(model, prompts, max_new_tokens=12, temperature=0)
    assert batched == [generate_ids(model, p, max_new_tokens=12, temperature=0) for p in prompts]
    assert batched == [uncached_greedy(model, p, 12) for p in prompts]


def test_long_prompt_keeps_last_block_size_tokens_for_learned_positions():
    model = tiny("gpt2")
    prompt = torch.randint(0, 50, (40,)).tolist()  # longer than block_size 16
    assert generate_ids(model, prompt, max_new_tokens=5, temperature=0) == uncached_greedy(model, prompt, 5)
    assert generate_ids(model, prompt, max_new_tokens=5, temperature=0) == generate_ids(
        model, prompt[-16:], max_new_tokens=5, temperature=0
    )


def test_training_mode_model_generates_without_dropout():
    model = GPT(ModelConfig(**VARIANTS["gpt2"], dropout=0.5)).train()
    prompt = [1, 2, 3]
    out = generate_ids(model, prompt, max_new_tokens=6, temperature=0)
    assert model.training and model.check_inputs  # restored afterwards
    assert out == uncached_greedy(model.eval(), prompt, 6)


# ----- sampling -----


def test_seeded_sampling_is_reproducible_and_samples_share_one_prefill(device):
    model = tiny("llama-gqa", device)
    prompt = [3, 1, 4, 1, 5]
    rules = dict(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.95, seed=11)
    assert generate_ids(model, prompt, **rules) == generate_ids(model, prompt, **rules)
    assert generate_ids(model, prompt, **rules) != generate_ids(model, prompt, **dict(rules, seed=12))
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape)))
    samples = generate_ids(model, prompt, num_samples=3, **rules)
    hook.remove()
    assert [shape for shape in calls if shape[1] > 1] == [(1, 5)]  # one prefill for three samples
    assert len({tuple(s) for s in samples}) == 3
    for j, sample_j in enumerate(samples):  # sample j draws with seed + j
        assert sample_j == generate_ids(model, prompt, **dict(rules, seed=11 + j))


def hf_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=50,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def hf_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def hf_new_tokens(hf, prompt: list[int], eos: int | None = None, **rules) -> list[list[int]]:
    """Hugging Face's generate, new tokens only, without the end-of-text token and its padding."""
    ids, mask = torch.tensor([prompt], device=hf.device), torch.ones(1, len(prompt), dtype=torch.long, device=hf.device)
    out = hf.generate(ids, attention_mask=mask, eos_token_id=eos, pad_token_id=0 if eos is None else eos, **rules)
    rows = out[:, len(prompt) :].tolist()
    if eos is not None:
        rows = [row[: row.index(eos)] if eos in row else row for row in rows]
    return rows


@pytest.mark.parametrize(
    "rules",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=10, top_p=0.9),
        dict(temperature=1.3, min_p=0.05, repetition_penalty=1.2),
    ],
)
def test_seeded_sampling_draws_hf_tokens(rules):
    # On CPU, seed s draws exactly what torch.manual_seed(s) + Hugging Face's do_sample=True draws.
    hf = hf_gpt2()
    model = gpt_from_hf_model(hf)
    prompt = [5, 7, 9, 11]
    for seed in (0, 1):
        torch.manual_seed(seed)
        [expected] = hf_new_tokens(hf, prompt, do_sample=True, max_new_tokens=12, **rules)
        assert generate_ids(model, prompt, max_new_tokens=12, seed=seed, **rules) == expected


def test_greedy_with_repetition_penalty_equals_hf(device):
    hf = hf_gpt2(1).to(device)
    model = gpt_from_hf_model(hf)
    prompt = [5, 7, 9, 11]
    [expected] = hf_new_tokens(hf, prompt, do_sample=False, max_new_tokens=15, repetition_penalty=1.5)
    assert generate_ids(model, prompt, max_new_tokens=15, temperature=0, repetition_penalty=1.5) == expected
    assert expected != hf_new_tokens(hf, prompt, do_sample=False, max_new_tokens=15)[0]


# ----- beam search -----


def test_one_beam_equals_greedy(variant_config):
    model = GPT(variant_config).eval()
    prompt = torch.randint(0, 50, (4,)).tolist()
    # 4 + 14 tokens pass block_size 16, so learned-position beams slide their window too.
    [(ids, reason)] = beam_search(model, prompt, SamplingParams(num_beams=1, max_new_tokens=14))
    assert ids == uncached_greedy(model, prompt, 14) and reason == "length"


@pytest.mark.parametrize(
    "arch, eos_at, early_stopping, length_penalty, num_samples, penalty",
    [
        ("gpt2", None, False, 1.0, 1, None),
        ("gpt2", 2, True, 1.0, 1, None),
        ("gpt2", 3, False, 2.0, 3, None),
        ("gpt2", 1, "never", 0.5, 2, 1.3),
        ("llama", 2, False, 1.0, 2, None),
    ],
)
def test_four_beams_equal_hf(arch, eos_at, early_stopping, length_penalty, num_samples, penalty):
    hf = hf_gpt2() if arch == "gpt2" else hf_llama()
    model = gpt_from_hf_model(hf)
    prompt = [11, 3, 27, 8, 40, 6]
    rules = dict(
        num_beams=4,
        max_new_tokens=12,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        repetition_penalty=penalty,
    )
    # The end-of-text token: one the beams actually produce, so that finished hypotheses are exercised.
    eos = None if eos_at is None else generate_ids(model, prompt, **rules)[eos_at]
    expected = hf_new_tokens(hf, prompt, eos, do_sample=False, num_return_sequences=num_samples, **rules)
    ours = generate_ids(model, prompt, eos_id=eos, num_samples=num_samples, **rules)
    assert (ours if num_samples > 1 else [ours]) == expected


# ----- ending: end-of-text token, stop strings, length -----


class Scripted(nn.Module):
    """A stand-in model that predicts the next token of a fixed script at every position (then end-of-text)."""

    def __init__(self, script: list[int], vocab_size: int, eos: int) -> None:
        super().__init__()
        self.config = ModelConfig(vocab_size=vocab_size, block_size=8, n_layer=1, n_head=1, n_embd=8, position="none")
        self.check_inputs = True
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the engine a device and dtype
        self.register_buffer("script", torch.tensor(script + [eos]))

    def forward(self, ids, cache=None, start_pos=0, trace=None, logits_at=None):
        T = ids.size(1)
        start = start_pos[:, None] if isinstance(start_pos, torch.Tensor) else torch.tensor([[start_pos]])
        nxt = self.script[(start + torch.arange(T) + 1).clamp(max=len(self.script) - 1)].expand(ids.size(0), T)
        logits = torch.zeros(ids.size(0), T, self.config.vocab_size).scatter(-1, nxt[..., None], 10.0)
        return logits if logits_at is None else logits[torch.arange(ids.size(0)), logits_at][:, None]


TEXT = "héllo wörld ✓ 😀 and more text"


@pytest.fixture
def scripted():
    tokenizer = ByteTokenizer()
    return Scripted(tokenizer.encode(TEXT), tokenizer.vocab_size, tokenizer.eos_id), tokenizer


def test_eos_stop_strings_and_length_end_generation(scripted):
    model, tokenizer = scripted
    prompt, rest = TEXT[:2], TEXT[2:]
    assert generate(model, tokenizer, prompt, max_new_tokens=200, temperature=0) == rest  # ended by EOS
    result = complete(model, [tokenizer.encode(prompt)], SamplingParams(max_new_tokens=200), tokenizer.eos_id)
    assert result.completions[0][0].finish_reason == "eos"
    assert tokenizer.eos_id not in result.completions[0][0].ids
    assert generate(model, tokenizer, prompt, max_new_tokens=4, temperature=0) == rest.encode()[:4].decode()
    assert generate(model, tokenizer, prompt, stop="ld", temperature=0) == "llo wör"
    assert generate(model, tokenizer, prompt, stop=["more", "😀", "xyz"], temperature=0) == "llo wörld ✓ "
    params = SamplingParams(stop=("✓",), temperature=0)
    result = complete(model, [tokenizer.encode(prompt)], params, tokenizer.eos_id, tokenizer.decode)
    [[completion]] = result.completions
    assert completion.finish_reason == "stop" and tokenizer.decode(completion.ids).endswith("✓")
    assert generate(model, tokenizer, prompt, stop="ld", num_beams=2) == "llo wör"  # beams stop too


def test_stream_never_splits_characters_and_joins_to_generate(scripted):
    model, tokenizer = scripted
    for stop in (None, "ld ✓", "more"):
        pieces = list(stream(model, tokenizer, TEXT[:2], max_new_tokens=200, temperature=0, stop=stop))
        assert "".join(pieces) == generate(model, tokenizer, TEXT[:2], max_new_tokens=200, temperature=0, stop=stop)
        assert len(pieces) > 5 and all(pieces) and not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == "llo wörld ✓ 😀 and "


def test_stream_and_generate_agree_when_sampling():
    model, tokenizer = tiny("untied-head-bias"), char_tokenizer()
    for seed in range(3):
        text = generate(model, tokenizer, "abc", max_new_tokens=30, seed=seed, stop="e")
        assert "".join(stream(model, tokenizer, "abc", max_new_tokens=30, seed=seed, stop="e")) == text
        assert "e" not in text


def test_stop_string_and_eos_on_a_real_model():
    model = tiny("llama-gqa")
    tokenizer = char_tokenizer()
    assert tokenizer.vocab_size == 50
    full = generate(model, tokenizer, "the", max_new_tokens=30, temperature=0)
    stop = full[6:8]
    assert generate(model, tokenizer, "the", max_new_tokens=30, temperature=0, stop=stop) == full[: full.find(stop)]
    ids = generate_ids(model, tokenizer.encode("the"), max_new_tokens=30, temperature=0)
    assert (
        generate_ids(model, tokenizer.encode("the"), max_new_tokens=30, temperature=0, eos_id=ids[5])
        == ids[: ids.index(ids[5])]
    )


# ----- the step-level engine (what a continuous-batching server drives) -----


def test_engine_rows_join_and_leave_between_steps(device):
    model = tiny("llama-gqa", device)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    a, b, c = Request([1, 2, 3, 4, 5, 6], greedy), Request([9, 8], greedy), Request([7, 7, 7, 1], greedy)
    engine = BatchEngine(model, batch_size=2, max_len=24)
    engine.add([a])
    engine.step()
    engine.step()
    engine.add([b])
    assert engine.rows == [a, b] and engine.free_rows == 0
    with pytest.raises(InputError, match="batch rows are free"):
        engine.add([c])
    finished: list[Request] = []
    while engine.rows:
        finished += engine.step()
        if finished == [a] and c.position == 0:  # a left first: b moved into row 0, and c takes row 1
            assert engine.rows == [b]
            engine.add([c])
            assert engine.rows == [b, c]
    assert a.generated == uncached_greedy(model, a.prompt, 8) and a.finish_reason == "length"
    assert b.generated == uncached_greedy(model, b.prompt, 8)
    assert c.generated == uncached_greedy(model, c.prompt, 8)
    assert finished == [a, b, c]


def test_bad_inputs_are_clear_errors():
    model = tiny("gpt2")
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        generate_ids(model, [1, 50], max_new_tokens=2)
    with pytest.raises(InputError, match="empty"):
        generate_ids(model, [], max_new_tokens=2)
    with pytest.raises(ConfigError, match="stop strings need"):
        generate_ids(model, [1, 2], stop="x")
    with pytest.raises(ConfigError, match="top_p"):
        generate_ids(model, [1, 2], top_p=0.0)
    with pytest.raises(InputError, match="no start"):
        generate(model, CharTokenizer(list("abc")), "")


def test_empty_prompt_starts_from_end_of_text_token():
    model = tiny("gpt2")
    tokenizer = char_tokenizer()
    text = generate(model, tokenizer, "", max_new_tokens=6, temperature=0)
    reference = uncached_greedy(model, [tokenizer.eos_id], 6) + [tokenizer.eos_id]
    assert text == tokenizer.decode(reference[: reference.index(tokenizer.eos_id)])


# ----- precision -----


def test_bf16_generation_runs_with_a_bf16_cache(device):
    model = tiny("llama-gqa", device).to(torch.bfloat16)
    prompt = [4, 8, 15, 16, 23]
    engine = BatchEngine(model, batch_size=1, max_len=20)
    assert engine.cache.keys[0].dtype == torch.bfloat16
    out = generate_ids(model, prompt, max_new_tokens=10, temperature=0)
    assert len(out) == 10 and all(0 <= t < 50 for t in out)
    # cached and uncached bf16 logits agree to bf16 precision
    cache = KVCache(model.config, 1, 16, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([prompt + out[:5]], device=device)
    logits = prefill(model, ids[:, :5], cache, torch.tensor([5], device=device))
    for t in range(5, 10):
        logits = decode_one_token(model, ids[:, t : t + 1], cache, torch.tensor([t], device=device))
        full = model(ids[:, : t + 1])[0, -1]
        torch.testing.assert_close(logits[0].float(), full.float(), atol=3e-2 * full.abs().max().item(), rtol=0)
    sampled = generate_ids(model, prompt, max_new_tokens=6, seed=1)
    assert sampled == generate_ids(model, prompt, max_new_tokens=6, seed=1)


# ----- the public API and the CLI -----


@pytest.fixture
def model_dir(tmp_path):
    tokenizer = char_tokenizer(eot=False)  # no end-of-text token: every call runs to max_new_tokens
    path = tmp_path / "model"
    save_model_dir(tiny("llama-gqa"), path, tokenizer)
    return path


def test_public_api_load_generate_stream(model_dir):
    model, tokenizer = gptkit.load(model_dir)
    text = gptkit.generate(model, tokenizer, "to be", max_new_tokens=12, seed=3)
    assert isinstance(text, str) and len(text) == 12  # one character per token, no end-of-text hit here
    assert "".join(gptkit.stream(model, tokenizer, "to be", max_new_tokens=12, seed=3)) == text
    batch = gptkit.generate(model, tokenizer, ["to be", "or"], max_new_tokens=5, temperature=0)
    assert batch == [gptkit.generate(model, tokenizer, p, max_new_tokens=5, temperature=0) for p in ["to be", "or"]]
    samples = gptkit.generate(model, tokenizer, "or", max_new_tokens=5, num_samples=2, seed=0)
    assert isinstance(samples, list) and len(samples) == 2
    ids = gptkit.generate_ids(model, [tokenizer.encode("to be")], max_new_tokens=12, seed=3)
    assert tokenizer.decode(ids[0]) == text


def test_cli_streams_text_and_reports_json(model_dir, capsys):
    model, tokenizer = gptkit.load(model_dir)
    expected = gptkit.generate(model, tokenizer, "to be", max_new_tokens=10, seed=5, top_k=10)
    assert (
        main(
            ["generate", str(model_dir), "--prompt", "to be", "--max-new-tokens", "10", "--seed", "5", "--top-k", "10"]
        )
        == 0
    )
    assert capsys.readouterr().out == expected + "\n" * (not expected.endswith("\n"))  # generate ends the line
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--prompt",
                "to be",
                "--max-new-tokens",
                "10",
                "--seed",
                "5",
                "--top-k",
                "10",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["text"] == expected and tokenizer.decode(report["ids"]) == expected
    assert report["prompt_ids"] == tokenizer.encode("to be") and report["finish_reason"] == "length"
    assert report["timing"]["prefill_tokens"] == 5 and report["timing"]["decode_tokens"] == 9
    assert report["timing"]["decode_tokens_per_s"] > 0 and report["timing"]["prefill_tokens_per_s"] > 0


def test_cli_reads_stdin_and_prompt_file(model_dir, capsys, monkeypatch, tmp_path):
    model, tokenizer = gptkit.load(model_dir)
    expected = gptkit.generate(model, tokenizer, "or not", max_new_tokens=6, temperature=0, stop="z")
    monkeypatch.setattr(sys, "stdin", io.StringIO("or not"))
    assert main(["generate", str(model_dir), "--max-new-tokens", "6", "--temperature", "0", "--stop", "z"]) == 0
    assert capsys.readouterr().out == expected + "\n" * (not expected.endswith("\n"))  # generate ends the line
    (tmp_path / "p.txt").write_text("or not")
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--prompt-file",
                str(tmp_path / "p.txt"),
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
                "--stop",
                "z",
                "--num-beams",
                "2",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["text"] == gptkit.generate(
        model, tokenizer, "or not", max_new_tokens=6, num_beams=2, stop="z"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "no start"),
        (["--prompt", "a", "--top-p", "1.5"], "top_p must be in"),
        (["--prompt", "a", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "a€"], "not in the char tokenizer's vocabulary"),
        (["--prompt", "a", "--num-beams", "2", "--top-k", "3"], "beam search is deterministic"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(model_dir, capsys, args, message):
    assert main(["generate", str(model_dir), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_cli_missing_model_dir_is_one_line_exit_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "a"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_says_when_a_learned_position_model_reads_only_the_prompts_end(tmp_path, capsys):
    path = save_model_dir(tiny("gpt2"), tmp_path / "model", char_tokenizer(eot=False))
    block = gptkit.load(path)[0].config.block_size
    assert main(["generate", str(path), "--prompt", "to be " * block, "--max-new-tokens", "2"]) == 0
    assert f"the prompt has {6 * block} tokens; this model (learned positions) reads only its last {block}" in (
        capsys.readouterr().err
    )
    assert main(["generate", str(path), "--prompt", "to be", "--max-new-tokens", "2"]) == 0
    assert "reads only" not in capsys.readouterr().err


def test_penalties_and_logit_bias_decode_as_their_formula_says():
    model = tiny("llama-gqa")
    prompt, steps = [3, 7, 7, 1], 12
    rules = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={5: 2.0, 9: -100})
    got = gptkit.generate_ids(model, prompt, max_new_tokens=steps, temperature=0, **rules)
    ids, counts = list(prompt), torch.zeros(model.config.vocab_size)
    with torch.no_grad():
        for _ in range(steps):  # the whole sequence each step, and OpenAI's formula written out
            logits = model(torch.tensor([ids]))[0, -1].float() - counts * 1.5 - (counts > 0).float() * 0.5
            logits[5] += 2.0
            logits[9] -= 100
            token = int(logits.argmax())
            ids.append(token)
            counts[token] += 1
    assert got == ids[len(prompt) :]
    assert 9 not in got and len(set(got)) > 1  # the penalties move it off a repeated token


def test_cli_takes_logit_bias_and_penalties(model_dir, capsys):
    _, tokenizer = gptkit.load(model_dir)
    z = tokenizer.encode("z")[0]
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--prompt",
                "to be",
                "--max-new-tokens",
                "5",
                "--seed",
                "1",
                "--logit-bias",
                f"{z}=100",
                "--frequency-penalty",
                "0.5",
                "--presence-penalty",
                "0.1",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "zzzzz\n"  # generate ends the line
    with pytest.raises(SystemExit) as usage:
        main(["generate", str(model_dir), "--prompt", "to be", "--logit-bias", "z=1"])
    assert usage.value.code == 2 and "TOKEN_ID=BIAS" in capsys.readouterr().err
