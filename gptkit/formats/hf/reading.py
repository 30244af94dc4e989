"""Reading Hugging Face checkpoints: lazy tensor loaders for a directory, and the GPT equal to an HF model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from gptkit.config import ModelConfig
from gptkit.formats.hf.config_map import config_from_hf, config_with_hint, detect_layout
from gptkit.formats.hf.layouts import ConversionError, Layout, ignorable_names, import_tensor, weight_rules, with_biases
from gptkit.model import GPT
from gptkit.tensors import INDEX_FILE, WEIGHTS_FILE, ModelDirError, read_config_json
from gptkit.tokenizer import tokenizer_or_none
from gptkit.weights import load_state_into

log = logging.getLogger(__name__)

BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@contextlib.contextmanager
def open_weights(path: Path) -> Iterator[tuple[dict[str, Callable[[], Tensor]], str]]:
    """Lazy loaders for every tensor of an HF directory, by name, and a description of where they come from.

    Reads model.safetensors, sharded safetensors (index json) or pytorch_model.bin (weights_only, never pickle
    code); a tensor is read only when its loader is called, so conversion never holds two copies of the model.
    """
    with contextlib.ExitStack() as stack:
        if (path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file():
            files = _shards(path, WEIGHTS_FILE, INDEX_FILE)
            loaders: dict[str, Callable[[], Tensor]] = {}
            for file in files:
                try:
                    handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                except FileNotFoundError:
                    raise ModelDirError(f"{file} does not exist (listed in {path / INDEX_FILE})") from None
                except (SafetensorError, OSError, ValueError) as err:
                    raise ModelDirError(
                        f"{file} is not a readable safetensors file (truncated or corrupt?): {_one_line(err)}"
                    ) from None
                for name in handle.keys():
                    loaders[name] = _safetensors_loader(handle, name, file)
            yield loaders, str(path)
        elif (path / BIN_FILE).is_file() or (path / BIN_INDEX_FILE).is_file():
            state: dict[str, Tensor] = {}
            for file in _shards(path, BIN_FILE, BIN_INDEX_FILE):
                state.update(_torch_load(file))
            yield {name: (lambda t=t: t) for name, t in state.items()}, str(path)
        else:
            raise ModelDirError(f"{path} has no {WEIGHTS_FILE}, {INDEX_FILE}, {BIN_FILE} or {BIN_INDEX_FILE}")


def _shards(path: Path, single: str, index: str) -> list[Path]:
    """The weight files of a directory: the single file, or every file its index names."""
    if (path / single).is_file():
        return [path / single]
    try:
        weight_map = json.loads((path / index).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ModelDirError(f"cannot read {path / index}: {err}") from None


def _safetensors_loader(handle: Any, name: str, file: Path) -> Callable[[], Tensor]:
    def load() -> Tensor:
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            why = _one_line(err)
            raise ModelDirError(f"{file}: cannot read tensor {name!r} (truncated or corrupt?): {why}") from None

    return load


def _torch_load(file: Path) -> dict[str, Tensor]:
    """A pytorch_model.bin state dict, with weights_only=True so that no pickled code runs."""
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise ModelDirError(
            f"{file} is not a readable PyTorch weights file (truncated, corrupt or not weights-only?): {_one_line(err)}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
        raise ModelDirError(f"{file} does not hold a flat dict of tensors")
    return state


def _one_line(err: BaseException) -> str:
    """The first line of an error's message (library messages can span several)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _base_prefix(layout: Layout, names: set[str]) -> str:
    """The body prefix actually used: OpenAI's original GPT-2 files name tensors without "transformer."."""
    if layout.base + layout.embed + ".weight" not in names and layout.embed + ".weight" in names:
        return ""
    return layout.base


