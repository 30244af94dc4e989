"""Loss by position in the window (gptkit.evaluate.score_positions, `gptkit eval --by-position`) and scoring at a
context past block_size (`--context`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.evaluate import position_buckets, score_positions, score_tokens
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.tokenizer import ByteTokenizer

BLOCK = 8
TEXT = "The loss by position shows what a model makes of a context longer than the one it was trained at.\n" * 3


@pytest.fixture(scope="module")
def rope_model() -> GPT:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=257, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, position="rope")
    return GPT(config).eval()


def hand_positions(model: GPT, ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Per position: summed nats and counts, each window of `context` tokens run alone and scored by hand."""
    sums, counts = np.zeros(context), np.zeros(context, dtype=np.int64)
    for start in range(0, len(ids) - 1, context):
        inputs = torch.tensor(ids[start : start + context][None])
        targets = ids[start + 1 : start + context + 1]
        with torch.no_grad():
            log_probs = torch.log_softmax(model(inputs)[0].float(), dim=-1)  # (T, vocab)
        for p, target in enumerate(targets):
            sums[p] -= float(log_probs[p, target])
            counts[p] += 1
    return sums, counts


@pytest.mark.parametrize("context", [BLOCK, 3 * BLOCK])  # at block_size and past it (RoPE)
def test_positions_match_a_hand_computation(rope_model, context):
    ids = np.asarray(ByteTokenizer().encode(TEXT), dtype=np.int64)[: 5 * context + 3]  # a short last window
    sums, counts = score_positions(rope_model, ids, context, batch_size=3)
    want_sums, want_counts = hand_positions(rope_model, ids, context)
    assert counts.tolist() == want_counts.tolist()
    # float32 logits of the same windows batched or alone: measured 0 (equal) here; 1e-5 relative allowed for kernels that batch differently
    assert np.allclose(sums, want_sums, rtol=1e-5)
    total, scored = score_tokens(rope_model, ids, stride=context, context=context)
    assert scored == counts.sum() == len(ids) - 1 and total == pytest.approx(sums.sum(), rel=1e-5)


def test_buckets_pool_positions():
    sums, counts = np.array([1.0, 3.0, 2.0, 6.0, 5.0]), np.array([1, 1, 2, 2, 0])
    buckets = position_buckets(sums, counts, 2)
    assert [(b.start, b.end, b.tokens) for b in buckets] == [(0, 2, 2), (2, 4, 4), (4, 5, 0)]
    assert buckets[0].loss == 2.0 and buckets[1].loss == 2.0 and buckets[2].loss is None
    with pytest.raises(InputError, match="--by-position"):
        position_buckets(sums, counts, 0)


def test_cli_by_position_json_and_table(rope_model, tmp_path, capsys):
    model_dir = save_model_dir(rope_model, tmp_path / "model", tokenizer=ByteTokenizer())
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["eval", str(model_dir), "--input", str(text), "--context", str(4 * BLOCK), "--by-position", str(BLOCK)]
    assert main([*argv, "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    ids = np.asarray(ByteTokenizer().encode(TEXT), dtype=np.int64)
    sums, counts = hand_positions(rope_model, ids, 4 * BLOCK)
    assert report["context"] == report["stride"] == 4 * BLOCK and len(report["by_position"]) == 4
    for i, bucket in enumerate(report["by_position"]):
        span = slice(i * BLOCK, (i + 1) * BLOCK)
        assert bucket["tokens"] == counts[span].sum()
        assert bucket["loss"] == pytest.approx(sums[span].sum() / counts[span].sum(), rel=1e-5)  # as above
    assert report["loss"] == pytest.approx(sums.sum() / counts.sum(), rel=1e-5)
    assert main([*argv, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "context 32" in out and "24-32" in out


def test_context_past_learned_positions_is_refused_in_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=257, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16)).eval()
    model_dir = save_model_dir(model, tmp_path / "model", tokenizer=ByteTokenizer())
    (tmp_path / "t.txt").write_text(TEXT)
    argv = ["eval", str(model_dir), "--input", str(tmp_path / "t.txt"), "--quiet", "--context", str(BLOCK + 1)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--context 9" in err and "learned positions" in err
    with pytest.raises(InputError, match="learned positions"):
        score_tokens(model, np.arange(40) % 200, context=BLOCK + 1)
    assert main([*argv[:-1], str(BLOCK - 2), "--by-position", "0"]) == 2  # a bucket of no positions
    assert "--by-position must be >= 1" in capsys.readouterr().err
