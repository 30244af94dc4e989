"""GPT: one configurable decoder-only transformer, the forward pass of SPEC section 1."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gptkit import cpu_kernels
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.kv_cache import KVCache, LayerKV
from gptkit.loss import linear_cross_entropy, soft_cap


@dataclass
class Trace:
    """What a forward pass saw, for inspection: filled in when passed to GPT.forward."""

    hidden_states: list[Tensor] = field(default_factory=list)  # after the embedding, each block, the final norm
    attentions: list[Tensor] = field(default_factory=list)  # per layer: (B, n_head, T, S) weights, rows sum to 1


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g, computed in fp32 as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


class Linear(nn.Linear):
    """nn.Linear whose inference on a CPU takes gptkit's faster products where measured faster (cpu_kernels.linear)."""

    def forward(self, x: Tensor) -> Tensor:
        return cpu_kernels.linear(x, self.weight, self.bias)


def make_norm(config: ModelConfig) -> nn.Module:
    """The configured normalisation over the model width."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.norm_bias)


def sinusoidal_embedding(positions: Tensor, dim: int) -> Tensor:
    """Vaswani et al.'s table at the given positions: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions[..., None].float() * inv_freq  # (..., T, dim/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # (..., T, dim), sin/cos interleaved


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary angles p * theta^(-2i/d) for the half-split layout (dim i pairs with i + d/2), as in HF Llama."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions[..., None].float() * inv_freq  # (B or 1, T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B or 1, T, head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (x_i, x_{i+d/2}) pair of x (B, H, T, head_dim) by its position's angle."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (B or 1, 1, T, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def document_positions(document_ids: Tensor) -> Tensor:
    """Each token's position inside its document (B, T): counting restarts where a row's id changes."""
    index = torch.arange(document_ids.size(1), device=document_ids.device).expand_as(document_ids)  # (B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # (B, T): where each token's document starts
    return index - first


def document_mask(document_ids: Tensor) -> Tensor:
    """Causal attention within documents (B, 1, T, T), True where a query may attend a key."""
    T = document_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


def plain_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float) -> tuple[Tensor, Tensor]:
    """softmax(QK^T / sqrt(d_k) + M) V, returning the output and the attention weights."""
    T, S = q.size(-2), k.size(-2)
    if mask is None:  # causal over the last T of S keys
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1))  # (B, H, T, S)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = F.dropout(weights, dropout).to(v.dtype) @ v  # (B, H, T, head_dim)
    return out, weights


class CausalSelfAttention(nn.Module):
    """Multi-head (grouped-query when n_kv_head < n_head) causal self-attention; with qk_norm, each head's q and k
    pass an RMSNorm over head_dim (one gain per norm, shared by the heads) before RoPE, as Qwen3's q_norm/k_norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        qkv_width = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.qkv = Linear(config.n_embd, qkv_width, bias=config.attn_bias)
        self.proj = Linear(config.n_head * config.head_dim, config.n_embd, bias=config.attn_bias)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)
        # softmax(QK^T)V in fp32 under autocast: the trainer sets it where a CPU's bf16 kernel measures slower.
        self.fp32_attention = False

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, kv: LayerKV | None, mask: Tensor | None,
        trace: Trace | None,
    ) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        if self.q_norm is not None:
            # Over each head's hd values; back in q's dtype, which an fp32 gain under autocast would promote past v's.
            q, k = self.q_norm(q).type_as(q), self.k_norm(k).type_as(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv is not None:
            k, v, mask = kv.update(k, v)  # (B, KV, S, hd) with S the cached length
        grouped = self.n_kv_head != self.n_head
        dropout = self.dropout if self.training else 0.0
        if trace is not None:
            if grouped:
                groups = self.n_head // self.n_kv_head
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, hd)
            y, weights = plain_attention(q, k, v, mask, dropout)
            trace.attentions.append(weights)
        else:
            y = self.attend(q, k, v, mask, dropout, grouped)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, H*hd)
        return self.resid_drop(self.proj(y))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, grouped: bool) -> Tensor:
        """PyTorch's fused attention (B, H, T, hd), causal unless given a mask; in fp32 with fp32_attention."""
        is_causal = mask is None and q.size(-2) > 1
        if self.fp32_attention and q.dtype != torch.float32:
            with torch.autocast(q.device.type, enabled=False):  # autocast would cast the fp32 inputs back
                y = self.attend(q.float(), k.float(), v.float(), mask, dropout, grouped)
            return y.to(q.dtype)
        # enable_gqa lets each group of query heads read its shared key/value head without copying the cache.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                              enable_gqa=grouped)


