// One weight row (of any format in quant.h) against 1 to M activation rows, and register tiles of fp32 rows for
// larger batches: the inner loops products.h dispatches over. AVX-512 BF16 adds bf16 dot products (vdpbf16ps) and
// AVX-512 VNNI byte dot products (vpdpbusd); without them the same sums take the widening or vpmaddubsw route.
#pragma once

#include "quant.h"

namespace gk {

// ----- one weight row against M activation rows (out[m] = row . x[m]) -----

// Independent sums a row keeps per activation row: with one activation row, a single chain of FMAs would wait on
// each one's latency (two chains streamed GPT-2 small's fp32 rows 12% faster on a 2-core AVX-512 EPYC). The same
// number for every M: a row's sum is then added in the same order whatever else shares the batch, so a request's
// logits do not depend on how many rows decode beside it (the batch invariance the server promises).
template <int M>
constexpr int chains() {
  return 2;
}

template <int M>
inline void row_f32(const float* w, const float* x, int64_t K, float* out) {
  constexpr int C = chains<M>();
  V acc[C][M];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) acc[c][m] = vzero();
  int64_t k = 0;
  for (; k + C * kLanes <= K; k += C * kLanes)
    for (int c = 0; c < C; ++c) {
      const V wv = vload(w + k + c * kLanes);
      for (int m = 0; m < M; ++m) acc[c][m] = vfma(wv, vload(x + m * K + k + c * kLanes), acc[c][m]);
    }
  for (; k + kLanes <= K; k += kLanes) {
    const V wv = vload(w + k);
    for (int m = 0; m < M; ++m) acc[0][m] = vfma(wv, vload(x + m * K + k), acc[0][m]);
  }
  for (int m = 0; m < M; ++m) {
    for (int c = 1; c < C; ++c) acc[0][m] = vadd(acc[0][m], acc[c][m]);
    float s = vsum(acc[0][m]);
    for (int64_t j = k; j < K; ++j) s += w[j] * x[m * K + j];
    out[m] = s;
  }
}

// Keeps v in a register: otherwise GCC folds a weight vector's load into each multiply-add that uses it, loading it
// MR times; held once, a 32-row GPT-2-small decode step went from 61 to 52 ms (2-core AVX-512 EPYC).
inline void in_register(V& v) { asm volatile("" : "+v"(v)); }

// Lines of weights to come, asked for a few at a time through a tile's arithmetic (products.h's product_tiles_f32):
// each step of k moves the goal on by stride bytes and prefetches every line up to it. Addresses as integers: the goal
// may pass the end of the weights by less than a stride, and a prefetch there is harmless where a pointer would not be.
struct Ahead {
  uintptr_t at = 0;
  uintptr_t goal = 0;
  uintptr_t stride = 0;
};

// NR weight rows against MR activation rows, one of row_f32's two chains at a time: acc[n * MR + m] carries the sum
// of row n . x[m] over the vectors k0, k0 + 2 kLanes, ... below k1 (k0's parity picks the chain: chain c sums the
// vectors of parity c, as row_f32's do). One chain needs NR * MR accumulators where both would not fit the registers,
// and each (n, m) sum still takes row_f32's operations in row_f32's order: its result is row_f32's to the bit. Each
// weight vector loaded serves MR rows and each activation vector NR rows (row_f32 loads an activation vector per
// multiply-add, which held GPT-2 small's batch-8 fp32 step to about 40% of the bandwidth bound on AVX2). fresh: the
// sums start from zero rather than from acc (the chain's first chunk). Each step of k also steps ahead, so that the
// reads of the next tile overlap this one's arithmetic.
template <int NR, int MR>
inline void tile_f32(const float* w, const float* x, int64_t K, int64_t k0, int64_t k1, V* acc, bool fresh,
                     Ahead& ahead) {
  V a[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) a[n][m] = fresh ? vzero() : acc[n * MR + m];
  // In registers through the loop: kept in memory, each step waited on the last one's store of them.
  uintptr_t at = ahead.at, goal = ahead.goal;
  const uintptr_t stride = ahead.stride;
  for (int64_t k = k0; k + kLanes <= k1; k += 2 * kLanes) {
    goal += stride;
    for (; at < goal; at += 64) _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
    V xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = vload(x + m * K + k);
    for (int n = 0; n < NR; ++n) {
      V wv = vload(w + n * K + k);
      in_register(wv);
      for (int m = 0; m < MR; ++m) a[n][m] = vfma(wv, xv[m], a[n][m]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < MR; ++m) acc[n * MR + m] = a[n][m];
  ahead.at = at, ahead.goal = goal;
}

// bf16 weights: with AVX-512 BF16 against bf16 activations xb (pairs multiplied exactly, summed in fp32); else
// widened to fp32 against the fp32 activations x.
template <int M>
inline void row_bf16(const bf16* w, const float* x, const bf16* xb, int64_t K, float* out) {
#if defined(__AVX512BF16__)
  constexpr int C = chains<M>();
  __m512 acc[C][M];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) acc[c][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * C <= K; k += 32 * C)
    for (int c = 0; c < C; ++c) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * c);
      for (int m = 0; m < M; ++m)
        acc[c][m] = _mm512_dpbf16_ps(acc[c][m], (__m512bh)_mm512_loadu_si512(xb + m * K + k + 32 * c), wv);
    }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1ull << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < M; ++m)
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + m * K + k), wv);
  }
  for (int m = 0; m < M; ++m) {
    for (int c = 1; c < C; ++c) acc[0][m] = _mm512_add_ps(acc[0][m], acc[c][m]);
    out[m] = _mm512_reduce_add_ps(acc[0][m]);
  }
  (void)x;
