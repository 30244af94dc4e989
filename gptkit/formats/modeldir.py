"""The gptkit model directory: config.json + model.safetensors (+ tokenizer files), saved atomically, never pickled.

Layout:
    config.json                     {"format": "gptkit", "format_version": 1, "model": {ModelConfig fields},
                                     "generation": {"eos_ids": [...], when more than the tokenizer's own}}
    model.safetensors               the weights (or model-0000x-of-0000y.safetensors + model.safetensors.index.json)
    tokenizer files                 whatever the tokenizer's save(dir) writes (see gptkit.tokenizer)
A tied LM head is stored once, as tok_emb.weight.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from gptkit.atomic import atomic_write, atomic_write_text, fsync_dir  # noqa: F401 (re-exported)
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError, GptkitError
from gptkit.model import GPT
from gptkit.weights import WeightsError, check_finite, load_state_into  # noqa: F401 (re-exported)

FORMAT = "gptkit"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ModelDirError(WeightsError):
    """A model directory that is missing, incomplete or corrupt; the message names the file or tensor."""


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors as one safetensors file, atomically; a failed write (a full disk, say) is an OSError."""
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}

    def write(tmp: Path) -> None:
        try:
            save_file(contiguous, str(tmp), metadata=metadata)
        except SafetensorError as err:  # how safetensors reports any failed write: back to the OSError it was
            raise _os_error(err, path) from None

    atomic_write(path, write)


def _os_error(err: SafetensorError, path: Path) -> OSError:
    """The OSError inside safetensors' error text ("... (os error 28)" or "... code: 28, ..."), else EIO."""
    found = re.search(r"os error (\d+)|code: (\d+)", str(err))
    code = int(found.group(1) or found.group(2)) if found else errno.EIO
    return OSError(code, os.strerror(code) if found else str(err), str(path))


def load_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file (memory-mapped, no pickle); a damaged file is a ModelDirError naming it."""
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except FileNotFoundError:
        raise ModelDirError(f"{path} does not exist") from None
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelDirError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from None


def model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The weights to save: the state dict without the tied head's second name, without compile prefixes."""
    module = getattr(model, "_orig_mod", model)  # torch.compile wraps the module
    state = module.state_dict()
    if module.config.tie_embeddings:
        state.pop("lm_head.weight")
    return state


def save_model_dir(model: GPT, path: str | Path, tokenizer: Any | None = None) -> Path:
    """Write model (and its tokenizer, if given) as a gptkit model directory; each file lands atomically."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    module = getattr(model, "_orig_mod", model)
    save_tensors(model_state(module), path / WEIGHTS_FILE, metadata={"format": "pt"})
    write_config_and_tokenizer(path, module.config, tokenizer)
    return path


def write_config_and_tokenizer(
    path: Path, config: ModelConfig, tokenizer: Any | None, extra: dict[str, Any] | None = None
) -> None:
    """The tokenizer's files and config.json (last: it makes the directory loadable) beside written weights."""
    data: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": config.to_dict(),
                            **(extra or {})}  # fmt: skip
    if tokenizer is not None:
        tokenizer.save(path)
        own = (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
        if tokenizer.eos_ids != own:  # end ids a model's config added (on import from Hugging Face)
            data["generation"] = {"eos_ids": list(tokenizer.eos_ids)}
    atomic_write_text(path / CONFIG_FILE, json.dumps(data, indent=2) + "\n")


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a model directory (gptkit's or Hugging Face's)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelDirError(f"{path} has no {CONFIG_FILE}; is it a model directory?")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelDirError(f"cannot read {config_path}: {err}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{config_path} must hold a JSON object")
    return data


def is_gptkit_dir(path: str | Path) -> bool:
    """Whether path holds a gptkit config.json (as opposed to, e.g., a Hugging Face one)."""
    try:
        return read_config_json(path).get("format") == FORMAT
    except ModelDirError:
        return False


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a gptkit model directory."""
    data = read_config_json(path)
    if data.get("format") != FORMAT:
        raise ModelDirError(f"{Path(path) / CONFIG_FILE} is not a gptkit config (no \"format\": \"gptkit\")")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise ModelDirError(
            f"{path} was written by a newer gptkit (format_version {data['format_version']}); upgrade gptkit"
        )
    try:
        return ModelConfig.from_dict(data.get("model"))
    except ConfigError as err:
        raise ModelDirError(f"{Path(path) / CONFIG_FILE}: {err}") from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding a directory's weights, single or sharded."""
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelDirError(f"cannot read {path / INDEX_FILE}: {err}") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    raise ModelDirError(f"{path} has no {WEIGHTS_FILE} (or {INDEX_FILE})")


def load_model_dir(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GPT:
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
    from gptkit.tokenizer import tokenizer_or_none

    tokenizer = tokenizer_or_none(path)
    if tokenizer is None:
        return None
    eos_ids = read_config_json(path).get("generation", {}).get("eos_ids")
    if eos_ids:
        tokenizer.add_eos_ids(eos_ids)
    return tokenizer
