"""The mixture-of-experts feed-forward (docs/spec.md section 1.7): a linear router, E expert MLPs, each token's top k
compute, an optional shared expert every token passes; the training losses that balance the experts; and the
routing statistics a run logs at its evaluations.

Each token's output depends on that token alone: no expert has a capacity that other tokens could fill, ties between
experts go to the lower index, and every expert's product runs on a multiple of ROW_BLOCK rows, so that the same
rows reach the same matrix kernel however many other tokens chose that expert. Inference over few tokens (a decode
step: N * k at most E) computes each token's routed experts one row at a time instead (routed_experts), reading only
those experts' weights, each token's result again its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from gptkit.config import GATED, ModelConfig
from gptkit.layers import Linear, activate
from gptkit.native.ops import linear

# Each expert's rows are padded with zero rows to a multiple of this. A CPU matrix product gives a row other bits
# when it has 1-4 rows (2 threads: also 5-6) than among many: measured with torch 2.13's fp32 mm on 32x64 to
# 1024x768 weights, every multiple of 8 up to 1024 rows gave each row the bits it has among 2000 rows, wherever it
# sat among them. (Not so for toy widths: with fewer than 8 inputs, or 9 outputs, a row's place in its block of 8
# changed its bits.)
ROW_BLOCK = 8


def route(logits: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(weights, experts), each (N, k): the k most probable experts of softmax(logits) (N, E), ties to the lower
    index, and their probabilities (divided by their sum with renormalize: Mixtral's softmax over the top-k logits)."""
    probs = logits.float().softmax(dim=-1)
    # A stable sort, not topk: topk does not promise which of equal values it returns.
    weights, experts = probs.sort(dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :k], experts[:, :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def load_balance(probs: Tensor, experts: Tensor, n_experts: int) -> Tensor:
    """Switch Transformer's balance term E * sum_e f_e P_e: f_e the share of the N * k routed slots that chose e,
    P_e the mean router probability of e over the N tokens; 1 when both are uniform. (HF's Mixtral loss is k times
    this, over every layer's tokens at once.)"""
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts)  # (E,)
    shares = counts.to(probs.dtype) / experts.numel()
    return n_experts * (shares * probs.mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(router logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def _uses_grouped_mm(x: Tensor, weight: Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: it exists, on a CPU (any float dtype; bf16 under torch.compile)
    or a Hopper-or-later GPU in bf16, with every row stride a multiple of 16 bytes (its own requirement, measured on
    torch 2.13's CPU)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu":
        return False
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # the shape function torch.compile traces it with takes bf16 only (torch 2.13)
    return all(size * x.element_size() % 16 == 0 for size in (weight.size(1), weight.size(2)))


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None, ends: Tensor, row_expert: Tensor) -> Tensor:
    """Rows ends[e-1]:ends[e] of x (R, in) times expert e's weight (E, out, in) transposed (+ its bias (E, out)):
    (R, out), ends[-1] = R. One grouped product where it works, else a loop over experts."""
    if torch.is_autocast_enabled(x.device.type):  # autocast does not cover these products: cast as F.linear would
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if _uses_grouped_mm(x, weight):
        out = torch._grouped_mm(x.contiguous(), weight.transpose(-2, -1), offs=ends.to(torch.int32))  # (R, out)
    else:
        bounds = [0, *ends.tolist()]  # the loop needs the group sizes on the host
        out = torch.cat([x[bounds[e] : bounds[e + 1]] @ weight[e].T for e in range(weight.size(0))])  # (R, out)
    return out if bias is None else out + bias[row_expert]


class ExpertWeights(nn.Module):
    """E linear maps in_features -> out_features held as one (E, out, in) weight (HF's fused expert layout).

    MoEFeedForward computes a stack through expert() and grouped() only, which gptkit.quantization's int8 and int4
    stacks implement too."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(n_experts, out_features)) if bias else None
        nn.init.normal_(self.weight, mean=0.0, std=0.02)  # GPT-2's init, as GPT.reset_parameters gives nn.Linear

    def expert(self, x: Tensor, e: int) -> Tensor:
        """x (M, in) through expert e alone: (M, out)."""
        return linear(x, self.weight[e], None if self.bias is None else self.bias[e])

    def grouped(self, x: Tensor, ends: Tensor, row_expert: Tensor) -> Tensor:
        """grouped_linear over this stack: rows ends[e-1]:ends[e] of x (R, in) through expert e, (R, out)."""
        return grouped_linear(x, self.weight, self.bias, ends, row_expert)


class MoEFeedForward(nn.Module):
    """A token's output: sum over its top-k experts of router weight x expert(x), plus a shared expert's output (times
    sigmoid(x w_gate) with moe_shared_gate). Expert e is act(x fc[e]^T) proj[e]^T with fc [gate; up] when gated.

    Names: router.weight (E, d); fc.weight (E, fc width, d); proj.weight (E, d, hidden); shared.* a dense
    feed-forward; shared_gate.weight (1, d).
    """

    def __init__(self, config: ModelConfig, shared: nn.Module | None) -> None:
        """shared: the dense feed-forward every token also passes (built by the model), or None."""
        super().__init__()
        self.n_experts, self.k, self.renormalize = config.n_experts, config.n_experts_per_token, config.moe_renormalize
        self.activation = config.activation
        self.aux_coefficient, self.z_coefficient = config.moe_aux_loss, config.moe_z_loss
        hidden = config.expert_hidden
        fc_width = 2 * hidden if config.activation in GATED else hidden
        self.router = Linear(config.n_embd, config.n_experts, bias=False)
        self.fc = ExpertWeights(config.n_experts, config.n_embd, fc_width, config.mlp_bias)
        self.proj = ExpertWeights(config.n_experts, hidden, config.n_embd, config.mlp_bias)
        self.shared = shared
        self.shared_gate = Linear(config.n_embd, 1, bias=False) if config.moe_shared_gate else None
        self.drop = nn.Dropout(config.dropout)
        self.aux_loss: Tensor | None = None  # this layer's weighted balance and z losses of the last training forward
        self.counts: Tensor | None = None  # routed slots per expert while counting (see start_routing_count)
        self.entropy = torch.zeros(())  # the summed router entropy of the counted tokens
        self.tokens = 0

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, d) -> (B, T, d)."""
        flat = x.reshape(-1, x.size(-1))  # (N, d)
        logits = self.router(flat).float()  # (N, E)
        weights, experts = route(logits, self.k, self.renormalize)  # (N, k) each
        few = not torch.is_grad_enabled() and experts.numel() <= self.n_experts
        compute = self.routed_experts if few else self.experts
        out = self.drop(compute(flat, weights.to(flat.dtype), experts))  # (N, d)
        self.aux_loss = None  # nothing left from an earlier forward for GPT's loss to read
        if self.training and torch.is_grad_enabled() and (self.aux_coefficient or self.z_coefficient):
            balance = load_balance(logits.softmax(dim=-1), experts, self.n_experts)
            self.aux_loss = self.aux_coefficient * balance + self.z_coefficient * router_z_loss(logits)
        if self.counts is not None:
            self.count(logits.detach(), experts)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view_as(x)  # (B, T, d)

    def experts(self, flat: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Each token's k expert outputs, weighted and summed in its own top-k order: (N, d). The N * k slots are
        sorted by expert into groups each padded to a multiple of ROW_BLOCK rows, and each expert computes its group."""
        N, k = experts.shape
        slot_experts = experts.reshape(-1)  # (N * k,)
        order = slot_experts.argsort(stable=True)  # slots by expert, then by token
        counts = torch.bincount(slot_experts, minlength=self.n_experts)  # (E,)
        padded = (counts + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK
        starts = padded.cumsum(0) - padded  # (E,) where each expert's rows start
        sorted_experts = slot_experts[order]
        within = torch.arange(N * k, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
        rows = starts[sorted_experts] + within  # each sorted slot's row in the padded buffer
        # Enough rows for any routing, so that nothing waits for the counts (a grouped product needs none on the
        # host); the last expert takes the spare rows, so that every row's product (and its gradient) is defined.
        total = ROW_BLOCK * math.ceil((N * k + self.n_experts * (ROW_BLOCK - 1)) / ROW_BLOCK)
        ends = torch.cat([starts[1:], starts.new_tensor([total])])  # (E,) where each expert's rows end
        row_expert = torch.bucketize(torch.arange(total, device=flat.device), ends, right=True)  # (total,) for biases
        buffer = flat.new_zeros(total, flat.size(1)).index_copy(0, rows, flat[order // k])  # (total, d)
        h = self.fc.grouped(buffer, ends, row_expert)  # (total, fc width)
        y = self.proj.grouped(activate(h, self.activation), ends, row_expert)  # (total, d)
        slot_rows = torch.empty_like(rows).index_copy_(0, order, rows)  # each slot's row, slots in token order
        y = y[slot_rows].view(N, k, -1)  # (N, k, d)
        return (y * weights[..., None].to(y.dtype)).sum(dim=1)  # (N, d)

    def routed_experts(self, flat: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """experts()' result for inference over few tokens (N * k at most E): each token's k experts one product of
        one row at a time, so that only the routed experts' weights are read (the grouped products read every
        expert's) and a token's output is computed from that token alone."""
        N, k = experts.shape
        ys = []
        for token, expert in zip(torch.arange(N).repeat_interleave(k).tolist(), experts.reshape(-1).tolist()):
            x = flat[token : token + 1]  # (1, d)
            h = activate(self.fc.expert(x, expert), self.activation)  # (1, hidden)
            ys.append(self.proj.expert(h, expert))  # (1, d)
        y = torch.cat(ys).view(N, k, -1)  # (N * k, d) -> (N, k, d)
        return (y * weights[..., None].to(y.dtype)).sum(dim=1)  # (N, d)

    def count(self, logits: Tensor, experts: Tensor) -> None:
        """Add a forward's routed slots per expert and router entropies to the counters."""
        self.counts += torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        log_probs = logits.log_softmax(dim=-1)
        self.entropy = self.entropy.to(logits.device) - (log_probs.exp() * log_probs).sum()
        self.tokens += logits.size(0)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's mixture-of-experts feed-forwards, in layer order (none for a dense model)."""
    return [module for module in model.modules() if isinstance(module, MoEFeedForward)]


def auxiliary_loss(model: nn.Module) -> Tensor | None:
    """The mean over MoE layers of the balance and z losses their last training forward computed (then forgotten),
    or None when there are none."""
    losses = []
    for layer in moe_layers(model):
        if layer.aux_loss is not None:
            losses.append(layer.aux_loss)
            layer.aux_loss = None
    return torch.stack(losses).mean() if losses else None


def start_routing_count(model: nn.Module) -> None:
    """Count routing from now on (at zero) in every MoE layer, for routing_metrics."""
    for layer in moe_layers(model):
        layer.counts = torch.zeros(layer.n_experts, dtype=torch.long, device=layer.router.weight.device)
        layer.entropy, layer.tokens = torch.zeros((), device=layer.router.weight.device), 0


def routing_metrics(model: nn.Module) -> dict[str, Any]:
    """What routing did since start_routing_count, and stop counting: moe_tokens_per_expert (routed slots per expert,
    a list per MoE layer), moe_load_cv (the coefficient of variation of those counts, std / mean, averaged over
    layers: 0 for a perfect balance) and moe_router_entropy (the router distribution's mean entropy in nats, averaged
    over layers; ln E for a uniform router). {} for a dense model or when nothing was counted."""
    counted = [layer for layer in moe_layers(model) if layer.counts is not None and layer.tokens]
    if not counted:
        return {}
    per_layer, cvs, entropies = [], [], []
    for layer in counted:
        counts = layer.counts.double()
        per_layer.append(layer.counts.tolist())
        cvs.append(float(counts.std(correction=0) / counts.mean()))
        entropies.append(float(layer.entropy) / layer.tokens)
    for layer in moe_layers(model):
        layer.counts = None
    return {
        "moe_tokens_per_expert": per_layer,
        "moe_load_cv": sum(cvs) / len(cvs),
        "moe_router_entropy": sum(entropies) / len(entropies),
    }
