"""gptkit eval: sliding-window scoring, metrics (docs/spec.md section 3.3) and the command line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.evaluate import evaluate_ids, evaluate_text, metrics, score_tokens, sliding_windows
from gptkit.formats.modeldir import save_model_dir
from gptkit.loss import next_token_loss
from gptkit.model import GPT
from gptkit.tokenizer import ByteTokenizer, CharTokenizer

BLOCK = 16
TEXT = "Héllo wörld — it's a test ✓ of bits per byte.\nSecond line, with $ and more words to score. " * 2


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=257, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)).eval()


def log_prob(model: GPT, context: list[int], target: int) -> float:
    """log p(target | context) from one direct forward over exactly the context."""
    with torch.no_grad():
        logits = model(torch.tensor([context]))[0, -1]
    return float(torch.log_softmax(logits.float(), dim=-1)[target])


@pytest.mark.parametrize(
    "n, block, stride", [(2, 4, 2), (17, 16, 8), (40, 16, 16), (41, 16, 15), (100, 8, 1), (9, 8, 3)]
)
def test_windows_score_every_token_but_the_first_once(n, block, stride):
    windows = sliding_windows(n, block, stride)
    scored = [t for w in windows for t in range(w.first_scored, w.end + 1)]
    assert scored == list(range(1, n))
    assert [w.start for w in windows] == [i * stride for i in range(len(windows))]
    assert all(0 < w.end - w.start <= block and w.first_scored >= w.start + 1 for w in windows)


def test_windows_default_stride_and_range():
    assert [w.start for w in sliding_windows(50, 16)] == [0, 8, 16, 24, 32, 40]  # 32 scores up to 48, 40 scores 49
    for bad in (0, 17):
        with pytest.raises(InputError, match="stride"):
            sliding_windows(50, 16, bad)
    with pytest.raises(InputError, match="2 tokens"):
        sliding_windows(1, 16)


def test_perplexity_is_exp_of_direct_forward_loss(model):
    text = "A short text."
    ids = ByteTokenizer().encode(text)
    assert len(ids) - 1 <= BLOCK  # one window
    result = evaluate_text(model, ByteTokenizer(), text)
    with torch.no_grad():
        direct = float(next_token_loss(model(torch.tensor([ids[:-1]])), torch.tensor([ids[1:]])))
    assert result.tokens == len(ids) - 1
    assert result.loss == pytest.approx(direct, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(direct), rel=1e-5)


def test_non_overlapping_stride_is_mean_of_chunk_losses(model):
    ids = np.random.default_rng(0).integers(0, 257, size=1 + 5 * BLOCK)
    result = evaluate_ids(model, ids, None, stride=BLOCK, batch_size=2)
    chunks = []
    with torch.no_grad():
        for s in range(0, 5 * BLOCK, BLOCK):
            x, y = torch.tensor(ids[s : s + BLOCK])[None], torch.tensor(ids[s + 1 : s + BLOCK + 1])[None]
            chunks.append(float(next_token_loss(model(x), y)))
    assert result.tokens == 5 * BLOCK
    assert result.loss == pytest.approx(sum(chunks) / len(chunks), rel=1e-5)
    assert result.bits_per_byte is None  # no byte lengths given


@pytest.mark.parametrize("stride", [BLOCK - 1, 5])
def test_overlapping_windows_match_brute_force(model, stride):
    """Each token scored by a forward over exactly its window's context (stride 15: one token of overlap)."""
    ids = np.random.default_rng(1).integers(0, 257, size=45).tolist()
    expected = 0.0
    for w in sliding_windows(len(ids), BLOCK, stride):
        for t in range(w.first_scored, w.end + 1):
            expected -= log_prob(model, ids[w.start : t], ids[t])
    for batch_size in (1, 3):  # batches mix full windows with the padded last one
        nll, tokens = score_tokens(model, np.array(ids), stride=stride, batch_size=batch_size)
        assert tokens == len(ids) - 1
        assert nll == pytest.approx(expected, rel=1e-5)


