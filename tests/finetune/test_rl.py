"""Reinforcement learning from verifiable rewards (finetune.objective grpo): the loss against a hand computation,
advantages, masks, pass@k, rewards that fail, and whole runs (full and LoRA) that resume bit for bit."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import addition_rows, byte_model_dir, same_run, write_jsonl

from gptkit.checkpoint import latest_checkpoint
from gptkit.cli import main
from gptkit.decoding.api import Completion
from gptkit.errors import ConfigError, StepAbandoned
from gptkit.finetune.groups import Group, completion_rows
from gptkit.finetune.policy_loss import PolicyLoss, group_advantages, pass_at_k, policy_gradient_loss
from gptkit.loading import load
from gptkit.loss import IGNORE_INDEX, row_logprobs
from gptkit.run_sources import from_sources
from gptkit.train import Trainer, train
from tests.finetune.test_finetune import _losses, _run_config
from tests.train.test_train import _wait_for_step

# ---------------------------------------------------------------- the loss


def test_advantages_are_rewards_minus_their_group_mean_over_its_spread():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]])
    centred = group_advantages(rewards, scale=False)
    torch.testing.assert_close(centred, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [1.0, -1.0, 0.0, 0.0]]))
    scaled = group_advantages(rewards, scale=True)
    std = math.sqrt((0.25 * 4) / 3)  # unbiased, as torch.std and TRL
    assert scaled[0, 0].item() == pytest.approx(0.5 / (std + 1e-4), rel=1e-6)
    assert scaled[1].abs().max().item() == 0.0  # no spread: no advantage, and no division by zero
    assert group_advantages(torch.tensor([[2.0], [5.0]]), scale=True).abs().max().item() == 0.0  # groups of one


def test_the_policy_gradient_loss_equals_its_hand_computation():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    reference = torch.tensor([[-1.5, -2.0, -0.1], [-0.3, -0.2, -4.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])  # 5 completion tokens
    advantages = torch.tensor([0.8, -0.4])
    loss, stats = policy_gradient_loss(PolicyLoss(kl_weight=0.1), logprobs, advantages, mask, reference)
    kl = stats["kl"]
    # The ratio is 1 at the sampling policy: the policy term is -sum(A_i over each of its tokens) / 5.
    policy = -(0.8 * 2 - 0.4 * 3) / 5
    k3 = lambda ref, lp: math.exp(ref - lp) - (ref - lp) - 1  # noqa: E731
    pairs = [(-1.5, -1.0), (-2.0, -2.0), (-0.3, -0.3), (-0.2, -0.7), (-4.0, -9.0)]
    kl_mean = sum(k3(r, lp) for r, lp in pairs) / 5
    assert loss.item() == pytest.approx(policy + 0.1 * kl_mean, rel=1e-6)
    assert kl.item() == pytest.approx(kl_mean, rel=1e-6)
    loss.backward()
    # d/dlogp: -A_i / N from the policy term, + kl_weight * (1 - exp(ref - logp)) / N from k3; masked tokens none.
    want = torch.zeros(2, 3)
    for (i, t), (ref, lp) in zip([(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)], pairs):
        want[i, t] = (-advantages[i].item() + 0.1 * (1 - math.exp(ref - lp))) / 5
    torch.testing.assert_close(logprobs.grad, want)


def test_without_a_reference_the_loss_has_no_kl_and_equal_advantages_give_no_gradient():
    logprobs = torch.randn(3, 4, requires_grad=True)
    loss, stats = policy_gradient_loss(PolicyLoss(), logprobs, torch.zeros(3), torch.ones(3, 4, dtype=torch.bool))
    loss.backward()
    assert "kl" not in stats and loss.item() == 0.0 and logprobs.grad.abs().max().item() == 0.0


def test_only_completion_tokens_are_targets():
    group = Group(
        prompts=[[5, 6, 7], [9]],
        completions=[[1, 2], [3], [4, 4, 4], [8]],
        rewards=torch.zeros(2, 2),
        passed=torch.zeros(2, 2, dtype=torch.bool),
        scored=torch.ones(2, 2, dtype=torch.bool),
        truncated=torch.zeros(2, 2, dtype=torch.bool),
        reward_parts=torch.zeros(2, 2, 1),
    )
    x, y = completion_rows(group, samples=2)
    assert x.tolist()[0][:4] == [5, 6, 7, 1] and y.tolist()[0][:4] == [IGNORE_INDEX, IGNORE_INDEX, 1, 2]
    assert y.tolist()[1][:3] == [IGNORE_INDEX, IGNORE_INDEX, 3] and y.tolist()[1][3] == IGNORE_INDEX
    assert x.tolist()[2][:3] == [9, 4, 4] and y.tolist()[2][:3] == [4, 4, 4]
    assert y.tolist()[3][0] == 8 and (y[3, 1:] == IGNORE_INDEX).all()
    logits = torch.randn(4, x.size(1), 11)
    logprobs = row_logprobs(logits, y, "none")
    assert (logprobs[y == IGNORE_INDEX] == 0).all()
    assert logprobs[0, 2].item() == pytest.approx(logits[0, 2].log_softmax(-1)[1].item(), rel=1e-6)


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))


# ---------------------------------------------------------------- runs


def _grpo(data: Path, out: Path, base: Path, **settings) -> object:
    finetune = dict(objective="grpo", group_size=4, completion_tokens=4, eval_samples=4, temperature=1.0) | settings
    finetune["train"] = {"batch_size": 2, "eval_examples": 4} | finetune.get("train", {})
    return _run_config(data, out, base, **finetune)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_grpo_run_logs_its_rewards_and_resumes_bit_for_bit(method, prompts, tmp_path, device):
    base, data = prompts
    settings = dict(method=method, lora_rank=4, kl_weight=0.05, train={"device": device.type})
    whole = train(_grpo(data, tmp_path / "whole", base, **settings), progress=False)
    records = _records(whole.run_dir)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["zero_spread"] <= 1.0 and r["reward_std"] >= 0.0
        assert 1.0 <= r["completion_tokens"] <= 5.0 and r["kl"] >= 0.0
    evaluations = [r for r in records if "val_pass_at_1" in r]
    assert [r["step"] for r in evaluations] == [0, 3, 6]
    assert all(r["val_pass_at_1"] <= r["val_pass_at_4"] for r in evaluations)
    three = {**settings, "train": {**settings["train"], "max_steps": 3}}
    part = train(_grpo(data, tmp_path / "part", base, **three), progress=False)
    resumed = train(_grpo(data, part.run_dir, base, **settings), resume=True, progress=False)
    torch.testing.assert_close(_losses(resumed.run_dir), _losses(whole.run_dir), **same_run(device))
    rewards = lambda run: [r["reward"] for r in _records(run) if "reward" in r]  # noqa: E731
    assert rewards(resumed.run_dir) == rewards(whole.run_dir)
    got, want = (load(c)[0].state_dict() for c in (resumed.checkpoint, whole.checkpoint))
    torch.testing.assert_close(got, want, **same_run(device))


def test_a_group_with_equal_rewards_gives_no_gradient(prompts, tmp_path, monkeypatch):
    base, data = prompts
    (tmp_path / "flat.py").write_text("def score(prompt, completion, row):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(_grpo(data, tmp_path / "run", base, reward="flat:score"), resume=False)
    loss, stats = trainer.objective.loss(trainer.forward, trainer.batches.next())
    loss.backward()
    assert stats["zero_spread"].item() == 1.0 and stats["reward"].item() == 0.5
    assert all(p.grad is None or p.grad.abs().max().item() == 0.0 for p in trainer.model.parameters())


@pytest.mark.parametrize(
    "module, body, message",
    [
        ("judge_raises", "raise ValueError('bad row')", "ValueError: bad row"),
        ("judge_says_high", "return 'high'", "'high'"),
        ("judge_nan", "return float('nan')", "nan"),
    ],
)
def test_a_reward_function_that_fails_is_one_line_naming_it(
    module, body, message, prompts, tmp_path, monkeypatch, capsys
):
    base, data = prompts
    (tmp_path / f"{module}.py").write_text(f"def score(prompt, completion, row):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "run"),
            "--model.init_from",
            str(base),
            "--finetune.objective",
            "grpo",
            "--finetune.reward",
            f"{module}:score",
            "--finetune.group_size",
            "2",
            "--finetune.completion_tokens",
            "3",
            "--train.max_steps",
            "1",
            "--train.device",
            "cpu",
            "--train.batch_size",
            "1",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and f"{module}:score" in err[-1] and message in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_eval_on_a_prompt_set_is_one_line_pointing_to_pass_at_k(prompts, capsys):
    base, data = prompts
    assert main(["eval", str(base), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds prompts" in err and "val_pass_at_1" in err and len(err.splitlines()) == 1


def test_a_prompt_set_trains_only_grpo_and_grpo_only_on_prompts(prompts, sft, tmp_path):
    base, data = prompts
    with pytest.raises(ConfigError, match="finetune.objective lm trains on examples .* use finetune.objective grpo"):
        Trainer(_run_config(data, tmp_path / "lm", base), resume=False)
    _, examples = sft
    with pytest.raises(ConfigError, match="finetune.objective grpo trains on prompts .* use finetune.objective lm"):
        Trainer(_grpo(examples, tmp_path / "rl", base), resume=False)


def test_completions_follow_the_json_schema_and_end_at_stop_strings(prompts, tmp_path):
    base, data = prompts
    schema = tmp_path / "number.json"
    schema.write_text('{"type": "integer"}')
    numbers = Trainer(
        _grpo(
            data, tmp_path / "a", base, reward="regex:^\\s*-?[0-9]+\\s*$", json_schema=str(schema), completion_tokens=6
        ),
        resume=False,
    )
    group = numbers.objective.sample(numbers.objective.train_prompts, [0, 1, 2], 4, seed=5)
    assert group.passed.all()  # every completion is an integer, as the schema asks
    stops = Trainer(
        _grpo(
            data,
            tmp_path / "b",
            base,
            reward="regex:[aeiou]",
            stop=list("aeiou"),
            completion_tokens=12,
            temperature=2.0,
        ),
        resume=False,
    )
    group = stops.objective.sample(stops.objective.train_prompts, [0, 1, 2], 4, seed=5)
    assert not group.passed.any()  # the reward reads the text before the first stop string
    texts = [stops.tokenizer.decode(ids) for ids in group.completions]
    assert any(t[-1:] in "aeiou" for t in texts if t)  # (some did stop at one)


@pytest.mark.parametrize("content", [None, '{"type": "integer"', '{"type": "no such type"}'])
def test_a_json_schema_file_that_is_missing_or_invalid_is_one_error_naming_the_setting(prompts, tmp_path, content):
    base, data = prompts
    schema = tmp_path / "schema.json"
    if content is not None:
        schema.write_text(content)
    with pytest.raises(ConfigError, match=r"^finetune.json_schema .*schema.json: "):
        Trainer(_grpo(data, tmp_path / "run", base, json_schema=str(schema)), resume=False)


def test_the_trained_completion_ends_with_the_end_id_the_model_chose(prompts, tmp_path):
    base, data = prompts
    objective = Trainer(_grpo(data, tmp_path / "run", base), resume=False).objective
    assert objective._text_and_ids(Completion([65, 66], "eos", 10)) == ("AB", [65, 66, 10])  # a second end id
    assert objective._text_and_ids(Completion([65, 66], "eos", None)) == ("AB", [65, 66])  # a grammar ended it
    assert objective._text_and_ids(Completion([65, 66], "length")) == ("AB", [65, 66])


def test_greedy_sampling_is_refused_and_a_group_of_one_warned_about(prompts, tmp_path, caplog):
    base, data = prompts
    with pytest.raises(ConfigError, match="finetune.temperature 0.0 samples greedily"):
        Trainer(_grpo(data, tmp_path / "greedy", base, temperature=0.0), resume=False)
    Trainer(_grpo(data, tmp_path / "one", base, group_size=1), resume=False)
    assert "finetune.group_size 1" in caplog.text


def test_a_prompt_set_without_held_out_prompts_is_refused(tmp_path):
    base = byte_model_dir(tmp_path / "base")
    rows = write_jsonl(tmp_path / "prompts.jsonl", addition_rows(6))
    assert (
        main(
            [
                "prepare",
                "--input",
                str(rows),
                "--tokenizer",
                str(base),
                "--out",
                str(tmp_path / "data"),
                "--val-fraction",
                "0",
            ]
        )
        == 0
    )
    with pytest.raises(ConfigError, match="no held-out prompts .* --val-fraction above 0"):
        Trainer(_grpo(tmp_path / "data", tmp_path / "run", base), resume=False)


def test_a_grpo_run_killed_and_resumed_goes_on_bit_for_bit(prompts, tmp_path):
    base, data = prompts
    settings = dict(train={"max_steps": 24, "checkpoint_interval": 5, "eval_interval": 12})
    whole = train(_grpo(data, tmp_path / "whole", base, **settings), progress=False)
    config = _grpo(data, tmp_path / "run", base, **settings)
    (tmp_path / "run.yaml").write_text(config.to_yaml())
    command = [sys.executable, "-m", "gptkit", "train", "--config", str(tmp_path / "run.yaml"), "--quiet"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _wait_for_step(tmp_path / "run", process, 11)
    process.kill()  # SIGKILL: whatever it was doing is cut short
    process.wait()
    assert latest_checkpoint(tmp_path / "run") is not None
    resumed = train(config, resume=True, progress=False)
    assert resumed.step == 24
    torch.testing.assert_close(_losses(resumed.run_dir), _losses(whole.run_dir), atol=0.0, rtol=0.0)
    rewards = lambda run: {r["step"]: r["reward"] for r in _records(run) if "reward" in r}  # noqa: E731
    assert rewards(resumed.run_dir) == rewards(whole.run_dir)


# ---------------------------------------------------------------- reward functions that hang, exit or die

# The reward scores like a real one (a fixed rule of the completion) until its call number FAIL_AFTER, whose end is
# the `failure`: what a user's function may do. Each process counts its own calls (a resumed run starts a new one).
JUDGE = """import os, signal, sys, time
calls = 0

