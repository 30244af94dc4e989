"""The sliding-window KV cache (gptkit.kv_cache): a windowed layer's ring gives every query exactly its window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptkit.config import ModelConfig
from gptkit.kv_cache import KVCache, quantize_rows

KV, HD = 2, 8
# Ring attention and the full reference sum the same terms in another order (fp32, values of size ~1): measured up
# to 3.6e-7 apart over these tests; the limit is about 6 times that.
TOL = 2e-6


def _config(window: int | None, n_layer: int = 1, layer_types: list[str] | None = None) -> ModelConfig:
    return ModelConfig(
        vocab_size=16,
        block_size=256,
        n_layer=n_layer,
        n_head=KV,
        n_embd=KV * HD,
        position="rope",
        sliding_window=window,
        layer_types=layer_types,
    )


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int) -> torch.Tensor:
    """Attention of queries at positions first.. over keys 0.. (B, KV, n, HD) with the band i - W < j <= i."""
    T, S = q.size(2), k.size(2)
    i = first + torch.arange(T)[:, None]
    j = torch.arange(S)[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - window))


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as an int8 cache gives it back."""
    values, scales = quantize_rows(x)
    return values.float() * scales[..., None]


def _run(cache: KVCache, q, k, v, chunks: list[int], window: int) -> None:
    """Feed k, v through layer 0 of cache in chunks and check each chunk's attention against the reference."""
    start = 0
    for size in chunks:
        part = slice(start, start + size)
        keys, values, mask = cache.layer(0, start).update(k[:, :, part], v[:, :, part])
        got = F.scaled_dot_product_attention(
            q[:, :, part], keys, values, attn_mask=mask, is_causal=mask is None and size > 1
        )
        want = _reference(q[:, :, part], k[:, :, : start + size], v[:, :, : start + size], start, window)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        start += size


@pytest.mark.parametrize("chunks", [[1] * 24, [5, 3, 9, 1, 1, 4, 1], [2, 11, 11], [1, 1, 1, 20, 1]])
def test_ring_matches_banded_attention_up_to_three_windows(chunks: list[int]) -> None:
    W = 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, KV, 3 * W, HD) for _ in range(3))
    cache = KVCache(_config(W), 2, 3 * W)
    assert cache.keys[0].size(2) == W  # the ring, not max_len
    _run(cache, q, k, v, chunks, W)


def test_ring_with_per_row_positions() -> None:
    """A (B,) tensor of positions: each row its own place in its ring, decoding and extending."""
    W, B = 6, 3
    torch.manual_seed(1)
    cache = KVCache(_config(W), B, 40)
    q, k, v = (torch.randn(B, KV, 40, HD) for _ in range(3))
    starts = [0, 5, 13]
    for b, s in enumerate(starts):  # row b's first s positions, one token at a time
        row = cache.row(b, 40)
        for p in range(s):
            row.layer(0, p).update(k[b : b + 1, :, p : p + 1], v[b : b + 1, :, p : p + 1])
    for size in (1, 4, 1, 7, 1):
        positions = torch.tensor(starts)
        new = torch.stack([torch.arange(s, s + size) for s in starts])  # (B, size)

        def take(x: torch.Tensor, new: torch.Tensor = new) -> torch.Tensor:
            return torch.stack([x[b, :, new[b]] for b in range(B)])  # (B, KV, size, HD)

        keys, values, mask = cache.layer(0, positions).update(take(k), take(v))
        got = F.scaled_dot_product_attention(take(q), keys, values, attn_mask=mask)
        for b, s in enumerate(starts):
            want = _reference(take(q)[b : b + 1], k[b : b + 1, :, : s + size], v[b : b + 1, :, : s + size], s, W)
            torch.testing.assert_close(got[b : b + 1], want, atol=TOL, rtol=0)
        starts = [s + size for s in starts]


def test_int8_ring_matches_banded_attention_over_rounded_keys() -> None:
    W = 5
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, KV, 3 * W, HD) for _ in range(3))
    cache = KVCache(_config(W), 1, 3 * W, kv_dtype=torch.int8)
    start = 0
    for size in (1, 1, 7, 1, 3, 1, 1, 1):
        part = slice(start, start + size)
        keys, values, mask = cache.layer(0, start).update(k[:, :, part], v[:, :, part])
        got = F.scaled_dot_product_attention(q[:, :, part], keys, values, attn_mask=mask)
        want = _reference(q[:, :, part], rounded(k[:, :, : start + size]), rounded(v[:, :, : start + size]), start, W)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        start += size


