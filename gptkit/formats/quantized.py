"""gptkit's model directory holding an int8-quantised model: config.json says "quantization": "int8", and
model.safetensors holds the int8 weights with their per-row scales (gptkit.quantization.Int8Linear)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gptkit.errors import ConfigError
from gptkit.formats.modeldir import (
    WEIGHTS_FILE,
    ModelDirError,
    load_tensors,
    read_config_json,
    read_model_config,
    save_tensors,
    weight_files,
    write_config_and_tokenizer,
)
from gptkit.model import GPT
from gptkit.quantization import METHODS, Int8Linear, is_quantized, probe_kernels, swap_linears


def save_quantized_dir(model: GPT, path: str | Path, tokenizer: Any | None = None) -> Path:
    """Write a quantised model as a gptkit model directory that load_quantized_dir (and gptkit.loading.load) read back."""
    base = getattr(model, "_orig_mod", model)
    if not is_quantized(base):
        raise ConfigError("the model is not quantised; call gptkit.quantize(model, 'int8') first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(base.state_dict(), path / WEIGHTS_FILE, metadata={"format": "pt", "quantization": "int8"})
    write_config_and_tokenizer(path, base.config, tokenizer, {"quantization": "int8"})
    return path


def quantization_of(path: str | Path) -> str | None:
    """The quantisation a gptkit model directory was saved with ("int8"), or None for a float one."""
    method = read_config_json(path).get("quantization")
    if method is not None:
        if method not in METHODS:
            raise ConfigError(f"{path}: unknown quantization {method!r}; gptkit knows {', '.join(METHODS)}")
    return method


def load_quantized_dir(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GPT:
    """Build the quantised GPT saved by save_quantized_dir directly from its int8 tensors, in eval mode."""
    path = Path(path)
    method = quantization_of(path)
    if method is None:
        raise ModelDirError(f"{path} holds a float model; load it with gptkit.load and quantise it")
    config = read_model_config(path)
    device = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, Tensor] = {}
    for file in weight_files(path):
        state.update(load_tensors(file, device))
    # Floats converted (or copied), int8 weights copied: out of the memory map into aligned, writable memory.
    state = {name: t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
             for name, t in state.items()}  # fmt: skip
    with torch.device("meta"):
        model = GPT(config)
        swap_linears(model, lambda lin: Int8Linear(lin.in_features, lin.out_features, lin.bias is not None))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ModelDirError(f"{path}: tensor {name!r} is {'missing' if missing else 'unexpected'} for this config")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape) or (expected[name].dtype == torch.int8) != (
            tensor.dtype == torch.int8
        ):
            raise ModelDirError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} / dtype {tensor.dtype}, "
                                f"the config needs {tuple(expected[name].shape)} / {expected[name].dtype}")  # fmt: skip
    model.load_state_dict(state, strict=True, assign=True)
    probe_kernels(device.type)
    return model.eval()
