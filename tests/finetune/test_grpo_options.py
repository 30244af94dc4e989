"""GRPO as practitioners run it: the four loss types and the clipped ratio against hand computations, advantages that
reach their own completions, num_iterations, weighted rewards that may not apply, mask_truncated, grad_accum
weighing, and a LoRA reference that is the base."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import same_run

from gptkit.config import ModelConfig
from gptkit.finetune.groups import Group, completion_rows
from gptkit.finetune.policy_loss import PolicyLoss, group_advantages, policy_gradient_loss
from gptkit.loading import load
from gptkit.loss import row_logprobs
from gptkit.model import GPT
from gptkit.train import Trainer, train
from tests.finetune.test_finetune import _losses, _run_config
from tests.finetune.test_rl import _grpo, _records

EPS, EPS_HIGH = 0.2, 0.28


def _hand_token_loss(lp: float, old: float, advantage: float) -> float:
    """PPO's clipped surrogate of one token, negated, as TRL writes it."""
    ratio = math.exp(lp - old)
    clipped = min(max(ratio, 1 - EPS), 1 + EPS_HIGH)
    return -min(ratio * advantage, clipped * advantage)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_each_loss_type_equals_its_hand_computation_with_the_ratio_clipped(loss_type):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -0.1], [-0.3, -0.7, -3.0, -1.0], [-2.0, -0.2, -0.4, -0.6]])
    # old differs from logprobs so that ratios fall below 1 - EPS, inside, and above 1 + EPS_HIGH
    old = logprobs + torch.tensor([[0.5, 0.0, -0.4, 0.1], [-0.3, 0.05, 0.0, 0.0], [0.0, 0.4, -0.1, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True], [True, False, False, False]])
    advantages = torch.tensor([1.0, -0.5, 2.0])
    rule = PolicyLoss(loss_type, EPS, EPS_HIGH, 0.0, completion_tokens=6)
    loss, stats = policy_gradient_loss(rule, logprobs, advantages, mask, old=old)
    per_token = [
        [
            _hand_token_loss(float(logprobs[i, t]), float(old[i, t]), float(advantages[i]))
            for t in range(4)
            if mask[i, t]
        ]
        for i in range(3)
    ]
    tokens = sum(len(row) for row in per_token)
    want = {
        "dapo": sum(map(sum, per_token)) / tokens,
        "bnpo": sum(map(sum, per_token)) / tokens,
        "grpo": sum(sum(row) / len(row) for row in per_token) / 3,
        "dr_grpo": sum(map(sum, per_token)) / (3 * 6),
    }[loss_type]
    assert float(loss) == pytest.approx(want, rel=1e-6)
    ratios = [
        (math.exp(float(logprobs[i, t] - old[i, t])), float(advantages[i]))
        for i in range(3)
        for t in range(4)
        if mask[i, t]
    ]
    binding = sum((r < 1 - EPS and a < 0) or (r > 1 + EPS_HIGH and a > 0) for r, a in ratios)
    assert binding > 0 and float(stats["clipped"]) == pytest.approx(binding / tokens)


def test_a_clipped_token_gives_no_gradient_and_an_unclipped_one_that_of_the_ratio():
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]])  # ratio e^0.5 = 1.65 > 1 + EPS_HIGH: clipped; then ratio 1
    loss, _ = policy_gradient_loss(
        PolicyLoss("dapo", EPS, EPS_HIGH), logprobs, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), old=old
    )
    loss.backward()
    assert logprobs.grad[0, 0].item() == 0.0
    assert logprobs.grad[0, 1].item() == pytest.approx(-1.0 / 2)  # -A * ratio / tokens


