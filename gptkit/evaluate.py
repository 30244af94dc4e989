"""Loss, perplexity and bits per byte of a token sequence under a model, scored with a sliding window.

Windows of block_size input tokens start at 0, S, 2S, ... The window starting at s predicts tokens
s+1 .. s+block_size and scores only those no earlier window scored, so every token but the first is scored
exactly once, each with as much context as its window gives (at least block_size - S tokens once the first
window is past). With S = block_size the windows do not overlap.

With a quantised KV cache (kv_cache="int8") each window runs through the cache in chunks of KV_CHUNK tokens, so
that every token attends to keys and values read back from the cache's elements, as decoding reads them.

Bits per byte (docs/spec.md section 3.3) = loss * tokens / (bytes * ln 2), where bytes are the UTF-8 bytes of the text
that the scored tokens stand for: the sum of the tokenizer's token_byte_lengths() over every token but the
first (special tokens count zero bytes). For text encoded by a byte-level tokenizer this is the UTF-8 length
of the text minus the bytes of its first token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gptkit.config import ModelConfig
from gptkit.data import PROMPT_KIND, SPLIT_FILES, Examples, example_batches, load_tokens, read_meta
from gptkit.errors import InputError
from gptkit.kv_cache import KV_DTYPES, KVCache, kv_dtype_of
from gptkit.loss import IGNORE_INDEX
from gptkit.model import GPT
from gptkit.quantization import QUANTIZATION_METHODS
from gptkit.tokenizer import Tokenizer, check_same_tokenizer, tokenizer_or_none

EVAL_DTYPES = ("float32", "bfloat16", "float16")
KV_CHUNK = 64  # tokens a window feeds through a quantised cache at a time


@dataclass
class EvalOptions:
    """How to run an evaluation; the CLI's flags are generated from these fields."""

    stride: int | None = field(
        default=None, metadata={"help": "tokens between window starts (default: half the context)"}
    )
    batch_size: int = field(default=8, metadata={"help": "windows per forward pass"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, mps or auto"})
    dtype: str = field(default="float32", metadata={"help": "weights' dtype", "choices": EVAL_DTYPES})
    quantize: str | None = field(
        default=None,
        metadata={
            "help": "weight-only quantisation of a float model after loading: int8 or int4",
            "choices": QUANTIZATION_METHODS,
        },
    )
    kv_cache: str | None = field(
        default=None,
        metadata={
            "help": "int8: score through an int8 KV cache, as decoding with one reads it (default: none)",
            "choices": tuple(KV_DTYPES),
        },
    )


@dataclass(frozen=True)
class Window:
    """One model input: tokens[start:end] go in, targets tokens[start+1:end+1] come out, and the targets
    from absolute index first_scored on are scored."""

    start: int
    end: int  # exclusive end of the input; targets end at end + 1
    first_scored: int  # absolute index of the first scored target token


@dataclass(frozen=True)
class EvalResult:
    """Metrics of a scored text (docs/spec.md section 3.3)."""

    tokens: int  # scored tokens
    bytes: int  # UTF-8 bytes those tokens stand for
    loss: float  # mean nats per scored token
    perplexity: float
    bits_per_byte: float | None  # None when the bytes are unknown (0)

    def to_dict(self) -> dict[str, Any]:
        """The metrics as a JSON-able dict."""
        return asdict(self)


def sliding_windows(n_tokens: int, block_size: int, stride: int | None = None) -> list[Window]:
    """The windows that score tokens 1 .. n_tokens-1 of a sequence once each (stride defaults to block_size // 2)."""
    stride = max(1, block_size // 2) if stride is None else stride
    if not 1 <= stride <= block_size:
        raise InputError(f"--stride must be between 1 and the context ({block_size}), got {stride}")
    if n_tokens < 2:
        raise InputError(f"need at least 2 tokens to score a next-token prediction, got {n_tokens}")
    windows, scored_up_to, start = [], 0, 0  # tokens 1 .. scored_up_to have been scored
    while scored_up_to < n_tokens - 1:
        end = min(start + block_size, n_tokens - 1)
        windows.append(Window(start, end, scored_up_to + 1))
        scored_up_to = end
        start += stride
    return windows


def metrics(nll_sum: float, tokens: int, n_bytes: int) -> EvalResult:
    """Mean loss, perplexity and bits per byte from a summed negative log-likelihood in nats."""
    if tokens < 1:
        raise InputError("no tokens were scored")
    loss = nll_sum / tokens
    bpb = nll_sum / (n_bytes * math.log(2)) if n_bytes > 0 else None  # = loss * tokens / (bytes * ln 2)
    perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
    return EvalResult(tokens=tokens, bytes=n_bytes, loss=loss, perplexity=perplexity, bits_per_byte=bpb)


def scored_bytes(ids: np.ndarray, token_byte_lengths: np.ndarray) -> int:
    """UTF-8 bytes that every token but the first stands for."""
    lengths = np.asarray(token_byte_lengths, dtype=np.int64)
    counts = np.bincount(np.asarray(ids[1:]), minlength=len(lengths))  # no per-token copy of a large memory map
    if len(counts) > len(lengths):
        raise InputError(f"token id {len(counts) - 1} is outside the tokenizer's {len(lengths)} ids")
    return int(counts @ lengths)


@torch.no_grad()
def score_tokens(
    model: GPT,
    ids: np.ndarray | torch.Tensor,
    stride: int | None = None,
    batch_size: int = 8,
    context: int | None = None,
    on_windows: Callable[[int], None] = lambda n: None,
    kv_cache: str | None = None,
) -> tuple[float, int]:
    """(summed nats, scored tokens) of ids (1-D) under model with sliding windows of `context` tokens.

    context defaults to the model's block_size; on_windows(n) is called after each batch of n windows. kv_cache:
    the windows run through a KV cache of that element type (module docstring).
    """
    nll_sum, scored = 0.0, 0
    for nll, mask in _window_losses(model, ids, stride, batch_size, context, on_windows, kv_cache):
        nll_sum += float(nll.sum())
        scored += int(mask.sum())
    return nll_sum, scored


@torch.no_grad()
def score_positions(
    model: GPT,
    ids: np.ndarray | torch.Tensor,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    on_windows: Callable[[int], None] = lambda n: None,
) -> tuple[np.ndarray, np.ndarray]:
    """(summed nats, scored tokens) per position in the window, each an array of `context` entries.

    Position p is the input index inside a window: its target has p tokens of context before it. stride defaults
    to the context here, so that every position is scored in every window (no position is favoured).
    """
    context = model.config.block_size if context is None else context
    stride = context if stride is None else stride
    nll_sums, counts = np.zeros(context), np.zeros(context, dtype=np.int64)
    for nll, mask in _window_losses(model, ids, stride, batch_size, context, on_windows, None):
        width = nll.size(1)
        nll_sums[:width] += nll.double().sum(0).cpu().numpy()
        counts[:width] += mask.sum(0).cpu().numpy()
    return nll_sums, counts


def _window_losses(
    model: GPT,
    ids: np.ndarray | torch.Tensor,
    stride: int | None,
    batch_size: int,
    context: int | None,
    on_windows: Callable[[int], None],
    kv_cache: str | None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch of windows: each target's nats (B, T; 0 where unscored) and which targets are scored (B, T)."""
    kv_dtype = kv_dtype_of(kv_cache)
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    config = model.config
    context = config.block_size if context is None else context
    check_context(config, context)
    tokens = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids  # a memory map stays one
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= config.vocab_size):
        raise InputError(
            f"token ids run from {int(tokens.min())} to {int(tokens.max())}, outside the model's vocabulary "
            f"of {config.vocab_size}; was the data prepared with this model's tokenizer?"
        )
    windows = sliding_windows(len(tokens), context, stride)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(windows), batch_size):
            batch = windows[first : first + batch_size]
            inputs, targets = _batch(tokens, batch, context)
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs) if kv_dtype is None else _through_cache(model, inputs, kv_dtype)
            nll = F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            )  # (B*T,), 0 where ignored
            yield nll.view(targets.shape), targets != IGNORE_INDEX  # (B*T,) -> (B, T)
            on_windows(len(batch))
    finally:
        model.train(was_training)


