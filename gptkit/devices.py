"""Choosing the device to run on: one rule for every command."""

from __future__ import annotations

import torch

from gptkit.errors import ConfigError


def pick_device(name: str, option: str = "--device") -> torch.device:
    """The device for `auto` (CUDA, then MPS, then CPU) or the named one, checked to exist.

    option names the setting in error messages (e.g. "--device" or "train.device").
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{option} {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option} {name} was asked for but no CUDA device is available; use auto or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option} {name} was asked for but MPS is not available; use auto or cpu")
    return device
