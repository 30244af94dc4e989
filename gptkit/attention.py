"""Causal self-attention: full or windowed, grouped-query, with the families' score scale, soft-cap and q/k norms.

Masks are boolean, True where a query may attend a key, broadcastable to (B, heads, T, S). A windowed layer of window
W lets query position i attend key positions i - W < j <= i (HF Mistral's and Gemma's rule). Without a KV cache a
long windowed pass never builds a (T, T) mask: its queries go in chunks of W, each attending the 2W keys of its own
chunk and the one before (windowed_attention); with a cache, LayerKV.update returns the mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit.config import ModelConfig
from gptkit.kv_cache import LayerKV
from gptkit.layers import Linear, RMSNorm
from gptkit.loss import soft_cap
from gptkit.positions import apply_rope

# attend(q, k, v, mask) -> output: the kernel windowed_attention runs on each chunk
Attend = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


def document_mask(document_ids: Tensor) -> Tensor:
    """Causal attention within documents (B, 1, T, T), True where a query may attend a key."""
    T = document_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


def dense_mask(T: int, window: int | None, document_ids: Tensor | None, device: torch.device) -> Tensor | None:
    """The (T, T) or (B, 1, T, T) mask of a cache-free pass: causal, within a window, within documents; None when
    it is plain causal attention (no documents, and no window or one that T does not exceed)."""
    banded = window is not None and T > window
    if document_ids is None and not banded:
        return None
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if banded:
        mask = mask.triu(1 - window)  # key j > i - W
    if document_ids is not None:
        mask = (document_ids[:, :, None] == document_ids[:, None, :]) & mask  # (B, T, T)
        return mask[:, None]  # (B, 1, T, T)
    return mask


def plain_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    dropout: float,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(cap(Q K^T * scale) + M) V (scale 1/sqrt(d_k) by default), returning the output and the weights.

    q (..., H, T, d), k and v (..., KV, S, d) with KV dividing H (grouped-query heads share a key/value head)."""
    T, S = q.size(-2), k.size(-2)
    if k.size(-3) != q.size(-3):
        groups = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)  # (..., H, S, d)
    if mask is None:  # causal over the last T of S keys
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = (q @ k.transpose(-2, -1)).float()  # (..., H, T, S)
    scores = scores / math.sqrt(q.size(-1)) if scale is None else scores * scale
    scores = soft_cap(scores, softcap)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = F.dropout(weights, dropout).to(v.dtype) @ v  # (..., H, T, d)
    return out, weights


