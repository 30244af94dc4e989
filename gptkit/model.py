"""GPT: one configurable decoder-only transformer, the forward pass of docs/spec.md section 1."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gptkit.attention import CausalSelfAttention
from gptkit.config import GATED, ModelConfig
from gptkit.errors import InputError
from gptkit.kv_cache import KVCache, LayerKV
from gptkit.layers import Linear, RMSNorm, activate, make_norm
from gptkit.loss import linear_cross_entropy, soft_cap
from gptkit.moe import MoEFeedForward, auxiliary_loss
from gptkit.positions import document_positions, rope_tables, sinusoidal_embedding


@dataclass
class Trace:
    """What a forward pass saw, for inspection: filled in when passed to GPT.forward."""

    hidden_states: list[Tensor] = field(default_factory=list)  # after the embedding, each block, the final norm
    attentions: list[Tensor] = field(default_factory=list)  # per layer: (B, n_head, T, S) weights, rows sum to 1


class FeedForward(nn.Module):
    """The position-wise network: act(x W1) W2 (relu2: act(h) = relu(h)^2), or a gated one, act(x W_gate) * (x W_up)
    W_down, with SiLU for swiglu and GELU (tanh) for geglu."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.activation = config.activation
        fc_width = 2 * config.ffn_hidden if config.activation in GATED else config.ffn_hidden
        self.fc = Linear(config.n_embd, fc_width, bias=config.mlp_bias)  # gated: [gate; up] in one matmul
        self.proj = Linear(config.ffn_hidden, config.n_embd, bias=config.mlp_bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(activate(self.fc(x), self.activation)))


def feed_forward(config: ModelConfig, layer_index: int) -> nn.Module:
    """Layer layer_index's feed-forward: dense, or a mixture of experts (gptkit.moe) where config.is_moe_layer."""
    if not config.is_moe_layer(layer_index):
        return FeedForward(config)
    hidden = config.moe_shared_hidden
    return MoEFeedForward(config, FeedForward(replace(config, ffn_hidden=hidden)) if hidden is not None else None)


