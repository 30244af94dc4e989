"""The LoRA adapters a server decodes beside its base model, by the name a request's `model` gives.

Each adapter directory (gptkit's LoRA format) must have been trained on the served base: its lora_config.json's
base fingerprint must equal the served weights' (gptkit.adapters.fingerprint), computed once from the weights as
loaded, before any quantisation. Serving one takes two steps. read() reads and checks its files on a thread of its
own under a deadline (LOAD_SECONDS), so that a file that never answers (a stalled network mount) costs one refused
load, not the server; no file is opened before it is known to be a regular file of a sane size. add() then serves
what was read, on the engine thread between two decode steps, touching no file. Adapters are numbered from 1 (0 is
the base) and applied per batch row (gptkit.multi_lora); a number is never reused, so that a request that resolved
a name before its adapter was swapped fails instead of decoding through another's weights.

Each adapter's key is a hash of its weights and scaling: a prefix cache keeps its blocks under the key, not the
name, so that the name served with other weights (reloaded at run time, or over a --cache-dir after a restart)
never finds another adapter's blocks.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor, nn

from gptkit.adapters import fingerprint
from gptkit.errors import GptkitError
from gptkit.formats.lora import is_lora_dir, read_lora_config, read_lora_weights
from gptkit.multi_lora import remove_adapter, serve_adapter
from gptkit.weights import model_state

log = logging.getLogger(__name__)

NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")
LOAD_SECONDS = 60.0  # reading one adapter's files (megabytes to a few hundred) longer than this is given up
# A LoRA of rank r <= min(in, out) holds r (in + out) <= 2 in out numbers per adapted in x out weight: in float64
# (the widest dtype), at most 16 bytes per base weight; plus room for the safetensors header.
BYTES_PER_BASE_WEIGHT = 16
HEADER_ROOM = 1 << 20

T = TypeVar("T")


class AdapterError(GptkitError):
    """An adapter that cannot be served; param names the load request's field at fault (lora_name, lora_path)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


class AdapterMisfit(AdapterError):
    """A sound adapter this server does not serve: trained on another base, or under a name no request can send."""


@dataclass
class Adapter:
    """One served adapter: its number in the model's AdapterSet layers, where it was read from, and its key (a hash
    of its weights and scaling, which the prefix cache files its blocks under)."""

    index: int
    path: str
    key: str


@dataclass
class ReadAdapter:
    """An adapter's checked settings and weights, read from its directory and not yet served."""

    path: str
    settings: dict[str, Any]
    state: dict[str, Tensor]
    key: str


@dataclass
class AdapterRegistry:
    """Served adapters by name over a base whose weights hash to base_fingerprint; an adapter file larger than
    max_bytes cannot be a LoRA of it (None: no limit)."""

    base_name: str
    base_fingerprint: str
    max_bytes: int | None = None
    adapters: dict[str, Adapter] = field(default_factory=dict)
    next_index: int = 1

    @classmethod
    def for_base(cls, model: nn.Module, name: str) -> AdapterRegistry:
        """The registry over model (served as `name`), hashed and sized from its weights as loaded."""
        state = model_state(model)
        weights = sum(tensor.numel() for tensor in state.values())
        return cls(name, fingerprint(state), BYTES_PER_BASE_WEIGHT * weights + HEADER_ROOM)

    def read(self, name: str, path: str | Path) -> ReadAdapter:
        """The adapter directory at path, read and checked for serving as `name` (an AdapterError naming what is
        wrong); its files are read on a thread of its own, given up after LOAD_SECONDS."""
        self._check_name(name)
        return _within(lambda: self._read(Path(path)), LOAD_SECONDS, f"reading the adapter in {path}")

    def _read(self, path: Path) -> ReadAdapter:
        if not is_lora_dir(path):
            raise AdapterError(
                f"{path} is not a LoRA directory (no lora_config.json): give what a LoRA fine-tune "
                "saved (a checkpoint of `gptkit train` with finetune.method lora)"
            )
        try:
            settings = read_lora_config(path)
        except GptkitError as err:
            raise AdapterError(str(err)) from None
        if settings["base_fingerprint"] != self.base_fingerprint:  # checked before the weights are read
            raise AdapterMisfit(
                f"the adapters in {path} were trained on another base ({settings['base']}, "
                f"weights {settings['base_fingerprint'][:12]}); this server's base hashes to "
                f"{self.base_fingerprint[:12]}"
            )
        try:
            state = read_lora_weights(path, self.max_bytes)
        except GptkitError as err:
            raise AdapterError(str(err)) from None
        key = hashlib.blake2b(f"{fingerprint(state)}|{float(settings['alpha'])!r}".encode(), digest_size=16)
        return ReadAdapter(str(path), settings, state, key.hexdigest())

    def add(self, model: nn.Module, name: str, adapter: ReadAdapter) -> Adapter:
        """Serve a read adapter as `name` (no file is touched: this runs on the engine thread)."""
        self._check_name(name)
        index = self.next_index
        try:
            serve_adapter(model, index, adapter.state, adapter.settings, adapter.path)
        except GptkitError as err:
            remove_adapter(model, index)  # the layers it reached before the misfit: no half-served adapter stays
            raise AdapterError(str(err)) from None
        self.next_index += 1
        self.adapters[name] = Adapter(index, adapter.path, adapter.key)
        return self.adapters[name]

    def remove(self, model: nn.Module, name: str) -> None:
        """Stop serving adapter `name` (requests decoding with it should have finished)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterError(f"no adapter named {name!r} is served", "lora_name")
        remove_adapter(model, adapter.index)

    def key_of(self, index: int) -> str:
        """The key of the adapter numbered index ("" for the base, or a number no longer served)."""
        return next((adapter.key for adapter in self.adapters.values() if adapter.index == index), "")

    def _check_name(self, name: str) -> None:
        if not name or not set(name) <= NAME_CHARACTERS or name == self.base_name:
            raise AdapterMisfit(
                f"adapter name {name!r} is not usable: use letters, digits and - _ . : / and not "
                f"the base model's name {self.base_name!r}",
                "lora_name",
            )
        if name in self.adapters:
            raise AdapterError(
                f"an adapter named {name!r} is served already; unload it first or pick another name", "lora_name"
            )


def _within(work: Callable[[], T], seconds: float, what: str) -> T:
    """work() on a daemon thread, waited for up to seconds: one that never returns is left behind (it cannot hold
    the process at exit) and the caller gets an AdapterError."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except Exception as err:  # noqa: BLE001  (handed to the waiting caller, who reports it)
            done.set_exception(err)

    threading.Thread(target=run, name="gptkit-adapter-read", daemon=True).start()
    try:
        return done.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise AdapterError(
            f"{what} took longer than {seconds:g} s (a file that does not answer, such as one on "
            "a stalled network mount?); load it from a local disk"
        ) from None


def resolved(path: str | Path) -> Path | None:
    """path with every symlink followed, or None where that fails (a symlink loop, a folder this user may not
    read)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # Python before 3.13 raises RuntimeError for a symlink loop
        return None


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
        except (OSError, RuntimeError) as err:  # unreadable, or a symlink loop (RuntimeError before Python 3.13)
            log.info("not looking in %s for an adapter: %s", path, err)
    return found
