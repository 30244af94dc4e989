"""The next-token objective (pre-training on text, supervised fine-tuning on examples), and what every objective
on example sets shares: the checks of the data, and the loss averaged over a split.

An objective's loss(forward, batch) gives the batch's mean loss and a few statistics (means over the batch's units:
trained tokens, pairs or texts) to log; example_split_losses averages the same over a split, so training and
validation report the same quantities. Supervised examples are also measured by what a model is for: the exact
match of the replies it writes to held-out prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gptkit.chat import load_chat_template
from gptkit.data import Batch, DataMeta, ExampleBatches, Examples, TrainBatches, example_batches
from gptkit.decoding.api import complete
from gptkit.decoding.sampling import SamplingParams
from gptkit.devices import autocast_for
from gptkit.errors import GptkitError
from gptkit.finetune.parts import ObjectiveBase, Setup, Stats, evaluation_mode
from gptkit.tokenizer import Tokenizer

# Evaluation forwards up to this many tokens at once (at least one training batch): bigger matrix products run
# faster per token on CPU, and the mean over equal-size windows is the same however they are grouped.
EVAL_TOKENS = 8192
# Splits up to this many tokens are checked whole; larger ones (made by `gptkit prepare`, which writes only ids
# of its tokenizer) by their first and last chunks, so that starting a large run does not read it all.
FULL_CHECK_TOKENS = 1 << 28
CHECK_CHUNK = 1 << 24


class LanguageModeling(ObjectiveBase):
    """The next-token loss (pre-training on text, supervised fine-tuning on examples).

    The mean over the trained targets: every token of text windows, or the trained tokens of supervised examples
    (then also the exact match of generated replies)."""

    data_kinds = ("text", "examples")

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.train_settings = setup.config.train
        self.block_size = setup.gpt.config.block_size
        data = setup.data
        if data.kind == "text":
            check_tokens("train.bin", data.train, data.meta.vocab_size, self.block_size)
            check_tokens("val.bin", data.val, data.meta.vocab_size, self.block_size)
            self.val_bytes_per_token = bytes_per_token(data.meta, "val", data.val, setup.tokenizer)
        else:
            check_examples(setup)
            self.task_metrics = {} if setup.sharded else {"val_exact_match": None}

    def stream(self, per_update: int) -> Any:
        """Random text windows, or whole examples (padded or packed)."""
        if self.setup.data.kind == "text":
            settings = self.train_settings
            return TrainBatches(self.setup.data.train, self.block_size, settings.batch_size, settings.seed)
        return example_stream(self.setup, per_update)

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The batch's mean next-token loss; nothing else to log."""
        return forward(batch.x, targets=batch.y, document_ids=batch.document_ids), {}

    def evaluate(self, forward: Callable[..., Any]) -> dict[str, float]:
        """Train and validation loss; for text, perplexity and bits per byte; for examples, the replies' exact match."""
        t, data, device = self.train_settings, self.setup.data, self.setup.device
        if data.kind != "text":
            train_loss, val_loss, _ = example_split_losses(self.loss, forward, self.setup)
            metrics = {
                "train_eval_loss": train_loss,
                "val_loss": val_loss,
                "train_eval_ppl": _exp(train_loss),
                "val_ppl": _exp(val_loss),
            }
            if self.task_metrics:  # (not under FSDP)
                metrics["val_exact_match"] = exact_match(
                    self.setup.gpt, self.setup.tokenizer, data.val, self.train_settings.eval_examples
                )
            return metrics
        train_loss = window_loss(
            forward, data.train, t.batch_size, t.eval_iters, self.block_size, t.seed + 1, device, t.dtype
        )
        val_loss = window_loss(
            forward, data.val, t.batch_size, t.eval_iters, self.block_size, t.seed + 2, device, t.dtype
        )
        metrics = {
            "train_eval_loss": train_loss,
            "val_loss": val_loss,
            "train_eval_ppl": _exp(train_loss),
            "val_ppl": _exp(val_loss),
        }
        if self.val_bytes_per_token:
            metrics["val_bpb"] = val_loss / (math.log(2) * self.val_bytes_per_token)
        return metrics


