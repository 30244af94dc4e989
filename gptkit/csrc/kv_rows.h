// One layer's keys or values in the KV cache as the fused decode step (step.cpp) reads and writes them: fp32, bf16,
// or int8 with one fp32 scale per row, head and position (gptkit.kv_cache's layout, quantised as it quantises);
// the cache row each of a step's rows uses; and one query head's attention over them.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "step_parts.h"

namespace kvrows {

enum Cache : int64_t { kCacheF32 = 0, kCacheBF16 = 1, kCacheI8 = 2 };

struct CacheView {  // one layer's keys or values: element (b, g, s, i) at data + b * sb + g * sg + s * ss + i
  void* data;
  const float* scales;  // int8: (b, g, s) at b * scb + g * scg + s * scs
  int64_t sb, sg, ss, scb, scg, scs;
  int64_t slots;  // positions held: max_len, or a windowed layer's ring (position p in slot p mod slots)
};

// The cache's kind from its keys' type (an int8 cache needs its scales).
inline int64_t kind(const at::Tensor& keys, bool scaled) {
  const int64_t cache = keys.scalar_type() == at::kFloat      ? kCacheF32
                        : keys.scalar_type() == at::kBFloat16 ? kCacheBF16
                                                              : kCacheI8;
  TORCH_CHECK(cache != kCacheI8 || (keys.scalar_type() == at::kChar && scaled),
              "DecodeStep: an int8 cache needs its scales");
  return cache;
}

// That layer l's cache of `slots` positions holds the positions up to longest - 1: a full layer every one, a ring of
// its window (window > 0, no spare slot) any.
inline void check_slots(int64_t slots, int64_t window, int64_t longest, int64_t l) {
  TORCH_CHECK(longest <= slots || (window > 0 && slots >= window), "DecodeStep: position ", longest - 1,
              " outside the cache of layer ", l);
  TORCH_CHECK(window == 0 || slots <= window, "DecodeStep: a ring of more slots than its window (spare)");
}

// Each of the B rows' cache row into rows (slots, int64, or row b's own where slots is empty), checked: within the
// cache's `cached` rows, and no two rows at one position of one cache row. Returns one past the furthest position of
// a cache row that several rows share (0: none shared).
inline int64_t cache_rows(const at::Tensor& slots, const int64_t* pos, int64_t B, int64_t cached,
                          std::vector<int64_t>& rows) {
  rows.resize(B);
  if (slots.numel() == 0) {
    TORCH_CHECK(cached >= B, "DecodeStep: ", B, " rows for a cache of ", cached);
    for (int64_t b = 0; b < B; ++b) rows[b] = b;
    return 0;
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
              "DecodeStep: one int64 cache row per row expected");
  const int64_t* slot = slots.data_ptr<int64_t>();
  int64_t shared_end = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < cached, "DecodeStep: cache row ", slot[b], " outside the cache's ", cached);
    rows[b] = slot[b];
    for (int64_t c = 0; c < b; ++c) {
      if (slot[c] != slot[b]) continue;
      TORCH_CHECK(pos[c] != pos[b], "DecodeStep: two rows write position ", pos[b], " of cache row ", slot[b]);
      shared_end = std::max(shared_end, std::max(pos[b], pos[c]) + 1);
    }
  }
  return shared_end;
}

// Each of the B rows' shared prefix (shared: int64 pairs, a cache row and a length P, or empty for none) into
// prefix_rows and prefix_lens: the row reads its positions below P from that cache row, whose positions there hold
// the same bits as its own (the engine shares only spans it found equal, so reading either gives the same logits;
// rows reading one span read it from cache rather than memory). Checked: within the cache's `cached` rows, P not
// past the row's own position, no row of this step writing the prefix's cache row below P, no ring (a windowed layer).
inline void shared_prefixes(const at::Tensor& shared, const int64_t* pos, const std::vector<int64_t>& rows,
                            int64_t cached, bool rings, std::vector<int64_t>& prefix_rows,
                            std::vector<int64_t>& prefix_lens) {
  const int64_t B = int64_t(rows.size());
  prefix_rows.assign(B, 0);
  prefix_lens.assign(B, 0);
  if (shared.numel() == 0) return;
  TORCH_CHECK(shared.scalar_type() == at::kLong && shared.is_contiguous() && shared.numel() == 2 * B,
              "DecodeStep: a cache row and a length per row expected in shared");
  TORCH_CHECK(!rings, "DecodeStep: shared prefixes in a windowed layer's ring");
  const int64_t* pair = shared.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t source = pair[2 * b], length = pair[2 * b + 1];
    TORCH_CHECK(source >= 0 && source < cached, "DecodeStep: prefix cache row ", source, " outside the cache's ",
                cached);
    TORCH_CHECK(length >= 0 && length <= pos[b], "DecodeStep: a shared prefix of ", length,
                " positions past row ", b, "'s position ", pos[b]);
    prefix_rows[b] = source, prefix_lens[b] = length;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < B; ++c)
      TORCH_CHECK(rows[c] != prefix_rows[b] || pos[c] >= prefix_lens[b], "DecodeStep: row ", c,
                  " writes position ", pos[c], " of cache row ", rows[c], " inside the prefix row ", b, " reads");
}

