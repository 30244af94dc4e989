"""Fine-tuning II: DPO over preference pairs and GPT-1's classification head (data, training, eval, export)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import FRUIT, VARIANTS, labelled_rows, preference_rows, same_run, write_jsonl

from gptkit.adapters import adapters
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.data import ExampleBatches, example_batches, load_examples, read_meta
from gptkit.evaluate import classification_scores
from gptkit.finetune.dpo import dpo_loss, preference_loss
from gptkit.finetune.heads import SequenceClassifier, is_classifier_dir, load_head, predict
from gptkit.loading import load
from gptkit.loss import IGNORE_INDEX, row_logprobs
from gptkit.model import GPT
from gptkit.tokenizer import ByteTokenizer
from gptkit.train import Trainer, train
from tests.finetune.test_finetune import _losses, _run_config

# ---------------------------------------------------------------- data


def test_preference_pairs_are_stored_chosen_then_rejected_and_batched_whole(prepared):
    _, pairs, _ = prepared
    meta = read_meta(pairs)
    assert meta.kind == "preferences" and meta.train_examples % 2 == 0 and meta.val_examples > 0
    examples = load_examples(pairs, "train", meta)
    tokenizer = ByteTokenizer()
    for pair in range(examples.items()):
        chosen, rejected = (
            examples.ids[examples.offsets[i] : examples.offsets[i + 1]] for i in (2 * pair, 2 * pair + 1)
        )
        chosen_text, rejected_text = tokenizer.decode(chosen.tolist()), tokenizer.decode(rejected.tolist())
        prompt = chosen_text[: chosen_text.index("assistant:")]
        assert rejected_text.startswith(prompt)  # one prompt, two completions
        trained = tokenizer.decode(
            chosen[examples.trained[examples.offsets[2 * pair] : examples.offsets[2 * pair + 1]] == 1].tolist()
        )
        assert "." in trained and "Say" not in trained  # only the reply is scored
    batch = ExampleBatches(examples, 64, batch_size=3, seed=0, packed=False).next_batch()
    assert batch.x.size(0) == 6 and batch.units == 3  # three pairs, a mean over pairs
    with pytest.raises(Exception, match="packing applies to supervised examples"):
        ExampleBatches(examples, 64, batch_size=3, seed=0, packed=True)


def test_labelled_texts_keep_their_labels_and_are_read_at_their_last_token(prepared):
    _, _, texts = prepared
    meta = read_meta(texts)
    assert meta.kind == "labelled" and meta.labels == ["fruit", "other"]
    examples = load_examples(texts, "train", meta)
    tokenizer = ByteTokenizer()
    batch = next(example_batches(examples, 64, 5))
    for r in range(5):
        a, b = examples.offsets[r], examples.offsets[r + 1]
        text = tokenizer.decode(examples.ids[a:b].tolist())
        assert meta.labels[int(batch.labels[r])] == ("fruit" if text.split()[1] in FRUIT else "other")
        assert int(batch.last[r]) == b - a - 1 and int(batch.x[r, batch.last[r]]) == int(examples.ids[b - 1])
        assert torch.equal(batch.y[r, : b - a - 1], torch.as_tensor(examples.ids[a + 1 : b], dtype=torch.long))
        assert int(batch.y[r, b - a - 1]) == IGNORE_INDEX


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "hi", "chosen": "a"}, "line 2 is not a preference row"),
        ({"prompt": "hi", "chosen": "a", "rejected": 3}, "line 2"),
        ({"text": "hi", "label": ["x"]}, '"label" must be a string'),
        ({"text": "", "label": "a"}, "the text is empty"),
    ],
)
def test_malformed_rows_are_one_line_errors_naming_file_and_line(row, message, tmp_path, capsys):
    first = preference_rows(1)[0] if "chosen" in row else {"text": "one", "label": "a"}
    path = write_jsonl(tmp_path / "rows.jsonl", [first, row])
    assert main(["prepare", "--input", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert last.startswith("gptkit prepare: error: ") and message in last and str(path) in last


def test_pairs_with_the_same_reply_twice_are_counted_in_one_warning(tmp_path, capsys):
    same = [
        {"prompt": "Say pear", "chosen": "pear.", "rejected": "pear."},
        {
            "prompt": [{"role": "user", "content": "Say fig"}],
            "chosen": [{"role": "assistant", "content": "fig"}],
            "rejected": [{"role": "assistant", "content": "fig"}],
        },
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", [*preference_rows(3), same[0], *preference_rows(2, seed=1), same[1]])
    assert main(["prepare", "--input", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "out")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gptkit: ")]
    assert warnings == [
        f"gptkit: 2 preference pair(s) have the same chosen and rejected reply, from which DPO learns "
        f"nothing (the first at {path} line 4); fix or drop them"
    ]
    assert read_meta(tmp_path / "out").train_examples + read_meta(tmp_path / "out").val_examples == 2 * 7


def test_one_label_mixed_kinds_and_the_wrong_objective_are_refused(prepared, tmp_path, capsys):
    base, pairs, texts = prepared
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "x"}])
    assert main(["prepare", "--input", str(one), "--tokenizer", "byte", "--out", str(tmp_path / "o")]) == 2
    assert "at least two labels" in capsys.readouterr().err
    mixed = [
        str(write_jsonl(tmp_path / "a.jsonl", labelled_rows(3))),
        str(write_jsonl(tmp_path / "b.jsonl", preference_rows(3))),
    ]
    assert (
        main(["prepare", "--input", mixed[0], "--input", mixed[1], "--tokenizer", "byte", "--out", str(tmp_path / "m")])
        == 2
    )
    assert "prepare them separately" in capsys.readouterr().err
    with pytest.raises(Exception, match="finetune.objective dpo trains on preferences"):
        Trainer(_run_config(texts, tmp_path / "r", base, objective="dpo"), resume=False)
    with pytest.raises(Exception, match="use finetune.objective dpo"):
        Trainer(_run_config(pairs, tmp_path / "r2", base), resume=False)


# ---------------------------------------------------------------- DPO


def test_dpo_loss_equals_the_formula_from_two_models_token_logprobs():
    torch.manual_seed(0)
    config = ModelConfig(**VARIANTS["gpt2"])
    policy, reference = GPT(config).eval(), GPT(config).eval()
    x = torch.randint(0, config.vocab_size, (4, 12))  # rows: chosen, rejected, chosen, rejected
    y = torch.randint(0, config.vocab_size, (4, 12))
    y[:, :5] = IGNORE_INDEX  # the prompt is not scored
    y[1, 9:] = IGNORE_INDEX  # padding
    beta = 0.3
    with torch.no_grad():
        got = dpo_loss(
            *row_logprobs(policy(x), y, "sum").view(2, 2).T, *row_logprobs(reference(x), y, "sum").view(2, 2).T, beta
        )

    def summed(model: GPT, row: int) -> float:  # the completion's log-probability, one token at a time
        with torch.no_grad():
            logprobs = model(x[row : row + 1])[0].double().log_softmax(-1)
        return sum(float(logprobs[t, y[row, t]]) for t in range(12) if y[row, t] != IGNORE_INDEX)

    for pair in range(2):
        c, r = 2 * pair, 2 * pair + 1
        margin = beta * ((summed(policy, c) - summed(reference, c)) - (summed(policy, r) - summed(reference, r)))
        assert float(got["loss"][pair]) == pytest.approx(-math.log(1 / (1 + math.exp(-margin))), rel=1e-5)
        assert float(got["chosen_reward"][pair]) == pytest.approx(
            beta * (summed(policy, c) - summed(reference, c)), rel=1e-4, abs=1e-6
        )
        assert float(got["accuracy"][pair]) == float(margin > 0)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_dpo_starts_at_log_2_with_zero_rewards_learns_and_resumes_exactly(method, prepared, tmp_path, device):
    base, pairs, _ = prepared
    settings = dict(
        objective="dpo",
        method=method,
        lora_rank=4,
        lora_dropout=0.1 if method == "lora" else 0.0,
        train={"device": device.type},
    )
    whole = train(_run_config(pairs, tmp_path / "whole", base, **settings), progress=False)
    records = [json.loads(line) for line in (whole.run_dir / "metrics.jsonl").read_text().splitlines()]
    start, first = records[0], records[1]
    assert start["step"] == 0 and start["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert start["val_chosen_reward"] == start["val_rejected_reward"] == start["val_margin"] == 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["margin"] == 0
    assert records[-1]["margin"] > 0 and records[-1]["val_loss"] < math.log(2)
    three = {**settings, "train": {"max_steps": 3, "device": device.type}}
    part = train(_run_config(pairs, tmp_path / "part", base, **three), progress=False)
    resumed = train(_run_config(pairs, part.run_dir, base, **settings), resume=True, progress=False)
    torch.testing.assert_close(_losses(resumed.run_dir), _losses(whole.run_dir), **same_run(device))
    got, want = (load(c)[0].state_dict() for c in (resumed.checkpoint, whole.checkpoint))
    torch.testing.assert_close(got, want, **same_run(device))
    assert main(["generate", str(whole.checkpoint), "--prompt", "user: Say apple", "--max-new-tokens", "3"]) == 0


def test_the_chosen_nll_term_adds_the_chosen_replies_mean_token_loss(prepared):
    base, pairs, _ = prepared
    model, _ = load(base)
    model.eval()
    batch = next(iter(example_batches(load_examples(pairs, "train", read_meta(pairs)), model.config.block_size, 4)))
    with torch.no_grad():
        logits = model(batch.x)
        plain, _ = preference_loss(logits, logits, batch.y, 0.1)
        weighted, stats = preference_loss(logits, logits, batch.y, 0.1, nll_weight=0.5)
        chosen = batch.y[0::2]
        nll = F.cross_entropy(model(batch.x[0::2]).flatten(0, 1), chosen.flatten(), ignore_index=IGNORE_INDEX)
    assert float(plain) == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference
    assert float(stats["chosen_nll"]) == pytest.approx(float(nll), rel=1e-5)
    assert float(weighted) == pytest.approx(float(plain) + 0.5 * float(nll), rel=1e-5)


def test_the_lora_reference_is_the_base_model(prepared, tmp_path):
    base, pairs, _ = prepared
    trainer = Trainer(
        _run_config(pairs, tmp_path / "run", base, objective="dpo", method="lora", lora_rank=4), resume=False
    )
    trainer.run(progress=False)
    assert any(float(a.lora_B.abs().max()) > 0 for a in adapters(trainer.model).values())  # the policy moved
    x = torch.randint(0, 256, (2, 20))
    base_model, _ = load(base)
    with torch.no_grad():
        torch.testing.assert_close(trainer.objective.reference(x), base_model.eval()(x), atol=1e-6, rtol=1e-6)
        assert not torch.allclose(trainer.model(x), base_model(x), atol=1e-4)


# ---------------------------------------------------------------- classification


def test_last_token_pooling_is_right_for_left_and_right_padded_batches():
    torch.manual_seed(0)
    classifier = SequenceClassifier(GPT(ModelConfig(**VARIANTS["llama-gqa"])).eval(), ["a", "b", "c"])
    rows = [torch.randint(0, 50, (n,)) for n in (3, 9, 6)]
    alone = torch.cat([classifier(r[None], torch.tensor([len(r) - 1]))[0] for r in rows])
    T = 9
    right = torch.zeros(3, T, dtype=torch.long)
    left, left_docs = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long)
    for i, r in enumerate(rows):
        right[i, : len(r)] = r
        left[i, T - len(r) :] = r
        left_docs[i, T - len(r) :] = 1  # padding is a document of its own, so the text's positions start at 0
    with torch.no_grad():
        from_right, _ = classifier(right, torch.tensor([len(r) - 1 for r in rows]))
        from_left, _ = classifier(left, torch.full((3,), T - 1), document_ids=left_docs)
        predicted = predict(classifier, [r.tolist() for r in rows], batch_size=2)
    torch.testing.assert_close(from_right, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_left, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(predicted, alone.softmax(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_an_exported_classifier_gives_transformers_the_same_logits(variant, tmp_path):
    transformers = pytest.importorskip("transformers")
    from gptkit.finetune.heads import save_head
    from gptkit.formats.modeldir import save_model_dir

    torch.manual_seed(0)
    config = ModelConfig(**{**VARIANTS[variant], "vocab_size": 257})
    classifier = SequenceClassifier(GPT(config).eval(), ["neg", "neu", "pos"])
    model_dir = save_model_dir(classifier.gpt, tmp_path / "model", tokenizer=ByteTokenizer())
    save_head(classifier, model_dir)
    assert main(["convert", "--to-hf", str(model_dir), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert (
        type(hf).__name__
        == {"gpt2": "GPT2ForSequenceClassification", "llama-gqa": "LlamaForSequenceClassification"}[variant]
    )
    assert hf.config.id2label == {0: "neg", 1: "neu", 2: "pos"}
    lengths = [5, 11, 8]
    ids = torch.full((3, 11), 256)  # right-padded with the end-of-text id, which transformers skips
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, 256, (n,))
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=(ids != 256).long()).logits
        got, _ = classifier(ids, torch.tensor(lengths) - 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_classification_scores_match_their_definitions():
    truth = np.array([0, 0, 1, 1, 2, 2, 2])
    predicted = np.array([0, 1, 1, 1, 2, 0, 2])
    scores = classification_scores(truth, predicted, ["a", "b", "c"])
    assert scores["accuracy"] == pytest.approx(5 / 7)
    assert scores["confusion"] == [[1, 1, 0], [0, 2, 0], [1, 0, 2]]
    f1 = [2 * 1 / (2 + 2), 2 * 2 / (2 + 3), 2 * 2 / (3 + 2)]  # 2 TP / (true + predicted) per label
    assert scores["macro_f1"] == pytest.approx(sum(f1) / 3)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_classifier_trains_resumes_evaluates_and_classifies(method, prepared, tmp_path, capsys):
    base, _, texts = prepared
    settings = dict(
        objective="classify",
        method=method,
        lora_rank=4,
        train={"max_steps": 40, "eval_interval": 20, "checkpoint_interval": 20},
        optim={"lr": 3e-3},
    )
    settings_part = {**settings, "train": {**settings["train"], "max_steps": 20}}

    def config(out: Path, s: dict) -> object:
        s = dict(s)
        optim = s.pop("optim")
        c = _run_config(texts, out, base, **s)
        c.optim.lr, c.optim.decay_steps = optim["lr"], 40
        return c

    whole = train(config(tmp_path / "whole", settings), progress=False)
    assert is_classifier_dir(whole.checkpoint)
    records = [json.loads(line) for line in (whole.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"label_loss", "lm_loss", "accuracy"} <= records[-1].keys() and records[-1]["val_accuracy"] >= 0.9
    part = train(config(tmp_path / "part", settings_part), progress=False)
    resumed = train(config(part.run_dir, settings), resume=True, progress=False)
    assert _losses(resumed.run_dir) == _losses(whole.run_dir)
    heads = [load_head(load(c)[0], c).score.weight for c in (resumed.checkpoint, whole.checkpoint)]
    assert torch.equal(*heads)

    assert main(["eval", str(whole.checkpoint), "--data", str(texts), "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["accuracy"] == pytest.approx(records[-1]["val_accuracy"]) and len(report["confusion"]) == 2
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"text": "a lemon x"}, {"text": "a tiger"}])
    assert main(["classify", str(whole.checkpoint), "--input", str(inputs), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["label"] for line in lines] == ["fruit", "other"]
    assert all(sum(line["probabilities"].values()) == pytest.approx(1.0) for line in lines)


def test_classification_without_the_lm_loss_logs_none(prepared, tmp_path):
    base, _, texts = prepared
    run = train(
        _run_config(texts, tmp_path / "run", base, objective="classify", lm_weight=0.0, train={"max_steps": 2}),
        progress=False,
    )
    last = json.loads((run.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert "lm_loss" not in last and last["loss"] == pytest.approx(last["label_loss"])
    classifier = load_head(load(run.checkpoint)[0], run.checkpoint)
    x = torch.randint(0, 256, (2, 7))
    logits, _ = classifier(x, torch.tensor([6, 3]))
    assert torch.allclose(F.softmax(logits, -1).sum(-1), torch.ones(2))
