"""DecodeOptions: one typed bundle of the decoding path, taken by every entry point of gptkit.decoding.api."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.decoding.api import complete, generate_ids
from gptkit.decoding.options import DecodeOptions, split_overrides
from gptkit.decoding.sampling import SamplingParams
from gptkit.errors import ConfigError
from gptkit.model import GPT


def tiny_model() -> GPT:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=32, block_size=64, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    return GPT(config).eval()


def test_overrides_go_to_the_dataclass_that_names_them():
    params, options = split_overrides(None, None, {"max_new_tokens": 3, "draft_k": 2, "compile": True})
    assert params == SamplingParams(max_new_tokens=3)
    assert options == DecodeOptions(compile=True, draft_k=2)
    assert split_overrides(None, DecodeOptions(kv_cache="int8"), {"compile": True})[1] == DecodeOptions(
        True, None, 4, "int8"
    )


def test_an_unknown_keyword_names_itself_and_both_lists():
    with pytest.raises(ConfigError, match="'draftk'.*decoding options are: compile, draft, draft_k"):
        split_overrides(None, None, {"draftk": 2})


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DecodeOptions().compile = True  # type: ignore[misc]


def test_options_and_keywords_decode_alike():
    model = tiny_model()
    prompt = [1, 2, 3, 4]
    plain = generate_ids(model, prompt, max_new_tokens=8, temperature=0)
    assert generate_ids(model, prompt, max_new_tokens=8, temperature=0, draft=model, draft_k=2) == plain
    assert generate_ids(model, prompt, max_new_tokens=8, temperature=0, options=DecodeOptions(draft=model)) == plain
    result = complete(model, [prompt], SamplingParams(max_new_tokens=8, temperature=0), options=DecodeOptions())
    assert result.completions[0][0].ids == plain
