"""Next-token cross-entropy (docs/spec.md section 3.1): from logits, or fused with the LM head over slices of rows."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # targets equal to this count in neither the loss nor its gradient

# linear_cross_entropy's slices hold about this many logits (128 MB in fp32: 668 rows of GPT-2's vocabulary). The
# LM-head weight gradient is read and written once per slice, so much smaller slices cost time. GPT-2 small's head
# and loss over 2048 rows, fwd + bwd on a 2-core CPU, two runs, s: 167 rows per slice 2.89 / 2.76, 334 2.74 / 2.86,
# 668 2.46 / 3.25, one slice 2.25 / 2.85; F.linear + F.cross_entropy 2.86 / 2.89. A whole GPT-2-small step on
# 2 x 1024 tokens took 8.9-9.8 s against 11.5-12.1 with F.cross_entropy (interleaved).
SLICE_LOGITS = 2**25
# On a GPU the slices are far larger (4 GB of fp32 logits): a GPU has the memory, and the plain path is two library
# kernels that torch.compile fuses, where each slice costs a dozen small launches (benchmarks/bench_gpu.py --parts
# loss times both).
GPU_SLICE_LOGITS = 2**30


def next_token_loss(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy (nats) over the targets not equal to ignore_index (docs/spec.md section 3.1)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=ignore_index)


def slice_logits(device: torch.device) -> int:
    """How many logits linear_cross_entropy computes at once on device."""
    return SLICE_LOGITS if device.type == "cpu" else GPU_SLICE_LOGITS


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(logits / cap) (Gemma 2's final-logit soft-cap), or logits unchanged when cap is None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
    vocab_size: int | None = None,
    scale: float = 1.0,
) -> Tensor:
    """next_token_loss(soft_cap(scale * F.linear(hidden, weight, bias)[..., :vocab_size], softcap), targets), without
    ever holding every row's logits.

    hidden (..., d) and targets (...) are taken a slice of rows at a time; a training step keeps no (rows, V)
    tensor for its backward pass (GPT-2's vocabulary at 12 x 1024 tokens: 2.5 GB of fp32 logits, as much again
    for their gradient). Logits that fit one slice take the plain path: on a char model's 65-token vocabulary
    the sliced one made a CPU training step 5-9% slower (its extra small operations). vocab_size (default: the
    weight's rows) leaves the weight's later rows, a padded vocabulary's, out of the softmax: their gradient is 0.
    """
    rows = hidden.reshape(-1, hidden.size(-1))
    vocab_size = weight.size(0) if vocab_size is None else vocab_size
    if rows.size(0) * weight.size(0) <= slice_logits(hidden.device):  # logits this small cost no memory worth saving
        logits = F.linear(rows, weight, bias)  # and PyTorch's kernels take fewer steps
        logits = logits[:, :vocab_size] if vocab_size < weight.size(0) else logits
        logits = soft_cap(logits if scale == 1.0 else logits * scale, softcap)
        return next_token_loss(logits, targets, ignore_index)
    # Under no_grad the function's needs_input_grad still says True: it is told here instead.
    grads = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        rows, weight, bias, targets.reshape(-1), ignore_index, grads, softcap, vocab_size, scale
    )


def _slice_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None, vocab_size: int, scale: float
) -> tuple[Tensor, torch.dtype, Tensor | float | None]:
    """(fp32 logits of a slice of rows, scaled, soft-capped, the padded columns -inf; the product's dtype; the
    derivative of the scale and soft-cap, scale * (1 - tanh^2 (z / cap)) at each logit, or the scale, or None)."""
    logits = F.linear(h, weight, bias)  # bf16 under autocast: the gradient products then are too
    compute = logits.dtype
    logits = logits.float()
    slope = None if scale == 1.0 else scale
    if scale != 1.0:
        logits.mul_(scale)
    if softcap is not None:
        logits.div_(softcap).tanh_()
        slope = (1.0 - logits.square()) * scale
        logits.mul_(softcap)
    if vocab_size < logits.size(1):
        logits[:, vocab_size:] = float("-inf")  # exp gives 0: out of the softmax, and out of the gradient
    return logits, compute, slope


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and, where autograd asks for them, its gradients, computed together slice by slice.

    A slice's softmax, less one at each target, is the gradient of its summed loss with respect to its logits (times
    the soft-cap's derivative 1 - tanh^2, with one), so the forward pass turns it into the slice's share of the
    hidden and weight gradients at once and keeps only those. The backward pass scales them by the incoming gradient.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        ignore_index: int,
        grads: bool,
        softcap: float | None,
        vocab_size: int,
        scale: float,
    ) -> Tensor:
        want_hidden, want_weight = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        want_bias = grads and bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None  # the first slice writes it whole
        grad_bias = torch.zeros_like(bias) if want_bias else None
        valid = targets != ignore_index
        count = valid.sum()
        safe_targets = targets.masked_fill(~valid, 0)  # any column: those rows are zeroed below
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = max(1, slice_logits(hidden.device) // weight.size(0))
        for start in range(0, hidden.size(0), step):
            h, t, keep = hidden[start : start + step], safe_targets[start : start + step], valid[start : start + step]
            logits, compute, slope = _slice_logits(h, weight, bias, softcap, vocab_size, scale)
            # log-sum-exp and softmax in place: a slice-sized temporary costs as much as the product here
            target_logit = logits.gather(1, t[:, None])[:, 0]
            row_max = logits.amax(dim=-1, keepdim=True)
            exp = logits.sub_(row_max).exp_()
            row_sum = exp.sum(dim=-1)
            total += ((row_max[:, 0] + row_sum.log() - target_logit) * keep).sum()
            if not (want_hidden or want_weight or want_bias):
                continue
            grad = exp.div_(row_sum[:, None])  # the softmax
            grad[torch.arange(len(t), device=grad.device), t] -= 1.0
            grad.mul_(keep[:, None] / count)  # the gradient of the mean: backward then only scales by its input
            if slope is not None:
                grad.mul_(slope)  # through the soft-cap and the scale to the product's logits
            grad = grad.to(compute)
            if grad_hidden is not None:
                grad_hidden[start : start + step] = grad @ weight.to(compute)
            if grad_weight is not None:
                if compute == grad_weight.dtype:  # beta=0 ignores the uninitialised values of the first slice
                    grad_weight.addmm_(grad.t(), h, beta=0.0 if start == 0 else 1.0)
                else:  # autocast: the product in its dtype, accumulated in the weight's
                    part = (grad.t() @ h.to(compute)).to(grad_weight.dtype)
                    grad_weight.copy_(part) if start == 0 else grad_weight.add_(part)
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0, dtype=torch.float32).to(grad_bias.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.spent = False
        return total / count

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        # The saved gradients are scaled in place: a copy of the LM head's would cost as much as its update.
        if ctx.spent:
            raise RuntimeError("the fused LM-head loss supports one backward pass (its saved gradients are used up)")
        ctx.spent = True
        grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.saved_tensors]
        return *grads, None, None, None, None, None, None  # targets, ignore_index, grads, softcap, vocab_size, scale


RowReduction = Literal["none", "sum", "mean"]


def row_logprobs(logits: Tensor, targets: Tensor, reduction: RowReduction) -> Tensor:
    """The log-probability of each target under logits (B, T, V), IGNORE_INDEX positions counting nothing: per token
    (B, T) with 0 at those positions ("none"), summed over each row (B,) ("sum"), or averaged over each row's
    targets (B,) ("mean"; a row with none gives 0)."""
    B, T, V = logits.shape
    nll = F.cross_entropy(
        logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    logprobs = -nll.view(B, T)  # (B, T)
    if reduction == "none":
        return logprobs
    summed = logprobs.sum(dim=1)  # (B,)
    return summed if reduction == "sum" else summed / (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)
