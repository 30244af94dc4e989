"""Reinforcement learning from verifiable rewards: GRPO (Shao et al. 2024, DeepSeekMath) as TRL's trainer runs it.

Each update takes a batch of prompts, samples a group of G completions of each through the batch engine (the
decoding code of generate and serve: its sampling settings, stop strings and JSON-schema constraint, one prefill
per prompt), scores each completion with the reward functions (gptkit.finetune.rewards: their weighted sum, over
those that apply), and moves the policy toward the completions that scored above their group's mean, by the
loss type's clipped surrogate (gptkit.finetune.policy_loss). With finetune.num_iterations N the same groups serve
N updates, the later ones through the importance ratio against the policy that sampled them, clipped. A group
whose rewards are all equal has zero advantages and so gives no gradient: the fraction of such groups
(zero_spread) says how much of a step taught. With one update per sampling the loss's value is near 0 by
construction (centred advantages, ratio 1): its gradient, not its value, is what moves; watch reward instead.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gptkit.accounting import kv_cache_bytes
from gptkit.data import Batch, Prompts
from gptkit.decoding.api import Completion, complete, grammar_for
from gptkit.decoding.grammar import SchemaError
from gptkit.decoding.prefix_cache import available_memory
from gptkit.decoding.request import first_stop
from gptkit.decoding.sampling import GREEDY_BELOW, SamplingParams, read_schema_file
from gptkit.distributed import all_mean
from gptkit.errors import ConfigError, GptkitError
from gptkit.finetune.groups import Group, PromptBatches, completion_rows
from gptkit.finetune.objectives import check_template
from gptkit.finetune.parts import ObjectiveBase, Setup, Stats, evaluation_mode
from gptkit.finetune.policy_loss import LossType, PolicyLoss, group_advantages, pass_at_k, policy_gradient_loss
from gptkit.finetune.rewards import RewardError, RewardProcess
from gptkit.loss import IGNORE_INDEX, row_logprobs
from gptkit.plan import GIB, training_memory
from gptkit.settings import PartSettings, check_range

logger = logging.getLogger(__name__)


@dataclass
class GrpoSettings(PartSettings):
    """GRPO's settings."""

    # The policy starts from a model that can attempt the task.
    needs_base = "improves a model that can already attempt the task (its sampled completions are the data)"
    data_parallel_only = True

    may_change_on_resume = ("reward_timeout",)  # a reward that timed out can be given longer

    reward: list[str] = field(default_factory=lambda: ["exact_match"])  # the reward functions, summed: exact_match
    #   (the row's "answer"), regex:PATTERN, json_schema (the row's "schema") or module:function, called as
    #   function(prompt, completion, row), which may return None where it does not apply
    reward_weights: list[float] | None = None  # each reward's weight in the sum (None: 1 each)
    group_size: int = 8  # completions sampled per prompt (G); advantages compare each with its group
    completion_tokens: int = 64  # the longest completion sampled
    loss_type: LossType = "dapo"  # how token losses are averaged: dapo (every token of an update alike; TRL's
    #   default), grpo (per completion), bnpo (per micro-batch) or dr_grpo (over a constant length)
    num_iterations: int = 1  # updates per sampling (the later ones through the clipped importance ratio)
    epsilon: float = 0.2  # the importance ratio is clipped to at least 1 - epsilon
    epsilon_high: float | None = None  # ... and to at most 1 + epsilon_high (None: epsilon; DAPO uses 0.28)
    kl_weight: float = 0.0  # weight of the KL penalty against the starting model (0: none, no reference)
    scale_rewards: bool = True  # divide each group's advantages by its rewards' standard deviation
    mask_truncated: bool = False  # completions cut at completion_tokens train nothing (their group still counts them)
    length_penalty: float = 0.0  # subtract this x completion length / completion_tokens from each reward
    temperature: float = 1.0  # sampling temperature of the completions
    top_k: int | None = None  # sample from the k most likely tokens only
    top_p: float | None = None  # nucleus sampling
    stop: list[str] | None = None  # strings that end a completion (the reward sees the text before)
    json_schema: str | None = None  # a JSON schema file every completion is constrained to
    eval_samples: int = 8  # completions per held-out prompt at evaluations (pass@1 and pass@eval_samples)
    pass_reward: float = 1.0  # a completion passes when its reward (before the length penalty) reaches this
    reward_timeout: float = 30.0  # seconds one reward call may take; past it the run stops (checkpoint first)

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of its range."""
        for key in ("group_size", "completion_tokens", "eval_samples", "num_iterations"):
            check_range(f"finetune.{key}", getattr(self, key), low=1)
        for key in ("kl_weight", "length_penalty", "temperature"):
            check_range(f"finetune.{key}", getattr(self, key), low=0.0)
        check_range("finetune.epsilon", self.epsilon, low=0.0, high=1.0, high_open=True)
        if self.epsilon_high is not None:
            check_range("finetune.epsilon_high", self.epsilon_high, low=0.0)
        check_range("finetune.reward_timeout", self.reward_timeout, low=0.0, low_open=True)
        if self.top_k is not None:
            check_range("finetune.top_k", self.top_k, low=1)
        if self.top_p is not None:
            check_range("finetune.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"finetune.stop must be a list of non-empty strings, got {self.stop!r}")
        if not self.reward:
            raise ConfigError("finetune.reward is empty: name at least one reward function")
        if self.reward_weights is not None:
            if len(self.reward_weights) != len(self.reward):
                raise ConfigError(
                    f"finetune.reward_weights has {len(self.reward_weights)} weight(s) for "
                    f"{len(self.reward)} reward(s) in finetune.reward: give one per reward"
                )
            for i, weight in enumerate(self.reward_weights):
                check_range(f"finetune.reward_weights[{i}]", weight, low=-math.inf)

    def weights(self) -> list[float]:
        """Each reward's weight."""
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward)


