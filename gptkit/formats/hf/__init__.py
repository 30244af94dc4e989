"""Conversion between gptkit models and Hugging Face GPT-2 / Llama-family checkpoints, in both directions.

Llama-style models export as Llama, or as Qwen3 with qk_norm; GPT-2 and Llama, Mistral, Qwen2 and Qwen3 import.

The package is split by concern: layouts.py (where each gptkit tensor lives in an HF state dict), config_map.py
(HF config.json <-> ModelConfig, family defaults and refusals), reading.py (HF directories and models -> GPT) and
writing.py (GPT -> HF directories and models). Whatever a checkpoint holds that gptkit cannot compute exactly is
refused with a ConversionError naming the setting, never approximated.

transformers itself is not needed for directories; only gpt_from_hf_model / hf_model_from_gpt import it.
"""

from __future__ import annotations

from gptkit.formats.hf.config_map import (
    FAMILY_DEFAULTS,
    HINT_FIELDS,
    HINT_KEY,
    config_from_hf,
    config_with_hint,
    detect_layout,
    hf_config_from_gptkit,
)
from gptkit.formats.hf.layouts import LAYOUTS, BlockTensor, ConversionError, Layout, Rule, weight_rules
from gptkit.formats.hf.reading import (
    BIN_FILE,
    BIN_INDEX_FILE,
    GENERATION_CONFIG_FILE,
    gpt_from_hf_model,
    hf_eos_ids,
    load_hf,
    model_from_hf_state,
    open_weights,
    state_from_hf,
)
from gptkit.formats.hf.writing import (
    CLASSIFIER_ARCHITECTURES,
    export_hf,
    hf_block_modules,
    hf_checkpoint,
    hf_classifier_checkpoint,
    hf_model_from_gpt,
)

__all__ = [
    "BIN_FILE",
    "BIN_INDEX_FILE",
    "CLASSIFIER_ARCHITECTURES",
    "FAMILY_DEFAULTS",
    "GENERATION_CONFIG_FILE",
    "HINT_FIELDS",
    "HINT_KEY",
    "LAYOUTS",
    "BlockTensor",
    "ConversionError",
    "Layout",
    "Rule",
    "config_from_hf",
    "config_with_hint",
    "detect_layout",
    "export_hf",
    "gpt_from_hf_model",
    "hf_block_modules",
    "hf_checkpoint",
    "hf_classifier_checkpoint",
    "hf_config_from_gptkit",
    "hf_eos_ids",
    "hf_model_from_gpt",
    "load_hf",
    "model_from_hf_state",
    "open_weights",
    "state_from_hf",
    "weight_rules",
]
