"""What a model does with its context (docs/spec.md section 5.2): the in-context learning score, induction-head
scores, the logit lens and each head's direct contribution to a prediction.

Each takes a GPT and token ids and returns plain tensors or floats, so that training (logged at evaluations),
`gptkit eval --icl`, `gptkit inspect` and the playground share one definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit.errors import InputError
from gptkit.model import GPT, Trace

# docs/spec.md section 5.2: loss late in the context (the last tenth of the block) against early (positions 5-10% in).
EARLY = (0.05, 0.10)
LATE = (0.90, 1.00)
ICL_WINDOWS = 64  # windows of block_size tokens the ICL score averages over (16 left it +-0.5 nats on a char model)
WINDOW_BATCH = 8  # windows per forward pass: the logits of 64 GPT-2 windows would take 13 GB
INDUCTION_BATCH = 8  # random sequences the induction scores average over
INDUCTION_SEED = 0


@dataclass(frozen=True)
class InductionResult:
    """What a repeated random sequence shows: per-head induction scores and the loss on each half."""

    scores: Tensor  # (n_layer, n_head): mean attention from each token of the second copy to the token that
    #                 followed the same token in the first copy (1: a perfect induction head; uniform: ~1/position)
    first_half_loss: float  # mean next-token loss over the first copy (random tokens: about log(vocab))
    repeated_half_loss: float  # over the second copy (low once the model copies from its context)
    length: int  # tokens in each copy


def _device(model: GPT) -> torch.device:
    return next(model.parameters()).device


def _one_sequence(ids: Sequence[int] | Tensor, what: str) -> Tensor:
    """ids as a 1-D long tensor, or a one-line error when they are not one non-empty sequence."""
    ids = torch.as_tensor(ids if isinstance(ids, Tensor) else list(ids), dtype=torch.long)
    if ids.dim() != 1 or len(ids) == 0:
        raise InputError(f"{what} read one non-empty sequence of token ids, got shape {tuple(ids.shape)}")
    return ids


def eval_forward(model: GPT, ids: Tensor, trace: Trace | None = None) -> Tensor:
    """model's logits for ids (B, T) in eval mode (no dropout), its mode restored afterwards."""
    was = model.training
    model.eval()
    try:
        return model(ids.to(_device(model)), trace=trace)
    finally:
        model.train(was)


def _context_windows(tokens: np.ndarray | Tensor, block_size: int, count: int, seed: int) -> Tensor:
    """count windows of block_size + 1 tokens at fixed random offsets (the same ones at every call); only the
    windows are read (a split may be a memory-mapped file of billions of tokens)."""
    if len(tokens) < block_size + 1:
        raise InputError(f"the ICL score needs at least block_size + 1 = {block_size + 1} tokens, got {len(tokens)}")
    starts = torch.randint(0, len(tokens) - block_size, (count,), generator=torch.Generator().manual_seed(seed))
    windows = [torch.as_tensor(np.asarray(tokens[s : s + block_size + 1], dtype=np.int64)) for s in starts.tolist()]
    return torch.stack(windows)  # (count, block_size + 1)


