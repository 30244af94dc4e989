"""ORPO and KTO: their losses against hand computations of TRL's formulas, and runs that learn and resume exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import same_run
from test_finetune import _losses, _run_config
from test_objectives import prepared  # noqa: F401 (a fixture)

from gptkit.finetune.orpo import orpo_loss
from gptkit.loading import load
from gptkit.loss import IGNORE_INDEX
from gptkit.train import train


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _row_mean_logprob(logits: torch.Tensor, targets: torch.Tensor, row: int) -> float:
    """A row's mean log-probability of its targets, token by token."""
    values = [float(logits[row, t].double().log_softmax(-1)[targets[row, t]]) for t in range(targets.size(1))
              if targets[row, t] != IGNORE_INDEX]  # fmt: skip
    return sum(values) / len(values)


def test_orpo_loss_equals_trls_formula():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)
    targets = torch.randint(0, 11, (4, 6))
    targets[:, :2] = IGNORE_INDEX  # the prompt
    targets[1, 5] = targets[2, 4:] = IGNORE_INDEX  # completions of different lengths
    beta = 0.25
    loss, stats = orpo_loss(logits, targets, beta)
    terms, margins, chosen_tokens, chosen_nll = [], [], 0, 0.0
    for pair in range(2):
        c, r = _row_mean_logprob(logits, targets, 2 * pair), _row_mean_logprob(logits, targets, 2 * pair + 1)
        log_odds = (c - r) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(r)))
        terms.append(math.log(1 / (1 + math.exp(-log_odds))))
        margins.append(beta * (c - r))
        kept = targets[2 * pair] != IGNORE_INDEX
        chosen_tokens += int(kept.sum())
        chosen_nll -= _row_mean_logprob(logits, targets, 2 * pair) * int(kept.sum())
    nll = chosen_nll / chosen_tokens  # a token mean over every chosen completion of the batch
    assert float(loss) == pytest.approx(nll - beta * sum(terms) / 2, rel=1e-5)
    assert float(stats["chosen_nll"]) == pytest.approx(nll, rel=1e-5)
    assert float(stats["log_odds_ratio"]) == pytest.approx(sum(terms) / 2, rel=1e-5)
    assert float(stats["margin"]) == pytest.approx(sum(margins) / 2, rel=1e-5)
    assert float(stats["accuracy"]) == sum(m > 0 for m in margins) / 2


@pytest.mark.parametrize("method", ["full", "lora"])
def test_orpo_learns_the_preference_and_resumes_exactly(method, prepared, tmp_path, device):  # noqa: F811
    base, pairs, _ = prepared
    settings = dict(objective="orpo", method=method, lora_rank=4, train={"device": device.type})
    if method == "full":
        settings.pop("lora_rank")
    whole = train(_run_config(pairs, tmp_path / "whole", base, **settings), progress=False)
    records = _records(whole.run_dir)
    assert records[-1]["val_log_odds"] > records[0]["val_log_odds"]  # the chosen reply grew likelier than the other
    assert 0 <= records[-1]["val_accuracy"] <= 1 and records[-1]["margin"] > records[1]["margin"]
    three = {**settings, "train": {"max_steps": 3, "device": device.type}}
    part = train(_run_config(pairs, tmp_path / "part", base, **three), progress=False)
    resumed = train(_run_config(pairs, part.run_dir, base, **settings), resume=True, progress=False)
    torch.testing.assert_close(_losses(resumed.run_dir), _losses(whole.run_dir), **same_run(device))
    if method == "full":
        got, want = (load(c)[0].state_dict() for c in (resumed.checkpoint, whole.checkpoint))
        torch.testing.assert_close(got, want, **same_run(device))


def test_orpo_with_beta_zero_is_refused_in_one_line(prepared, tmp_path):  # noqa: F811
    base, pairs, _ = prepared
    with pytest.raises(Exception, match=r"^finetune.orpo_beta must be > 0.0, got 0.0$"):
        _run_config(pairs, tmp_path / "r", base, objective="orpo", orpo_beta=0.0).validate()


def test_orpo_nll_is_the_plain_next_token_loss_of_the_chosen_replies(prepared):  # noqa: F811
    base, pairs, _ = prepared
    from gptkit.data import example_batches, load_examples, read_meta

    model, _ = load(base)
    model.eval()
    batch = next(iter(example_batches(load_examples(pairs, "train", read_meta(pairs)), model.config.block_size, 4)))
    with torch.no_grad():
        _, stats = orpo_loss(model(batch.x), batch.y, 0.1)
        nll = F.cross_entropy(model(batch.x[0::2]).flatten(0, 1), batch.y[0::2].flatten(), ignore_index=IGNORE_INDEX)
    assert float(stats["chosen_nll"]) == pytest.approx(float(nll), rel=1e-5)
