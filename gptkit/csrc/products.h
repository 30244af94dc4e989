// The products: a weight matrix of any format (quant.h) against activation rows over a range of its output rows,
// the dispatch over formats and row counts (row_products.h holds the inner loops), and the split of rows between
// threads.
#pragma once

#include <vector>

#include "row_products.h"

namespace gk {

// ----- a weight matrix of any format, and its product over a range of output rows -----

enum Format : int64_t { kF32 = 0, kBF16 = 1, kI8 = 2, kQ4 = 3 };

struct Weight {
  int64_t format = kF32;
  int64_t N = 0, K = 0;
  const void* data = nullptr;
  const void* scales = nullptr;  // int8: fp32 per row; q4: fp16 per block
  const float* bias = nullptr;   // fp32, or none
};

// Whether a weight's product reads activations rounded to int8 (to_q8) rather than fp32.
inline bool rounds_activations(const Weight& w) { return w.format == kQ4 || (w.format == kI8 && w.K % kQ4Block == 0); }

// The activations of M rows in every form a product may take (filled by the caller's preparation).
struct Input {
  const float* x = nullptr;  // (M, K) fp32
  const bf16* xb = nullptr;  // (M, K) bf16 (bf16 weights under AVX-512 BF16)
  Q8Rows q8{};               // q4 weights
};

// The q4 rows [n0, n1) by their groups of 8; a group's rows outside [n0, n1) (another range's, or padding past N)
// are computed but not stored.
template <int M>
inline void product_q4(const Weight& w, const Input& in, float* y, int64_t ldy, int64_t n0, int64_t n1,
                       bool accumulate) {
  const int64_t K = w.K, blocks = K / kQ4Block;
  float out[M][kQ4Group];
  for (int64_t g = n0 / kQ4Group; g * kQ4Group < n1; ++g) {
    group_q4<M>(static_cast<const uint8_t*>(w.data) + g * blocks * kQ4GroupBytes,
                static_cast<const uint16_t*>(w.scales) + g * blocks * kQ4Group, in.q8, K, out);
    for (int64_t r = 0; r < kQ4Group; ++r) {
      const int64_t n = g * kQ4Group + r;
      if (n < n0 || n >= n1) continue;
      const float b = w.bias ? w.bias[n] : 0.0f;
      for (int m = 0; m < M; ++m) y[m * ldy + n] = (accumulate ? y[m * ldy + n] : 0.0f) + (out[m][r] + b);
    }
  }
}

constexpr int kBf16Rows = 4;  // bf16 weight rows a batch-1 product reads side by side (rows_bf16)
// Rows of fewer values go one at a time: Gemma-3-1B's rows of 1152 decoded about 15% slower four at a time, where
// Llama-3.2-1B's of 2048 and 8192 ran faster (the same one-core A/B as rows_bf16's).
constexpr int64_t kBf16GroupsFromK = 2048;

// product_rows' bf16 rows from n0 at one activation row, kBf16Rows at a time (the widening route only); returns the
// first row not done.
inline int64_t bf16_row_groups(const Weight& w, const Input& in, float* y, int64_t n0, int64_t n1, bool accumulate) {
  int64_t n = n0;
#if !defined(__AVX512BF16__)
  for (float out[kBf16Rows]; n + kBf16Rows <= n1; n += kBf16Rows) {
    rows_bf16<kBf16Rows>(static_cast<const bf16*>(w.data) + n * w.K, in.x, w.K, out);
    for (int r = 0; r < kBf16Rows; ++r) {
      const float b = w.bias ? w.bias[n + r] : 0.0f;
      y[n + r] = (accumulate ? y[n + r] : 0.0f) + (out[r] + b);
    }
  }
#else
  (void)w, (void)in, (void)y, (void)n1, (void)accumulate;  // (vdpbf16ps rows go one at a time)
#endif
  return n;
}

// y[m * ldy + n] = w[n] . x[m] (+ bias[n]) for n in [n0, n1); with accumulate, added to what y holds
template <int M>
inline void product_rows(const Weight& w, const Input& in, float* y, int64_t ldy, int64_t n0, int64_t n1,
                         bool accumulate) {
  if (w.format == kQ4) {
    product_q4<M>(w, in, y, ldy, n0, n1, accumulate);
    return;
  }
  float out[M], offsets[M] = {};
  const int64_t K = w.K;
  if (w.format == kI8 && K % kQ4Block == 0)
    for (int m = 0; m < M; ++m)
      for (int64_t b = 0; b < K / kQ4Block; ++b) offsets[m] += in.q8.dsum[m * (K / kQ4Block) + b];
  const int64_t first =
      M == 1 && w.format == kBF16 && w.K >= kBf16GroupsFromK ? bf16_row_groups(w, in, y, n0, n1, accumulate) : n0;
  for (int64_t n = first; n < n1; ++n) {
    switch (w.format) {
      case kF32:
        row_f32<M>(static_cast<const float*>(w.data) + n * K, in.x, K, out);
        break;
      case kBF16:
        row_bf16<M>(static_cast<const bf16*>(w.data) + n * K, in.x, in.xb, K, out);
        break;
      case kI8: {
        if (K % kQ4Block == 0)
          row_i8q<M>(static_cast<const int8_t*>(w.data) + n * K, in.q8, offsets, K, out);
        else
          row_i8<M>(static_cast<const int8_t*>(w.data) + n * K, in.x, K, out);
        const float s = static_cast<const float*>(w.scales)[n];
        for (int m = 0; m < M; ++m) out[m] *= s;
        break;
      }
      default:
        break;  // (q4: product_q4)
    }
    const float b = w.bias ? w.bias[n] : 0.0f;
    for (int m = 0; m < M; ++m) y[m * ldy + n] = (accumulate ? y[m * ldy + n] : 0.0f) + (out[m] + b);
  }
}

// Calls fn with M (1 to 8) as a compile-time constant, so that each row count gets its own unrolled loops.
template <typename Fn>
inline void with_rows(int64_t M, Fn&& fn) {
  switch (M) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

constexpr int64_t kMaxRows = 8;  // activation rows one pass over a weight row computes (with_rows' largest)

// The activations of rows m0.. of in (each form's rows K values apart, q8's scales K / 32 apart).
inline Input rows_from(const Input& in, int64_t m0, int64_t K) {
  Input out = in;
  const int64_t blocks = K / kQ4Block;
  if (in.x) out.x = in.x + m0 * K;
  if (in.xb) out.xb = in.xb + m0 * K;
  if (in.q8.q) out.q8 = {in.q8.q + m0 * K, in.q8.d + m0 * blocks, in.q8.dsum + m0 * blocks};
  return out;
}

// Activation rows staged in the forms an Input points at beside the fp32 rows themselves: each row as the product
// of a given weight reads it (bf16, or rounded to int8 in blocks of 32). Rows sit the weight's K values (K / 32
// blocks) apart, so a row's staging is the same whichever weight staged the rows beside it.
class Staging {
 public:
  // Room for `rows` rows of up to K values each.
  void resize(int64_t rows, int64_t K) {
    const size_t blocks = size_t(rows * (K / kQ4Block + 1));
    xb_.resize(size_t(rows * K));
    xq_.resize(size_t(rows * K));
    d_.resize(blocks);
    dsum_.resize(blocks);
  }

  // Row r of x (w.K values a row) in the form w's product reads; nothing for fp32 rows that it reads as they are.
  void prepare(const Weight& w, const float* x, int64_t r) {
    const int64_t K = w.K;
    if (w.format == kBF16) {
#if defined(__AVX512BF16__)
      to_bf16(x + r * K, xb_.data() + r * K, K);
#endif
    } else if (rounds_activations(w)) {
      const int64_t blocks = K / kQ4Block;
      to_q8(x + r * K, xq_.data() + r * K, d_.data() + r * blocks, dsum_.data() + r * blocks, K);
    }
  }

  // The rows of x, with their prepared forms.
  Input input(const float* x) const {
    Input in;
    in.x = x;
    in.xb = xb_.data();
    in.q8 = {xq_.data(), d_.data(), dsum_.data()};
    return in;
  }

 private:
  std::vector<bf16> xb_;
  std::vector<int8_t> xq_;
  std::vector<float> d_, dsum_;
};

// fp32 register tiles (tile_f32): kTileN weight rows by kTileM activation rows, one chain's accumulators with the
// tile's activation vectors and a weight vector in the vector registers (AVX2: 12 + 3 + 1 of 16; AVX-512: 24 + 4 + 1
// of 32). On AVX2, 4 by 3 loads 7 vectors for 12 multiply-adds where 6 by 2 loads 8: with the spread prefetch, the
// batch-8 products of product_tiles_f32's comment took 29.7 ms (median 35.7) in 4 by 3 tiles and 33.5 (37.0) in 6 by 2.
constexpr int64_t kTileN = kLanes == 16 ? 6 : 4, kTileM = kLanes == 16 ? 4 : 3;
// k runs in chunks of this many floats, an even number of vectors (so each chunk starts on chain 0): a chunk of every
// activation row and of the tile's weight rows (AVX2: 8 + 4 rows of 2 KiB) stays in L1 while the tile's slices pass it.
constexpr int64_t kTileChunk = 512;

// Calls fn(std::integral_constant<int, v>) for v in First..Last (values past Last as Last).
template <int First, int Last, typename Fn>
inline void with_value(int64_t v, Fn&& fn) {
  if constexpr (First >= Last)
    fn(std::integral_constant<int, Last>{});
  else if (v <= First)
    fn(std::integral_constant<int, First>{});
  else
    with_value<First + 1, Last>(v, fn);
}

// From this many activation rows fp32 products run in register tiles; fewer go a row at a time (row_f32). AVX2: tiles
// streamed GPT-2 small's products 1.07x as fast as rows at 2 rows, 1.12-1.23x at 3-7 and 1.25-1.3x at 8 (one core,
// AMD EPYC). AVX-512: from 6 rows, where its earlier two-chain tiles were measured (2-core AVX-512 EPYC).
constexpr int64_t kTilesFromRows = kLanes == 16 ? 6 : 2;

// Both chains' sums of nr weight rows (w, K apart) against gm <= kMaxRows activation rows x: sums[c] holds slice m0's
// (kTileM rows from m0) in [m0 * kTileN, ...), n * mr + (m - m0) within it. The tile's weight rows meet every
// activation row chunk by chunk of k, while both are in L1; each step of k steps ahead (tile_f32).
inline void tile_sums_f32(const float* w, const float* x, int64_t K, int64_t nr, int64_t gm,
                          V (*sums)[kTileN * kMaxRows], Ahead& ahead) {
  const int64_t whole = K / kLanes * kLanes;
  if (whole == 0)
    for (int c = 0; c < 2; ++c)
      for (int64_t i = 0; i < kTileN * kMaxRows; ++i) sums[c][i] = vzero();
  for (int64_t k0 = 0; k0 < whole; k0 += kTileChunk) {
    const int64_t k1 = k0 + kTileChunk < whole ? k0 + kTileChunk : whole;
    for (int c = 0; c < 2; ++c)
      for (int64_t m0 = 0; m0 < gm; m0 += kTileM) {
        const int64_t mr = gm - m0 < kTileM ? gm - m0 : kTileM;
        with_value<1, kTileN>(nr, [&](auto n) {
          with_value<1, kTileM>(mr, [&](auto m) {
            tile_f32<decltype(n)::value, decltype(m)::value>(w, x + m0 * K, K, k0 + c * kLanes, k1,
                                                             sums[c] + m0 * kTileN, k0 == 0, ahead);
          });
        });
      }
  }
}

// fp32 weight rows [n0, n1) against M activation rows in register tiles: each tile of kTileN weight rows is read from
// memory once and passed by up to kMaxRows activation rows at a time. Through the first group's passes, the steps of
// k prefetch the next tile line by line, so that it arrives while this one computes. Bursts of prefetches at each
// pass's start did less: the 49 products of GPT-2 small's batch-8 fp32 step, every weight streamed from 2 MiB pages
// on 2 threads and timed alone in a C++ loop, took 40.7 ms (best of 6 interleaved rounds; median 45.2) with bursts and
// 37.5 (39.2) spread, where reading the same bytes with no arithmetic took 24.4 (26.0); one 2-core AVX2 EPYC.
inline void product_tiles_f32(const Weight& w, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0,
                              int64_t n1, bool accumulate) {
  const int64_t K = w.K, whole = K / kLanes * kLanes;
  const float* data = static_cast<const float*>(w.data);
  V sums[2][kTileN * kMaxRows];
  for (int64_t t0 = n0; t0 < n1; t0 += kTileN) {
    const int64_t nr = n1 - t0 < kTileN ? n1 - t0 : kTileN;
    for (int64_t g0 = 0; g0 < M; g0 += kMaxRows) {
      const int64_t gm = M - g0 < kMaxRows ? M - g0 : kMaxRows;
      // The next tile's bytes over this group's steps of k (each slice steps through half the vectors per chain); a
      // later group finds the tile in cache and asks for nothing.
      const int64_t next = t0 + nr + kTileN < n1 ? t0 + nr + kTileN : n1;
      const int64_t steps = (whole / kLanes + 1) * ((gm + kTileM - 1) / kTileM);
      const uintptr_t from = reinterpret_cast<uintptr_t>(data + (t0 + nr) * K);
      Ahead ahead{from, from, g0 == 0 ? uintptr_t(((next - t0 - nr) * K * 4 + steps - 1) / steps) : 0};
      tile_sums_f32(data + t0 * K, x + g0 * K, K, nr, gm, sums, ahead);
      for (int64_t m = 0; m < gm; ++m) {
        const int64_t m0 = m - m % kTileM, mr = gm - m0 < kTileM ? gm - m0 : kTileM;
        for (int64_t n = 0; n < nr; ++n) {
          const int64_t i = m0 * kTileN + n * mr + (m - m0);
          float s = vsum(vadd(sums[0][i], sums[1][i]));  // then row_f32's tail past the whole vectors
          for (int64_t j = whole; j < K; ++j) s += data[(t0 + n) * K + j] * x[(g0 + m) * K + j];
          float* dst = y + (g0 + m) * ldy + t0 + n;
          *dst = (accumulate ? *dst : 0.0f) + (s + (w.bias ? w.bias[t0 + n] : 0.0f));
        }
      }
    }
  }
}

// fp32 weights from kTilesFromRows activation rows go through register tiles. Other formats past kMaxRows rows: a
// tile of kQ4Group weight rows is read from memory once and then, from cache, by every slice of up to kMaxRows
// activation rows in turn, so the weights stream once per step whatever the batch. Each (row, output) sum is the one
// product_rows computes for that row at any M, so neither path changes a result.
inline void product_range(const Weight& w, const Input& in, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1,
                          bool accumulate = false) {
  if (M <= kMaxRows && (w.format != kF32 || M < kTilesFromRows)) {
    with_rows(M, [&](auto rows) { product_rows<decltype(rows)::value>(w, in, y, ldy, n0, n1, accumulate); });
    return;
  }
  if (w.format == kF32) {
    product_tiles_f32(w, in.x, M, y, ldy, n0, n1, accumulate);
    return;
  }
  for (int64_t t0 = n0; t0 < n1; t0 += kQ4Group) {
    const int64_t t1 = t0 + kQ4Group < n1 ? t0 + kQ4Group : n1;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const Input part = rows_from(in, m0, w.K);
      with_rows(M - m0 < kMaxRows ? M - m0 : kMaxRows, [&](auto rows) {
        product_rows<decltype(rows)::value>(w, part, y + m0 * ldy, ldy, t0, t1, accumulate);
      });
    }
  }
}

// [lo, hi) of n items for part t of T, in whole multiples of `align` (the last part takes the rest)
inline void split(int64_t n, int t, int T, int64_t align, int64_t* lo, int64_t* hi) {
  const int64_t units = (n + align - 1) / align;
  const int64_t per = units / T, extra = units % T;
  const int64_t first = t * per + (t < extra ? t : extra);
  const int64_t count = per + (t < extra ? 1 : 0);
  *lo = first * align < n ? first * align : n;
  *hi = (first + count) * align < n ? (first + count) * align : n;
}

}  // namespace gk
