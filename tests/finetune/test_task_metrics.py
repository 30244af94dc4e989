"""Task metrics at each evaluation, for every objective: exact match of generated replies (supervised examples),
accuracy and macro-F1 (classification), preference accuracy and margin (DPO); into metrics.jsonl, the progress
line and loss.png's panels."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.data import Examples
from gptkit.decoding.api import generate_ids
from gptkit.evaluate import classification_scores
from gptkit.finetune.objectives import exact_match, reply_of
from gptkit.model import GPT
from gptkit.observe.training import plot_run
from gptkit.train import train
from tests.finetune.test_finetune import _run_config


def _example(prompt: list[int], reply: list[int], tail: list[int] = ()) -> tuple[list[int], list[int]]:
    return prompt + reply + list(tail), [0] * len(prompt) + [1] * len(reply) + [0] * len(tail)


def _examples(rows: list[tuple[list[int], list[int]]]) -> Examples:
    ids = np.concatenate([np.asarray(i, dtype=np.uint32) for i, _ in rows])
    trained = np.concatenate([np.asarray(t, dtype=np.uint8) for _, t in rows])
    offsets = np.cumsum([0] + [len(i) for i, _ in rows]).astype(np.int64)
    return Examples(ids, trained, offsets)


def test_the_first_reply_is_the_first_run_of_trained_tokens():
    ids, trained = _example([1, 2], [3, 4], [5])
    assert reply_of(np.asarray(ids), np.asarray(trained)) == ([1, 2], [3, 4])
    assert reply_of(np.asarray([7, 8]), np.asarray([0, 0])) is None  # nothing trained
    assert reply_of(np.asarray([7, 8, 9]), np.asarray([1, 1, 1])) is None  # all trained (--loss-on all): no prompt


def test_exact_match_counts_the_replies_the_model_writes_greedily():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=40, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    prompt = [3, 4, 5]
    greedy = generate_ids(model, prompt, max_new_tokens=8, temperature=0.0)
    k = next(k for k in range(1, 8) if greedy[k] not in greedy[:k])  # greedy[k] ends the reply: the "end" id
    tokenizer = SimpleNamespace(eos_ids=(greedy[k],))
    wrong = [(greedy[0] + 1) % 40] + greedy[1 : k + 1]
    examples = _examples(
        [
            _example(prompt, greedy[: k + 1]),  # the reply and its end: a match
            _example(prompt, wrong),  # one token off
            _example(prompt, greedy[:k] + [greedy[k] + 1 if greedy[k] < 39 else 0]),  # no end
            _example(prompt, greedy[:2]),
        ]
    )  # cut short (no end id): its tokens as far as they go
    assert exact_match(model, tokenizer, examples, 4) == pytest.approx(2 / 4)
    assert exact_match(model, tokenizer, examples, 1) == 1.0


def _evaluations(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_loss" in r]


def test_supervised_runs_log_the_exact_match_of_their_replies(sft, tmp_path, capsys):
    base, data = sft
    run = train(_run_config(data, tmp_path / "run", base, train={"eval_examples": 5, "plot": True}), progress=True)
    evaluations = _evaluations(run.run_dir)
    assert [r["step"] for r in evaluations] == [0, 3, 6]
    assert all(0.0 <= r["val_exact_match"] <= 1.0 and r["val_ppl"] > 1.0 for r in evaluations)
    assert "exact match" in capsys.readouterr().err
    assert (run.run_dir / "loss.png").stat().st_size > 0


@pytest.mark.parametrize(
    "objective, metrics", [("classify", ("val_accuracy", "val_macro_f1")), ("dpo", ("val_accuracy", "val_margin"))]
)
def test_classification_and_dpo_runs_log_their_task_metrics(objective, metrics, prepared, tmp_path):
    base, pairs, texts = prepared
    data = texts if objective == "classify" else pairs
    run = train(_run_config(data, tmp_path / "run", base, objective=objective), progress=False)
    evaluations = _evaluations(run.run_dir)
    assert len(evaluations) == 3 and all(r[m] is not None for r in evaluations for m in metrics)
    assert all(0.0 <= r["val_accuracy"] <= 1.0 for r in evaluations)


def test_macro_f1_is_the_mean_f1_over_the_labels():
    truth, predicted = np.array([0, 0, 1, 1, 2]), np.array([0, 1, 1, 1, 0])
    # label 0: TP 1, FP 1, FN 1 -> 0.5; label 1: TP 2, FP 1, FN 0 -> 0.8; label 2: TP 0, FN 1 -> 0
    assert classification_scores(truth, predicted, ["a", "b", "c"])["macro_f1"] == pytest.approx((0.5 + 0.8) / 3)


def test_loss_png_has_a_panel_per_task_metric(tmp_path, monkeypatch):
    history = [
        {"step": s, "loss": 1.0 / (s + 1), "val_loss": 1.0, "val_reward": s / 10, "val_pass_at_1": s / 20}
        for s in range(0, 30, 10)
    ]
    panels = []
    from matplotlib.figure import Figure

    real = Figure.subplots
    monkeypatch.setattr(Figure, "subplots", lambda self, *a, **k: panels.append(a[0]) or real(self, *a, **k))
    plot_run(history, tmp_path / "loss.png", {"val_reward": "reward", "val_pass_at_1": None, "val_pass_at_8": None})
    assert panels == [3]  # losses, reward, pass@1 (pass@8 was never logged: no empty panel)
    plot_run([r | {"loss": None, "val_loss": None} for r in history], tmp_path / "rl.png", {"val_reward": None})
    assert panels == [3, 1]


def _first_reply(ids: np.ndarray, trained: np.ndarray) -> tuple[list[int], list[int]]:
    """(prompt, reply): the tokens before the first trained one, and the run of trained tokens from it."""
    start = int(np.flatnonzero(trained)[0])
    end = start + int(np.argmin(trained[start:])) if not trained[start:].all() else len(ids)
    return ids[:start].tolist(), ids[start:end].tolist()


def test_the_logged_exact_match_is_what_the_final_model_writes(sft, tmp_path):
    from helpers import WORDS, write_jsonl

    from gptkit.cli import main
    from gptkit.data import load_examples, read_meta
    from gptkit.loading import load

    base, _ = sft
    rows = [{"prompt": f"{w} {w[::-1]}?", "completion": " yes" if w[0] in "aeiou" else " no"} for w in WORDS * 8]
    data = tmp_path / "data"  # a task a few steps learn in part: the logged share is neither 0 nor 1
    assert (
        main(
            [
                "prepare",
                "--input",
                str(write_jsonl(tmp_path / "r.jsonl", rows)),
                "--tokenizer",
                str(base),
                "--out",
                str(data),
                "--val-fraction",
                "0.2",
            ]
        )
        == 0
    )
    run = train(
        _run_config(data, tmp_path / "run", base, train={"eval_examples": 6, "max_steps": 30, "eval_interval": 30}),
        progress=False,
    )
    logged = _evaluations(run.run_dir)[-1]["val_exact_match"]
    model, tokenizer = load(run.checkpoint)
    val = load_examples(data, "val", read_meta(data))
    hits = 0
    for a, b in zip(val.offsets[:6], val.offsets[1:7]):  # the first eval_examples held-out examples
        prompt, reply = _first_reply(np.asarray(val.ids[a:b]), np.asarray(val.trained[a:b]))
        assert reply[-1] in tokenizer.eos_ids  # a whole reply ends with its end-of-text token
        written = generate_ids(model.eval(), prompt, max_new_tokens=len(reply), temperature=0.0, eos_id=None)
        hits += written[: len(reply)] == reply  # the reply, then its end, greedily
    assert logged == pytest.approx(hits / 6) and hits > 0  # (0.83 here: some replies right, not all)


def test_the_logged_dpo_margin_and_accuracy_are_the_final_models(prepared, tmp_path):
    from gptkit.data import load_examples, read_meta
    from gptkit.loading import load

    base, pairs, _ = prepared
    run = train(_run_config(pairs, tmp_path / "run", base, objective="dpo", dpo_beta=0.5), progress=False)
    last = _evaluations(run.run_dir)[-1]
    val = load_examples(pairs, "val", read_meta(pairs))
    policy, reference = load(run.checkpoint)[0].eval(), load(base)[0].eval()

    def summed(model: GPT, row: int) -> float:
        ids = torch.tensor(np.asarray(val.ids[val.offsets[row] : val.offsets[row + 1]], dtype=np.int64))
        trained = np.asarray(val.trained[val.offsets[row] : val.offsets[row + 1]]).astype(bool)
        with torch.no_grad():
            logprobs = model(ids[None, :-1])[0].double().log_softmax(-1)
        return sum(float(logprobs[t - 1, ids[t]]) for t in range(1, len(ids)) if trained[t])

    margins = [
        0.5
        * (
            (summed(policy, 2 * p) - summed(reference, 2 * p))
            - (summed(policy, 2 * p + 1) - summed(reference, 2 * p + 1))
        )
        for p in range(min(len(val) // 2, 2 * 4))
    ]  # eval_iters x batch_size pairs at most
    assert last["val_margin"] == pytest.approx(float(np.mean(margins)), rel=1e-4, abs=1e-5)
    assert last["val_accuracy"] == pytest.approx(float(np.mean([m > 0 for m in margins])))