def score(prompt, completion, row):
    global calls
    calls += 1
    if calls > {fail_after}:
        {failure}
    return float(len(completion) % 2)
"""
# (The deadline is 0.5 s where the reward hangs, the default 30 s elsewhere: a busy machine never fails them.)
FAILURES = {
    "hang": (
        "time.sleep(30)",
        r"was still scoring after 0\.5 s, so its process was stopped \(finetune\.reward_timeout "
        r"is 0\.5 s\)",
    ),
    "sys.exit": ("sys.exit(3)", r"called sys\.exit\(3\)"),
    "os._exit": ("os._exit(3)", r"ended its process while scoring \(exit code 3\)"),
    "killed": ("os.kill(os.getpid(), signal.SIGKILL)", r"ended its process while scoring \(killed by SIGKILL\)"),
    "raise": ("raise ValueError('no digits')", r"raised ValueError: no digits"),
}


def _judge(directory: Path, name: str, failure: str = "pass", fail_after: int = 10**9) -> str:
    (directory / f"{name}.py").write_text(JUDGE.format(fail_after=fail_after, failure=failure))
    return f"{name}:score"


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_reward_that_hangs_exits_or_dies_is_one_line_naming_it_and_the_run_is_saved(
    failure, prompts, tmp_path, monkeypatch, capsys
):
    base, data = prompts
    monkeypatch.chdir(tmp_path)
    body, said = FAILURES[failure]
    spec = _judge(tmp_path, "judge", body, fail_after=2)  # batch 1 x group 2: the first call of step 2 fails
    run = tmp_path / "run"
    deadline = "0.5" if failure == "hang" else "30"
    code = main(
        [
            "train",
            "--data",
            str(data),
            "--out",
            str(run),
            "--model.init_from",
            str(base),
            "--quiet",
            "--finetune.objective",
            "grpo",
            "--finetune.reward",
            spec,
            "--finetune.group_size",
            "2",
            "--finetune.completion_tokens",
            "3",
            "--finetune.reward_timeout",
            deadline,
            "--train.max_steps",
            "4",
            "--train.device",
            "cpu",
            "--train.batch_size",
            "1",
            "--train.eval_at_start",
            "false",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err), err
    assert re.fullmatch(
        rf"gptkit train: error: reward (function )?judge:score {said} \(on prompt \d+ \('\d\+\d='\) "
        rf"of the train split of {re.escape(str(data))}\); the run is saved as of step 1 "
        rf"\({re.escape(str(run / 'checkpoints' / 'step-000001'))}\): continue it with --resume once "
        "that is fixed",
        err[-1],
    ), err[-1]
    assert latest_checkpoint(run).name == "step-000001"


def test_a_run_stopped_by_a_failing_reward_resumes_as_if_it_had_not_failed(prompts, tmp_path, monkeypatch):
    """The failure comes in the second micro-batch of step 3, after the first drew its batch, its sampling seed and
    its dropout: the checkpoint of step 2 is written as if step 3 had never begun."""
    base, data = prompts
    monkeypatch.chdir(tmp_path)
    settings = dict(
        method="lora",
        lora_rank=4,
        lora_dropout=0.1,
        group_size=2,
        reward="judge:score",
        train={
            "batch_size": 1,
            "grad_accum": 2,
            "max_steps": 4,
            "checkpoint_interval": 100,
            "eval_interval": 100,
            "eval_at_start": False,
        },
    )
    _judge(tmp_path, "judge")
    whole = train(_grpo(data, tmp_path / "whole", base, **settings), progress=False)
    _judge(tmp_path, "judge", "raise ValueError('broken')", fail_after=10)  # 2 calls a micro-batch: step 3's second
    with pytest.raises(StepAbandoned, match=r"raised ValueError: broken .* the run is saved as of step 2"):
        train(_grpo(data, tmp_path / "run", base, **settings), progress=False)
    assert latest_checkpoint(tmp_path / "run").name == "step-000002"
    _judge(tmp_path, "judge")  # fixed
    resumed = train(_grpo(data, tmp_path / "run", base, **settings), resume=True, progress=False)
    assert _losses(resumed.run_dir) == _losses(whole.run_dir) and len(_losses(whole.run_dir)) == 4
    rewards = lambda run: [(r["step"], r.get("reward"), r.get("val_reward")) for r in _records(run)]  # noqa: E731
    assert rewards(resumed.run_dir) == rewards(whole.run_dir)
    got, want = (load(c)[0].state_dict() for c in (resumed.checkpoint, whole.checkpoint))
    torch.testing.assert_close(got, want, atol=0.0, rtol=0.0)


def test_sigterm_while_a_reward_hangs_checkpoints_and_stops_at_once(prompts, tmp_path, monkeypatch):
    base, data = prompts
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "hanging"
    spec = _judge(
        tmp_path, "judge", f"open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)", fail_after=2
    )
    config = _grpo(
        data,
        tmp_path / "run",
        base,
        group_size=2,
        reward=spec,
        reward_timeout=120.0,
        train={"batch_size": 1, "max_steps": 4, "eval_at_start": False},
    )

    def terminate() -> None:  # once the reward hangs, as `kill` from another terminal would
        deadline = time.monotonic() + 60
        while not (marker.is_file() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate)
    killer.start()
    try:
        result = train(config, progress=False)
        stopped = time.monotonic()
    finally:
        killer.join()
    assert result.interrupted and result.step == 1 and result.checkpoint.name == "step-000001"
    assert latest_checkpoint(tmp_path / "run") == result.checkpoint
    with pytest.raises(ProcessLookupError):  # the reward's process was killed, not left sleeping
        os.kill(int(marker.read_text()), 0)
    assert stopped - marker.stat().st_mtime < 10  # at once, not after the reward's 60 s (or its 120 s deadline)


def test_the_reward_timeout_is_checked_and_may_change_on_resume(prompts, tmp_path, capsys):
    base, data = prompts
    with pytest.raises(ConfigError, match=r"^finetune.reward_timeout must be > 0.0, got 0.0$"):
        _grpo(data, tmp_path / "zero", base, reward_timeout=0.0).validate()
    run = tmp_path / "run"
    flags = [
        "--finetune.objective",
        "grpo",
        "--finetune.group_size",
        "2",
        "--finetune.completion_tokens",
        "2",
        "--train.device",
        "cpu",
        "--train.batch_size",
        "1",
        "--train.eval_at_start",
        "false",
        "--quiet",
    ]
    assert (
        main(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(run),
                "--model.init_from",
                str(base),
                "--train.max_steps",
                "1",
                *flags,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--out",
                str(run),
                "--resume",
                "--train.max_steps",
                "2",
                "--finetune.reward_timeout",
                "90",
                "--quiet",
            ]
        )
        == 0
    )  # a reward that timed out may be given longer
    assert from_sources(run / "config.yaml", {}).finetune.value("reward_timeout") == 90
    assert main(["train", "--out", str(run), "--resume", "--finetune.group_size", "4"]) == 2  # the others may not
    assert "finetune.group_size cannot change on --resume" in capsys.readouterr().err


# ---------------------------------------------------------------- sizes a typo makes too large


@pytest.mark.parametrize(
    "setting, value, message",
    [
        (
            "group_size",
            10**8,
            r"finetune.group_size 100000000 x train.batch_size 2 = 200,000,000 completions of up to "
            r"\d+ tokens need about [\d,.]+ GiB \(gptkit plan's estimate\), more than the [\d,.]+ GiB "
            r"free on cpu: lower finetune.group_size",
        ),
        (
            "eval_samples",
            10**9,
            r"finetune.eval_samples 1000000000 x 4 held-out prompts = 4,000,000,000 completions of up "
            r"to \d+ tokens need about [\d,.]+ GiB .* lower finetune.eval_samples",
        ),
    ],
)
def test_a_group_too_large_for_memory_is_refused_before_any_work(setting, value, message, prompts, tmp_path):
    base, data = prompts  # (terabytes at these sizes: more than any machine this runs on holds)
    with pytest.raises(ConfigError, match=message) as caught:
        Trainer(_grpo(data, tmp_path / "run", base, **{setting: value}), resume=False)
    assert "\n" not in str(caught.value)
