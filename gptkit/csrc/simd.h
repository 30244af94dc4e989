// The vector layer every CPU kernel of gptkit is written against, compiled for one instruction set.
//
// The library is built once per machine for the widest set its CPU runs (native/cpu.py's ISA_LEVELS passes -mavx2 ...
// -mavx512bf16 as the CPU allows), so each kernel is written once against the vector width the compiler targets:
// 16 fp32 lanes under AVX-512, 8 under AVX2 + FMA. Here: bf16 and fp16 conversions, fp32 vectors (V) and their
// operations, exp / tanh / erf, the activations, and small dot and axpy helpers.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gk {

using bf16 = uint16_t;  // the raw bits of a bfloat16 (c10::BFloat16 has this layout)

inline float bf16_to_float(bf16 v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline bf16 float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16 does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  return bf16((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// ----- vectors of fp32 lanes -----

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
inline float vmaxall(V v) { return _mm512_reduce_max_ps(v); }
inline V vload_bf16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline V vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V vabs(V v) { return _mm512_abs_ps(v); }
// 2^n for integral n held in fp32 lanes
inline V vpow2i(V n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
#else
constexpr int kLanes = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline float vsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vmaxall(V v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V vload_bf16(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline V vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V vabs(V v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
inline V vpow2i(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
#endif

// exp(x) to about 1 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial in r, times 2^n).
inline V vexp(V x) {
  x = vmax(x, vset(-87.3f));  // below, e^x is under float's smallest normal: flush to ~0 rather than wrap
#if defined(__AVX512F__)
  x = _mm512_min_ps(x, vset(88.3f));
#else
  x = _mm256_min_ps(x, vset(88.3f));
#endif
  const V n = vround(vmul(x, vset(1.44269504088896341f)));
  V r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  V p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset(1.0f)));
  return vmul(p, vpow2i(n));
}

// tanh(z) = sign(z) (1 - 2 / (e^{2|z|} + 1)): absolute error about 1e-7, which is what GELU needs.
inline V vtanh(V z) {
  const V a = vabs(z);
  const V t = vsub(vset(1.0f), vdiv(vset(2.0f), vadd(vexp(vadd(a, a)), vset(1.0f))));
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
                                             _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(INT32_MIN))));
#else
  return _mm256_or_ps(t, _mm256_and_ps(z, _mm256_set1_ps(-0.0f)));
#endif
}

// erf by Abramowitz and Stegun 7.1.26 (absolute error under 1.5e-7)
inline V verf(V x) {
  const V a = vabs(x);
  const V t = vdiv(vset(1.0f), vfma(vset(0.3275911f), a, vset(1.0f)));
  V p = vset(1.061405429f);
  p = vfma(p, t, vset(-1.453152027f));
  p = vfma(p, t, vset(1.421413741f));
  p = vfma(p, t, vset(-0.284496736f));
  p = vfma(p, t, vset(0.254829592f));
  const V y = vsub(vset(1.0f), vmul(vmul(p, t), vexp(vsub(vzero(), vmul(a, a)))));
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(y),
                                             _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
#else
  return _mm256_or_ps(y, _mm256_and_ps(x, _mm256_set1_ps(-0.0f)));
#endif
}

// ----- activations, in place over n values -----

enum Activation : int64_t { kGeluTanh = 0, kGelu = 1, kRelu = 2, kSwiglu = 3 };

inline float scalar_act(float x, int64_t act) {
  if (act == kGeluTanh) return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  if (act == kGelu) return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f));
  return x > 0.0f ? x : 0.0f;
}

inline void activate(float* x, int64_t n, int64_t act) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V v = vload(x + i);
    V y;
    if (act == kGeluTanh) {
      const V inner = vmul(vset(0.7978845608028654f), vfma(vmul(vset(0.044715f), vmul(v, v)), v, v));
      y = vmul(vmul(vset(0.5f), v), vadd(vset(1.0f), vtanh(inner)));
    } else if (act == kGelu) {
      y = vmul(vmul(vset(0.5f), v), vadd(vset(1.0f), verf(vmul(v, vset(0.7071067811865476f)))));
    } else {
      y = vmax(v, vzero());
    }
    vstore(x + i, y);
  }
  for (; i < n; ++i) x[i] = scalar_act(x[i], act);
}

// out[i] = silu(gate[i]) * up[i] = gate / (1 + e^-gate) * up
inline void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V g = vload(gate + i);
    const V s = vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g))));
    vstore(out + i, vmul(s, vload(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// ----- small vector helpers -----

inline float dot(const float* a, const float* b, int64_t n) {
  V acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a x
  const V av = vset(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vfma(av, vload(x + i), vload(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

}  // namespace gk
