"""Conversion between gptkit models and Hugging Face checkpoints, in both directions.

Families: GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text), Phi-3, SmolLM3, OLMo 2, GPT-NeoX and Granite
import and export; an export writes the family named, or the one the model's settings call for (export_family).

The package is split by concern: layouts.py (where each gptkit tensor lives in an HF state dict), families.py (each
family's config keys, fixed settings and defaults), config_map.py (HF config.json <-> ModelConfig and refusals) with
rope.py, windows.py and extras.py beside it, reading.py (HF directories and models -> GPT) and writing.py (GPT -> HF
directories and models). Whatever a checkpoint holds that gptkit cannot compute exactly is
refused with a ConversionError naming the setting, never approximated.

transformers itself is not needed for directories; only gpt_from_hf_model / hf_model_from_gpt import it.
"""

from __future__ import annotations

from gptkit.formats.hf.config_map import (
    HINT_FIELDS,
    HINT_KEY,
    config_from_hf,
    config_with_hint,
    detect_family,
    detect_layout,
    export_family,
    hf_config_from_gptkit,
)
from gptkit.formats.hf.families import FAMILIES, FAMILY_DEFAULTS, Family
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
    "FAMILIES",
    "FAMILY_DEFAULTS",
    "GENERATION_CONFIG_FILE",
    "HINT_FIELDS",
    "HINT_KEY",
    "LAYOUTS",
    "BlockTensor",
    "ConversionError",
    "Family",
    "Layout",
    "Rule",
    "config_from_hf",
    "config_with_hint",
    "detect_family",
    "detect_layout",
    "export_family",
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