// That rows sharing a cache row, at positions up to shared_end - 1, fit layer l's `slots` positions without wrapping:
// in a windowed layer's ring a later row's write would overwrite a key an earlier row still reads.
inline void check_shared(int64_t slots, int64_t shared_end, int64_t l) {
  TORCH_CHECK(shared_end <= slots, "DecodeStep: rows sharing a cache row up to position ", shared_end - 1,
              " would wrap the ring of layer ", l, " (", slots, " slots)");
}

inline CacheView view(const at::Tensor& t, const at::Tensor* scales, int64_t cache) {
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "DecodeStep: cache tensors (B, KV, S, head_dim) expected");
  CacheView v{t.data_ptr(), nullptr, t.stride(0), t.stride(1), t.stride(2), 0, 0, 0, t.size(2)};
  if (cache == kCacheI8) {
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->dim() == 3, "DecodeStep: fp32 cache scales expected");
    v.scales = scales->data_ptr<float>();
    v.scb = scales->stride(0), v.scg = scales->stride(1), v.scs = scales->stride(2);
  }
  return v;
}

// Row (b, g, p) := v (head_dim values), rounded to the cache's type.
inline void write(const CacheView& c, int64_t cache, int64_t head_dim, int64_t b, int64_t g, int64_t p,
                  const float* v) {
  const int64_t at = b * c.sb + g * c.sg + p * c.ss;
  if (cache == kCacheF32) {
    std::copy(v, v + head_dim, static_cast<float*>(c.data) + at);
  } else if (cache == kCacheBF16) {
    gk::bf16* dst = static_cast<gk::bf16*>(c.data) + at;
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = gk::float_to_bf16(v[i]);
  } else {  // as gptkit.kv_cache quantises: scale = max|v| / 127, q = round(v / scale)
    float amax = 0.0f;
    for (int64_t i = 0; i < head_dim; ++i) amax = std::fmax(amax, std::fabs(v[i]));
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* dst = static_cast<int8_t*>(c.data) + at;
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = int8_t(std::nearbyint(v[i] * inv));
    const_cast<float*>(c.scales)[b * c.scb + g * c.scg + p * c.scs] = scale;
  }
}

// Cached row (b, g, s) as fp32: the cache itself when it is fp32, else converted into buffer.
inline const float* cached(const CacheView& c, int64_t cache, int64_t head_dim, int64_t b, int64_t g, int64_t s,
                           float* buffer) {
  const int64_t at = b * c.sb + g * c.sg + s * c.ss;
  if (cache == kCacheF32) return static_cast<const float*>(c.data) + at;
  if (cache == kCacheBF16) {
    const gk::bf16* v = static_cast<const gk::bf16*>(c.data) + at;
    for (int64_t i = 0; i < head_dim; ++i) buffer[i] = gk::bf16_to_float(v[i]);
  } else {
    const int8_t* v = static_cast<const int8_t*>(c.data) + at;
    const float scale = c.scales[b * c.scb + g * c.scg + s * c.scs];
    for (int64_t i = 0; i < head_dim; ++i) buffer[i] = float(v[i]) * scale;
  }
  return buffer;
}

// scores[s] = q . k_s * scale over S fp32 keys (k, ss apart): each sum gk::dot's to the bit (one chain, its vsum, its
// scalar tail), four positions interleaved so that four chains hide the multiply-adds' latency, which one chain waits
// on (a batch-8 GPT-2 small step spent about a tenth of its time in attention).
inline void scores_f32(const float* q, const float* k, int64_t ss, int64_t head_dim, int64_t S, float scale,
                       float* scores) {
  const int64_t whole = head_dim / gk::kLanes * gk::kLanes;
  int64_t s = 0;
  for (; s + 4 <= S; s += 4) {
    gk::V acc[4] = {gk::vzero(), gk::vzero(), gk::vzero(), gk::vzero()};
    for (int64_t i = 0; i < whole; i += gk::kLanes) {
      const gk::V qv = gk::vload(q + i);
      for (int j = 0; j < 4; ++j) acc[j] = gk::vfma(qv, gk::vload(k + (s + j) * ss + i), acc[j]);
    }
    for (int j = 0; j < 4; ++j) {
      float d = gk::vsum(acc[j]);
      for (int64_t i = whole; i < head_dim; ++i) d += q[i] * k[(s + j) * ss + i];
      scores[s + j] = d * scale;
    }
  }
  for (; s < S; ++s) scores[s] = gk::dot(q, k + s * ss, head_dim) * scale;
}

