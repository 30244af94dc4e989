"""The neutral tensor and metadata I/O every format, checkpoint and fine-tuning part uses.

- safetensors read and write (save_tensors, load_tensors; a damaged file is a ModelDirError naming it, a failed
  write the OSError it was), and the weight files of a single or sharded directory (weight_files);
- versioned JSON: read_versioned_json and check_version, the one "written by a newer gptkit" check;
- a model directory's config.json (read_config_json): the file names below are Hugging Face's, and gptkit's own
  directories use the same ones, so every format module reads a directory's config from here;
- the config.json of a gptkit directory (GPTKIT_FORMAT, write_config_and_tokenizer, read_model_config,
  is_gptkit_dir). It lives here rather than in gptkit.formats.modeldir because two formats write it: a float
  gptkit directory (formats.modeldir) and a quantised one (formats.quantized), which is the same directory with a
  "quantization" field and quantised tensors. Neither format module imports the other; both build on this one.

Nothing here imports a format, fine-tuning, loading or training module, nor torch at import time: the torch-free
tokenizer reads its versioned JSON with read_versioned_json.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from safetensors import SafetensorError, safe_open

from gptkit.atomic import atomic_write, atomic_write_text
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError, GptkitError
from gptkit.weights import WeightsError

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

GPTKIT_FORMAT = "gptkit"
GPTKIT_FORMAT_VERSION = 1


class ModelDirError(WeightsError):
    """A model directory or tensor file that is missing, incomplete or corrupt; the message names the file."""


class TokenizerFiles(Protocol):
    """What a model directory needs of its tokenizer (gptkit.tokenizer.Tokenizer is one; that module builds on this
    one, so it is named by what it does)."""

    eos_id: int | None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation."""

    def save(self, directory: Path) -> None:
        """Write the tokenizer's files into directory."""


# ---------------------------------------------------------------------------------------------------------
# safetensors files.


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors as one safetensors file, atomically; a failed write (a full disk, say) is an OSError."""
    from safetensors.torch import save_file  # imports torch, which the JSON readers here do not need

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


# ---------------------------------------------------------------------------------------------------------
# Versioned JSON: {"format": ..., "format_version": N, ...}.


def check_version(
    data: dict[str, Any], source: str | Path, version: int, error: type[GptkitError] = GptkitError
) -> None:
    """Raise error when data's format_version is newer than version, the newest this gptkit reads."""
    if data.get("format_version", 0) > version:
        raise error(f"{source} was written by a newer gptkit (format_version {data['format_version']}); upgrade gptkit")


def read_versioned_json(
    path: Path, fmt: str, version: int, what: str, error: type[GptkitError] = GptkitError
) -> dict[str, Any]:
    """The JSON object in path, checked to be of format fmt (a `what`) and no newer than version."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise error(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise error(f'{path} is not a {what} (no "format": "{fmt}")')
    check_version(data, path, version, error)
    return data


# ---------------------------------------------------------------------------------------------------------
# A model directory's config.json (gptkit's or Hugging Face's), and gptkit's own.


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


def write_config_and_tokenizer(
    path: Path, config: ModelConfig, tokenizer: TokenizerFiles | None, extra: dict[str, Any] | None = None
) -> None:
    """The tokenizer's files and a gptkit config.json (last: it makes the directory loadable) beside written
    weights; extra holds further fields (a quantised directory's "quantization")."""
    data: dict[str, Any] = {
        "format": GPTKIT_FORMAT,
        "format_version": GPTKIT_FORMAT_VERSION,
        "model": config.to_dict(),
        **(extra or {}),
    }
    if tokenizer is not None:
        tokenizer.save(path)
        own = (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
        if tokenizer.eos_ids != own:  # end ids a model's config added (on import from Hugging Face)
            data["generation"] = {"eos_ids": list(tokenizer.eos_ids)}
    atomic_write_text(path / CONFIG_FILE, json.dumps(data, indent=2) + "\n")


def is_gptkit_dir(path: str | Path) -> bool:
    """Whether path holds a gptkit config.json (as opposed to, e.g., a Hugging Face one)."""
    try:
        return read_config_json(path).get("format") == GPTKIT_FORMAT
    except ModelDirError:
        return False


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a gptkit model directory (float or quantised)."""
    data = read_config_json(path)
    if data.get("format") != GPTKIT_FORMAT:
        raise ModelDirError(f'{Path(path) / CONFIG_FILE} is not a gptkit config (no "format": "{GPTKIT_FORMAT}")')
    check_version(data, path, GPTKIT_FORMAT_VERSION, ModelDirError)
    try:
        return ModelConfig.from_dict(data.get("model"))
    except ConfigError as err:
        raise ModelDirError(f"{Path(path) / CONFIG_FILE}: {err}") from None