class FeedForward(nn.Module):
    """The position-wise network: act(x W1) W2 (relu2: act(h) = relu(h)^2), or SiLU(x W_gate) * (x W_up) W_down for
    swiglu."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.activation = config.activation
        fc_width = 2 * config.ffn_hidden if config.activation == "swiglu" else config.ffn_hidden
        self.fc = Linear(config.n_embd, fc_width, bias=config.mlp_bias)  # swiglu: [gate; up] in one matmul
        self.proj = Linear(config.ffn_hidden, config.n_embd, bias=config.mlp_bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "relu2":
            h = F.relu(h).square()
        elif self.activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.proj(h))


class Block(nn.Module):
    """Attention then feed-forward, each in a residual connection with pre- or post-normalisation."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.norm1, self.attn = make_norm(config), CausalSelfAttention(config)
        self.norm2, self.mlp = make_norm(config), FeedForward(config)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None, kv: LayerKV | None, mask: Tensor | None,
        trace: Trace | None,
    ) -> Tensor:
        if self.pre_norm:
            x = x + self.attn(self.norm1(x), rope, kv, mask, trace)
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x, rope, kv, mask, trace))
        return self.norm2(x + self.mlp(x))


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
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config) if config.norm_position == "pre" else None
        self.lm_head = Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 L) (or zero, with
        zero_init_proj, as modded-nanogpt: each pre-norm block then starts as the identity)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
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
                raise InputError(f"targets must have the shape of ids {tuple(ids.shape)} (and come without "
                                 f"logits_at), got {tuple(targets.shape)}")  # fmt: skip
            if logits_at is not None and (tuple(logits_at.shape) != (ids.size(0),) or int(logits_at.min()) < 0
                                          or int(logits_at.max()) >= ids.size(1)):  # fmt: skip
                raise InputError(f"logits_at must hold one index in [0, {ids.size(1)}) per row of ids, got {logits_at}")
        x = self.hidden(ids, cache, start_pos, trace, document_ids)  # (B, T, d)
        if targets is not None:
            return self.loss(x, targets)
        if logits_at is not None:
            x = x[torch.arange(x.size(0), device=x.device), logits_at][:, None]  # (B, 1, d)
        return self.logits(x)  # (B, T, V)

    def attend_in_fp32(self, on: bool) -> None:
        """Every block's attention in fp32 under autocast (on) or in autocast's dtype (off, the default)."""
        for block in self.blocks:
            block.attn.fp32_attention = on

    def logits(self, x: Tensor) -> Tensor:
        """Next-token logits (..., vocab_size) of final hidden states x (..., n_embd): the LM head over the real
        vocabulary (a padded head's extra columns dropped), soft-capped to c * tanh(z / c) with logit_softcap c."""
        z = self.lm_head(x)  # (..., padded V)
        if z.size(-1) != self.config.vocab_size:
            z = z[..., : self.config.vocab_size]  # (..., V)
        return soft_cap(z, self.config.logit_softcap)

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """The mean next-token loss of logits(x) against targets (IGNORE_INDEX skipped), the head fused into it."""
        return linear_cross_entropy(x, self.lm_head.weight, self.lm_head.bias, targets,
                                    softcap=self.config.logit_softcap, vocab_size=self.config.vocab_size)

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
                raise InputError(f"document_ids must have the shape of ids {tuple(ids.shape)} (and come without a "
                                 f"cache), got {tuple(document_ids.shape)}")  # fmt: skip
        T = ids.size(1)
        offsets = torch.arange(T, device=ids.device)
        positions = start_pos[:, None] + offsets if isinstance(start_pos, Tensor) else (start_pos + offsets)[None]
        mask = None
        if document_ids is not None:
            positions = document_positions(document_ids)
            mask = document_mask(document_ids)
        x = self.tok_emb(ids)  # (B, T, d)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        elif self.config.position == "sinusoidal":
            x = x + sinusoidal_embedding(positions, self.config.n_embd).to(x.dtype)
        rope = None
        if self.config.position == "rope":
            rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.drop(x)
        if trace is not None:
            trace.hidden_states.append(x)
        for index, block in enumerate(self.blocks):
            kv = cache.layer(index, start_pos) if cache is not None else None
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled() and kv is None and trace is None:
                x = checkpoint(block, x, rope, None, mask, None, use_reentrant=False)  # dropout's RNG replayed
            else:
                x = block(x, rope, kv, mask, trace)
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

