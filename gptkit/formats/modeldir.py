"""The gptkit model directory: config.json + model.safetensors (+ tokenizer files), saved atomically, never pickled.

Layout:
    config.json                     {"format": "gptkit", "format_version": 1, "model": {ModelConfig fields},
                                     "generation": {"eos_ids": [...], when more than the tokenizer's own}}
    model.safetensors               the weights (or model-0000x-of-0000y.safetensors + model.safetensors.index.json)
    tokenizer files                 whatever the tokenizer's save(dir) writes (see gptkit.tokenizer)
A tied LM head is stored once, as tok_emb.weight.

What this module owns is the float model in such a directory: writing it and building it back. The directory's
config.json (shared with the quantised directory of gptkit.formats.quantized), the safetensors I/O and the file
names (Hugging Face's, which gptkit's directories share) live in gptkit.tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gptkit.model import GPT
from gptkit.tensors import (
    WEIGHTS_FILE,
    load_tensors,
    read_config_json,
    read_model_config,
    save_tensors,
    weight_files,
    write_config_and_tokenizer,
)
from gptkit.tokenizer import Tokenizer, tokenizer_or_none
from gptkit.weights import load_state_into, model_state


def save_model_dir(model: GPT, path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write model (and its tokenizer, if given) as a gptkit model directory; each file lands atomically."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    module = getattr(model, "_orig_mod", model)
    save_tensors(model_state(module), path / WEIGHTS_FILE, metadata={"format": "pt"})
    write_config_and_tokenizer(path, module.config, tokenizer)
    return path


def load_model_dir(path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> GPT:
    """Build the GPT saved in a gptkit model directory, in eval mode, without holding two copies of the weights."""
    path = Path(path)
    config = read_model_config(path)
    device = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        state.update(load_tensors(file, device))
    if dtype is not None:
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    with torch.device("meta"):
        model = GPT(config)
    return load_state_into(model, state, str(path)).eval()


def load_model_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer a gptkit model directory holds, with the model's own end ids; None when it holds none."""
    tokenizer = tokenizer_or_none(path)
    if tokenizer is None:
        return None
    eos_ids = read_config_json(path).get("generation", {}).get("eos_ids")
    if eos_ids:
        tokenizer.add_eos_ids(eos_ids)
    return tokenizer
