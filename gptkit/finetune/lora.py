"""LoRA (Hu et al. 2021): low-rank adapters train over a frozen base model (gptkit.adapters wraps its layers).

Its checkpoints are LoRA directories (gptkit.formats.lora): the adapters and the settings, naming the base by path
and weight fingerprint, so a checkpoint holds a few kilobytes to megabytes however large the base. Its reference is
the same model with the adapters switched off: the base, with no second copy in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from gptkit.adapters import adapters_disabled, check_lora, load_lora_state
from gptkit.config import resolve_model
from gptkit.errors import ConfigError
from gptkit.finetune.full import with_config
from gptkit.finetune.parts import RunModel, evaluation_mode
from gptkit.formats.lora import WEIGHTS_FILE, adapt, is_lora_dir, read_lora_config, write_lora_dir
from gptkit.loading import adapted_model, load_base
from gptkit.model import GPT
from gptkit.settings import PartSettings
from gptkit.tensors import load_tensors
from gptkit.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gptkit.train_config import RunConfig


BasePrecision = Literal["float32", "bfloat16", "int8"]
LoraTargets = Literal["attention", "mlp", "all"]


@dataclass
class LoraSettings(PartSettings):
    """LoRA's settings."""

    # Adapters need a base; FSDP would shard only their small updates.
    needs_base = "trains adapters over a base model"
    data_parallel_only = True

    lora_rank: int = 8  # r: the adapters' inner width
    lora_alpha: float = 16.0  # the update is scaled by alpha / r, as in PEFT
    lora_dropout: float = 0.0  # dropout on an adapter's input (PEFT's default is none)
    lora_targets: LoraTargets = "all"  # the block layers adapted: attention (q, k, v and output), mlp, or all
    base_precision: BasePrecision = "float32"  # the frozen base's weights (bfloat16 or int8 save memory)

    def validate(self) -> None:
        """The adapters' ranges, checked where a LoRA directory's are."""
        check_lora(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets)


class Lora:
    """Adapters train over a frozen base (the base in finetune.base_precision)."""

    settings_type = LoraSettings

    def __init__(self, settings: LoraSettings) -> None:
        self.run_settings = settings
        self.settings: dict[str, Any] = {}  # lora_config.json's fields but the format's (set by build or resume)

    def build(self, config: RunConfig, vocab_size: int) -> RunModel:
        """model.init_from (the base, checked by fingerprint at every later load) with fresh adapters."""
        section, lora = config.model, self.run_settings
        if section.init_from is None:
            raise ConfigError("finetune.method lora trains adapters over a base model: set model.init_from")
        pretrained, tokenizer, fingerprint = load_base(section.init_from)
        model = with_config(pretrained, resolve_model(section, vocab_size, pretrained.config))
        self.settings = {
            "base": str(Path(section.init_from).resolve()),
            "base_fingerprint": fingerprint,
            "rank": lora.lora_rank,
            "alpha": lora.lora_alpha,
            "dropout": lora.lora_dropout,
            "targets": lora.lora_targets,
            "base_precision": lora.base_precision,
        }
        return RunModel(adapt(model, self.settings), tokenizer, section.init_from)

    def resume(self, checkpoint: Path) -> RunModel:
        """The base of the checkpoint's settings with fresh adapters (restore fills them)."""
        if not is_lora_dir(checkpoint):
            raise ConfigError(
                f"{checkpoint} holds a whole model, not LoRA adapters: resume the run with finetune.method full"
            )
        settings = read_lora_config(checkpoint)
        model, tokenizer = adapted_model(settings)
        self.settings = {k: v for k, v in settings.items() if k not in ("format", "format_version")}
        return RunModel(model, tokenizer, str(checkpoint))

    def save(self, gpt: GPT, directory: Path, tokenizer: Tokenizer | None, tokenizer_config: bytes | None) -> None:
        """A LoRA directory: the adapters, the settings and the chat template."""
        write_lora_dir(gpt, directory, self.settings, tokenizer_config)

    def restore(self, gpt: GPT, directory: Path) -> None:
        """The checkpoint's adapters, copied into gpt's."""
        device = next(gpt.parameters()).device
        load_lora_state(gpt, load_tensors(directory / WEIGHTS_FILE, device), str(directory))

    def reference(self, gpt: GPT, config: RunConfig, device: torch.device) -> Callable[[Tensor], Tensor]:
        """The base: gpt itself with its adapters switched off (and no dropout)."""

        def reference(ids: Tensor) -> Tensor:
            with adapters_disabled(gpt), evaluation_mode(gpt):
                return gpt(ids)

        return reference
