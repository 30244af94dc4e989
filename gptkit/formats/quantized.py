"""gptkit's model directory holding a quantised model: config.json says "quantization": "int8" or "int4", and
model.safetensors holds each layer's int8 weights with their per-row scales (gptkit.quantization.Int8Linear) or
packed Q4_0 weights (uint8) with their per-block fp16 scales (Int4Linear), a mixture of experts' stacks the same per
expert (Int8Experts, Int4Experts); the weight's dtype says which.

It is a gptkit directory plus a field, so its config.json is read and written by gptkit.tensors, which the float
directory (gptkit.formats.modeldir) uses too; this module imports no other format."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from gptkit.errors import ConfigError
from gptkit.model import GPT
from gptkit.moe import ExpertWeights
from gptkit.quantization import (
    QUANTIZATION_METHODS,
    Int4Experts,
    Int4Linear,
    Int8Experts,
    Int8Linear,
    probe_kernels,
    quantization_method,
)
from gptkit.tensors import (
    WEIGHTS_FILE,
    ModelDirError,
    load_tensors,
    read_config_json,
    read_model_config,
    save_tensors,
    weight_files,
    write_config_and_tokenizer,
)
from gptkit.tokenizer import Tokenizer
from gptkit.weights import check_finite


def save_quantized_dir(model: GPT, path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write a quantised model as a gptkit model directory that load_quantized_dir (and gptkit.loading.load) read back."""
    base = getattr(model, "_orig_mod", model)
    method = quantization_method(base)
    if method is None:
        raise ConfigError("the model is not quantised; call gptkit.quantize(model, 'int8') (or 'int4') first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(base.state_dict(), path / WEIGHTS_FILE, metadata={"format": "pt", "quantization": method})
    write_config_and_tokenizer(path, base.config, tokenizer, {"quantization": method})
    return path


def quantization_of(path: str | Path) -> str | None:
    """The quantisation a gptkit model directory was saved with ("int8", "int4"), or None for a float one."""
    method = read_config_json(path).get("quantization")
    if method is not None:
        if method not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"{path}: unknown quantization {method!r}; gptkit knows {', '.join(QUANTIZATION_METHODS)}"
            )
    return method


def load_quantized_dir(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GPT:
    """Build the quantised GPT saved by save_quantized_dir directly from its quantised tensors, in eval mode."""
    path = Path(path)
    method = quantization_of(path)
    if method is None:
        raise ModelDirError(f"{path} holds a float model; load it with gptkit.load and quantise it")
    config = read_model_config(path)
    device = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, Tensor] = {}
    for file in weight_files(path):
        state.update(load_tensors(file, device))
    # Floats converted (or copied; never the fp16 block scales of int4), integer weights copied: out of the memory
    # map into aligned, writable memory.
    state = {
        name: t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != torch.float16 else t.clone()
        for name, t in state.items()
    }
    with torch.device("meta"):
        model = GPT(config)
        _quantized_layers(model, state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ModelDirError(f"{path}: tensor {name!r} is {'missing' if missing else 'unexpected'} for this config")
    kept = (torch.int8, torch.uint8, torch.float16)  # quantised weights and Q4_0 scales keep their dtype
    for name, tensor in state.items():
        want = expected[name]
        wrong_dtype = (tensor.dtype in kept or want.dtype in kept) and tensor.dtype != want.dtype
        if tuple(tensor.shape) != tuple(want.shape) or wrong_dtype:
            raise ModelDirError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} / dtype {tensor.dtype}, "
                f"the config needs {tuple(expected[name].shape)} / {expected[name].dtype}"
            )
    check_finite(state, str(path))  # the int4 blocks' fp16 scales too
    model.load_state_dict(state, strict=True, assign=True)
    probe_kernels(device.type)
    return model.eval()


def _quantized_layers(model: GPT, state: dict[str, Tensor]) -> None:
    """Replace each nn.Linear of model by the layer its saved weight's dtype names: int8 Int8Linear, uint8
    Int4Linear, a float one stays (a model read from a GGUF file may keep some layers in float); each expert stack
    (ExpertWeights) alike by Int8Experts or Int4Experts."""
    layers = {torch.int8: Int8Linear, torch.uint8: Int4Linear}
    stacks = {torch.int8: Int8Experts, torch.uint8: Int4Experts}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            weight = state.get(f"{name}.{child_name}.weight".lstrip("."))
            if weight is None:
                continue
            if isinstance(child, nn.Linear) and weight.dtype in layers:
                layer = layers[weight.dtype](child.in_features, child.out_features, child.bias is not None)
                setattr(module, child_name, layer)
            elif isinstance(child, ExpertWeights) and weight.dtype in stacks:
                n, out, width = child.weight.shape
                setattr(module, child_name, stacks[weight.dtype](n, width, out, child.bias is not None))