class ExampleObjective(ObjectiveBase):
    """What every objective over whole examples shares (preference pairs, marked completions): its data checked at
    start, batches of whole examples, and an evaluation that averages its own loss and statistics over the same
    held-out examples each time. A subclass gives settings_type, data_kinds and loss."""

    def __init__(self, setup: Setup) -> None:
        check_examples(setup)
        self.setup = setup

    def stream(self, per_update: int) -> Any:
        """Whole examples (a pair's chosen then rejected rows stay together), batched as finetune.packing says."""
        return example_stream(self.setup, per_update)

    def evaluate(self, forward: Callable[..., Any]) -> dict[str, float]:
        """Train and validation loss, and the loss's statistics on validation examples (val_accuracy, ...)."""
        train_loss, val_loss, stats = example_split_losses(self.loss, forward, self.setup)  # type: ignore[attr-defined]
        return {"train_eval_loss": train_loss, "val_loss": val_loss, **stats}


def example_stream(setup: Setup, per_update: int) -> ExampleBatches:
    """Whole examples (pairs, labelled texts), batched as finetune.packing says; per_update micro-batches an update."""
    t = setup.config.train
    return ExampleBatches(
        setup.data.train,
        setup.gpt.config.block_size,
        t.batch_size,
        t.seed,
        setup.config.finetune.packing,
        group=per_update,
    )