def test_each_completions_advantage_reaches_its_own_tokens():
    torch.manual_seed(0)
    logprobs = torch.randn(4, 5, requires_grad=True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False
    advantages = torch.tensor([0.7, -1.1, 0.0, 0.4])
    loss, _ = policy_gradient_loss(PolicyLoss("grpo"), logprobs, advantages, mask)
    loss.backward()
    lengths = mask.sum(dim=1)
    want = -(advantages[:, None] / lengths[:, None]) / 4 * mask  # each token: -A_i / |o_i| / N
    torch.testing.assert_close(logprobs.grad, want)
    # permuting the completions (their logprobs, masks and advantages together) permutes the gradient with them
    order = torch.tensor([2, 0, 3, 1])
    moved = logprobs.detach()[order].clone().requires_grad_(True)
    policy_gradient_loss(PolicyLoss("grpo"), moved, advantages[order], mask[order])[0].backward()
    torch.testing.assert_close(moved.grad, logprobs.grad[order])


def test_unscored_completions_have_no_advantage_and_do_not_shift_their_groups_mean():
    rewards = torch.tensor([[1.0, 0.0, 9.0, 0.0]])
    scored = torch.tensor([[True, True, False, True]])
    got = group_advantages(rewards, scale=False, scored=scored)
    mean = (1.0 + 0.0 + 0.0) / 3
    torch.testing.assert_close(got, torch.tensor([[1 - mean, -mean, 0.0, -mean]]))
    scaled = group_advantages(rewards, scale=True, scored=scored)
    std = math.sqrt(((1 - mean) ** 2 + 2 * mean**2) / 2)
    assert float(scaled[0, 0]) == pytest.approx((1 - mean) / (std + 1e-4), rel=1e-6) and float(scaled[0, 2]) == 0.0


def test_one_update_raises_the_best_completions_log_probability():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=16))
    completions = [[3, 4, 5], [6, 7], [8, 9, 10], [11]]
    group = Group(
        [[1, 2]],
        completions,
        torch.tensor([[1.0, 0.0, 0.2, 0.0]]),
        torch.zeros(1, 4, dtype=torch.bool),
        torch.ones(1, 4, dtype=torch.bool),
        torch.zeros(1, 4, dtype=torch.bool),
        torch.zeros(1, 4, 1),
    )
    x, y = completion_rows(group, samples=4)

    def sequence_logprobs() -> torch.Tensor:
        return row_logprobs(model(x), y, "none").sum(dim=1)

    before = sequence_logprobs().detach()
    advantages = group_advantages(group.rewards, scale=True).reshape(-1)
    loss, _ = policy_gradient_loss(PolicyLoss(), row_logprobs(model(x), y, "none"), advantages, y != -100)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
    after = sequence_logprobs().detach()
    assert after[0] > before[0] and after[1] < before[1] and after[3] < before[3]