def state_from_hf(
    config: ModelConfig,
    layout: Layout,
    loaders: dict[str, Callable[[], Tensor]],
    source: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """gptkit's state dict for config, built tensor by tensor from HF tensors in one dtype; names any bad tensor."""
    base = _base_prefix(layout, set(loaders))
    rules = weight_rules(config, layout, base)
    needed = {name for rule in rules for name in rule.theirs}
    for rule in rules:
        for name in rule.theirs:
            if name not in loaders:
                raise ConversionError(f"{source} lacks tensor {name!r} (needed for {rule.ours})")
    extra = sorted(set(loaders) - needed - ignorable_names(config, layout, base))
    if extra:
        raise ConversionError(
            f"{source} has tensor {extra[0]!r} that {layout.architecture} with this config does not use "
            f"({len(extra)} such); refusing rather than dropping weights"
        )
    device = torch.device(device) if device is not None else torch.device("cpu")
    state = {}
    for rule in rules:
        if rule.theirs:
            tensor = import_tensor(rule, lambda name: loaders[name](), source)
        else:  # HF never stores this bias; it is zero
            tensor = torch.zeros(rule.shape)
        # One dtype for the whole model, as transformers loads it: a mixed file (bf16 weights, fp32 norms) would
        # fail at forward. Unless one is requested, the token embedding's (the first rule; the bulk's dtype).
        dtype = tensor.dtype if dtype is None else dtype
        state[rule.ours] = tensor.to(device=device, dtype=dtype)
    return state


def untied_if_head_differs(
    config: ModelConfig,
    layout: Layout,
    loaders: dict[str, Callable[[], Tensor]],
    source: str,
    dtype: torch.dtype | None = None,
) -> ModelConfig:
    """config, untied when it ties the head but the file holds a head weight that is not the embedding."""
    embed = _base_prefix(layout, set(loaders)) + layout.embed + ".weight"
    head_name = f"{layout.head}.weight"
    if not config.tie_embeddings or head_name not in loaders or embed not in loaders:
        return config
    head, embedding = loaders[head_name](), loaders[embed]()
    dtype = embedding.dtype if dtype is None else dtype  # compared as imported, like transformers after loading
    if head.shape == embedding.shape and torch.equal(head.to(dtype), embedding.to(dtype)):
        return config
    # transformers then keeps both tensors (with a warning): the model computes with the file's head.
    log.warning("%s: %s differs from the embedding although the config ties them; keeping both", source, head_name)
    return dataclasses.replace(config, tie_embeddings=False)


def model_from_hf_state(
    hf: dict[str, Any],
    loaders: dict[str, Callable[[], Tensor]],
    source: str,
    class_name: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> GPT:
    """The GPT equal to an HF model given as its config dict and its tensors (lazily loaded)."""
    layout = detect_layout(hf, source, class_name)
    head = f"{layout.head}.weight"
    if head != "lm_head.weight" and head not in loaders and "lm_head.weight" in loaders:
        # transformers' in-memory models (and files saved from them by hand) name every head lm_head.
        loaders = {head if name == "lm_head.weight" else name: load for name, load in loaders.items()}
    derived = untied_if_head_differs(config_from_hf(hf, layout, source), layout, loaders, source, dtype)
    state = state_from_hf(derived, layout, loaders, source, dtype, device)
    config = config_with_hint(derived, hf)
    if config != derived:
        try:
            state = with_biases(state, derived, config)
        except ConversionError:
            config = derived  # the recorded config dropped a bias that is no longer zero: keep it
    with torch.device("meta"):
        model = GPT(config)
    return load_state_into(model, state, source).eval()


def load_hf(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[GPT, Any]:
    """(model, tokenizer) from a local Hugging Face checkpoint directory; tokenizer is None without tokenizer.json."""
    path = Path(path)
    hf = read_config_json(path)
    detect_layout(hf, str(path))  # refuse an unknown architecture before touching the weights
    with open_weights(path) as (loaders, source):
        model = model_from_hf_state(hf, loaders, source, dtype=dtype, device=device)
    tokenizer = tokenizer_or_none(path)
    if tokenizer is not None:
        # An id past the tokenizer's vocabulary (a padded embedding's) could never be decoded anyway.
        tokenizer.add_eos_ids(i for i in hf_eos_ids(path, hf) if 0 <= i < tokenizer.vocab_size)
    return model, tokenizer


def hf_eos_ids(path: Path, hf: dict[str, Any]) -> list[int]:
    """The eos_token_id(s) that end generation: generation_config.json's (what `generate` reads), else config's."""
    source = hf
    file = path / GENERATION_CONFIG_FILE
    if file.is_file():
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ModelDirError(f"cannot read {file}: {err}") from None
        if isinstance(data, dict) and data.get("eos_token_id") is not None:
            source = data
    ids = source.get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def gpt_from_hf_model(hf_model: Any) -> GPT:
    """The GPT equal to an in-memory transformers model (GPT2LMHeadModel or another family's *ForCausalLM)."""
    from transformers.core_model_loading import revert_weight_conversion

    # The names save_pretrained writes, which the layouts describe: transformers 5 holds some families' tensors
    # otherwise in memory (a mixture of experts' as 3-D gate_up_proj and down_proj).
    state = revert_weight_conversion(hf_model, hf_model.state_dict())
    loaders = {name: (lambda t=t: t.detach().clone()) for name, t in state.items()}  # no storage shared
    param = next(hf_model.parameters())
    return model_from_hf_state(
        hf_model.config.to_dict(),
        loaders,
        type(hf_model).__name__,
        class_name=type(hf_model).__name__,
        device=param.device,
    )