// out += sum over the S fp32 value rows (v, ss apart) of p[j] v_j, NV vectors of out at a time: each element the sum
// gk::axpy row after row would give, held in registers across the rows rather than loaded and stored for each.
template <int NV>
inline void weighted_sum_f32(const float* p, const float* v, int64_t ss, int64_t head_dim, int64_t S, float* out) {
  for (int64_t i0 = 0; i0 < head_dim; i0 += NV * gk::kLanes) {
    gk::V acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = gk::vload(out + i0 + i * gk::kLanes);
    for (int64_t j = 0; j < S; ++j) {
      const gk::V pj = gk::vset(p[j]);
      for (int i = 0; i < NV; ++i) acc[i] = gk::vfma(pj, gk::vload(v + j * ss + i0 + i * gk::kLanes), acc[i]);
    }
    for (int i = 0; i < NV; ++i) gk::vstore(out + i0 + i * gk::kLanes, acc[i]);
  }
}

// The scores q . k_s * scale of positions [from, to) of cache row b (fp32 keys read in place, others converted
// through row).
inline void scores_of(const float* q, const CacheView& keys, int64_t cache, int64_t head_dim, int64_t b, int64_t g,
                      int64_t from, int64_t to, float scale, float* scores, float* row) {
  if (from >= to) return;
  if (cache == kCacheF32) {
    scores_f32(q, cached(keys, cache, head_dim, b, g, from, row), keys.ss, head_dim, to - from, scale, scores + from);
    return;
  }
  for (int64_t s = from; s < to; ++s)
    scores[s] = gk::dot(q, cached(keys, cache, head_dim, b, g, s, row), head_dim) * scale;
}

// out += the weights p[s] times the values of positions [from, to) of cache row b, in position order.
inline void values_of(const float* p, const CacheView& values, int64_t cache, int64_t head_dim, int64_t b, int64_t g,
                      int64_t from, int64_t to, float* out, float* row) {
  if (from >= to) return;
  const bool f32 = cache == kCacheF32;
  const float* v0 = f32 ? cached(values, cache, head_dim, b, g, from, row) : nullptr;
  if (f32 && head_dim % (8 * gk::kLanes) == 0)
    weighted_sum_f32<8>(p + from, v0, values.ss, head_dim, to - from, out);
  else if (f32 && head_dim % (4 * gk::kLanes) == 0)
    weighted_sum_f32<4>(p + from, v0, values.ss, head_dim, to - from, out);
  else
    for (int64_t j = from; j < to; ++j) gk::axpy(p[j], cached(values, cache, head_dim, b, g, j, row), out, head_dim);
}

// softmax(q . k_s * scale, soft-capped at softcap: 0 none) over the S cached positions of (b, g), times their values,
// into out (head_dim values); positions below P read from cache row pb instead (a shared prefix: the same bits, and
// each sum runs in the same order, so the result is the one reading row b alone gives). scores holds S + head_dim
// floats of scratch (the scores, then one converted row).
inline void attend(const float* q, const CacheView& keys, const CacheView& values, int64_t cache, int64_t head_dim,
                   int64_t b, int64_t g, int64_t S, int64_t pb, int64_t P, float scale, float softcap, float* scores,
                   float* out) {
  float* row = scores + S;  // one dequantised key or value row
  P = std::min(P, S);
  scores_of(q, keys, cache, head_dim, pb, g, 0, P, scale, scores, row);
  scores_of(q, keys, cache, head_dim, b, g, P, S, scale, scores, row);
  if (softcap > 0.0f) parts::soft_cap(scores, S, softcap);
  float top = -INFINITY;
  for (int64_t s = 0; s < S; ++s) top = std::fmax(top, scores[s]);
  int64_t s = 0;
  gk::V total = gk::vzero();
  for (; s + gk::kLanes <= S; s += gk::kLanes) {
    const gk::V e = gk::vexp(gk::vsub(gk::vload(scores + s), gk::vset(top)));
    gk::vstore(scores + s, e);
    total = gk::vadd(total, e);
  }
  float sum = gk::vsum(total);
  for (; s < S; ++s) {
    scores[s] = std::exp(scores[s] - top);
    sum += scores[s];
  }
  std::fill(out, out + head_dim, 0.0f);
  values_of(scores, values, cache, head_dim, pb, g, 0, P, out, row);
  values_of(scores, values, cache, head_dim, b, g, P, S, out, row);
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < head_dim; ++i) out[i] *= inv;
}

}  // namespace kvrows