def test_window_larger_than_cache_grows_with_it() -> None:
    """A ring shorter than its window never wrapped: growing the cache keeps every position in its slot."""
    W = 16
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, KV, 3 * W, HD) for _ in range(3))
    cache = KVCache(_config(W), 1, 6)
    _run(cache, q, k, v, [3, 3], W)
    cache.grow(3 * W)
    assert cache.keys[0].size(2) == W and cache.max_len == 3 * W
    start = 6
    for size in (1, 12, 1, 9, 1, 5, 1, 5, 1, 1, 1, 1):
        part = slice(start, start + size)
        keys, values, mask = cache.layer(0, start).update(k[:, :, part], v[:, :, part])
        got = F.scaled_dot_product_attention(
            q[:, :, part], keys, values, attn_mask=mask, is_causal=mask is None and size > 1
        )
        want = _reference(q[:, :, part], k[:, :, : start + size], v[:, :, : start + size], start, W)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        start += size


def test_cache_memory_follows_the_windows() -> None:
    """Full layers hold max_len positions, sliding ones min(W, max_len) (docs/spec.md section 2.3)."""
    config = _config(4, n_layer=3, layer_types=["sliding", "full", "sliding"])
    cache = KVCache(config, 2, 10)
    assert [t.size(2) for t in cache.keys] == [4, 10, 4]
    assert cache.nbytes == 2 * 2 * KV * HD * 4 * (4 + 10 + 4)
    assert cache.view(1, 3).keys[0].size(2) == 4 and cache.view(1, 3).keys[1].size(2) == 3


def test_spans_restore_a_ring() -> None:
    """Spans read right after they were written rebuild the ring bit for bit (what the prefix cache relies on)."""
    W, chunk = 5, 4
    torch.manual_seed(4)
    k, v = torch.randn(1, KV, 20, HD), torch.randn(1, KV, 20, HD)
    cache, spans = KVCache(_config(W), 1, 20), []
    for start in range(0, 20, chunk):
        cache.layer(0, start).update(k[:, :, start : start + chunk], v[:, :, start : start + chunk])
        spans.append(cache.read_span(0, start, start + chunk))
    restored = KVCache(_config(W), 1, 20)
    for i, span in enumerate(spans):
        restored.write_span(0, i * chunk, span)
    for a, b in zip(cache.tensors, restored.tensors):
        assert torch.equal(a, b)


def test_spare_slots_keep_the_window_when_written_tokens_are_taken_back() -> None:
    """Speculative decoding writes k + 1 tokens and keeps some: with k + 1 spare slots the rejected ones never
    overwrite a position the next queries see (without them, this test's second extend reads a clobbered key)."""
    W, k = 6, 3
    torch.manual_seed(5)
    q, k_all, v_all = (torch.randn(1, KV, 40, HD) for _ in range(3))
    junk = torch.randn(1, KV, k + 1, HD)
    cache = KVCache(_config(W), 1, 40, spare=k + 1)
    assert cache.keys[0].size(2) == W + k + 1
    start = 0
    for accepted in (4, 1, 2, 4, 1, 3, 2, 4):
        # Write k + 1 tokens whose last ones are junk (rejected), then continue after the accepted ones.
        keys = torch.cat([k_all[:, :, start : start + accepted], junk[:, :, : k + 1 - accepted]], dim=2)
        values = torch.cat([v_all[:, :, start : start + accepted], junk[:, :, : k + 1 - accepted]], dim=2)
        cache.layer(0, start).update(keys[:, :, : k + 1], values[:, :, : k + 1])
        start += min(accepted, k + 1)
        part = slice(start, start + 1)
        got_k, got_v, mask = cache.layer(0, start).update(k_all[:, :, part], v_all[:, :, part])
        got = F.scaled_dot_product_attention(q[:, :, part], got_k, got_v, attn_mask=mask)
        want = _reference(q[:, :, part], k_all[:, :, : start + 1], v_all[:, :, : start + 1], start, W)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        start += 1