def windowed_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, document_ids: Tensor | None, attend: Attend
) -> Tensor:
    """Attention within a window of W keys for q (B, H, T, d), k and v (B, KV, T, d), without a (T, T) mask.

    The queries go in chunks of W (the last one padded); chunk c attends keys [(c-1) W, (c+1) W), where the band
    i - W < j <= i of every query in it lies. So the work and memory are T x 2W, not T x T."""
    B, H, T, d = q.shape
    W = window
    chunks = -(-T // W)
    tail = chunks * W - T
    q = F.pad(q, (0, 0, 0, tail)).reshape(B, H, chunks, W, d).transpose(1, 2)  # (B, C, H, W, d)
    keys, values = (_chunk_pairs(F.pad(t, (0, 0, W, tail)), chunks, W) for t in (k, v))  # (B, C, KV, 2W, d)
    row = torch.arange(W, device=q.device)[:, None]  # query i = c W + row
    col = torch.arange(2 * W, device=q.device)[None, :]  # key j = (c - 1) W + col
    mask = (col > row) & (col <= row + W)  # (W, 2W): i - W < j <= i
    first = torch.arange(chunks, device=q.device)[:, None, None] > 0
    mask = mask & (first | (col >= W))  # (C, W, 2W): chunk 0's previous chunk is padding
    if document_ids is not None:
        ids = F.pad(document_ids, (W, tail), value=-1)  # (B, (C+1) W)
        query_ids = ids[:, W:].view(B, chunks, W)  # (B, C, W)
        key_ids = torch.cat([ids[:, :-W].view(B, chunks, W), query_ids], dim=-1)  # (B, C, 2W)
        mask = mask & (query_ids[..., :, None] == key_ids[..., None, :])  # (B, C, W, 2W)
    # Rows and chunks as one batch dimension: the 4-D inputs every fused attention kernel takes.
    mask = mask.expand(B, chunks, W, 2 * W).reshape(B * chunks, 1, W, 2 * W)  # (B C, 1, W, 2W)
    out = attend(*(t.flatten(0, 1) for t in (q, keys, values)), mask)  # (B C, H, W, d)
    return out.view(B, chunks, H, W, d).transpose(1, 2).reshape(B, H, chunks * W, d)[:, :, :T]  # (B, H, T, d)


def _chunk_pairs(t: Tensor, chunks: int, W: int) -> Tensor:
    """(B, KV, (C+1) W, d) padded keys -> (B, C, KV, 2W, d): each chunk's previous and own W keys."""
    B, KV, _, d = t.shape
    blocks = t.reshape(B, KV, chunks + 1, W, d)  # (B, KV, C+1, W, d)
    return torch.cat([blocks[:, :, :-1], blocks[:, :, 1:]], dim=3).transpose(1, 2)  # (B, C, KV, 2W, d)


class CausalSelfAttention(nn.Module):
    """Multi-head (grouped-query when n_kv_head < n_head) causal self-attention, windowed in a sliding layer.

    With qk_norm, q and k pass an RMSNorm before RoPE: over each head's head_dim (one gain shared by the heads,
    Qwen3) or over all of q and all of k (qk_norm_scope width, OLMo 2). attn_scale replaces 1/sqrt(head_dim), and
    attn_softcap caps the scores (Gemma 2)."""

    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.window = config.layer_window(layer_index)
        self.scale, self.softcap = config.attn_scale, config.attn_softcap
        qkv_width = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.qkv = Linear(config.n_embd, qkv_width, bias=config.attn_bias)
        self.proj = Linear(config.n_head * config.head_dim, config.n_embd, bias=config.attn_bias)
        self.whole_width = config.qk_norm_scope == "width"
        q_width, k_width = (self.n_head * self.head_dim, self.n_kv_head * self.head_dim)
        if not self.whole_width:
            q_width = k_width = self.head_dim
        self.q_norm = RMSNorm(q_width, config.norm_eps, config.norm_gain_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.norm_eps, config.norm_gain_offset) if config.qk_norm else None
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)
        # softmax(QK^T)V in fp32 under autocast: the trainer sets it where a CPU's bf16 kernel measures slower.
        self.fp32_attention = False

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        kv: LayerKV | None,
        document_ids: Tensor | None,
        weights_out: list[Tensor] | None,
    ) -> Tensor:
        """x (B, T, n_embd) -> (B, T, n_embd); appends the attention weights to weights_out when given."""
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(x).split([self.n_head * hd, self.n_kv_head * hd, self.n_kv_head * hd], dim=-1)
        if self.q_norm is not None and self.whole_width:
            # Over q's and k's whole width; back in their dtype, which an fp32 gain under autocast would promote.
            q, k = self.q_norm(q).type_as(q), self.k_norm(k).type_as(k)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_head, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, self.n_kv_head, hd).transpose(1, 2)  # (B, KV, T, hd)
        if self.q_norm is not None and not self.whole_width:
            q, k = self.q_norm(q).type_as(q), self.k_norm(k).type_as(k)  # over each head's hd values
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        mask = None
        if kv is not None:
            k, v, mask = kv.update(k, v)  # (B, KV, S, hd) with S the cached length; the mask holds any window
        dropout = self.dropout if self.training else 0.0
        if weights_out is not None:
            if kv is None:
                mask = dense_mask(T, self.window, document_ids, x.device)
            y, weights = plain_attention(q, k, v, mask, dropout, self.scale, self.softcap)
            weights_out.append(weights)
        elif kv is None and self.window is not None and T > self.window:
            y = windowed_attention(q, k, v, self.window, document_ids, lambda *qkvm: self.attend(*qkvm, dropout))
        else:
            if kv is None and document_ids is not None:
                mask = document_mask(document_ids)
            y = self.attend(q, k, v, mask, dropout)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hd)  # (B, T, H*hd)
        return self.resid_drop(self.proj(y))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float) -> Tensor:
        """Attention output (..., H, T, hd) of q (..., H, T, hd), k and v (..., KV, S, hd): causal unless given a mask;
        PyTorch's fused kernel, or the plain path for soft-capped scores; in fp32 with fp32_attention."""
        if self.fp32_attention and q.dtype != torch.float32:
            with torch.autocast(q.device.type, enabled=False):  # autocast would cast the fp32 inputs back
                y = self.attend(q.float(), k.float(), v.float(), mask, dropout)
            return y.to(q.dtype)
        if self.softcap is not None:  # the fused kernel has no soft-cap
            return plain_attention(q, k, v, mask, dropout, self.scale, self.softcap)[0]
        is_causal = mask is None and q.size(-2) > 1
        # enable_gqa lets each group of query heads read its shared key/value head without copying the cache.
        grouped = k.size(-3) != q.size(-3)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=self.scale, enable_gqa=grouped
        )
