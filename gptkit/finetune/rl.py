"""Reinforcement learning from verifiable rewards: GRPO (Shao et al. 2024, DeepSeekMath) with a token-level loss.

Each step takes a batch of prompts, samples a group of G completions of each through the batch engine (the
decoding code of generate and serve: its sampling settings, stop strings and JSON-schema constraint), scores each
completion with a reward function (gptkit.finetune.rewards), and moves the policy toward the completions that
scored above their group's mean. The advantage of completion i of a group is r_i - mean(r) (divided by the
group's standard deviation with finetune.scale_rewards, as GRPO does); every completion token carries its
completion's advantage, and the loss is the mean over all completion tokens of the batch (the token-level mean of
DAPO, Yu et al. 2025, which TRL's GRPO trainer also uses by default), so that long completions count per token:

    loss = -sum_{i,t} A_i * pi(y_it) / pi_old(y_it) / N_tokens  [+ kl_weight * sum_{i,t} KL_it / N_tokens]

One update follows each sampling, so pi_old is the policy itself (detached): the ratio is 1 and its gradient
that of log pi. KL_it = exp(ref - logp) - (ref - logp) - 1 (Schulman's k3 estimator, GRPO's) against the starting
model, frozen (for LoRA, the same model with its adapters off). A group whose rewards are all equal has zero
advantages and so gives no gradient: the fraction of such groups (zero_spread) says how much of a step taught.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit.accounting import kv_cache_bytes
from gptkit.data import Batch, Prompts
from gptkit.decoding.api import Completion, complete, grammar_for
from gptkit.decoding.grammar import SchemaError
from gptkit.decoding.prefix_cache import available_memory
from gptkit.decoding.request import first_stop
from gptkit.decoding.sampling import GREEDY_BELOW, SamplingParams, read_schema_file
from gptkit.errors import ConfigError
from gptkit.finetune.objectives import check_template
from gptkit.finetune.parts import ObjectiveBase, Setup, Stats, evaluation_mode
from gptkit.finetune.rewards import RewardError, RewardProcess
from gptkit.loss import IGNORE_INDEX
from gptkit.plan import GIB, training_memory

logger = logging.getLogger(__name__)

# Added to a group's standard deviation before dividing by it (TRL's value): a group of nearly equal rewards
# does not blow its tiny differences up to unit size.
STD_EPS = 1e-4


def group_advantages(rewards: Tensor, scale: bool) -> Tensor:
    """(P, G) rewards -> (P, G) advantages: each reward minus its group's mean, over the group's standard deviation
    (unbiased, + STD_EPS) when scale; a group of one has none (zero)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale or rewards.size(1) < 2:
        return centred if rewards.size(1) > 1 else torch.zeros_like(rewards)
    return centred / (rewards.std(dim=1, keepdim=True) + STD_EPS)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """(B, T) log-probability of each target under the logits (0 where the target is IGNORE_INDEX)."""
    B, T, V = logits.shape
    nll = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="none")  # fmt: skip
    return -nll.view(B, T)


