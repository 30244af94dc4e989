"""ORPO and KTO: their losses against hand computations of TRL's formulas, KTO's data, and runs that learn and resume
exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import preference_rows, same_run, write_jsonl

from gptkit.cli import main
from gptkit.data import load_examples, read_meta
from gptkit.finetune.kto import KtoSettings, kto_loss, mismatched
from gptkit.finetune.orpo import orpo_loss
from gptkit.loading import load
from gptkit.loss import IGNORE_INDEX
from gptkit.train import train
from tests.finetune.test_finetune import _losses, _run_config


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _row_mean_logprob(logits: torch.Tensor, targets: torch.Tensor, row: int) -> float:
    """A row's mean log-probability of its targets, token by token."""
    values = [
        float(logits[row, t].double().log_softmax(-1)[targets[row, t]])
        for t in range(targets.size(1))
        if targets[row, t] != IGNORE_INDEX
    ]
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
def test_orpo_learns_the_preference_and_resumes_exactly(method, prepared, tmp_path, device):
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


def test_orpo_with_beta_zero_is_refused_in_one_line(prepared, tmp_path):
    base, pairs, _ = prepared
    with pytest.raises(Exception, match=r"^finetune.orpo_beta must be > 0.0, got 0.0$"):
        _run_config(pairs, tmp_path / "r", base, objective="orpo", orpo_beta=0.0).validate()


def test_orpo_nll_is_the_plain_next_token_loss_of_the_chosen_replies(prepared):
    base, pairs, _ = prepared
    from gptkit.data import example_batches

    model, _ = load(base)
    model.eval()
    batch = next(iter(example_batches(load_examples(pairs, "train", read_meta(pairs)), model.config.block_size, 4)))
    with torch.no_grad():
        _, stats = orpo_loss(model(batch.x), batch.y, 0.1)
        nll = F.cross_entropy(model(batch.x[0::2]).flatten(0, 1), batch.y[0::2].flatten(), ignore_index=IGNORE_INDEX)
    assert float(stats["chosen_nll"]) == pytest.approx(float(nll), rel=1e-5)


# ---------------------------------------------------------------- KTO


def unpaired_rows(count: int) -> list[dict]:
    """The preference pairs of test_objectives, split: each chosen reply marked desirable, each rejected one not."""
    rows = []
    for pair in preference_rows(count):
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


@pytest.fixture(scope="module")
def unpaired(prepared, tmp_path_factory) -> Path:
    base = prepared[0]
    root = tmp_path_factory.mktemp("kto")
    data = root / "data"
    assert (
        main(
            [
                "prepare",
                "--input",
                str(write_jsonl(root / "u.jsonl", unpaired_rows(30))),
                "--tokenizer",
                str(base),
                "--out",
                str(data),
            ]
        )
        == 0
    )
    return data


def test_unpaired_rows_are_stored_with_true_and_false_labels(unpaired):
    meta = read_meta(unpaired)
    assert meta.kind == "unpaired" and meta.labels == ["false", "true"]
    examples = load_examples(unpaired, "train", meta)
    assert set(examples.labels.tolist()) == {0, 1} and len(examples.labels) == len(examples)
    assert (examples.targets() > 0).all()  # each completion is trained on, its prompt not


@pytest.mark.parametrize(
    "label, message", [("yes", "must be true or false, got a string"), (1, "must be true or false, got a number")]
)
def test_an_unpaired_label_that_is_not_a_boolean_is_one_line(label, message, prepared, tmp_path, capsys):
    rows = [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": label}]
    code = main(
        [
            "prepare",
            "--input",
            str(write_jsonl(tmp_path / "u.jsonl", rows)),
            "--tokenizer",
            str(prepared[0]),
            "--out",
            str(tmp_path / "d"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code != 0 and "line 2" in err and message in err


def test_kto_loss_equals_trls_formula():
    policy, reference = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -4.5, -2.0])
    desirable = torch.tensor([True, False, True])
    settings = KtoSettings(kto_beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    kl = torch.tensor(0.3)
    out = kto_loss(policy, reference, kl, desirable, settings)
    sigmoid = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    want = [
        2.0 * (1 - sigmoid(0.5 * (1.0 - 0.3))),
        0.5 * (1 - sigmoid(0.5 * (0.3 - (-0.5)))),
        2.0 * (1 - sigmoid(0.5 * (0.0 - 0.3))),
    ]
    torch.testing.assert_close(out["loss"], torch.tensor(want))
    torch.testing.assert_close(out["reward"], torch.tensor([0.5, -0.25, 0.0]))
    assert out["agrees"].tolist() == [1.0, 1.0, 0.0]  # 1.0 > 0.3; -0.5 < 0.3; 0.0 < 0.3 though desirable


def test_the_kl_estimate_pairs_each_prompt_with_the_next_completion():
    i = IGNORE_INDEX
    x = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]])  # prompts [1, 2] and [4]; completions [3, 9] and [5, 6, 7, 8]
    y = torch.tensor([[i, 3, 9, i], [5, 6, 7, 8]])
    kx, ky = mismatched(x, y)
    assert kx[0].tolist()[:5] == [1, 2, 5, 6, 7] and ky[0].tolist()[:5] == [i, 5, 6, 7, 8]
    assert kx[1].tolist()[:2] == [4, 3] and ky[1].tolist()[:2] == [3, 9] and (ky[1, 2:] == i).all()


@pytest.mark.parametrize("method", ["full", "lora"])
def test_kto_starts_at_half_learns_the_labels_and_resumes_exactly(method, prepared, unpaired, tmp_path, device):
    base = prepared[0]
    settings = dict(objective="kto", method=method, train={"device": device.type})
    if method == "lora":
        settings["lora_rank"] = 4
    whole = train(_run_config(unpaired, tmp_path / "whole", base, **settings), progress=False)
    records = _records(whole.run_dir)
    assert records[0]["val_loss"] == pytest.approx(0.5, abs=1e-6) and records[0]["val_kl"] == 0.0
    assert records[0]["val_accuracy"] == 0.0  # every reward is 0, and KL: none is on its label's side yet
    losses = [r["val_loss"] for r in records if "val_loss" in r]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.5  # the objective falls at every evaluation
    assert records[-1]["val_accuracy"] > 0 and records[-1]["val_kl"] > 0
    three = {**settings, "train": {"max_steps": 3, "device": device.type}}
    part = train(_run_config(unpaired, tmp_path / "part", base, **three), progress=False)
    resumed = train(_run_config(unpaired, part.run_dir, base, **settings), resume=True, progress=False)
    torch.testing.assert_close(_losses(resumed.run_dir), _losses(whole.run_dir), **same_run(device))
