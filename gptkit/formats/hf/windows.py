"""Sliding-window attention between a Hugging Face config.json and ModelConfig (sliding_window, layer_types).

Each family says in its own keys which layers attend in a window (families.Family.windows):
- all: Mistral and Phi-3, one sliding_window for every layer (null: none);
- qwen: Qwen2 and Qwen3, a window only with use_sliding_window, in the layers from max_window_layers on unless
  layer_types says otherwise;
- layer_types: Gemma 2 and 3, layer_types (by default Gemma 2 alternates from a sliding layer 0, Gemma 3 puts a
  full layer after every five sliding ones);
- smollm3: SmolLM3, a window only with use_sliding_window, in the layers layer_types names (by default the NoPE ones).
transformers' window W lets query i attend key j when i - W < j <= i, as gptkit's sliding_window does.
"""

from __future__ import annotations

from typing import Any

from gptkit.config import ModelConfig
from gptkit.formats.hf.extras import no_rope_flags
from gptkit.formats.hf.families import Family
from gptkit.formats.hf.layouts import ConversionError

FULL, SLIDING = "full_attention", "sliding_attention"
OURS = {FULL: "full", SLIDING: "sliding"}


def _hf_layer_types(hf: dict[str, Any], family: Family, get: Any, window: int | None, n_layer: int) -> list[Any]:
    """config.json's layer_types, or the list the family's config class derives when it has none."""
    if hf.get("layer_types") is not None:
        return hf["layer_types"]
    if family.windows == "qwen":
        start = get("max_window_layers")
        return [SLIDING if window is not None and i >= start else FULL for i in range(n_layer)]
    if family.windows == "smollm3":
        rope = no_rope_flags(hf, get, n_layer)
        return [SLIDING if window is not None and not rope[i] else FULL for i in range(n_layer)]
    period = family.window_period or get("sliding_window_pattern")
    return [SLIDING if (i + 1) % period else FULL for i in range(n_layer)]


def read_windows(hf: dict[str, Any], family: Family, get: Any, n_layer: int, source: str) -> dict[str, Any]:
    """The ModelConfig fields sliding_window and layer_types (None unless the layers differ) of an HF config."""
    if family.windows == "none":
        return {"sliding_window": None, "layer_types": None}
    window = get("sliding_window")
    if family.windows in ("qwen", "smollm3") and not get("use_sliding_window"):
        window = None  # their config classes switch the window off whatever sliding_window says
    if family.windows == "all":
        return {"sliding_window": window, "layer_types": None}
    types = _hf_layer_types(hf, family, get, window, n_layer)
    if not isinstance(types, list) or len(types) != n_layer:
        raise ConversionError(f"{source}: layer_types must list one type per layer ({n_layer}); got {types!r}")
    for entry in types:
        if entry not in OURS:
            why = "gptkit's layers attend in full or in a sliding window"
            raise ConversionError(f"{source}: layer type {entry!r} is not supported: {why}")
    ours = [OURS[entry] for entry in types]
    if "sliding" not in ours:
        return {"sliding_window": None, "layer_types": None}
    if window is None:
        raise ConversionError(
            f"{source}: layer_types names sliding layers but no window is set; set sliding_window"
            + (" and use_sliding_window" if family.windows in ("qwen", "smollm3") else "")
        )
    return {"sliding_window": window, "layer_types": None if "full" not in ours else ours}


def write_windows(config: ModelConfig, family: Family) -> dict[str, Any]:
    """The config.json entries saying which layers of config attend in a window, or a ConversionError."""
    windows = [config.layer_window(i) for i in range(config.n_layer)]
    sliding = [w is not None for w in windows]
    window = config.sliding_window if any(sliding) else None
    if family.windows == "none":
        if window is not None:
            raise ConversionError(
                f"sliding_window {window} cannot be exported as {family.model_type}: its attention is full causal "
                "(mistral, qwen2, qwen3, gemma2, gemma3_text, phi3 and smollm3 have windows)"
            )
        return {}
    if family.windows == "all":
        if any(sliding) and not all(sliding):
            raise ConversionError(
                f"layer_types cannot be exported as {family.model_type}: its window applies to every layer "
                "(qwen2, qwen3, gemma2, gemma3_text and smollm3 window some layers)"
            )
        return {"sliding_window": window}
    types = [SLIDING if s else FULL for s in sliding]
    if window is None and family.windows == "layer_types":
        window = family.defaults["sliding_window"]  # Gemma builds its sliding mask even when no layer uses it
    entries: dict[str, Any] = {"sliding_window": window, "layer_types": types}
    if family.windows in ("qwen", "smollm3"):
        entries["use_sliding_window"] = window is not None
    if family.windows == "qwen":
        entries["max_window_layers"] = next((i for i, s in enumerate(sliding) if s), config.n_layer)
    return entries