@torch.no_grad()  # not inference_mode: FSDP2 reuses its all-gather buffers in the next training step
def window_loss(
    forward: Callable[..., Any],
    tokens: np.ndarray,
    batch_size: int,
    batches: int,
    block_size: int,
    seed: int,
    device: torch.device,
    dtype: str,
) -> float:
    """Mean loss over batches x batch_size fixed windows of a split (the same windows at every evaluation)."""
    stream = TrainBatches(tokens, block_size, batch_size, seed)
    x, y = (torch.cat(parts) for parts in zip(*(stream.next_batch() for _ in range(batches))))
    chunk = max(batch_size, EVAL_TOKENS // block_size)
    total = torch.zeros((), device=device)
    for start in range(0, len(x), chunk):
        xb, yb = x[start : start + chunk].to(device), y[start : start + chunk].to(device)
        with autocast_for(device, dtype):
            total += forward(xb, targets=yb).float() * len(xb)
    return (total / len(x)).item()


LossFn = Callable[[Callable[..., Any], Batch], tuple[Tensor, Stats]]  # an objective's loss(forward, batch)


def example_split_losses(
    loss: LossFn, forward: Callable[..., Any], setup: Setup, val_loss: LossFn | None = None
) -> tuple[float, float, dict]:
    """(train loss, validation loss, the validation statistics) of an objective's loss over example sets: the same
    eval_iters x batch_size items of each split at every evaluation (val_loss, if given, reads the validation
    batches instead: the same loss, also keeping what else the objective measures on them)."""
    t = setup.config.train
    train_examples, val_examples = setup.data.train, setup.data.val
    order = np.random.default_rng(t.seed + 1).permutation(train_examples.items())
    limit = t.eval_iters * t.batch_size
    block = setup.gpt.config.block_size
    with autocast_for(setup.device, t.dtype):
        train_m = split_means(loss, forward, train_examples, block, t.batch_size, limit, order, setup.device)
        val_m = split_means(val_loss or loss, forward, val_examples, block, t.batch_size, limit, None, setup.device)
    train_loss, val_loss = train_m.pop("loss"), val_m.pop("loss")
    return train_loss, val_loss, {f"val_{name}": value for name, value in val_m.items()}


@torch.no_grad()
def split_means(
    loss: LossFn,
    forward: Callable[..., Any],
    examples: Examples,
    block_size: int,
    batch_size: int,
    limit: int | None,
    order: np.ndarray | None,
    device: torch.device,
) -> dict[str, float]:
    """An objective's loss and statistics averaged over the first `limit` items of a split (in `order`)."""
    sums: dict[str, Tensor] = {}
    units = 0
    for batch in example_batches(examples, block_size, batch_size, limit, order):
        if not batch.units:
            continue
        value_of_loss, stats = loss(forward, batch.to(lambda t: t.to(device)))
        for name, value in {"loss": value_of_loss, **stats}.items():
            sums[name] = sums.get(name, 0) + value.float() * batch.units
        units += batch.units
    return {name: float(total) / max(units, 1) for name, total in sums.items()}


def reply_of(ids: np.ndarray, trained: np.ndarray) -> tuple[list[int], list[int]] | None:
    """(the prompt before an example's first trained token, that first reply: its run of trained tokens), or
    None when nothing after the first token is trained, or its first token is (no prompt: --loss-on all, text)."""
    positions = np.flatnonzero(trained[1:]) + 1
    if not len(positions) or trained[0]:
        return None
    start = int(positions[0])
    end = start
    while end < len(ids) and trained[end]:
        end += 1
    return ids[:start].tolist(), ids[start:end].tolist()


@torch.no_grad()
def exact_match(gpt: Any, tokenizer: Tokenizer | None, examples: Examples, count: int) -> float:
    """The fraction of the first `count` held-out examples whose first reply the model writes exactly, greedily
    (the reply's end-of-text token included: a reply that runs on does not match)."""
    pairs = [
        reply_of(np.asarray(examples.ids[a:b]), np.asarray(examples.trained[a:b]))
        for a, b in zip(examples.offsets[:-1][:count], examples.offsets[1:][:count])
    ]
    pairs = [p for p in pairs if p is not None]
    if not pairs:
        return math.nan
    eos = tuple(tokenizer.eos_ids) if tokenizer is not None else ()
    params = SamplingParams(max_new_tokens=max(len(reply) for _, reply in pairs), temperature=0.0)
    with evaluation_mode(gpt):
        result = complete(gpt, [prompt for prompt, _ in pairs], params, eos_id=eos)
    hits = 0
    for (_, reply), (completion,) in zip(pairs, result.completions):
        if reply[-1] in eos:  # the reply and then its end
            hits += completion.finish_reason == "eos" and completion.ids == reply[:-1]
        else:  # an example cut short by --max-length: its reply as far as it goes
            hits += completion.ids[: len(reply)] == reply
    return hits / len(pairs)


def check_tokens(name: str, tokens: np.ndarray, vocab_size: int, block_size: int) -> None:
    """Each split must be long enough for one window and hold only ids inside the vocabulary (the model skips it)."""
    if len(tokens) == 0 and name.startswith("val"):
        raise GptkitError(
            f"{name} is empty (data prepared with --val-fraction 0): training evaluates on it; "
            "prepare the data again with --val-fraction above 0"
        )
    if len(tokens) < block_size + 1:
        raise GptkitError(
            f"{name} has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}; "
            "lower model.block_size or prepare more text"
        )
    if len(tokens) <= FULL_CHECK_TOKENS:
        starts = range(0, len(tokens), CHECK_CHUNK)
    else:
        starts = [0, len(tokens) - CHECK_CHUNK]
    top = max(int(tokens[i : i + CHECK_CHUNK].max()) for i in starts)
    if top >= vocab_size:
        raise GptkitError(f"{name} holds token id {top}, outside the vocabulary of {vocab_size}; re-prepare the data")


def check_examples(setup: Setup) -> None:
    """Examples must hold ids of the vocabulary, and have been rendered with the run's chat template (the one it
    will be served with)."""
    vocab_size = setup.data.meta.vocab_size
    for name, split in (("train", setup.data.train), ("val", setup.data.val)):
        if len(split) == 0 and name == "val":
            raise GptkitError(
                "the data set has no validation examples (prepared with --val-fraction 0): training "
                "evaluates on them; prepare the data again with --val-fraction above 0"
            )
        if len(split.ids) and int(split.ids.max()) >= vocab_size:
            raise GptkitError(
                f"{name} examples hold token id {int(split.ids.max())}, outside the vocabulary of "
                f"{vocab_size}; re-prepare the data"
            )
    check_template(setup)


def check_template(setup: Setup) -> None:
    """Examples (and prompts) must have been rendered with the run's chat template (the one it is served with)."""
    meta = setup.data.meta
    own = load_chat_template(setup.template_dir).source
    if meta.chat_template != own:
        which = "a different" if meta.chat_template else "the default"
        raise GptkitError(
            f"the {setup.data.kind} were rendered with {which} chat template than the model's "
            f"({setup.template_dir}); prepare them again with --tokenizer {setup.template_dir}"
        )


def bytes_per_token(meta: DataMeta, split: str, tokens: np.ndarray, tokenizer: Tokenizer | None) -> float | None:
    """UTF-8 bytes of text per token of a split, for bits per byte (docs/spec.md section 3.3): meta.json or counted."""
    text_bytes = meta.train_bytes if split == "train" else meta.val_bytes
    if isinstance(text_bytes, int) and len(tokens):
        return text_bytes / len(tokens)
    if tokenizer is None or not len(tokens):
        return None
    lengths = np.asarray(tokenizer.token_byte_lengths(), dtype=np.float64)
    counts = np.bincount(np.asarray(tokens), minlength=len(lengths))[: len(lengths)]
    return float(counts @ lengths) / len(tokens)


def _exp(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