#else
  // row_f32's chains: one chain of widened bf16 multiply-adds waits on each one's latency while reading half the
  // bytes an fp32 one does, so at batch 1 a single chain fell short of the bandwidth.
  constexpr int C = chains<M>();
  V acc[C][M];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) acc[c][m] = vzero();
  int64_t k = 0;
  for (; k + C * kLanes <= K; k += C * kLanes)
    for (int c = 0; c < C; ++c) {
      const V wv = vload_bf16(w + k + c * kLanes);
      for (int m = 0; m < M; ++m) acc[c][m] = vfma(wv, vload(x + m * K + k + c * kLanes), acc[c][m]);
    }
  for (; k + kLanes <= K; k += kLanes) {
    const V wv = vload_bf16(w + k);
    for (int m = 0; m < M; ++m) acc[0][m] = vfma(wv, vload(x + m * K + k), acc[0][m]);
  }
  for (int m = 0; m < M; ++m) {
    for (int c = 1; c < C; ++c) acc[0][m] = vadd(acc[0][m], acc[c][m]);
    float s = vsum(acc[0][m]);
    for (int64_t j = k; j < K; ++j) s += bf16_to_float(w[j]) * x[m * K + j];
    out[m] = s;
  }
  (void)xb;
#endif
}

// NR bf16 weight rows against one activation row (the widening route), each row's two chains in row_bf16<1>'s order,
// so each result is row_bf16<1>'s to the bit: an activation vector loaded once serves NR rows. Four rows decoded the
// Llama-3.2-1B shape 5-10% faster than one at a time on one AVX2 EPYC core (6 alternating runs, same tokens); two
// and six were slower than one.
template <int NR>
inline void rows_bf16(const bf16* w, const float* x, int64_t K, float* out) {
  V acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = vzero();
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes)
    for (int c = 0; c < 2; ++c) {
      const V xv = vload(x + k + c * kLanes);
      for (int r = 0; r < NR; ++r) acc[r][c] = vfma(vload_bf16(w + r * K + k + c * kLanes), xv, acc[r][c]);
    }
  for (; k + kLanes <= K; k += kLanes) {
    const V xv = vload(x + k);
    for (int r = 0; r < NR; ++r) acc[r][0] = vfma(vload_bf16(w + r * K + k), xv, acc[r][0]);
  }
  for (int r = 0; r < NR; ++r) {
    float s = vsum(vadd(acc[r][0], acc[r][1]));
    for (int64_t j = k; j < K; ++j) s += bf16_to_float(w[r * K + j]) * x[j];
    out[r] = s;
  }
}

template <int M>
inline void row_i8(const int8_t* w, const float* x, int64_t K, float* out) {
  V acc[M];
  for (int m = 0; m < M; ++m) acc[m] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const V wv = vload_i8(w + k);
    for (int m = 0; m < M; ++m) acc[m] = vfma(wv, vload(x + m * K + k), acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    float s = vsum(acc[m]);
    for (int64_t j = k; j < K; ++j) s += float(w[j]) * x[m * K + j];
    out[m] = s;
  }
}

