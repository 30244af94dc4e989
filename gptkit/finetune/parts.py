"""The two parts a training run is made of, and what they are built from; the training loop knows nothing else.

A method (full.py, lora.py) says what trains: how the model is built from a starting point (a fresh model, a model
to fine-tune, a checkpoint to resume), how its trained weights are saved into a checkpoint and read back, and what
the starting model is for an objective that needs a frozen reference. An objective (objectives.py, dpo.py,
heads.py, rl.py) says what is minimised: which data it trains on, what it adds around the model (a label head),
its batches, its loss and the statistics logged beside it, its evaluation with the task's own metrics, and any
state a checkpoint must hold for the run to resume exactly. catalogue.py maps the config's names to both.

Adding a method or an objective is one file here and one line in catalogue.py; gptkit/train.py does not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from gptkit.data import Batch, RunData
from gptkit.distributed import World
from gptkit.model import GPT
from gptkit.settings import PartSettings
from gptkit.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gptkit.train_config import RunConfig

Stats = dict[str, Tensor]


@dataclass
class RunModel:
    """The GPT a run trains and what comes with it."""

    gpt: GPT
    tokenizer: Tokenizer | None  # the model's own (init_from's or the checkpoint's), None for a fresh model
    template_dir: str | None  # the directory whose chat template the model carries (init_from or the checkpoint)


class Method(Protocol):
    """What trains: every weight (full.py) or adapters over a frozen base (lora.py), built from its own settings."""

    settings_type: ClassVar[type[PartSettings]]  # its settings (flat keys of the finetune section) and run rules

    def __init__(self, settings: Any) -> None: ...

    def build(self, config: RunConfig, vocab_size: int) -> RunModel:
        """A new run's model: a fresh one, or model.init_from's, made ready to train."""
        ...

    def resume(self, checkpoint: Path) -> RunModel:
        """The model of a checkpoint of this method, built as the run built it (weights loaded by restore)."""
        ...

    def save(self, gpt: GPT, directory: Path, tokenizer: Tokenizer | None, tokenizer_config: bytes | None) -> None:
        """Write the trained weights (and the tokenizer and chat template) into a checkpoint directory."""
        ...

    def restore(self, gpt: GPT, directory: Path) -> None:
        """Load what save wrote into gpt, in place (the optimiser holds its parameters)."""
        ...

    def reference(self, gpt: GPT, config: RunConfig, device: torch.device) -> Callable[[Tensor], Tensor]:
        """The starting model, frozen: ids -> logits (for objectives that keep the policy near it)."""
        ...


@dataclass
class Setup:
    """What an objective is built from."""

    config: RunConfig
    data: RunData
    gpt: GPT
    tokenizer: Tokenizer | None
    method: Method
    device: torch.device
    world: World
    template_dir: Path  # the directory whose chat template the model carries

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded across processes (FSDP): no rank holds the whole model to decode."""
        return self.config.train.parallel == "fsdp" and self.world.distributed


class Objective(Protocol):
    """What a run minimises, and how it is measured."""

    settings_type: ClassVar[type[PartSettings]]  # its settings (flat keys of the finetune section) and run rules
    data_kinds: ClassVar[tuple[str, ...]]  # the data sets it trains on (gptkit.data_kinds)
    # The evaluation's task metrics, each drawn in a panel of loss.png with the training steps' statistic it pairs
    # with, if any (val_reward with each step's reward).
    task_metrics: dict[str, str | None]
    step_shown: tuple[str, ...]  # statistics of a training step shown on the progress bar

    def wrap(self, gpt: GPT) -> nn.Module:
        """The module that trains: gpt itself, or a module around it (a head) that holds it as its `gpt` attribute,
        through which the loop saves and restores its weights with the method."""
        ...

    def stream(self, per_update: int) -> Any:
        """The global stream of training batches (next_batch, state_dict, load_state_dict, seed and step);
        per_update micro-batches make one update across all processes."""
        ...

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """(the batch's mean loss, statistics: each a mean over the batch's units); an objective that learns how
        many tokens it forwarded only as it goes (GRPO samples them) sets batch.tokens."""
        ...

    def update_scale(self) -> Tensor | None:
        """After an update's micro-batches, a factor for its gradients and loss, for an objective whose normaliser is
        known only then (GRPO's dapo: the update's completion tokens); None leaves them as they are."""
        ...

    def evaluate(self, forward: Callable[..., Any]) -> dict[str, float]:
        """The evaluation's numbers: losses (train_eval_loss, val_loss) where they mean something, and the task
        metrics; forward is in eval mode, under no_grad."""
        ...

    def save(self, module: nn.Module, directory: Path) -> None:
        """Write what the objective adds to the model (a head) into a checkpoint directory."""
        ...

    def restore(self, module: nn.Module, directory: Path) -> None:
        """Load what save wrote, in place."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What else a checkpoint must hold for the run to resume exactly (JSON-able)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from state_dict()'s value ({} for a checkpoint written before the objective had state)."""
        ...


class ObjectiveBase:
    """The defaults of an objective: no settings of its own, the model trains as it is, adds nothing to a checkpoint,
    keeps no state."""

    settings_type: ClassVar[type[PartSettings]] = PartSettings

    task_metrics: dict[str, str | None] = {}
    step_shown: tuple[str, ...] = ()

    def wrap(self, gpt: GPT) -> nn.Module:
        """gpt itself."""
        return gpt

    def update_scale(self) -> Tensor | None:
        """The micro-batches' weights were final."""
        return None

    def save(self, module: nn.Module, directory: Path) -> None:
        """Nothing to write."""

    def restore(self, module: nn.Module, directory: Path) -> None:
        """Nothing to read."""

    def state_dict(self) -> dict[str, Any]:
        """No state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state."""


@contextlib.contextmanager
def evaluation_mode(module: nn.Module) -> Iterator[None]:
    """Within the block, module is in eval mode (no dropout); its mode is restored after."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)