def test_bits_per_byte_follows_the_formula(model):
    result = evaluate_text(model, ByteTokenizer(), TEXT, stride=4)
    first = len(TEXT[0].encode("utf-8"))  # the first token ('H') is context only
    assert result.bytes == len(TEXT.encode("utf-8")) - first
    assert result.bits_per_byte == pytest.approx(result.loss * result.tokens / (result.bytes * math.log(2)))
    assert metrics(10.0, 5, 8).bits_per_byte == pytest.approx(10.0 / (8 * math.log(2)))


def test_char_tokenizer_counts_utf8_bytes(model):
    tokenizer = CharTokenizer.train([TEXT])
    small = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16))
    result = evaluate_text(small, tokenizer, TEXT)
    assert result.tokens == len(TEXT) - 1  # one token per character
    assert result.bytes == len(TEXT[1:].encode("utf-8")) > result.tokens  # é, ö, — and ✓ take several bytes


def test_special_token_text_is_scored_as_text_as_prepare_encodes_it(model):
    text = "one document<|endoftext|>and the next"
    result = evaluate_text(model, ByteTokenizer(), text)
    assert result.bytes == len(text.encode()) - 1 and result.tokens == len(text.encode()) - 1


def test_ids_outside_the_vocabulary_are_an_input_error(model):
    with pytest.raises(InputError, match="vocabulary"):
        score_tokens(model, np.array([1, 2, 300]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    return save_model_dir(model, tmp_path_factory.mktemp("model"), tokenizer=ByteTokenizer())


def test_cli_json_on_a_text_file(model_dir, model, tmp_path, capsys):
    text_file = tmp_path / "t.txt"
    text_file.write_bytes(TEXT.replace("\n", "\r\n<|endoftext|>").encode())  # scored as written, as text
    assert main(["eval", str(model_dir), "--input", str(text_file), "--json", "--stride", "6", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"tokens", "bytes", "loss", "perplexity", "bits_per_byte"}
    direct = evaluate_text(model, ByteTokenizer(), TEXT.replace("\n", "\r\n<|endoftext|>"), stride=6)
    assert report["loss"] == pytest.approx(direct.loss, rel=1e-6) and report["tokens"] == direct.tokens
    assert report["bytes"] == text_file.stat().st_size - 1  # every byte but the first token's


def test_cli_on_prepared_val_bin(model_dir, model, tmp_path, capsys):
    from gptkit.data import load_tokens
    from gptkit.prepare import PrepareConfig, prepare

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3, encoding="utf-8")
    meta = prepare(PrepareConfig(out=str(tmp_path / "data"), inputs=[str(corpus)], tokenizer="byte", val_fraction=0.5))
    assert main(["eval", str(model_dir), "--data", str(tmp_path / "data"), "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    val = load_tokens(tmp_path / "data" / "val.bin", meta.dtype)
    assert report["tokens"] == len(val) - 1
    assert report["bytes"] == meta.val_bytes - 1  # every byte of the split but the first token's
    assert report["loss"] == pytest.approx(evaluate_ids(model, np.asarray(val), None).loss, rel=1e-6)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--input", "{tmp}/missing.txt"], "does not exist"),
        (["--input", "{tmp}/empty.txt"], "empty"),
        (["--input", "{tmp}/t.txt", "--stride", "0"], "--stride"),
        (["--input", "{tmp}/t.txt", "--stride", str(BLOCK + 1)], "--stride"),
        (["--data", "{tmp}/nodata"], "does not exist"),
        (["--data", "{tmp}/bpe-data"], "different tokenizer"),  # as many ids as the model's bytes, other tokens
    ],
)
def test_cli_errors_are_one_line_exit_2(model_dir, tmp_path, capsys, extra, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "t.txt").write_text(TEXT)
    if "{tmp}/bpe-data" in extra:
        from gptkit.prepare import PrepareConfig, prepare

        meta = prepare(
            PrepareConfig(
                out=str(tmp_path / "bpe-data"),
                inputs=[str(tmp_path / "t.txt")],
                tokenizer="bpe",
                vocab_size=257,
                val_fraction=0.5,
            )
        )
        assert meta.vocab_size == 257
    argv = ["eval", str(model_dir), "--quiet", *[a.format(tmp=tmp_path) for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
