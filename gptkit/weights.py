"""Weights put into a model and taken out of it: every loader (model directories, Hugging Face, GGUF) hands its
tensors to load_state_into, which checks their names, shapes, kinds and finiteness once, naming the tensor at
fault; every writer takes a model's weights from model_state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptkit.errors import GptkitError

if TYPE_CHECKING:  # torch-free to import: gptkit.tensors' JSON readers serve the torch-free tokenizer
    import torch

    from gptkit.config import ModelConfig
    from gptkit.model import GPT


class WeightsError(GptkitError):
    """Weights that do not fit the model or hold non-finite values; the message names the tensor."""


def model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The weights to save: the state dict without the tied head's second name, without compile prefixes."""
    module = getattr(model, "_orig_mod", model)  # torch.compile wraps the module
    state = module.state_dict()
    if module.config.tie_embeddings:
        state.pop("lm_head.weight")
    return state


def real_vocab_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """state with the embedding's and the LM head's rows cut to config.vocab_size: what a format that knows no
    padded vocabulary stores (the rows past vocab_size are never used)."""
    if config.padded_vocab_size == config.vocab_size:
        return state
    vocab_rows = ("tok_emb.weight", "lm_head.weight", "lm_head.bias")
    return {name: t[: config.vocab_size] if name in vocab_rows else t for name, t in state.items()}


def load_state_into(model: GPT, state: dict[str, torch.Tensor], source: str) -> GPT:
    """Assign state to a (possibly meta-device) model, naming any missing, extra or misshapen tensor."""
    expected = {name: p for name, p in model.state_dict().items()}
    if model.config.tie_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise WeightsError(f"{source} lacks tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise WeightsError(f"{source} has unexpected tensor {unexpected[0]!r} for this config")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise WeightsError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config needs {tuple(expected[name].shape)}"
            )
        if tensor.is_floating_point() != expected[name].is_floating_point():
            raise WeightsError(
                f"{source}: tensor {name!r} has dtype {tensor.dtype}, the model needs "
                f"{'floating-point' if expected[name].is_floating_point() else 'integer'} values"
            )
    check_finite(state, source)
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    return model


def check_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Raise a WeightsError naming the first floating-point tensor of state that holds a NaN or an infinity."""
    # Every loader passes its weights through here once: a NaN weight otherwise surfaces only later, as a NaN
    # probability in the middle of sampling. One isfinite pass per tensor costs little next to reading it.
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            bad = int((~tensor.isfinite()).sum())
            raise WeightsError(
                f"{source}: tensor {name!r} holds {bad} NaN or infinite value(s) of "
                f"{tensor.numel()} (a diverged run or a damaged file); load an earlier checkpoint "
                "or an intact copy"
            )