def check_context(config: ModelConfig, context: int) -> None:
    """Refuse a scoring context the model cannot run: past block_size with learned positions, or below 1."""
    if context < 1:
        raise InputError(f"--context must be >= 1, got {context}")
    if config.position == "learned" and context > config.block_size:
        raise InputError(
            f"--context {context} exceeds the model's {config.block_size} learned positions (a learned table has "
            f"no rows past block_size); use --context {config.block_size} or less, or a RoPE model"
        )


@dataclass(frozen=True)
class PositionBucket:
    """Mean loss over the targets at window positions start .. end-1."""

    start: int
    end: int
    tokens: int
    loss: float | None  # None when no target there was scored


def position_buckets(nll_sums: np.ndarray, counts: np.ndarray, width: int) -> list[PositionBucket]:
    """score_positions' per-position sums pooled into buckets of `width` positions (the last may be shorter)."""
    if width < 1:
        raise InputError(f"--by-position must be >= 1 positions per bucket, got {width}")
    buckets = []
    for start in range(0, len(counts), width):
        end = min(start + width, len(counts))
        n = int(counts[start:end].sum())
        loss = float(nll_sums[start:end].sum() / n) if n else None
        buckets.append(PositionBucket(start, end, n, loss))
    return buckets


def _through_cache(model: GPT, inputs: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """The logits of inputs (B, T) computed KV_CHUNK tokens at a time through a fresh cache storing kv_dtype."""
    weight = model.tok_emb.weight
    cache = KVCache(
        model.config, inputs.size(0), inputs.size(1), device=weight.device, dtype=weight.dtype, kv_dtype=kv_dtype
    )
    parts = [
        model(inputs[:, start : start + KV_CHUNK], cache=cache, start_pos=start)
        for start in range(0, inputs.size(1), KV_CHUNK)
    ]
    return torch.cat(parts, dim=1)


def _batch(tokens: np.ndarray, windows: list[Window], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, T) and targets (B, T) of a batch of windows; unscored targets and padding are IGNORE_INDEX.

    Only the last window of a sequence can be shorter than the rest; padding sits after its real tokens, where
    the causal mask keeps it from touching them.
    """
    width = min(context, max(w.end - w.start for w in windows))
    inputs = torch.zeros(len(windows), width, dtype=torch.long)
    targets = torch.full((len(windows), width), IGNORE_INDEX, dtype=torch.long)
    for row, w in enumerate(windows):
        n = w.end - w.start
        inputs[row, :n] = torch.from_numpy(np.asarray(tokens[w.start : w.end], dtype=np.int64))
        skip = w.first_scored - (w.start + 1)  # targets an earlier window already scored
        targets[row, skip:n] = torch.from_numpy(np.asarray(tokens[w.first_scored : w.end + 1], dtype=np.int64))
    return inputs, targets


def evaluate_ids(
    model: GPT,
    ids: np.ndarray,
    token_byte_lengths: np.ndarray | None,
    stride: int | None = None,
    batch_size: int = 8,
    on_windows: Callable[[int], None] = lambda n: None,
    kv_cache: str | None = None,
    context: int | None = None,
) -> EvalResult:
    """Metrics of a token sequence with windows of `context` tokens (default block_size); bytes come from the
    tokenizer's per-token byte lengths (0 if unknown)."""
    nll_sum, tokens = score_tokens(model, ids, stride, batch_size, context, on_windows, kv_cache)
    n_bytes = scored_bytes(ids, token_byte_lengths) if token_byte_lengths is not None else 0
    return metrics(nll_sum, tokens, n_bytes)


@torch.no_grad()
def score_examples(
    model: torch.nn.Module,
    examples: Examples,
    block_size: int,
    batch_size: int = 8,
    limit: int | None = None,
    order: np.ndarray | None = None,
    on_examples: Callable[[int], None] = lambda n: None,
) -> tuple[float, int]:
    """(summed nats, scored tokens) over the trained tokens of supervised examples (the first `limit`, in `order`).

    Each example is scored alone (padded batches), as training scores it."""
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    total, count = torch.zeros((), device=device), 0
    for batch in example_batches(examples, block_size, batch_size, limit, order):
        scored = int((batch.y != IGNORE_INDEX).sum())
        if scored:
            total += model(batch.x.to(device), targets=batch.y.to(device)).float() * scored
        count += scored
        on_examples(len(batch.x))
    return float(total), count


def evaluate_examples(
    model: GPT,
    examples: Examples,
    token_byte_lengths: np.ndarray | None,
    batch_size: int = 8,
    on_examples: Callable[[int], None] = lambda n: None,
) -> EvalResult:
    """Metrics over the trained tokens of every example of a split (bytes: those the trained tokens stand for)."""
    was_training = model.training
    model.eval()
    try:
        nll_sum, scored = score_examples(model, examples, model.config.block_size, batch_size, on_examples=on_examples)
    finally:
        model.train(was_training)
    n_bytes = 0
    if token_byte_lengths is not None:
        n_bytes = int(token_byte_lengths[np.asarray(examples.ids)[1:][np.asarray(examples.trained)[1:] != 0]].sum())
    return metrics(nll_sum, scored, n_bytes)


def encode_text(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """text's ids as `gptkit prepare` encodes a file: special-token text such as <|endoftext|> stays text."""
    return np.asarray(tokenizer.encode_arrays([text])[0], dtype=np.int64)


def evaluate_text(
    model: GPT,
    tokenizer: Tokenizer,
    text: str,
    stride: int | None = None,
    batch_size: int = 8,
    on_windows: Callable[[int], None] = lambda n: None,
) -> EvalResult:
    """Metrics of text encoded as `gptkit prepare` encodes a file (special-token text such as <|endoftext|> stays
    text, so bits per byte count every byte, as in training's val_bpb)."""
    if not text:
        raise InputError("the text to evaluate is empty")
    ids = encode_text(tokenizer, text)
    if len(ids) < 2:
        raise InputError(f"the text encodes to {len(ids)} token; at least 2 are needed to score a prediction")
    return evaluate_ids(model, ids, tokenizer.token_byte_lengths(), stride, batch_size, on_windows)


def classification_scores(truth: np.ndarray, predicted: np.ndarray, labels: list[str]) -> dict[str, Any]:
    """Accuracy, macro-F1 (the mean F1 over the labels that occur in truth or prediction, as scikit-learn's
    f1_score(average="macro") counts them) and the confusion matrix (rows: true label, columns: predicted)."""
    n = len(labels)
    confusion = np.zeros((n, n), dtype=np.int64)
    np.add.at(confusion, (truth, predicted), 1)
    hits = np.diag(confusion).astype(np.float64)
    true_counts, predicted_counts = confusion.sum(1), confusion.sum(0)
    present = (true_counts + predicted_counts) > 0
    f1 = np.divide(2 * hits, true_counts + predicted_counts, out=np.zeros(n), where=present)
    return {
        "examples": int(len(truth)),
        "accuracy": float(hits.sum() / max(len(truth), 1)),
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "labels": list(labels),
        "f1": {label: float(f1[i]) for i, label in enumerate(labels)},
        "confusion": confusion.tolist(),
    }


def val_tokens(data_dir: str, model_tokenizer: Tokenizer | None, model_dir: str) -> tuple[np.ndarray, Tokenizer | None]:
    """val.bin of a prepared text directory and the tokenizer it was encoded with (checked to be the model's)."""
    meta = read_meta(data_dir)
    if meta.kind == PROMPT_KIND:
        raise InputError(
            f"{data_dir} holds prompts (a GRPO data set), with no text or replies to score; a GRPO run "
            "measures held-out reward and pass@k at its evaluations (val_pass_at_1 in metrics.jsonl)"
        )
    tokens = load_tokens(Path(data_dir) / SPLIT_FILES["val"], meta.dtype)
    tokenizer = tokenizer_or_none(data_dir) or model_tokenizer
    if tokenizer is not None and model_tokenizer is not None:
        check_same_tokenizer(tokenizer, model_tokenizer, data_dir, model_dir)
    return tokens, tokenizer
