"""The LoRA adapters a server decodes beside its base model, by the name a request's `model` gives.

Each adapter directory (gptkit's LoRA format) must have been trained on the served base: its lora_config.json's
base fingerprint must equal the served weights' (gptkit.adapters.fingerprint), computed once from the weights as
loaded, before any quantisation. Adapters are numbered from 1 (0 is the base) and applied per batch row
(gptkit.multi_lora); adding or removing one runs on the engine thread, between two decode steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from gptkit.errors import GptkitError
from gptkit.formats.lora import WEIGHTS_FILE, is_lora_dir, read_lora_config
from gptkit.multi_lora import remove_adapter, serve_adapter
from gptkit.tensors import load_tensors
from gptkit.weights import check_finite

log = logging.getLogger(__name__)

NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")


@dataclass
class Adapter:
    """One served adapter: its number in the model's AdapterSet layers and where it was read from."""

    index: int
    path: str


@dataclass
class AdapterRegistry:
    """Served adapters by name over a base whose weights hash to base_fingerprint."""

    base_name: str
    base_fingerprint: str
    adapters: dict[str, Adapter] = field(default_factory=dict)

    def add(self, model: nn.Module, name: str, path: str | Path) -> Adapter:
        """Read the adapter directory at path and serve it as `name` (GptkitError naming what is wrong)."""
        if not name or not set(name) <= NAME_CHARACTERS or name == self.base_name:
            raise GptkitError(f"adapter name {name!r} is not usable: use letters, digits and - _ . : / and not the "
                              f"base model's name {self.base_name!r}")  # fmt: skip
        if name in self.adapters:
            raise GptkitError(f"an adapter named {name!r} is served already; unload it first or pick another name")
        if not is_lora_dir(path):
            raise GptkitError(f"{path} is not a LoRA directory (no lora_config.json): give what a LoRA fine-tune "
                              "saved (a checkpoint of `gptkit train` with finetune.method lora)")  # fmt: skip
        settings = read_lora_config(path)
        if settings["base_fingerprint"] != self.base_fingerprint:
            raise GptkitError(f"the adapters in {path} were trained on another base ({settings['base']}, weights "
                              f"{settings['base_fingerprint'][:12]}); this server's base hashes to "
                              f"{self.base_fingerprint[:12]}")  # fmt: skip
        state = load_tensors(Path(path) / WEIGHTS_FILE, "cpu")
        check_finite(state, str(Path(path) / WEIGHTS_FILE))
        index = next(i for i in range(1, len(self.adapters) + 2) if i not in self.indices())
        try:
            serve_adapter(model, index, state, settings, str(path))
        except GptkitError:
            remove_adapter(model, index)  # the layers it reached before the misfit: no half-served adapter stays
            raise
        self.adapters[name] = Adapter(index, str(path))
        return self.adapters[name]

    def remove(self, model: nn.Module, name: str) -> None:
        """Stop serving adapter `name` (requests decoding with it should have finished)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise GptkitError(f"no adapter named {name!r} is served")
        remove_adapter(model, adapter.index)

    def indices(self) -> set[int]:
        """The numbers in use."""
        return {adapter.index for adapter in self.adapters.values()}


def adapters_beside(model_dir: str | Path) -> dict[str, Path]:
    """The LoRA directories in the folder holding model_dir (as given: a symlinked base's own folder), by directory
    name; whether each was trained on this base is AdapterRegistry.add's check. An entry that cannot be read is
    skipped in a log line; none where model_dir is not a path on disk or its folder cannot be listed."""
    given = Path(model_dir).absolute()
    if not given.exists():
        return {}
    try:
        entries = sorted(given.parent.iterdir())
    except OSError as err:
        log.info("not looking for adapters beside the base: %s", err)
        return {}
    found = {}
    for path in entries:
        try:
            if path.resolve() != given.resolve() and path.is_dir() and is_lora_dir(path):
                found[path.name] = path
        except OSError as err:  # a folder this user may not read
            log.info("not looking in %s for an adapter: %s", path, err)
    return found
