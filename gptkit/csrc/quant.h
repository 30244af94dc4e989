// Quantised groups: the weight formats gptkit's products read, and the activations rounded for them.
//
// Weight formats (one row of a (N, K) matrix each; every product accumulates in fp32):
//   fp32, bf16     plain rows;
//   int8           int8 rows times one fp32 scale per row (gptkit.quantization.Int8Linear): where K holds whole
//                  blocks of 32, the activations are rounded to int8 per block first (below) and a row's product is
//                  scale * sum over blocks of d_x * sum(w * x_q) in integers; else fp32 activations times the
//                  widened weights;
//   q4             llama.cpp's Q4_0 math: blocks of 32 weights, w = d * (q - 8) with q in 0..15 (two per byte: byte j
//                  of a block holds element j in its low nibble and element j + 16 in its high one) and one fp16 d
//                  per block; a block's product is d * d_x * sum((q - 8) * x_q) with rounded activations.
// Rounded activations are llama.cpp's q8_0: per block of 32 values, d_x = max|x| / 127 and x_q = round(x / d_x). The
// integer sums run on vpdpbusd (unsigned by signed bytes: the int8 weights offset by 128, the offset taken back
// with the block's sum of x_q) or, without AVX-512 VNNI, on vpmaddubsw (|w| by x_q with w's sign).
#pragma once

#include "simd.h"

namespace gk {

constexpr int64_t kQ4Block = 32;

// ----- activations rounded for the products that take them so -----

// x (K fp32 values) rounded to bf16, for vdpbf16ps.
inline void to_bf16(const float* x, bf16* out, int64_t K) {
  for (int64_t k = 0; k < K; ++k) out[k] = float_to_bf16(x[k]);
}

// x (K fp32 values, K a multiple of 32) as llama.cpp's q8_0 rounds it: per block of 32, d = max|x| / 127 and
// q = round(x / d); dsum[b] is d times the sum of block b's q (for the offset terms of the unsigned-by-signed
// products: sum_j (u_j - o) q_j = sum_j u_j q_j - o sum_j q_j).
inline void to_q8(const float* x, int8_t* q, float* d, float* dsum, int64_t K) {
  constexpr int kVectors = kQ4Block / kLanes;
  for (int64_t b = 0; b < K / kQ4Block; ++b) {
    const float* xb = x + b * kQ4Block;
    V v[kVectors];
    V top = vzero();
    for (int i = 0; i < kVectors; ++i) {
      v[i] = vload(xb + i * kLanes);
      top = vmax(top, vabs(v[i]));
    }
    const float amax = vmaxall(top);
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    alignas(64) int32_t rounded[kQ4Block];
    for (int i = 0; i < kVectors; ++i) {  // round to nearest, ties to even, as std::nearbyint and torch.round
#if defined(__AVX512F__)
      _mm512_store_si512(rounded + i * kLanes, _mm512_cvtps_epi32(vmul(v[i], vset(inv))));
#else
      _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + i * kLanes), _mm256_cvtps_epi32(vmul(v[i], vset(inv))));
#endif
    }
    int32_t total = 0;
    for (int j = 0; j < kQ4Block; ++j) {
      q[b * kQ4Block + j] = int8_t(rounded[j]);
      total += rounded[j];
    }
    d[b] = scale;
    dsum[b] = scale * float(total);
  }
}

}  // namespace gk
