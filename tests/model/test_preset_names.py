"""Preset names: one name a shape; a former name (in an old run's config.yaml) still read, with a warning."""

from __future__ import annotations

import logging

import pytest

from gptkit.config import PRESETS, ModelConfig, ModelSection, resolve_model
from gptkit.errors import ConfigError
from gptkit.presets import RENAMED


def test_the_story_models_are_named_by_size_and_the_old_name_is_read_with_a_warning(caplog):
    assert "llama-tiny" not in PRESETS and {"llama-15m", "llama-110m", "tiny-llama"} <= set(PRESETS)
    with caplog.at_level(logging.WARNING, logger="gptkit.config"):
        old = ModelConfig.preset("llama-tiny")
    assert old == ModelConfig.preset("llama-15m") and "now called 'llama-15m'" in caplog.text
    assert ModelConfig.load("llama-tiny") == old


def test_a_run_naming_a_former_preset_resolves_to_the_same_shape():
    old = resolve_model(ModelSection(preset="llama-tiny"), vocab_size=300)
    assert old == resolve_model(ModelSection(preset="llama-15m"), vocab_size=300)
    assert (old.n_layer, old.n_embd, old.n_kv_head, old.vocab_size) == (6, 288, 2, 300)


def test_every_former_name_points_at_a_preset_and_unknown_names_still_fail():
    assert all(new in PRESETS and old not in PRESETS for old, new in RENAMED.items())
    with pytest.raises(ConfigError, match="unknown preset 'llama-tiniest'"):
        ModelConfig.preset("llama-tiniest")
