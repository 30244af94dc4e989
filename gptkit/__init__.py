"""gptkit: train, evaluate, inspect, sample from and serve GPT-style decoder-only language models."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the module each lives in; imported on first use so that `gptkit --help` stays fast.
_EXPORTS = {
    "ModelConfig": "gptkit.config",
    "PRESETS": "gptkit.config",
    "GPT": "gptkit.model",
    "Trace": "gptkit.model",
    "next_token_loss": "gptkit.loss",
    "linear_cross_entropy": "gptkit.loss",
    "KVCache": "gptkit.kv_cache",
    "param_breakdown": "gptkit.accounting",
    "forward_flops_per_token": "gptkit.accounting",
    "training_flops_per_token": "gptkit.accounting",
    "kv_cache_bytes": "gptkit.accounting",
    "GptkitError": "gptkit.errors",
    "load": "gptkit.loading",
    "save_model_dir": "gptkit.formats.modeldir",
    "load_model_dir": "gptkit.formats.modeldir",
    "load_tokenizer": "gptkit.tokenizer",
    "generate": "gptkit.decoding.api",
    "generate_ids": "gptkit.decoding.api",
    "stream": "gptkit.decoding.api",
    "SamplingParams": "gptkit.decoding.sampling",
    "DecodeOptions": "gptkit.decoding.options",
    "quantize": "gptkit.quantization",
    "save_quantized_dir": "gptkit.formats.quantized",
    "load_hf": "gptkit.formats.hf",
    "export_hf": "gptkit.loading",
    "gpt_from_hf_model": "gptkit.formats.hf",
    "hf_model_from_gpt": "gptkit.formats.hf",
    "icl_score": "gptkit.observe.measures",
    "position_losses": "gptkit.observe.measures",
    "induction_scores": "gptkit.observe.measures",
    "induction_test": "gptkit.observe.measures",
    "chance_induction_score": "gptkit.observe.measures",
    "logit_lens": "gptkit.observe.measures",
    "head_contributions": "gptkit.observe.measures",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gptkit' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
