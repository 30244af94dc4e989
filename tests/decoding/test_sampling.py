import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gptkit.decoding.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    min_p_filter,
    process_logits,
    sample,
    top_k_filter,
    top_p_filter,
)
from gptkit.errors import ConfigError

V = 97
NO_IDS = torch.zeros(4, 1, dtype=torch.long)  # the warpers ignore input_ids


def random_logits(seed: int, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * (1 + seed % 4)  # flat and peaked distributions


def kept(logits: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 10, 96, 97, 500])
def test_top_k_keeps_hf_set(seed, k):
    logits = random_logits(seed)
    expected = TopKLogitsWarper(top_k=k)(NO_IDS, logits.clone())
    assert torch.equal(kept(top_k_filter(logits, k)), kept(expected))
    assert (kept(top_k_filter(logits, k)).sum(-1) == min(k, V)).all()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p", [1e-4, 0.1, 0.5, 0.9, 0.999, 1.0])
def test_top_p_keeps_hf_set_and_at_least_one(seed, p):
    logits = random_logits(seed)
    ours = top_p_filter(logits, p)
    assert torch.equal(kept(ours), kept(TopPLogitsWarper(top_p=p)(NO_IDS, logits.clone())))
    assert (kept(ours).sum(-1) >= 1).all()
    assert torch.equal(ours[kept(ours)], logits[kept(ours)])  # kept logits are untouched


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_keeps_hf_set(seed, min_p):
    logits = random_logits(seed)
    expected = MinPLogitsWarper(min_p=min_p)(NO_IDS, logits.clone())
    assert torch.equal(kept(min_p_filter(logits, min_p)), kept(expected))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_hf(temperature):
    logits = random_logits(1)
    expected = TemperatureLogitsWarper(temperature)(NO_IDS, logits.clone())
    torch.testing.assert_close(apply_temperature(logits, temperature), expected)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    logits = random_logits(2)
    ids = torch.randint(0, V, (4, 30), generator=torch.Generator().manual_seed(3))  # with repeats
    seen = torch.zeros(4, V, dtype=torch.bool).scatter(1, ids, True)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, penalty), expected)
    assert not torch.equal(expected, logits)


@pytest.mark.parametrize("seed", range(4))
def test_full_pipeline_matches_hf_order(seed):
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.2)
    logits = random_logits(seed)
    ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(seed))
    seen = torch.zeros(4, V, dtype=torch.bool).scatter(1, ids, True)
    hf = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.2),
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(40),
            TopPLogitsWarper(0.8),
            MinPLogitsWarper(0.05),
        ]
    )
    expected = hf(ids, logits.clone())
    ours = process_logits(logits, params, seen)
    assert torch.equal(kept(ours), kept(expected))
    torch.testing.assert_close(ours[kept(ours)], expected[kept(expected)])


def test_greedy_is_argmax_after_repetition_penalty():
    logits = random_logits(0)
    assert torch.equal(sample(logits, None, SamplingParams(temperature=0)), logits.argmax(-1))
    seen = torch.zeros(4, V, dtype=torch.bool)
    seen[torch.arange(4), logits.argmax(-1)] = True
    penalised = sample(logits, None, SamplingParams(temperature=0, repetition_penalty=100.0), seen)
    assert (penalised != logits.argmax(-1)).all()


def test_sampling_is_seeded_and_stays_in_the_kept_set():
    logits = random_logits(3, rows=64)
    params = SamplingParams(top_k=5, top_p=0.9)
    draw = lambda seed: sample(logits, torch.Generator().manual_seed(seed), params)  # noqa: E731
    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))
    allowed = kept(process_logits(logits, params))
    for seed in range(5):
        tokens = draw(seed)
        assert allowed[torch.arange(64), tokens].all()


def test_sampling_follows_the_softmax():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).repeat(40_000, 1)
    tokens = sample(logits, torch.Generator().manual_seed(0), SamplingParams(temperature=1.0))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.01, rtol=0)
    hot = sample(logits, torch.Generator().manual_seed(0), SamplingParams(temperature=0.25))
    assert (hot == 3).float().mean() > 0.6  # low temperature sharpens towards the top token


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
        (dict(top_p=1.5), "top_p must be in \\(0, 1\\]"),
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_k=0), "top_k must be >= 1"),
        (dict(min_p=1.2), "min_p must be in \\[0, 1\\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in \\[0.01, 100\\]"),
        (dict(repetition_penalty=1e-300), "repetition_penalty must be in"),
        (dict(repetition_penalty=1e300), "repetition_penalty must be in"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(num_samples=2.5), "num_samples must be an integer"),
        (dict(stop=["ok", ""]), "stop string"),
        (dict(num_beams=2, top_k=5), "beam search is deterministic"),
        (dict(num_beams=2, num_samples=3), "at most num_beams"),
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(seed=-1), "seed must be >= 0"),
    ],
)
def test_bad_params_name_the_field(bad, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**bad)


EXTREME_TEMPERATURES = [5e-324, 1e-300, 1e-45, 9.9e-6, 1e-5, 1e-3, 1.0, 1e6, 1e300, 1.7e308]


@pytest.mark.parametrize("temperature", EXTREME_TEMPERATURES)
@pytest.mark.parametrize("penalty", [None, 0.01, 100.0])
def test_no_accepted_value_makes_a_nan(temperature, penalty):
    # Logits as large as a model's can get in fp32 (and a row that is all one value).
    logits = torch.cat(
        [torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 1e4, torch.full((1, 50), -3e4)]
    )
    seen = torch.zeros(4, 50, dtype=torch.bool)
    seen[:, :25] = True
    for filters in ({}, {"top_k": 3}, {"top_p": 1e-9}, {"min_p": 1.0}):
        params = SamplingParams(temperature=temperature, repetition_penalty=penalty, **filters)
        processed = process_logits(logits, params, seen)
        assert not processed.isnan().any() and (processed.amax(dim=-1) > float("-inf")).all()
        tokens = sample(logits, torch.Generator().manual_seed(1), params, seen)
        assert ((tokens >= 0) & (tokens < 50)).all()
    assert SamplingParams(temperature=temperature).greedy == (temperature < 1e-5)


def test_params_defaults_declared_once_and_stop_normalised():
    params = SamplingParams(stop="\n")
    assert params.stop == ("\n",)
    assert SamplingParams(stop=None).stop == ()
    assert {f.name for f in dataclasses.fields(SamplingParams)} >= {
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "stop",
        "seed",
        "num_samples",
        "num_beams",
        "length_penalty",
        "early_stopping",
    }


def test_openai_penalties_and_logit_bias_follow_their_formulas():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    counts = torch.tensor([[0, 1, 3, 0, 0, 0, 0, 0, 0, 2], [0] * 9 + [1]], dtype=torch.float)
    params = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=-1.5, logit_bias={3: 7.0, 0: -100})
    got = process_logits(logits, params, counts=counts)
    want = logits.clone()
    for b in range(2):
        for v in range(10):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
            want[b, v] -= counts[b, v] * 0.5 + float(counts[b, v] > 0) * -1.5
        want[b, 3] += 7.0
        want[b, 0] -= 100
    torch.testing.assert_close(got, want)
    assert SamplingParams(logit_bias=[(3, 7.0)]).logit_bias == ((3, 7),)
    with pytest.raises(ConfigError, match="frequency_penalty must be in \\[-2, 2\\]"):
        SamplingParams(frequency_penalty=2.5)
    with pytest.raises(ConfigError, match="logit_bias values must be in \\[-100, 100\\]"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ConfigError, match="beam search does not apply"):
        SamplingParams(num_beams=2, presence_penalty=1.0)