// Activations of M rows rounded for the int8 and q4 products (to_q8): values, scales and scaled block sums, row
// after row.
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* dsum;
};

// One block of 32 as 8 int32 lanes whose total is sum_j u_j * x_j: u unsigned bytes (q4's nibbles, or int8 weights
// plus 128).
inline __m256i block_dot_unsigned(__m256i u, const int8_t* xq) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xv);
#else  // q4 only (u <= 15): |15 * 127 * 2| fits vpmaddubsw's int16 pairs
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1));
#endif
}

#if !defined(__AVX512VNNI__)
// One block of 32 int8 weights against 32 rounded activations, as 8 int32 lanes summing to sum_j w_j * x_j (the
// VNNI route offsets w instead: block_dot_unsigned).
inline __m256i block_dot_signed(__m256i w, const int8_t* xq) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));  // |127 * 127 * 2| fits
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512VNNI__)
// Lanes 0-7 a, lanes 8-15 b: one scale for each of two blocks' lanes.
inline __m512 two_scales(float a, float b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}
#endif

// q4 in groups of 8 rows (gptkit.quantization.Int4Linear's layout in memory, as llama.cpp repacks Q4_0 for its CPU
// kernels): for group g and block b, 128 bytes: bytes 0-7 of each of the 8 rows' 16 packed bytes, row after row, then
// bytes 8-15 likewise; and the 8 rows' fp16 scales. Byte j of a row holds its element j (low nibble) and j + 16
// (high nibble), so 8 bytes of a row meet activations j..j+7 and j+16..j+23: one broadcast of 8 activation bytes
// serves all 8 rows, whose 4-byte pieces sit in their own 32-bit lanes of one vpdpbusd (or vpmaddubsw). Per block
// the 8 rows then share one conversion and one FMA, where a row at a time paid them for each row.
constexpr int64_t kQ4Group = 8;
constexpr int64_t kQ4GroupBytes = kQ4Group * kQ4Block / 2;  // 128 bytes of nibbles per group and block

#if defined(__AVX512F__)
// Sums of 32-bit lanes 2r and 2r+1 into lane r (r = 0..7): both halves of one row's 8 bytes.
inline __m256i row_pairs(__m512i v) { return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32))); }
#else
inline __m256i row_pairs(__m256i rows03, __m256i rows47) {  // (each: lanes 2r, 2r+1 for 4 rows)
  const __m256i a = _mm256_add_epi32(rows03, _mm256_srli_epi64(rows03, 32));
  const __m256i b = _mm256_add_epi32(rows47, _mm256_srli_epi64(rows47, 32));
  const __m256 picked = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0x88);  // a0 a2 b0 b2 | ..
  return _mm256_permute4x64_epi64(_mm256_castps_si256(picked), 0xD8);  // a0 a2 a4 a6 b0 b2 b4 b6
}

// sum over pairs of u (unsigned, < 16) times x (signed), 4 bytes a lane
inline __m256i unsigned_dot4(__m256i u, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}
#endif

// One block of a group: 8 int32 lanes, lane r = sum over the block's 32 elements of q (0..15) times x_q for row r.
inline __m256i q4_group_block(const uint8_t* w, const int8_t* xq) {
  int64_t x_lo0, x_lo1, x_hi0, x_hi1;  // activations 0-7, 8-15, 16-23, 24-31
  std::memcpy(&x_lo0, xq, 8);
  std::memcpy(&x_lo1, xq + 8, 8);
  std::memcpy(&x_hi0, xq + 16, 8);
  std::memcpy(&x_hi1, xq + 24, 8);
#if defined(__AVX512F__)
  const __m512i low = _mm512_set1_epi8(15);
  const __m512i first = _mm512_loadu_si512(w), second = _mm512_loadu_si512(w + 64);  // bytes 0-7, 8-15 of 8 rows
#if defined(__AVX512VNNI__)
  __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(first, low), _mm512_set1_epi64(x_lo0));
  sums = _mm512_dpbusd_epi32(sums, _mm512_and_si512(_mm512_srli_epi16(first, 4), low), _mm512_set1_epi64(x_hi0));
  sums = _mm512_dpbusd_epi32(sums, _mm512_and_si512(second, low), _mm512_set1_epi64(x_lo1));
  sums = _mm512_dpbusd_epi32(sums, _mm512_and_si512(_mm512_srli_epi16(second, 4), low), _mm512_set1_epi64(x_hi1));
