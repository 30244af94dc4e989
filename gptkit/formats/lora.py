"""A LoRA directory: adapters and the base model they were trained on, named by path and weight fingerprint.

Layout:
    lora_config.json        {"format": "gptkit-lora", "format_version": 1, "base": absolute path of the base model,
                             "base_fingerprint": gptkit.adapters.fingerprint of its weights as stored,
                             "rank", "alpha", "dropout", "targets", "base_precision"}
    adapters.safetensors    "<module>.lora_A" (r, in) and "<module>.lora_B" (out, r) per adapted layer
    tokenizer_config.json   the base's, when it has one (its chat template serves the fine-tuned model)
A training checkpoint of a LoRA run is such a directory plus the optimiser, RNG and trainer files, so it holds the
adapters only: the base is read from its own directory and must still hash to the fingerprint.

Like every format module, this one imports no other format: the base is loaded by gptkit.loading, and the Hugging
Face module names the PEFT export needs (gptkit.formats.hf.hf_block_modules) are passed in by the caller.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as tensors_from_bytes
from torch import Tensor, nn

from gptkit.adapters import TARGETS, add_lora, load_lora_state, lora_state, merge_lora, peft_adapter, wrap_block_layers
from gptkit.atomic import atomic_write_text
from gptkit.errors import GptkitError
from gptkit.tensors import check_version, save_tensors
from gptkit.weights import check_finite

FORMAT = "gptkit-lora"
FORMAT_VERSION = 1
CONFIG_FILE = "lora_config.json"
WEIGHTS_FILE = "adapters.safetensors"
TOKENIZER_CONFIG = "tokenizer_config.json"
PRECISIONS = ("float32", "bfloat16", "int8")
CONFIG_LIMIT = 1 << 20  # bytes: a LoRA config is a dozen fields
_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}


def is_lora_dir(path: str | Path) -> bool:
    """Whether path is a LoRA directory (it holds lora_config.json)."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_lora_config(path: str | Path) -> dict[str, Any]:
    """The checked lora_config.json of a LoRA directory."""
    file = Path(path) / CONFIG_FILE
    try:
        data = json.loads(read_regular_file(file, CONFIG_LIMIT, "LoRA config"))
    except RecursionError:
        raise GptkitError(f"{file} nests too deep to be a LoRA config; save the fine-tune's config again") from None
    except ValueError as err:  # not UTF-8, or not JSON
        raise GptkitError(f"cannot read {file}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise GptkitError(f'{file} is not a gptkit LoRA config (no "format": "{FORMAT}")')
    check_version(data, file, FORMAT_VERSION)
    kinds = {
        "base": str,
        "base_fingerprint": str,
        "rank": int,
        "alpha": (int, float),
        "dropout": (int, float),
        "targets": str,
        "base_precision": str,
    }
    for key, kind in kinds.items():
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            raise GptkitError(f"{file}: field {key!r} is missing or malformed")
    if data["base_precision"] not in PRECISIONS:
        raise GptkitError(f"{file}: base_precision must be one of {', '.join(PRECISIONS)}")
    return data


def read_lora_weights(path: str | Path, limit: int | None = None) -> dict[str, Tensor]:
    """The adapters of a LoRA directory (on the CPU, as stored), their file checked first: a regular file of at
    most limit bytes (None: any size), whole and finite."""
    file = Path(path) / WEIGHTS_FILE
    data = read_regular_file(file, limit, "set of adapters for this base")
    try:
        state = tensors_from_bytes(data)
    except (SafetensorError, ValueError) as err:
        raise GptkitError(f"{file} is not a readable safetensors file (truncated or corrupt?): {err}") from None
    check_finite(state, str(file))
    return state


def read_regular_file(file: Path, limit: int | None, what: str) -> bytes:
    """file's bytes, read only once it is known to be a regular file of at most limit bytes (None: any size): a
    FIFO or a device opened as a file holds its reader for ever, or streams without end."""
    try:
        _check_regular(file, os.stat(file), limit, what)
        # Non-blocking: a FIFO swapped in since the stat cannot hold the open either; fstat then tells.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as err:
        raise GptkitError(f"cannot read {file}: {err.strerror or err}") from None
    with os.fdopen(fd, "rb") as f:
        _check_regular(file, os.fstat(f.fileno()), limit, what)
        try:
            data = f.read() if limit is None else f.read(limit + 1)
        except OSError as err:
            raise GptkitError(f"cannot read {file}: {err.strerror or err}") from None
    if limit is not None and len(data) > limit:  # it grew since the stat
        raise GptkitError(f"{file} is larger than the {limit:,} bytes a {what} may be")
    return data


def _check_regular(file: Path, info: os.stat_result, limit: int | None, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a file")
        raise GptkitError(f"{file} is {kind}, not a regular file; give a LoRA directory as gptkit wrote it")
    if limit is not None and info.st_size > limit:
        raise GptkitError(f"{file} is {info.st_size:,} bytes, more than the {limit:,} a {what} may be")


def base_chain(path: str | Path) -> list[Path]:
    """path, then each base down to the first that is not a LoRA directory (adapters may sit on merged adapters);
    a base that leads back into the chain is a GptkitError naming the chain, before anything loads."""
    chain = [Path(path)]
    seen = {chain[0].resolve()}
    while is_lora_dir(chain[-1]):
        base = Path(read_lora_config(chain[-1])["base"])
        if base.resolve() in seen:  # followed blindly, the bases load one another until Python's stack runs out
            loop = " -> ".join(str(p) for p in [*chain, base])
            raise GptkitError(
                f'the LoRA bases form a cycle ({loop}); set "base" in {chain[-1] / CONFIG_FILE} to '
                "the model the adapters were trained on"
            )
        seen.add(base.resolve())
        chain.append(base)
    return chain


def write_lora_dir(
    model: nn.Module, path: str | Path, settings: dict[str, Any], tokenizer_config: bytes | None = None
) -> Path:
    """Write model's adapters and settings (see the module docstring) into path; each file lands atomically."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(lora_state(model), path / WEIGHTS_FILE, metadata={"format": "pt"})
    if tokenizer_config is not None:
        atomic_write_text(path / TOKENIZER_CONFIG, tokenizer_config.decode("utf-8"))
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, **settings}
    atomic_write_text(path / CONFIG_FILE, json.dumps(data, indent=2) + "\n")  # last: it makes the directory one
    return path


def with_precision(model: nn.Module, precision: str) -> nn.Module:
    """The frozen base in the precision its adapters train over: float32, or the blocks' linear weights stored in
    bfloat16 or int8 (weight-only) and multiplied in float32; embeddings, norms and the head stay float (the fused
    loss reads the head's weight, and they are a small part of the weights). A mixture of experts' stacks (E, out, in)
    stay float32 under bfloat16 and become int8 stacks under int8 (gptkit.quantization.Int8Experts)."""
    # Here, not above: reading and writing adapter directories need neither the model's layers nor the quantised ones.
    from gptkit.moe import ExpertWeights
    from gptkit.quantization import Bfloat16Linear, quantize

    def stored(name: str, layer: nn.Module) -> nn.Module:
        return layer if isinstance(layer, ExpertWeights) else Bfloat16Linear(layer)

    if precision == "bfloat16":
        wrap_block_layers(model, TARGETS["all"], stored)
        return model
    if precision == "int8":
        return quantize(model, "int8", include_head=False)
    return model


def adapt(model: nn.Module, settings: dict[str, Any]) -> nn.Module:
    """The base in its training precision with fresh adapters as settings describe (load_lora_state fills them)."""
    model = with_precision(model, settings["base_precision"])
    return add_lora(model, settings["rank"], float(settings["alpha"]), float(settings["dropout"]), settings["targets"])


def merged(model: nn.Module, path: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The base model with a LoRA directory's adapters folded into its float weights, in eval mode: a LoRA
    directory used like a model directory (an int8-trained run's adapters too, over the float base)."""
    settings = read_lora_config(path)
    add_lora(model, settings["rank"], float(settings["alpha"]), float(settings["dropout"]), settings["targets"])
    device = next(model.parameters()).device
    state = {name: t.to(device) for name, t in read_lora_weights(path).items()}  # finite: NaN would spread
    load_lora_state(model, state, str(path))
    model = merge_lora(model)
    for param in model.parameters():
        param.requires_grad_(True)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def write_peft_dir(
    path: str | Path, out: str | Path, hf_modules: dict[str, list[tuple[str, int | None]]], fan_in_fan_out: bool
) -> Path:
    """Write a LoRA directory's adapters in PEFT's format, for its base as `gptkit convert --to-hf` exports it:
    peft.PeftModel.from_pretrained(that HF base, out) computes what the merged model does. hf_modules and
    fan_in_fan_out describe that HF base (gptkit.formats.hf.hf_block_modules of the base's config)."""
    settings = read_lora_config(path)
    config, tensors = peft_adapter(read_lora_weights(path), hf_modules, settings, settings["base"], fan_in_fan_out)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(tensors, out / PEFT_WEIGHTS, metadata={"format": "pt"})
    atomic_write_text(out / PEFT_CONFIG, json.dumps(config, indent=2) + "\n")
    return out