class GroupPolicyGradient(ObjectiveBase):
    """GRPO: reinforcement learning from rewards on sampled completions of prompts."""

    settings_type = GrpoSettings
    data_kinds = ("prompts",)
    step_shown = ("reward",)

    def __init__(self, setup: Setup) -> None:
        f, t = setup.config.finetune.of(GrpoSettings), setup.config.train
        if setup.tokenizer is None:
            raise ConfigError("finetune.objective grpo decodes completions for the reward: the model needs a tokenizer")
        self.setup, self.settings, self.gpt, self.tokenizer = setup, f, setup.gpt, setup.tokenizer
        self.train_prompts, self.val_prompts = setup.data.train, setup.data.val
        self._check_prompts(setup)
        self.longest_row = self._check_lengths(f.completion_tokens)
        self._check_memory(setup)
        self._check_sampling(f.group_size, f.temperature)
        self.group, self.weights = f.group_size, f.weights()
        self.rule = PolicyLoss(
            f.loss_type,
            f.epsilon,
            f.epsilon if f.epsilon_high is None else f.epsilon_high,
            f.kl_weight,
            f.completion_tokens,
        )
        self.params = SamplingParams(
            max_new_tokens=f.completion_tokens,
            temperature=f.temperature,
            top_k=f.top_k,
            top_p=f.top_p,
            stop=tuple(f.stop or ()),
            json_schema=_schema(f.json_schema),
        )
        try:
            self.grammar = grammar_for(self.gpt, self.tokenizer, self.params)
        except SchemaError as err:  # read, but no grammar compiles from it
            raise ConfigError(f"finetune.json_schema {f.json_schema}: {err}") from None
        self.rewards = [RewardProcess(spec, f.reward_timeout) for spec in f.reward]
        for reward in self.rewards:
            for name, split in (("train", self.train_prompts), ("val", self.val_prompts)):
                try:
                    reward.check_rows(split.rows)
                except ConfigError as err:
                    raise ConfigError(f"{err} (in the {name} split of {setup.data.directory})") from None
        self.reference = setup.method.reference(self.gpt, setup.config, setup.device) if f.kl_weight > 0 else None
        self.seed, self.rank, self.draws = t.seed, setup.world.rank, 0
        self.accum = t.grad_accum
        self.calls = 0  # loss() calls so far: which micro-batch of which update comes next
        self.kept: dict[int, Group] = {}  # micro-batch -> its group, kept for the later iterations of its sampling
        self.update_tokens = torch.zeros((), device=setup.device)  # trained tokens of this update so far (dapo)
        self.task_metrics = {
            "val_reward": "reward",
            "val_pass_at_1": "pass_rate",
            f"val_pass_at_{f.eval_samples}": None,
        }

    def _check_prompts(self, setup: Setup) -> None:
        """Prompts rendered with the model's template, of its vocabulary, with held-out ones to evaluate on."""
        check_template(setup)
        for name, split in (("train", self.train_prompts), ("val", self.val_prompts)):
            if len(split.ids) and int(split.ids.max()) >= self.gpt.config.vocab_size:
                raise ConfigError(
                    f"{name} prompts hold token id {int(split.ids.max())}, outside the model's "
                    "vocabulary: prepare them with --tokenizer MODEL (the model trained)"
                )
        if len(self.val_prompts) == 0:
            raise ConfigError(
                f"{setup.data.directory} holds no held-out prompts (prepared with --val-fraction 0): "
                "evaluations measure reward and pass@k on them; prepare the prompts again with "
                "--val-fraction above 0"
            )

    @staticmethod
    def _check_sampling(group_size: int, temperature: float) -> None:
        """Greedy completions of a prompt are all the same, so their group has no advantage: refused. A group of one
        has none either; it runs (a step's cost without the group's, as bench_finetune measures) with a warning."""
        if temperature < GREEDY_BELOW:
            raise ConfigError(
                f"finetune.temperature {temperature} samples greedily: every completion of a prompt "
                "would be the same and nothing would train; use a temperature such as 1.0"
            )
        if group_size == 1:
            logger.warning(
                "finetune.group_size 1: a completion alone has no group to compare with, so nothing "
                "trains; use 2 or more (8 is usual)"
            )

    def _check_lengths(self, completion_tokens: int) -> int:
        """Every prompt and its longest completion must fit a learned-position model's block_size; returns the
        longest prompt's length plus completion_tokens."""
        config = self.gpt.config
        longest = max(int(np.diff(p.offsets).max()) for p in (self.train_prompts, self.val_prompts) if len(p))
        if config.position == "learned" and longest + completion_tokens > config.block_size:
            room = config.block_size - longest
            fix = f"lower finetune.completion_tokens to {room} or " if room > 0 else ""
            raise ConfigError(
                f"a prompt of {longest} tokens and finetune.completion_tokens {completion_tokens} "
                f"exceed the model's block_size {config.block_size}: {fix}prepare shorter prompts "
                "(gptkit prepare --max-length)"
            )
        return longest + completion_tokens

    def _check_memory(self, setup: Setup) -> None:
        """The completions a step samples and trains on, and those an evaluation samples, must fit the device's free
        memory (a training forward's activations by gptkit plan's estimate, a sampling's key-value cache): a typo in
        finetune.group_size is refused here in one line, not after minutes of allocating."""
        f, t, config = self.settings, setup.config.train, self.gpt.config
        free = _free_bytes(setup.device)
        step_rows, eval_rows = t.batch_size * f.group_size, min(t.eval_examples, len(self.val_prompts)) * f.eval_samples
        memory = training_memory(config, step_rows, self.longest_row, t.dtype)
        forward = memory.activations_checkpointed if t.activation_checkpointing else memory.activations
        needs = [
            (
                "finetune.group_size",
                f.group_size,
                f"x train.batch_size {t.batch_size}",
                step_rows,
                max(forward, kv_cache_bytes(config, step_rows, self.longest_row, "float32")),
            ),
            (
                "finetune.eval_samples",
                f.eval_samples,
                f"x {eval_rows // f.eval_samples} held-out prompts",
                eval_rows,
                kv_cache_bytes(config, eval_rows, self.longest_row, "float32"),
            ),
        ]
        for name, value, times, rows, need in needs:
            if need > free:
                raise ConfigError(
                    f"{name} {value} {times} = {rows:,} completions of up to {self.longest_row} tokens "
                    f"need about {need / GIB:,.1f} GiB (gptkit plan's estimate), more than the "
                    f"{free / GIB:,.1f} GiB free on {setup.device.type}: lower {name}"
                )

    def stream(self, per_update: int) -> PromptBatches:
        """The training prompts in a seeded order, train.batch_size per micro-batch, each update's repeated for the
        iterations of its sampling."""
        t = self.setup.config.train
        return PromptBatches(self.train_prompts, t.batch_size, t.seed, per_update, self.settings.num_iterations)

    def _next_seed(self) -> int:
        """The sampling seed of the next step: a counter-based generator keyed by (train.seed, rank), whose state
        (the count of draws) the checkpoint holds, so that a resumed run samples what it would have."""
        self.draws += 1
        return int(np.random.SeedSequence([self.seed, self.rank, self.draws]).generate_state(1)[0] >> 1)

    @torch.no_grad()
    def sample(self, prompts: Prompts, indices: list[int], samples: int, seed: int) -> Group:
        """samples completions of each prompt, in one batch, and their rewards."""
        ids = [prompts.prompt(i) for i in indices]
        params = dataclasses.replace(self.params, num_samples=samples, seed=seed)
        device = self.setup.device
        with evaluation_mode(self.gpt), torch.autocast(device.type, enabled=False):
            result = complete(
                self.gpt, ids, params, eos_id=self.tokenizer.eos_ids, decode=self.tokenizer.decode, grammar=self.grammar
            )
        completions, parts, truncated = [], [], []
        for index, row in zip(indices, result.completions):
            for completion in row:
                text, trained = self._text_and_ids(completion)
                completions.append(trained)
                parts.append([math.nan if v is None else v for v in self._score(prompts, index, text)])
                truncated.append(completion.finish_reason == "length")
        shape = (len(indices), samples)
        values = torch.tensor(parts, dtype=torch.float32).view(*shape, len(self.rewards))
        applies = ~values.isnan()
        total = (values.nan_to_num() * torch.tensor(self.weights)).sum(dim=-1)
        lengths = torch.tensor([len(c.ids) for row in result.completions for c in row], dtype=torch.float32)
        penalty = self.settings.length_penalty * lengths.view(shape) / self.params.max_new_tokens
        scored = applies.any(dim=-1)
        return Group(
            ids,
            completions,
            torch.where(scored, total - penalty, 0.0),
            scored & (total >= self.settings.pass_reward),
            scored,
            torch.tensor(truncated).view(shape),
            values,
        )

    def _text_and_ids(self, completion: Completion) -> tuple[str, list[int]]:
        """(the text the reward reads: cut before a stop string, the ids trained on: the sampled ones, with the
        end-of-text id the model chose where it chose one; none where a stop string or a grammar ended it)."""
        text = self.tokenizer.decode(completion.ids)
        cut = first_stop(text, self.params.stop)
        end = [completion.end_id] if completion.end_id is not None else []
        return (text if cut < 0 else text[:cut]), completion.ids + end

    def _score(self, prompts: Prompts, index: int, completion: str) -> list[float | None]:
        """Each reward of a completion of prompt index (None where one does not apply); a RewardError names the
        prompt."""
        text = prompts.texts[index]
        try:
            return [reward(text, completion, prompts.rows[index]) for reward in self.rewards]
        except RewardError as err:
            split = "train" if prompts is self.train_prompts else "val"
            shown = repr(text if len(text) <= 40 else text[:37] + "...")
            where = f"on prompt {index} ({shown}) of the {split} split of {self.setup.data.directory}"
            raise RewardError(f"{err} ({where})", interrupted=err.interrupted) from None

    def _group_for(self, batch: Batch) -> tuple[Group, float]:
        """The micro-batch's group and the seconds sampling it took: sampled at the first iteration of an update's
        sampling (and kept for the next ones), else the one kept."""
        micro, update = self.calls % self.accum, self.calls // self.accum
        self.calls += 1
        if micro == 0:
            self.update_tokens = torch.zeros((), device=self.setup.device)
        iteration = update % self.settings.num_iterations
        if iteration:
            if micro not in self.kept:
                raise GptkitError(f"the group of micro-batch {micro} was not kept for iteration {iteration + 1}")
            group = self.kept[micro]
            if iteration == self.settings.num_iterations - 1:
                del self.kept[micro]
            return group, 0.0
        started = time.perf_counter()
        group = self.sample(self.train_prompts, batch.prompts or [], self.group, self._next_seed())
        return group, time.perf_counter() - started  # (complete() waits for the device: the time is the sampling's)

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The micro-batch's groups (sampled, or kept from the update that sampled them), and the policy-gradient
        loss over their completion tokens."""
        group, sampling = self._group_for(batch)
        device = self.setup.device
        advantages = group_advantages(group.rewards, self.settings.scale_rewards, group.scored).to(device).reshape(-1)
        x, y = completion_rows(group, self.group)
        batch.tokens = sum(len(group.prompts[i // self.group]) + len(c) - 1 for i, c in enumerate(group.completions))
        x, y = x.to(device), y.to(device)
        trains = group.scored & ~group.truncated if self.settings.mask_truncated else group.scored
        mask = (y != IGNORE_INDEX) & trains.reshape(-1, 1).to(device)
        logprobs = row_logprobs(forward(x), y, "none")
        if group.old_logprobs is None:  # the first update of this sampling: the policy that sampled is this one
            old = logprobs.detach()
            if self.settings.num_iterations > 1:  # (kept on the host, in checkpoints: the one sync this costs)
                group.old_logprobs = old.cpu()
                self.kept[(self.calls - 1) % self.accum] = group
        else:
            old = group.old_logprobs.to(device)
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = row_logprobs(self.reference(x), y, "none")
        loss, stats = policy_gradient_loss(self.rule, logprobs, advantages, mask, reference, old)
        if self.rule.loss_type == "dapo":  # a sum here; update_scale divides by the update's tokens
            loss = loss * mask.sum() / self._dapo_unit()
            self.update_tokens += mask.sum()
        return loss, {name: value.to(device) for name, value in {**self._stats(group, sampling), **stats}.items()}

    def _dapo_unit(self) -> int:
        """What a micro-batch's dapo sum is divided by before update_scale (the same for every micro-batch, so that
        one scale afterwards makes it the mean over the update's tokens): its most possible trained tokens."""
        return self.setup.config.train.batch_size * self.group * self.settings.completion_tokens

    def update_scale(self) -> Tensor | None:
        """dapo: the factor that turns the update's summed micro-batch losses (each divided by _dapo_unit, averaged
        over micro-batches and processes) into the mean over every trained token of the update."""
        if self.rule.loss_type != "dapo":
            return None
        mean_tokens = all_mean(self.setup.world, self.update_tokens.float()).clamp(min=1)
        return self.accum * self._dapo_unit() / mean_tokens

    def _stats(self, group: Group, sampling: float) -> dict[str, Tensor]:
        """What a step logs of its groups (means over completions; reward over the scored ones)."""
        spread = group.rewards.std(dim=1) if self.group > 1 else torch.zeros(len(group.prompts))
        scored = group.scored.float()
        stats = {
            "reward": (group.rewards * scored).sum() / scored.sum().clamp(min=1),
            "reward_std": spread.mean(),
            "zero_spread": (spread == 0).float().mean(),
            "pass_rate": group.passed.float().mean(),
            "unscored": 1 - scored.mean(),
            "truncated": group.truncated.float().mean(),
            "completion_tokens": torch.tensor([len(c) for c in group.completions], dtype=torch.float).mean(),
            "sample_s": torch.tensor(sampling),
        }
        if len(self.rewards) > 1:  # each reward's mean where it applies
            for k in range(len(self.rewards)):
                values = group.reward_parts[..., k]
                stats[f"reward_{k + 1}"] = values.nan_to_num().sum() / (~values.isnan()).sum().clamp(min=1)
        return stats

    def evaluate(self, forward: Callable[..., Any]) -> dict[str, float]:
        """On the first train.eval_examples held-out prompts, eval_samples completions each (a fixed seed): the mean
        reward, pass@1 and pass@eval_samples."""
        count = min(self.setup.config.train.eval_examples, len(self.val_prompts))
        if count == 0:
            return {}
        n = self.settings.eval_samples
        group = self.sample(self.val_prompts, list(range(count)), n, self.seed + 3)
        correct = group.passed.sum(dim=1).tolist()
        scored = group.scored.float()
        return {
            "val_reward": float((group.rewards * scored).sum() / scored.sum().clamp(min=1)),
            "val_pass_at_1": float(np.mean([pass_at_k(n, c, 1) for c in correct])),
            f"val_pass_at_{n}": float(np.mean([pass_at_k(n, c, n) for c in correct])),
            "val_completion_tokens": float(np.mean([len(c) for c in group.completions])),
        }

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator's state (how many seeds it has drawn), where the updates stand, and the groups kept
        for the later iterations of a sampling."""
        return {
            "sampling_draws": self.draws,
            "calls": self.calls,
            "kept": {str(micro): group.to_state() for micro, group in self.kept.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sampling seeds, the updates and their kept groups where the checkpoint left them."""
        self.draws = int(state.get("sampling_draws", 0))
        self.calls = int(state.get("calls", 0))
        self.kept = {int(micro): Group.from_state(group) for micro, group in state.get("kept", {}).items()}


def _free_bytes(device: torch.device) -> int:
    """Bytes the device could give now: free GPU memory, else the system's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


def _schema(path: str | None) -> str | None:
    """finetune.json_schema's schema as compact JSON text (None without one); a missing or unreadable file is a
    ConfigError naming the setting."""
    try:
        return read_schema_file(path) if path is not None else None
    except ValueError as err:
        raise ConfigError(f"finetune.json_schema {path}: {err}") from None
