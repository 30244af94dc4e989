"""Full training: every weight of the model trains (pre-training from scratch, or fine-tuning a whole model).

Its checkpoints are gptkit model directories (with the tokenizer and the chat template), usable as models as they
are; its reference is the starting model (model.init_from) loaded again and frozen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gptkit.atomic import atomic_write
from gptkit.chat import TOKENIZER_CONFIG
from gptkit.checkpoint import load_weights
from gptkit.config import resolve_model
from gptkit.errors import ConfigError
from gptkit.finetune.parts import RunModel
from gptkit.formats.lora import is_lora_dir
from gptkit.formats.modeldir import load_model_tokenizer, save_model_dir
from gptkit.loading import load
from gptkit.model import GPT
from gptkit.settings import PartSettings
from gptkit.tensors import read_model_config
from gptkit.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gptkit.train_config import RunConfig


class Full:
    """Every weight trains."""

    settings_type = PartSettings  # none of its own

    def __init__(self, settings: PartSettings) -> None:
        self.settings = settings

    def build(self, config: RunConfig, vocab_size: int) -> RunModel:
        """A fresh model of the model section, or model.init_from's (its dropout as configured)."""
        section = config.model
        if section.init_from is None:
            return RunModel(GPT(resolve_model(section, vocab_size)), None, None)
        pretrained, tokenizer = load(section.init_from)
        return RunModel(
            with_config(pretrained, resolve_model(section, vocab_size, pretrained.config)), tokenizer, section.init_from
        )

    def resume(self, checkpoint: Path) -> RunModel:
        """A model of the checkpoint's config (restore fills its weights)."""
        if is_lora_dir(checkpoint):
            raise ConfigError(f"{checkpoint} holds LoRA adapters: resume the run with finetune.method lora")
        return RunModel(GPT(read_model_config(checkpoint)), load_model_tokenizer(checkpoint), str(checkpoint))

    def save(self, gpt: GPT, directory: Path, tokenizer: Tokenizer | None, tokenizer_config: bytes | None) -> None:
        """A model directory, with the chat template the model carries."""
        save_model_dir(gpt, directory, tokenizer=tokenizer)
        if tokenizer_config is not None:
            atomic_write(directory / TOKENIZER_CONFIG, lambda tmp: tmp.write_bytes(tokenizer_config))

    def restore(self, gpt: GPT, directory: Path) -> None:
        """The checkpoint's weights, copied into gpt."""
        load_weights(gpt, directory)

    def reference(self, gpt: GPT, config: RunConfig, device: torch.device) -> Callable[[Tensor], Tensor]:
        """model.init_from loaded again, frozen (also when the run resumes: the model it started from)."""
        if config.model.init_from is None:
            raise ConfigError(
                f"finetune.objective {config.finetune.objective} keeps the policy near the model it "
                "starts from: set model.init_from"
            )
        frozen, _ = load(config.model.init_from)
        if frozen.config.vocab_size != gpt.config.vocab_size or frozen.config.n_embd != gpt.config.n_embd:
            raise ConfigError(f"model.init_from {config.model.init_from} is not the model this run started from")
        frozen = frozen.to(device).eval().requires_grad_(False)
        frozen.check_inputs = False
        return frozen


def with_config(pretrained: GPT, config: Any) -> GPT:
    """pretrained in training mode, rebuilt when the run's config differs from its own (only dropout may)."""
    if config == pretrained.config:
        return pretrained.train()
    model = GPT(config)
    model.load_state_dict(pretrained.state_dict())
    return model