def policy_gradient_loss(logprobs: Tensor, advantages: Tensor, mask: Tensor, reference: Tensor | None = None,
                         kl_weight: float = 0.0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(loss, mean KL) over the completion tokens (mask, (N, T)) of N sequences with one advantage each (N,):
    the module docstring's formula; the KL is 0 without a reference."""
    ratio = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of log pi
    per_token = -ratio * advantages[:, None]
    tokens = mask.sum().clamp(min=1)
    kl = torch.zeros((), device=logprobs.device)
    if reference is not None:
        delta = reference - logprobs
        per_token_kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_weight * per_token_kl
        kl = (per_token_kl * mask).sum().detach() / tokens
    return (per_token * mask).sum() / tokens, kl


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The chance that at least one of k of the samples passes, estimated without bias from how many of them
    passed (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


class PromptBatches:
    """Batches of prompt indices, deterministic in (seed, batch number): epoch e visits every prompt once, in an
    order drawn from a Philox generator keyed by the seed with its counter set to e (as ExampleBatches orders
    examples); batch k is prompts k * batch_size ... of that endless stream, so the state is just k."""

    def __init__(self, prompts: Prompts, batch_size: int, seed: int) -> None:
        if len(prompts) == 0:
            raise ConfigError("the data set has no prompts to train on")
        self.prompts, self.batch_size, self.seed = prompts, batch_size, int(seed)
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
        first = self.step * self.batch_size
        self.step += 1
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


def _schema(path: str | None) -> str | None:
    """finetune.json_schema's schema as compact JSON text (None without one); a missing or unreadable file is a
    ConfigError naming the setting."""
    try:
        return read_schema_file(path) if path is not None else None
    except ValueError as err:
        raise ConfigError(f"finetune.json_schema {path}: {err}") from None


@dataclasses.dataclass
class Group:
    """The completions of a batch of prompts: P prompts x G completions, flattened prompt by prompt."""

    prompts: list[list[int]]  # (P) prompt ids
    completions: list[list[int]]  # (P * G) the ids trained on (an ended completion's end-of-text id included)
    rewards: Tensor  # (P, G) with the length penalty
    passed: Tensor  # (P, G) bool: the reward before the length penalty reached finetune.pass_reward


class GroupPolicyGradient(ObjectiveBase):
    """GRPO over a prompt data set (gptkit prepare on {"prompt": ...} or {"messages": [... user]} rows)."""

    data_kinds = ("prompts",)
    step_shown = ("reward",)

    def __init__(self, setup: Setup) -> None:
        f, t = setup.config.finetune, setup.config.train
        if setup.tokenizer is None:
            raise ConfigError("finetune.objective grpo decodes completions for the reward: the model needs a tokenizer")
        self.setup, self.gpt, self.tokenizer = setup, setup.gpt, setup.tokenizer
        self.train_prompts, self.val_prompts = setup.data.train, setup.data.val
        check_template(setup)
        for name, split in (("train", self.train_prompts), ("val", self.val_prompts)):
            if len(split.ids) and int(split.ids.max()) >= self.gpt.config.vocab_size:
                raise ConfigError(f"{name} prompts hold token id {int(split.ids.max())}, outside the model's "
                                  "vocabulary: prepare them with --tokenizer MODEL (the model trained)")  # fmt: skip
        if len(self.val_prompts) == 0:
            raise ConfigError(f"{setup.data.directory} holds no held-out prompts (prepared with --val-fraction 0): "
                              "evaluations measure reward and pass@k on them; prepare the prompts again with "
                              "--val-fraction above 0")  # fmt: skip
        self.longest_row = self._check_lengths(f.completion_tokens)
        self._check_memory(setup)
        self._check_sampling(f.group_size, f.temperature)
        self.group, self.kl_weight, self.scale = f.group_size, f.kl_weight, f.scale_rewards
        self.length_penalty, self.pass_reward, self.eval_samples = f.length_penalty, f.pass_reward, f.eval_samples
        self.params = SamplingParams(max_new_tokens=f.completion_tokens, temperature=f.temperature, top_k=f.top_k,
                                     top_p=f.top_p, stop=tuple(f.stop or ()), json_schema=_schema(f.json_schema))
        try:
            self.grammar = grammar_for(self.gpt, self.tokenizer, self.params)
        except SchemaError as err:  # read, but no grammar compiles from it
            raise ConfigError(f"finetune.json_schema {f.json_schema}: {err}") from None
        self.reward = RewardProcess(f.reward, f.reward_timeout)
        for name, split in (("train", self.train_prompts), ("val", self.val_prompts)):
            try:
                self.reward.check_rows(split.rows)
            except ConfigError as err:
                raise ConfigError(f"{err} (in the {name} split of {setup.data.directory})") from None
        self.reference = setup.method.reference(self.gpt, setup.config, setup.device) if f.kl_weight > 0 else None
        self.seed, self.rank, self.draws = t.seed, setup.world.rank, 0
        self.task_metrics = {"val_reward": "reward", "val_pass_at_1": "pass_rate",
                             f"val_pass_at_{f.eval_samples}": None}  # fmt: skip

    @staticmethod
    def _check_sampling(group_size: int, temperature: float) -> None:
        """Greedy completions of a prompt are all the same, so their group has no advantage: refused. A group of one
        has none either; it runs (a step's cost without the group's, as bench_finetune measures) with a warning."""
        if temperature < GREEDY_BELOW:
            raise ConfigError(f"finetune.temperature {temperature} samples greedily: every completion of a prompt "
                              "would be the same and nothing would train; use a temperature such as 1.0")  # fmt: skip
        if group_size == 1:
            logger.warning("finetune.group_size 1: a completion alone has no group to compare with, so nothing "
                           "trains; use 2 or more (8 is usual)")  # fmt: skip

    def _check_lengths(self, completion_tokens: int) -> int:
        """Every prompt and its longest completion must fit a learned-position model's block_size; returns the
        longest prompt's length plus completion_tokens."""
        config = self.gpt.config
        longest = max(int(np.diff(p.offsets).max()) for p in (self.train_prompts, self.val_prompts) if len(p))
        if config.position == "learned" and longest + completion_tokens > config.block_size:
            room = config.block_size - longest
            fix = f"lower finetune.completion_tokens to {room} or " if room > 0 else ""
            raise ConfigError(f"a prompt of {longest} tokens and finetune.completion_tokens {completion_tokens} "
                              f"exceed the model's block_size {config.block_size}: {fix}prepare shorter prompts "
                              "(gptkit prepare --max-length)")  # fmt: skip
        return longest + completion_tokens

    def _check_memory(self, setup: Setup) -> None:
        """The completions a step samples and trains on, and those an evaluation samples, must fit the device's free
        memory (a training forward's activations by gptkit plan's estimate, a sampling's key-value cache): a typo in
        finetune.group_size is refused here in one line, not after minutes of allocating."""
        f, t, config = setup.config.finetune, setup.config.train, self.gpt.config
        free = _free_bytes(setup.device)
        step_rows, eval_rows = t.batch_size * f.group_size, min(t.eval_examples, len(self.val_prompts)) * f.eval_samples
        memory = training_memory(config, step_rows, self.longest_row, t.dtype)
        forward = memory.activations_checkpointed if t.activation_checkpointing else memory.activations
        needs = [("finetune.group_size", f.group_size, f"x train.batch_size {t.batch_size}", step_rows,
                  max(forward, kv_cache_bytes(config, step_rows, self.longest_row, "float32"))),
                 ("finetune.eval_samples", f.eval_samples, f"x {eval_rows // f.eval_samples} held-out prompts",
                  eval_rows, kv_cache_bytes(config, eval_rows, self.longest_row, "float32"))]  # fmt: skip
        for name, value, times, rows, need in needs:
            if need > free:
                raise ConfigError(f"{name} {value} {times} = {rows:,} completions of up to {self.longest_row} tokens "
                                  f"need about {need / GIB:,.1f} GiB (gptkit plan's estimate), more than the "
                                  f"{free / GIB:,.1f} GiB free on {setup.device.type}: lower {name}")  # fmt: skip

    def stream(self, per_update: int) -> PromptBatches:
        """The training prompts in a seeded order, train.batch_size per micro-batch."""
        t = self.setup.config.train
        return PromptBatches(self.train_prompts, t.batch_size, t.seed)

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
            result = complete(self.gpt, ids, params, eos_id=self.tokenizer.eos_ids, decode=self.tokenizer.decode,
                              grammar=self.grammar)  # fmt: skip
        completions, rewards, passed = [], [], []
        for n, (index, row) in enumerate(zip(indices, result.completions)):
            for completion in row:
                text, trained = self._text_and_ids(completion)
                raw = self._score(prompts, index, text)
                completions.append(trained)
                passed.append(raw >= self.pass_reward)
                rewards.append(raw - self.length_penalty * len(completion.ids) / self.params.max_new_tokens)
        shape = (len(indices), samples)
        return Group(ids, completions, torch.tensor(rewards).view(shape), torch.tensor(passed).view(shape))

    def _text_and_ids(self, completion: Completion) -> tuple[str, list[int]]:
        """(the text the reward reads: cut before a stop string, the ids trained on: the sampled ones, with the
        end-of-text id the model chose where it chose one; none where a stop string or a grammar ended it)."""
        text = self.tokenizer.decode(completion.ids)
        cut = first_stop(text, self.params.stop)
        end = [completion.end_id] if completion.end_id is not None else []
        return (text if cut < 0 else text[:cut]), completion.ids + end

    def _score(self, prompts: Prompts, index: int, completion: str) -> float:
        """The reward of a completion of prompt index; a RewardError names the prompt."""
        text = prompts.texts[index]
        try:
            return self.reward(text, completion, prompts.rows[index])
        except RewardError as err:
            split = "train" if prompts is self.train_prompts else "val"
            shown = repr(text if len(text) <= 40 else text[:37] + "...")
            where = f"on prompt {index} ({shown}) of the {split} split of {self.setup.data.directory}"
            raise RewardError(f"{err} ({where})", interrupted=err.interrupted) from None

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """Sample the batch's groups, score them, and the policy-gradient loss over their completion tokens."""
        started = time.perf_counter()
        group = self.sample(self.train_prompts, batch.prompts or [], self.group, self._next_seed())
        sampling = time.perf_counter() - started  # (complete() waits for the device: the time is the sampling's)
        advantages = group_advantages(group.rewards, self.scale).to(self.setup.device).reshape(-1)
        x, y = completion_rows(group, self.group)
        batch.tokens = sum(len(group.prompts[i // self.group]) + len(c) - 1 for i, c in enumerate(group.completions))
        x, y = x.to(self.setup.device), y.to(self.setup.device)
        mask = y != IGNORE_INDEX
        logprobs = token_logprobs(forward(x), y)
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = token_logprobs(self.reference(x), y)
        loss, kl = policy_gradient_loss(logprobs, advantages, mask, reference, self.kl_weight)
        spread = group.rewards.std(dim=1) if self.group > 1 else torch.zeros(len(group.prompts))
        stats = {"reward": group.rewards.mean(), "reward_std": spread.mean(),
                 "zero_spread": (spread == 0).float().mean(), "pass_rate": group.passed.float().mean(),
                 "completion_tokens": torch.tensor([len(c) for c in group.completions], dtype=torch.float).mean(),
                 "sample_s": torch.tensor(sampling)}
        if self.reference is not None:
            stats["kl"] = kl
        return loss, {name: value.to(self.setup.device) for name, value in stats.items()}

    def evaluate(self, forward: Callable[..., Any]) -> dict[str, float]:
        """On the first train.eval_examples held-out prompts, eval_samples completions each (a fixed seed): the mean
        reward, pass@1 and pass@eval_samples."""
        count = min(self.setup.config.train.eval_examples, len(self.val_prompts))
        if count == 0:
            return {}
        group = self.sample(self.val_prompts, list(range(count)), self.eval_samples, self.seed + 3)
        n, correct = self.eval_samples, group.passed.sum(dim=1).tolist()
        return {"val_reward": float(group.rewards.mean()),
                "val_pass_at_1": float(np.mean([pass_at_k(n, c, 1) for c in correct])),
                f"val_pass_at_{n}": float(np.mean([pass_at_k(n, c, n) for c in correct])),
                "val_completion_tokens": float(np.mean([len(c) for c in group.completions]))}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator's state: how many seeds it has drawn."""
        return {"sampling_draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sampling seeds where the checkpoint left them."""
        self.draws = int(state.get("sampling_draws", 0))


def _free_bytes(device: torch.device) -> int:
    """Bytes the device could give now: free GPU memory, else the system's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


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