def _user_reward(tmp_path, monkeypatch, body: str) -> str:
    (tmp_path / "judge.py").write_text(f"def score(prompt, completion, row):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    return "judge:score"


def test_weighted_rewards_sum_and_a_reward_returning_none_leaves_its_completions_out(prompts, tmp_path, monkeypatch):
    base, data = prompts
    # Applies to even ids only: the other prompts' completions are scored by no reward and train nothing.
    spec = _user_reward(tmp_path, monkeypatch, "return float(len(completion)) if row['id'] % 2 == 0 else None")
    trainer = Trainer(_grpo(data, tmp_path / "run", base, reward=[spec, spec], reward_weights=[0.5, 2.0]), resume=False)
    batch = trainer.batches.next()
    train_rows = trainer.objective.train_prompts.rows
    batch.prompts = [next(i for i, r in enumerate(train_rows) if r["id"] % 2 == parity) for parity in (0, 1)]
    group = trainer.objective.sample(trainer.objective.train_prompts, batch.prompts, 4, 7)
    rows = [train_rows[i] for i in batch.prompts]
    for p, row in enumerate(rows):
        for g in range(4):
            if row["id"] % 2 == 0:  # both rewards give the completion's length: 0.5 x it + 2 x it
                length = float(group.reward_parts[p, g, 0])
                assert float(group.reward_parts[p, g, 1]) == length and float(group.rewards[p, g]) == 2.5 * length
                assert bool(group.scored[p, g])
            else:
                assert not bool(group.scored[p, g]) and float(group.rewards[p, g]) == 0.0
                assert math.isnan(float(group.reward_parts[p, g, 0]))
    trainer.objective._group_for = lambda batch: (group, 0.0)
    loss, stats = trainer.objective.loss(trainer.forward, batch)
    loss.backward()
    assert float(stats["unscored"]) == pytest.approx(float(1 - group.scored.float().mean()))
    assert float(stats["reward_1"]) == pytest.approx(float(group.reward_parts[..., 0].nanmean()))


def test_mask_truncated_leaves_cut_completions_out_of_the_loss(prompts, tmp_path, monkeypatch):
    base, data = prompts
    spec = _user_reward(tmp_path, monkeypatch, "return float(len(completion))")
    trainer = Trainer(_grpo(data, tmp_path / "run", base, reward=spec, mask_truncated=True), resume=False)
    batch = trainer.batches.next()
    group = trainer.objective.sample(trainer.objective.train_prompts, batch.prompts, 4, 3)
    group.truncated = torch.tensor([[True, True, True, True], [False, False, False, False]])
    trainer.objective._group_for = lambda batch: (group, 0.0)
    loss, _ = trainer.objective.loss(trainer.forward, batch)
    loss.backward()
    scale = trainer.objective.update_scale()  # dapo: the sum above over the update's trained tokens
    grads = {n: p.grad * scale for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()
    alone = Group(
        group.prompts[1:],
        group.completions[4:],
        group.rewards[1:],
        group.passed[1:],
        group.scored[1:],
        group.truncated[1:],
        group.reward_parts[1:],
    )
    x, y = completion_rows(alone, 4)
    advantages = group_advantages(alone.rewards, True, alone.scored).reshape(-1)
    rule = trainer.objective.rule
    want, _ = policy_gradient_loss(rule, row_logprobs(trainer.forward(x), y, "none"), advantages, y != -100)
    want.backward()
    for name, param in trainer.model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_grad_accum_weighs_micro_batches_as_the_loss_type_defines(loss_type, prompts, tmp_path, monkeypatch):
    base, data = prompts
    spec = _user_reward(tmp_path, monkeypatch, "return float(len(completion) % 3)")
    one = Trainer(
        _grpo(data, tmp_path / "one", base, reward=spec, loss_type=loss_type, train={"batch_size": 2}), resume=False
    )
    two = Trainer(
        _grpo(data, tmp_path / "two", base, reward=spec, loss_type=loss_type, train={"batch_size": 1, "grad_accum": 2}),
        resume=False,
    )
    batch = one.batches.next()
    whole = one.objective.sample(one.objective.train_prompts, batch.prompts, 4, 11)
    halves = [
        Group(
            whole.prompts[k : k + 1],
            whole.completions[4 * k : 4 * k + 4],
            whole.rewards[k : k + 1],
            whole.passed[k : k + 1],
            whole.scored[k : k + 1],
            whole.truncated[k : k + 1],
            whole.reward_parts[k : k + 1],
        )
        for k in range(2)
    ]
    one.objective._group_for = lambda batch: (whole, 0.0)
    feed = iter(halves)
    two.objective._group_for = lambda batch: (next(feed), 0.0)
    per_micro = []  # bnpo by hand: each micro-batch's token mean under the starting weights
    for half in halves:
        x, y = completion_rows(half, 4)
        advantages = group_advantages(half.rewards, True, half.scored).reshape(-1)
        with torch.no_grad():
            per_micro.append(
                policy_gradient_loss(
                    PolicyLoss("bnpo"), row_logprobs(two.forward(x), y, "none"), advantages, y != -100
                )[0]
            )
    loss_one, norm_one, _ = one.train_step()
    loss_two, norm_two, _ = two.train_step()
    if loss_type == "dapo":  # every token of the update alike: two micro-batches are one batch of twice the size
        torch.testing.assert_close(loss_two, loss_one, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(norm_two, norm_one, rtol=1e-4, atol=1e-6)
    else:  # bnpo: each micro-batch's token mean, the two weighed equally
        assert float(loss_two) == pytest.approx(float(sum(per_micro) / 2), rel=1e-5, abs=1e-7)


def test_num_iterations_two_reuses_each_sampling_and_resumes_between_iterations(prompts, tmp_path, device):
    base, data = prompts
    settings = dict(
        num_iterations=2,
        epsilon_high=0.28,
        train={"device": device.type, "max_steps": 4, "checkpoint_interval": 1, "eval_interval": 4},
    )
    whole = train(_grpo(data, tmp_path / "whole", base, **settings), progress=False)
    steps = [r for r in _records(whole.run_dir) if "loss" in r]
    sampled = [r["sample_s"] > 0 for r in steps]
    assert sampled == [True, False, True, False]  # the second update of each sampling samples nothing
    assert steps[0]["clipped"] == 0.0  # on-policy: the ratio is 1
    # stopped after step 3 (the first of a sampling's two updates): the kept group is in the checkpoint
    part = train(
        _grpo(data, tmp_path / "part", base, **{**settings, "train": {**settings["train"], "max_steps": 3}}),
        progress=False,
    )
    resumed = train(_grpo(data, part.run_dir, base, **settings), resume=True, progress=False)
    torch.testing.assert_close(_losses(resumed.run_dir), _losses(whole.run_dir), **same_run(device))
    got, want = (load(c)[0].state_dict() for c in (resumed.checkpoint, whole.checkpoint))
    torch.testing.assert_close(got, want, **same_run(device))


def test_the_lora_reference_is_the_base_kl_zero_first_then_above(prompts, tmp_path, monkeypatch):
    base, data = prompts
    spec = _user_reward(tmp_path, monkeypatch, "return float(len(completion))")  # a spread: the adapters move
    run = train(
        _grpo(
            data, tmp_path / "run", base, method="lora", lora_rank=4, kl_weight=0.1, reward=spec, train={"max_steps": 4}
        ),
        progress=False,
    )
    kl = [r["kl"] for r in _records(run.run_dir) if "kl" in r]
    assert kl[0] == 0.0 and kl[-1] > 0.0


@pytest.mark.parametrize("objective", ["lm", "grpo"])
def test_fine_tuning_and_rl_runs_are_measured_on_the_bases_own_text(objective, sft, prompts, tmp_path, monkeypatch):
    from gptkit.cli import main

    text = tmp_path / "text.txt"  # held-out text of the base's own kind, prepared with its tokenizer
    text.write_text(" ".join(["the apple and the river", "a stone, a cloud; the night"] * 200))
    observed = tmp_path / "observed"
    assert main(["prepare", "--input", str(text), "--tokenizer", "byte", "--out", str(observed)]) == 0
    if objective == "lm":  # supervised conversations
        base, data = sft
        config = _run_config(data, tmp_path / "run", base, train={"observe_data": str(observed)})
    else:
        base, data = prompts
        spec = _user_reward(tmp_path, monkeypatch, "return float(len(completion))")
        config = _grpo(data, tmp_path / "run", base, reward=spec, train={"observe_data": str(observed)})
    run = train(config, progress=False)
    evaluations = [r for r in _records(run.run_dir) if "val_loss" in r or "val_reward" in r]
    assert [r["step"] for r in evaluations] == [0, 3, 6]
    for record in evaluations:
        assert math.isfinite(record["icl_score"]) and 0 <= record["induction_score"] <= 1
        assert math.isfinite(record["ablation_repeat_change"])
    assert len((run.run_dir / "insight.jsonl").read_text().splitlines()) == 3


def test_observe_data_of_another_vocabulary_is_refused_in_one_line(sft, tmp_path):
    from gptkit.cli import main

    base, data = sft
    text = tmp_path / "text.txt"
    text.write_text("abcdefgh " * 500)
    assert main(["prepare", "--input", str(text), "--tokenizer", "char", "--out", str(tmp_path / "chars")]) == 0
    with pytest.raises(Exception, match=r"^train.observe_data .* must be text prepared with the model's tokenizer"):
        Trainer(
            _run_config(data, tmp_path / "run", base, train={"observe_data": str(tmp_path / "chars")}), resume=False
        )