@torch.no_grad()
def window_losses(model: GPT, tokens: np.ndarray | Tensor, windows: int = ICL_WINDOWS, seed: int = 0) -> Tensor:
    """(windows, block_size): the next-token loss at each position of each of windows of tokens."""
    batch = _context_windows(tokens, model.config.block_size, windows, seed)
    out = []
    for rows in batch.split(WINDOW_BATCH):
        rows = rows.to(_device(model))
        logits = eval_forward(model, rows[:, :-1]).float()  # (rows, T, V)
        out.append(F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none").cpu())
    return torch.cat(out)


def position_losses(model: GPT, tokens: np.ndarray | Tensor, windows: int = ICL_WINDOWS, seed: int = 0) -> Tensor:
    """(block_size,): the mean next-token loss at each position of the context, over windows of tokens."""
    return window_losses(model, tokens, windows, seed).mean(0)


@torch.no_grad()
def sequence_losses(model: GPT, ids: Sequence[int] | Tensor) -> Tensor:
    """(T - 1,): the next-token loss at each position of one sequence (position i predicts ids[i + 1])."""
    ids = _one_sequence(ids, "per-position losses")
    if len(ids) < 2:
        raise InputError(f"per-position losses need at least 2 tokens, got {len(ids)}")
    logits = eval_forward(model, ids[None])[0, :-1].float()
    return F.cross_entropy(logits, ids[1:].to(logits.device), reduction="none").cpu()


def _span(losses: Tensor, bounds: tuple[float, float]) -> Tensor:
    """The losses at positions bounds[0] * T .. bounds[1] * T (at least one position)."""
    T = len(losses)
    start = min(int(bounds[0] * T), T - 1)
    return losses[start : max(int(bounds[1] * T), start + 1)]


def early_late_losses(losses: Tensor) -> tuple[float, float]:
    """The mean loss early in the context (positions 5-10% in) and late in it (the last tenth)."""
    return float(_span(losses, EARLY).mean()), float(_span(losses, LATE).mean())


def icl_score_of(losses: Tensor) -> float:
    """Late-context loss minus early-context loss from per-position losses (negative: the context helps)."""
    early, late = early_late_losses(losses)
    return late - early


def icl_score(model: GPT, tokens: np.ndarray | Tensor, windows: int = ICL_WINDOWS, seed: int = 0) -> float:
    """The in-context learning score (Olsson et al. 2022; docs/spec.md section 5.2): mean loss on the last tenth
    of the block minus mean loss on positions 5-10% in, over windows of tokens; negative once the model uses its
    context."""
    return icl_score_of(position_losses(model, tokens, windows, seed))


def induction_score_of(attentions: Sequence[Tensor], length: int) -> Tensor:
    """(n_layer, n_head) induction scores from per-layer attention weights (B, H, 2L, 2L) over sequences made of
    a random L-token sequence repeated twice: the mean weight from position i of the second copy (i >= L + 1)
    to position i - L + 1, the token after the same token's first occurrence."""
    rows = torch.arange(length + 1, 2 * length)  # second-copy positions that have a successor in the first copy
    cols = rows - length + 1
    return torch.stack([a[:, :, rows, cols].float().mean(dim=(0, 2)) for a in attentions]).cpu()


@torch.no_grad()
def induction_test(
    model: GPT, length: int | None = None, batch: int = INDUCTION_BATCH, seed: int = INDUCTION_SEED
) -> InductionResult:
    """Run batch random sequences of length tokens, each repeated twice, through model with a trace."""
    config = model.config
    length = length if length is not None else min(config.block_size // 2, 256)
    if not 2 <= length <= config.block_size // 2:
        raise InputError(
            f"the repeated sequence must be 2 to block_size / 2 = {config.block_size // 2} tokens, got {length}"
        )
    generator = torch.Generator().manual_seed(seed)
    half = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
    ids = torch.cat([half, half], dim=1).to(_device(model))  # (batch, 2L)
    trace = Trace()
    logits = eval_forward(model, ids, trace).float()
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (batch, 2L - 1)
    return InductionResult(
        scores=induction_score_of(trace.attentions, length),
        first_half_loss=float(losses[:, : length - 1].mean()),
        repeated_half_loss=float(losses[:, length:].mean()),
        length=length,
    )


def induction_scores(model: GPT, length: int | None = None, batch: int = INDUCTION_BATCH) -> Tensor:
    """(n_layer, n_head): each head's induction score (1: a perfect induction head; uniform attention scores
    about 1/position)."""
    return induction_test(model, length, batch).scores


def _lens_states(model: GPT, ids: Tensor) -> tuple[list[Tensor], Tensor]:
    """The residual stream after the embedding and after each block (each (T, d)), and the model's logits."""
    trace = Trace()
    logits = eval_forward(model, ids[None], trace)[0]
    return [h[0] for h in trace.hidden_states[: model.config.n_layer + 1]], logits


@torch.no_grad()
def logit_lens(model: GPT, ids: Sequence[int] | Tensor, first: int = 0) -> Tensor:
    """(n_layer + 1, T, vocab) log-probabilities read out of the residual stream after the embedding and after each
    block, each through the final norm and the LM head: the last equals the model's own log-softmax. first > 0
    keeps positions first.. only (the whole tensor for 1024 GPT-2 positions would be 2.7 GB)."""
    ids = _one_sequence(ids, "the logit lens")
    states, _ = _lens_states(model, ids)
    outs = []
    for state in states:
        state = state[first:]
        if model.norm_f is not None:
            state = model.norm_f(state)
        outs.append(model.logits(state).float().log_softmax(-1))
    return torch.stack(outs).cpu()


@dataclass(frozen=True)
class LensTop:
    """The logit lens reduced as it is read, stage by stage (no (stages, T, vocab) tensor is ever held)."""

    tokens: Tensor  # (n_layer + 1, T, k): each stage's k most likely next tokens
    probs: Tensor  # (n_layer + 1, T, k): their probabilities
    prediction_probs: Tensor  # (n_layer + 1, T): the probability each stage gives the model's own prediction


@torch.no_grad()
def logit_lens_top(model: GPT, ids: Sequence[int] | Tensor, k: int = 1) -> LensTop:
    """The logit lens's top k tokens per stage and position, and each stage's probability of the model's own
    prediction, holding one stage's (T, vocab) probabilities at a time (a server's memory stays bounded)."""
    ids = _one_sequence(ids, "the logit lens")
    states, logits = _lens_states(model, ids)
    prediction = logits.argmax(-1)  # (T,): the model's own prediction at each position
    tokens, probs, chosen = [], [], []
    for state in states:
        if model.norm_f is not None:
            state = model.norm_f(state)
        stage = model.logits(state).float().softmax(-1)  # (T, V)
        values, top = stage.topk(k, dim=-1)
        tokens.append(top)
        probs.append(values)
        chosen.append(stage.gather(-1, prediction[:, None])[:, 0])
    return LensTop(torch.stack(tokens).cpu(), torch.stack(probs).cpu(), torch.stack(chosen).cpu())


@torch.no_grad()
def head_contributions(model: GPT, ids: Sequence[int] | Tensor, position: int = -1, token: int | None = None) -> Tensor:
    """(n_layer, n_head): each head's direct contribution to the logit of `token` (default: the model's own
    prediction) at `position`: its output through the output projection, the final norm's scale at that position
    (held fixed, as direct logit attribution does) and the LM head's row of the token. Pre-norm models only.
    With logit_softcap these add up to the logit before the cap (the cap is monotonic, not linear)."""
    if model.norm_f is None:
        raise InputError("head contributions need a pre-norm model (a post-norm one normalises after each head)")
    ids = _one_sequence(ids, "head contributions")
    if not -len(ids) <= position < len(ids):
        raise InputError(f"position {position} is outside the {len(ids)}-token sequence")
    config = model.config
    trace = Trace()
    logits = eval_forward(model, ids[None], trace)[0]  # (T, V)
    token = int(logits[position].argmax()) if token is None else token
    if not 0 <= token < config.vocab_size:
        raise InputError(f"token {token} is outside the vocabulary [0, {config.vocab_size})")
    final = trace.hidden_states[config.n_layer][0, position].float()  # the residual stream the final norm reads
    centred = isinstance(model.norm_f, torch.nn.LayerNorm)
    scale = (final - final.mean()).pow(2).mean() if centred else final.pow(2).mean()
    scale = torch.rsqrt(scale + config.norm_eps)
    unembed = model.lm_head.weight[token].float() * model.norm_f.weight.float()  # (d,)
    out = torch.zeros(config.n_layer, config.n_head)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        x = block.norm1(trace.hidden_states[layer][0])  # (T, d): what the attention read
        _, _, v = attn.qkv(x).split(
            [config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.n_kv_head * config.head_dim],
            dim=-1,
        )
        v = v.view(-1, config.n_kv_head, config.head_dim).repeat_interleave(config.n_head // config.n_kv_head, 1)
        weights = trace.attentions[layer][0, :, position]  # (H, T): how the position spread over the keys
        heads = torch.einsum("ht,thd->hd", weights.to(v.dtype), v)  # (H, hd): each head's output there
        w_out = attn.proj.weight.view(config.n_embd, config.n_head, config.head_dim)  # (d, H, hd)
        written = torch.einsum("hd,ehd->he", heads, w_out).float()  # (H, d): each head's write to the stream
        if centred:
            written = written - written.mean(-1, keepdim=True)
        out[layer] = (written * scale) @ unembed
    return out


def chance_induction_score(length: int) -> float:
    """What uniform causal attention scores on the induction test: the mean of 1 / (i + 1) over the scored rows."""
    return sum(1 / (i + 1) for i in range(length + 1, 2 * length)) / (length - 1)


def top_heads(scores: Tensor, k: int = 5) -> list[tuple[int, int, float]]:
    """The k highest-scoring heads of an (n_layer, n_head) table as (layer, head, score), counted from 0."""
    flat = scores.flatten()
    order = flat.argsort(descending=True)[:k].tolist()
    n_head = scores.size(1)
    return [(i // n_head, i % n_head, float(flat[i])) for i in order]


@torch.no_grad()
def attention_from(model: GPT, ids: Sequence[int] | Tensor, position: int = -1) -> Tensor:
    """(n_layer, T): how the token at `position` spreads its attention over the sequence in each layer, the mean
    over heads (the answer position of a few-shot prompt: which demonstration tokens it reads)."""
    ids = _one_sequence(ids, "attention_from")
    trace = Trace()
    eval_forward(model, ids[None], trace)
    return torch.stack([a[0, :, position].float().mean(0) for a in trace.attentions]).cpu()


def icl_summary(model: GPT, tokens: np.ndarray | Tensor, windows: int = ICL_WINDOWS, heads: int = 5) -> dict:
    """The ICL score with its standard error over windows and its early and late losses, and the induction test,
    as one JSON-ready dict (what `gptkit eval --icl` prints)."""
    per_window = window_losses(model, tokens, windows)
    early, late = early_late_losses(per_window.mean(0))
    scores = torch.tensor([icl_score_of(row) for row in per_window])
    test = induction_test(model)
    return {
        "icl_score": late - early,
        "icl_stderr": float(scores.std() / math.sqrt(len(scores))) if len(scores) > 1 else None,
        "early_loss": early,
        "late_loss": late,
        "context": model.config.block_size,
        "windows": windows,
        "induction": {
            "length": test.length,
            "first_half_loss": test.first_half_loss,
            "repeated_half_loss": test.repeated_half_loss,
            "chance": chance_induction_score(test.length),
            "top_heads": [{"layer": layer, "head": h, "score": v} for layer, h, v in top_heads(test.scores, heads)],
            "scores": test.scores.tolist(),
        },
    }


def lens_predictions(lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From logit-lens log-probabilities (S, T, V): each stage's top token (S, T), its probability (S, T), and the
    probability each stage gives the model's eventual (last-stage) prediction at that position (S, T)."""
    probs = lens.exp()
    top_prob, top = probs.max(-1)
    final = top[-1]  # (T,): what the whole model predicts at each position
    return top, top_prob, probs.gather(-1, final.expand(len(lens), -1)[..., None])[..., 0]
