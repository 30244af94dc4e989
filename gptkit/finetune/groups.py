"""What GRPO trains on: batches of prompts, the groups of completions sampled from them, and their training rows.

A Group holds P prompts x G completions, flattened prompt by prompt, with each completion's reward (the weighted
sum of the rewards that apply to it), whether any reward applied (scored), whether it passed, whether it was cut at
finetune.completion_tokens (truncated), and, once a first update has computed them, the sampling policy's
log-probabilities of its tokens (what later iterations' importance ratios divide by). A group kept between the
iterations of an update is written into checkpoints (to_state), so that a run resumes exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gptkit.data import Batch, Prompts
from gptkit.errors import ConfigError
from gptkit.loss import IGNORE_INDEX


class PromptBatches:
    """Batches of prompt indices, deterministic in (seed, batch number): epoch e visits every prompt once, in an
    order drawn from a Philox generator keyed by the seed with its counter set to e (as ExampleBatches orders
    examples); batch k is prompts k * batch_size ... of that endless stream, so the state is just k. With repeat
    r > 1 each update's batches (per_update of them) come r times over: the updates that reuse one sampling
    (finetune.num_iterations) read the prompts it sampled."""

    def __init__(self, prompts: Prompts, batch_size: int, seed: int, per_update: int = 1, repeat: int = 1) -> None:
        if len(prompts) == 0:
            raise ConfigError("the data set has no prompts to train on")
        self.prompts, self.batch_size, self.seed = prompts, batch_size, int(seed)
        self.per_update, self.repeat = per_update, repeat
        self.step = 0
        self._order: tuple[tuple[int, int], np.ndarray] | None = None  # ((seed, epoch), its order), the last used

    def _prompt(self, g: int) -> int:
        epoch, i = divmod(g, len(self.prompts))
        if self._order is None or self._order[0] != (self.seed, epoch):
            key = np.random.SeedSequence([self.seed, 2]).generate_state(2, dtype=np.uint64)
            generator = np.random.Generator(np.random.Philox(key=key, counter=[0, 0, 0, epoch]))
            self._order = ((self.seed, epoch), generator.permutation(len(self.prompts)))
        return int(self._order[1][i])

    def next_batch(self) -> Batch:
        """The next micro-batch: its prompts' indices (the loss, which samples, counts its tokens)."""
        update, micro = divmod(self.step, self.per_update)
        source = (update // self.repeat) * self.per_update + micro
        self.step += 1
        first = source * self.batch_size
        chosen = [self._prompt(g) for g in range(first, first + self.batch_size)]
        empty = torch.zeros((0,), dtype=torch.long)
        return Batch(empty, empty, units=len(chosen), prompts=chosen)

    def state_dict(self) -> dict[str, int]:
        """The position in the batch stream (JSON-able)."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        try:
            self.seed, self.step = int(state["seed"]), int(state["step"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"not a PromptBatches state (needs integer 'seed' and 'step'): {state!r}") from None


@dataclasses.dataclass
class Group:
    """The completions of a batch of prompts: P prompts x G completions, flattened prompt by prompt."""

    prompts: list[list[int]]  # (P) prompt ids
    completions: list[list[int]]  # (P * G) the ids trained on (an ended completion's end-of-text id included)
    rewards: Tensor  # (P, G) the weighted sum of the rewards that apply, with the length penalty (0 if none does)
    passed: Tensor  # (P, G) bool: the reward before the length penalty reached finetune.pass_reward
    scored: Tensor  # (P, G) bool: at least one reward applied (an unscored completion trains nothing)
    truncated: Tensor  # (P, G) bool: cut at finetune.completion_tokens
    reward_parts: Tensor  # (P, G, rewards) each reward's value, NaN where it did not apply
    old_logprobs: Tensor | None = None  # (P * G, T) the sampling policy's, set at the update that sampled it

    def to_state(self) -> dict[str, Any]:
        """The group as JSON-able lists (floats round-trip exactly through JSON)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.tolist() if isinstance(v, Tensor) else v for k, v in state.items()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Group:
        """The group to_state wrote."""
        tensors = {
            "rewards": torch.float32,
            "passed": torch.bool,
            "scored": torch.bool,
            "truncated": torch.bool,
            "reward_parts": torch.float32,
            "old_logprobs": torch.float32,
        }
        values = {
            k: torch.tensor(v, dtype=tensors[k]) if k in tensors and v is not None else v for k, v in state.items()
        }
        return cls(**values)


def completion_rows(group: Group, samples: int) -> tuple[Tensor, Tensor]:
    """(x, y) of each prompt + completion, right-padded: y holds the completion's tokens as targets and
    IGNORE_INDEX elsewhere (the prompt and the padding train nothing)."""
    rows = [(group.prompts[i // samples], completion) for i, completion in enumerate(group.completions)]
    width = max(len(p) + len(c) for p, c in rows) - 1
    x = torch.zeros((len(rows), width), dtype=torch.long)
    y = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, (prompt, completion) in enumerate(rows):
        ids = torch.as_tensor(prompt + completion, dtype=torch.long)
        x[r, : len(ids) - 1] = ids[:-1]
        y[r, len(prompt) - 1 : len(ids) - 1] = ids[len(prompt) :]
    return x, y