class Block(nn.Module):
    """Attention then feed-forward, each in a residual, normalised as norm_position says (docs/spec.md section 1.2):
    pre x + f(norm(x)); post norm(x + f(x)); sandwich x + norm_post(f(norm(x))); sublayer_post x + norm(f(x)). Each
    sublayer's output is scaled by residual_scale; parallel_residual feeds both sublayers the same x (GPT-NeoX)."""

    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.norm_position, self.parallel = config.norm_position, config.parallel_residual
        self.residual_scale = config.residual_scale
        self.norm1, self.attn = make_norm(config), CausalSelfAttention(config, layer_index)
        self.norm2, self.mlp = make_norm(config), feed_forward(config, layer_index)
        sandwich = config.norm_position == "sandwich"
        self.norm1_post = make_norm(config) if sandwich else None
        self.norm2_post = make_norm(config) if sandwich else None

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        kv: LayerKV | None,
        document_ids: Tensor | None,
        trace: Trace | None,
    ) -> Tensor:
        """x (B, T, n_embd) -> (B, T, n_embd)."""
        weights = trace.attentions if trace is not None else None
        if self.norm_position == "post":
            x = self.norm1(x + self.scaled(self.attn(x, rope, kv, document_ids, weights)))
            return self.norm2(x + self.scaled(self.mlp(x)))

        def attn(h: Tensor) -> Tensor:
            return self.attn(h, rope, kv, document_ids, weights)

        if self.parallel:  # summed in GPT-NeoX's order: mlp + attn + x
            mlp_out = self.branch(x, self.mlp, self.norm2, self.norm2_post)
            return mlp_out + self.branch(x, attn, self.norm1, self.norm1_post) + x
        x = x + self.branch(x, attn, self.norm1, self.norm1_post)
        return x + self.branch(x, self.mlp, self.norm2, self.norm2_post)

    def branch(
        self, x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module, post_norm: nn.Module | None
    ) -> Tensor:
        """What a sublayer adds to the residual stream x, with its norm before it (or after, sublayer_post) and a
        sandwich's post_norm after it."""
        if self.norm_position == "sublayer_post":
            out = norm(sublayer(x))
        else:
            out = sublayer(norm(x))
            if post_norm is not None:
                out = post_norm(out)
        return self.scaled(out)

    def scaled(self, out: Tensor) -> Tensor:
        """A sublayer's output times residual_scale (Granite's residual_multiplier)."""
        return out if self.residual_scale == 1.0 else out * self.residual_scale


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size).

    The embedding and the LM head hold config.padded_vocab_size rows; the rows past vocab_size are never looked up
    and their logits never leave the model (logits and loss below read the real vocabulary only).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Checking ids costs a device sync; callers that feed validated data (the trainer) turn it off.
        self.check_inputs = True
        # Recomputing each block's activations in the backward pass instead of keeping them: a training step
        # holds one block's activations at a time, for about a third more compute (the trainer sets it).
        self.checkpoint_blocks = False
        self.tok_emb = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd) if config.position == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, index) for index in range(config.n_layer))
        self.norm_f = make_norm(config) if config.norm_position != "post" else None
        self.lm_head = Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 L) (or zero, with
        zero_init_proj, as modded-nanogpt: each pre-norm block then starts as the identity); every norm's gain starts
        at 1 (an RMSNorm's weight at 1 - norm_gain_offset)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            if isinstance(module, RMSNorm):
                nn.init.constant_(module.weight, 1.0 - module.gain_offset)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)
            if self.config.zero_init_proj:
                nn.init.zeros_(block.attn.proj.weight)
                nn.init.zeros_(block.mlp.proj.weight)

    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        start_pos: int | Tensor = 0,
        trace: Trace | None = None,
        logits_at: Tensor | None = None,
        targets: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits for every position of ids (B, T), whose first token sits at absolute position start_pos.

        With a cache, each layer writes its keys and values at positions start_pos.. and attends over all
        cached positions up to each query. start_pos may be a (B,) tensor giving each row its own position.
        With a trace, attention takes the plain path and the trace records its weights and hidden states.
        logits_at, a (B,) tensor of indices into T, asks for logits (B, 1, V) at those positions only: a prefill
        needs no others, and the LM head over every position can be a fifth of its time.
        targets (B, T) returns instead the mean next-token loss over those not equal to IGNORE_INDEX, with the LM
        head fused into the loss (gptkit.loss.linear_cross_entropy): no (B, T, V) logits are kept for training.
        document_ids (B, T) packs several documents (contiguous runs of equal ids) into a row: each token attends
        only to earlier tokens of its own document, and positions restart at 0 where a document starts.
        """
        if self.check_inputs:
            if targets is not None and (tuple(targets.shape) != tuple(ids.shape) or logits_at is not None):
                raise InputError(
                    f"targets must have the shape of ids {tuple(ids.shape)} (and come without "
                    f"logits_at), got {tuple(targets.shape)}"
                )
            if logits_at is not None and (
                tuple(logits_at.shape) != (ids.size(0),)
                or int(logits_at.min()) < 0
                or int(logits_at.max()) >= ids.size(1)
            ):
                raise InputError(f"logits_at must hold one index in [0, {ids.size(1)}) per row of ids, got {logits_at}")
        x = self.hidden(ids, cache, start_pos, trace, document_ids)  # (B, T, d)
        if targets is not None:
            loss = self.loss(x, targets)
            # A mixture of experts' balance and z losses (gptkit.moe) reach the optimiser with the loss they train.
            extra = auxiliary_loss(self) if self.training and self.config.n_experts is not None else None
            return loss if extra is None else loss + extra
        if logits_at is not None:
            x = x[torch.arange(x.size(0), device=x.device), logits_at][:, None]  # (B, 1, d)
        return self.logits(x)  # (B, T, V)

    def attend_in_fp32(self, on: bool) -> None:
        """Every block's attention in fp32 under autocast (on) or in autocast's dtype (off, the default)."""
        for block in self.blocks:
            block.attn.fp32_attention = on

    def logits(self, x: Tensor) -> Tensor:
        """Next-token logits (..., vocab_size) of final hidden states x (..., n_embd): the LM head over the real
        vocabulary (a padded head's extra columns dropped), times logit_scale, soft-capped to c * tanh(z / c) with
        logit_softcap c."""
        z = self.lm_head(x)  # (..., padded V)
        if z.size(-1) != self.config.vocab_size:
            z = z[..., : self.config.vocab_size]  # (..., V)
        if self.config.logit_scale != 1.0:
            z = z * self.config.logit_scale
        return soft_cap(z, self.config.logit_softcap)

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """The mean next-token loss of logits(x) against targets (IGNORE_INDEX skipped), the head fused into it."""
        c, head = self.config, self.lm_head
        return linear_cross_entropy(
            x, head.weight, head.bias, targets, softcap=c.logit_softcap, vocab_size=c.vocab_size, scale=c.logit_scale
        )

    def hidden(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        start_pos: int | Tensor = 0,
        trace: Trace | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """The final hidden states (B, T, n_embd) the LM head reads: what forward computes before its head."""
        if self.check_inputs:
            self._check_inputs(ids, cache, start_pos)
            if document_ids is not None and (tuple(document_ids.shape) != tuple(ids.shape) or cache is not None):
                raise InputError(
                    f"document_ids must have the shape of ids {tuple(ids.shape)} (and come without a "
                    f"cache), got {tuple(document_ids.shape)}"
                )
        T = ids.size(1)
        offsets = torch.arange(T, device=ids.device)
        positions = start_pos[:, None] + offsets if isinstance(start_pos, Tensor) else (start_pos + offsets)[None]
        if document_ids is not None:
            positions = document_positions(document_ids)
        x = self.tok_emb(ids)  # (B, T, d)
        if self.config.embedding_scale is not None:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)  # the scale rounded first, as Gemma's
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        elif self.config.position == "sinusoidal":
            x = x + sinusoidal_embedding(positions, self.config.n_embd).to(x.dtype)
        ropes = rope_tables(self.config, positions) if self.config.position == "rope" else [None] * len(self.blocks)
        x = self.drop(x)
        if trace is not None:
            trace.hidden_states.append(x)
        for index, block in enumerate(self.blocks):
            kv = cache.layer(index, start_pos) if cache is not None else None
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled() and kv is None and trace is None:
                # use_reentrant=False replays dropout's RNG in the recomputation
                x = checkpoint(block, x, ropes[index], None, document_ids, None, use_reentrant=False)
            else:
                x = block(x, ropes[index], kv, document_ids, trace)
            if trace is not None:
                trace.hidden_states.append(x)
        if self.norm_f is not None:
            x = self.norm_f(x)
            if trace is not None:
                trace.hidden_states.append(x)
        return x

    def _check_inputs(self, ids: Tensor, cache: KVCache | None, start_pos: int | Tensor) -> None:
        """Raise InputError for ids the forward pass cannot take."""
        if ids.dim() != 2:
            raise InputError(f"token ids must have shape (batch, time), got {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"token ids must be an integer tensor, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= self.config.vocab_size else int(ids.min())
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        last = int(start_pos.max()) if isinstance(start_pos, Tensor) else start_pos
        last += ids.size(1)
        if self.pos_emb is not None and last > self.config.block_size:
            raise InputError(
                f"positions up to {last} exceed block_size {self.config.block_size} of a model with learned "
                f"positions; keep only the last {self.config.block_size} tokens"
            )
        if cache is not None and (last > cache.max_len or ids.size(0) != cache.batch_size):
            raise InputError(
                f"a batch of {ids.size(0)} rows reaching position {last} does not fit a KV cache of "
                f"{cache.batch_size} rows x {cache.max_len} positions"
            )