#else
  const __m512i ones = _mm512_set1_epi16(1);
  auto dot4 = [&](__m512i u, int64_t x) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, _mm512_set1_epi64(x)), ones);
  };
  __m512i sums = _mm512_add_epi32(dot4(_mm512_and_si512(first, low), x_lo0),
                                  dot4(_mm512_and_si512(_mm512_srli_epi16(first, 4), low), x_hi0));
  sums = _mm512_add_epi32(sums, _mm512_add_epi32(dot4(_mm512_and_si512(second, low), x_lo1),
                                                 dot4(_mm512_and_si512(_mm512_srli_epi16(second, 4), low), x_hi1)));
#endif
  return row_pairs(sums);
#else
  const __m256i low = _mm256_set1_epi8(15);
  __m256i halves[2];  // rows 0-3, rows 4-7
  for (int h = 0; h < 2; ++h) {
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));  // bytes 0-7, 4 rows
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 + 32 * h));
    __m256i sums = _mm256_add_epi32(unsigned_dot4(_mm256_and_si256(first, low), _mm256_set1_epi64x(x_lo0)),
                                    unsigned_dot4(_mm256_and_si256(_mm256_srli_epi16(first, 4), low),
                                                  _mm256_set1_epi64x(x_hi0)));  // fmt: skip
    sums = _mm256_add_epi32(sums, unsigned_dot4(_mm256_and_si256(second, low), _mm256_set1_epi64x(x_lo1)));
    halves[h] = _mm256_add_epi32(sums, unsigned_dot4(_mm256_and_si256(_mm256_srli_epi16(second, 4), low),
                                                     _mm256_set1_epi64x(x_hi1)));  // fmt: skip
  }
  return row_pairs(halves[0], halves[1]);
#endif
}

// The 8 rows of a q4 group against M rounded activation rows: out[m][r], before any bias.
// Per block: rows' d * (d_x * sum(q x_q) - 8 * d_x * sum(x_q)), 8 rows in one vector.
template <int M>
inline void group_q4(const uint8_t* w, const uint16_t* scales, const Q8Rows& x, int64_t K, float (*out)[kQ4Group]) {
  const int64_t blocks = K / kQ4Block;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kQ4GroupBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kQ4Group)));
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * blocks + b;
      const __m256 sums = _mm256_cvtepi32_ps(q4_group_block(block, x.q + m * K + b * kQ4Block));
      const __m256 t = _mm256_fmsub_ps(sums, _mm256_set1_ps(x.d[i]), _mm256_set1_ps(8.0f * x.dsum[i]));
      acc[m] = _mm256_fmadd_ps(t, d, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

// int8 weights against rounded activations (K a multiple of 32), before the row's scale; offsets[m] is the sum over
// blocks of row m's dsum (the VNNI route's 128, taken back at the end). Two blocks a step, as row_q4.
template <int M>
inline void row_i8q(const int8_t* w, const Q8Rows& x, const float* offsets, int64_t K, float* out) {
  const int64_t blocks = K / kQ4Block;
  __m256 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  int64_t b = 0;
#if defined(__AVX512VNNI__)
  __m512 wide[M];
  for (int m = 0; m < M; ++m) wide[m] = _mm512_setzero_ps();
  for (; b + 2 <= blocks; b += 2) {
    const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(w + b * kQ4Block), _mm512_set1_epi8(char(0x80)));  // w + 128
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_loadu_si512(x.q + m * K + b * kQ4Block);
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv);
      wide[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), two_scales(x.d[m * blocks + b], x.d[m * blocks + b + 1]),
                                wide[m]);
    }
  }
#endif
  for (; b < blocks; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kQ4Block));
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = x.q + m * K + b * kQ4Block;
#if defined(__AVX512VNNI__)
      const __m256i sums = block_dot_unsigned(_mm256_xor_si256(wv, _mm256_set1_epi8(char(0x80))), xq);
#else
      const __m256i sums = block_dot_signed(wv, xq);
#endif
      acc[b & 1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(x.d[m * blocks + b]), acc[b & 1][m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float total = hsum256(_mm256_add_ps(acc[0][m], acc[1][m]));
#if defined(__AVX512VNNI__)
    total += _mm512_reduce_add_ps(wide[m]) - 128.0f * offsets[m];
#else
    (void)offsets;
#endif
    out[m] = total;
  }
}

}  // namespace gk
