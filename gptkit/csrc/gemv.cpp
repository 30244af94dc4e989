// Few-row matrix products that stream the weights at memory speed, for decoding on a CPU:
//   gemv_bf16: y = x @ w^T (+ bias), bf16 x (M, K) and w (N, K), accumulated in fp32, bf16 out;
//   gemv_int8: y = (x @ q^T) * scales, fp32 x (M, K), int8 q (N, K) and fp32 scales (N,), fp32 out.
// Decoding one token is a matrix-vector product per weight matrix: its speed is how fast the weights stream from
// memory. PyTorch 2.13's bf16 and int8 kernels read them at about 7-12 GB/s on a 2-core AVX-512 machine where
// fp32 reaches 20; these loops read bf16 at 16-18 and int8 at 11-12 (measurements in gptkit/cpu_kernels.py).
// The file builds with AVX-512 F/BW/VL; gemv_bf16 alone also needs AVX512-BF16 (vdpbf16ps: fp32 += pairs of bf16
// products), so it is compiled for that target and only called where the CPU has it. Built once per machine by
// cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>

namespace {

constexpr int64_t kLanes = 32;           // bf16 values in one 512-bit register
constexpr int64_t kPrefetchAhead = 256;  // elements; software prefetch helps the hardware's with several row streams

#define BF16_TARGET __attribute__((target("avx512bf16")))

BF16_TARGET inline __m512bh load(const c10::BFloat16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Rows [n0, n1) of y for M rows of x, R rows of w at a time: each weight is loaded once for all M rows of x.
template <int M, int R>
BF16_TARGET void bf16_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias,
                           c10::BFloat16* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const __mmask32 all = ~__mmask32(0);
  const __mmask32 tail = K % kLanes ? __mmask32((1u << (K % kLanes)) - 1) : all;
  const int64_t k_full = K - K % kLanes;
  int64_t n = n0;
  auto finish = [&](const __m512* acc, int64_t row) {
    for (int m = 0; m < M; ++m) {
      float v = _mm512_reduce_add_ps(acc[m]) + (bias ? float(bias[row]) : 0.0f);
      y[m * N + row] = c10::BFloat16(v);
    }
  };
  for (; n + R <= n1; n += R) {
    __m512 acc[R][M] = {};  // zeros
    const c10::BFloat16* rows = w + n * K;
    for (int64_t k = 0; k < K; k += kLanes) {
      const __mmask32 mask = k < k_full ? all : tail;
      __m512bh wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(rows + r * K + k + kPrefetchAhead), _MM_HINT_T0);
        wv[r] = load(rows + r * K + k, mask);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = load(x + m * K + k, mask);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);
      }
    }
    for (int r = 0; r < R; ++r) finish(acc[r], n + r);
  }
  for (; n < n1; ++n) {  // the last rows of this thread's range, one at a time
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += kLanes) {
      const __mmask32 mask = k < k_full ? all : tail;
      const __m512bh wv = load(w + n * K + k, mask);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], load(x + m * K + k, mask), wv);
    }
    finish(acc, n);
  }
}

template <int M>
void bf16_m(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t K,
            int64_t N) {
  // Weight rows per pass, measured (50 GPT-2-small matrices, 2 threads): more rows share each x load but add
  // streams and registers; 4 is best at M = 1-2 (17 GB/s), 2 at M = 3-4 (12), 1 above (10, against 7 with 2).
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { bf16_rows<M, R>(x, w, bias, y, K, N, n0, n1); });
}

// Calls fn with M (1 to 8) as a compile-time constant, so that each row count gets its own unrolled loops.
template <typename Fn>
void with_rows(int64_t M, Fn&& fn) {
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

// Rows [n0, n1) of y for M rows of x, R int8 weight rows at a time, 16 weights per step widened to fp32.
template <int M, int R>
void int8_rows(const float* x, const int8_t* q, const float* scales, float* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  constexpr int64_t lanes = 16;
  const __mmask16 all = ~__mmask16(0);
  const __mmask16 tail = K % lanes ? __mmask16((1u << (K % lanes)) - 1) : all;
  const int64_t k_full = K - K % lanes;
  auto widen = [](const int8_t* p, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[R][M] = {};  // zeros
    const int8_t* rows = q + n * K;
    for (int64_t k = 0; k < K; k += lanes) {
      const __mmask16 mask = k < k_full ? all : tail;
      __m512 wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        // As many bytes ahead as the bf16 loop (int8 weights are half as wide).
        _mm_prefetch(reinterpret_cast<const char*>(rows + r * K + k + 2 * kPrefetchAhead), _MM_HINT_T0);
        wv[r] = widen(rows + r * K + k, mask);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(xv, wv[r], acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) * scales[n + r];
  }
  for (; n < n1; ++n) {
    for (int m = 0; m < M; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += lanes) {
        const __mmask16 mask = k < k_full ? all : tail;
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k), widen(q + n * K + k, mask), acc);
      }
      y[m * N + n] = _mm512_reduce_add_ps(acc) * scales[n];
    }
  }
}

template <int M>
void int8_m(const float* x, const int8_t* q, const float* scales, float* y, int64_t K, int64_t N) {
  // As for bf16; at M = 1, 4 rows measured 11.8 GB/s against 10.2 for 1 or 2 and 11.1 for 8.
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { int8_rows<M, R>(x, q, scales, y, K, N, n0, n1); });
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "gemv_int8: x (M, K) and q (N, K) expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "gemv_int8: fp32 x, int8 q and fp32 scales expected");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scales.is_contiguous() && scales.numel() == q.size(0),
              "gemv_int8: contiguous tensors and one scale per row of q expected");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "gemv_int8: 1 to 8 rows of x expected, got ", M);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  with_rows(M, [&](auto rows) { int8_m<rows()>(xp, qp, sp, yp, K, N); });
  return y;
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: x (M, K) and w (N, K) expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 tensors expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv_bf16: contiguous tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "gemv_bf16: 1 to 8 rows of x expected, got ", M);
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "gemv_bf16: a contiguous bf16 bias of w.size(0) values expected");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  with_rows(M, [&](auto rows) { bf16_m<rows()>(xp, wp, b, yp, K, N); });
  return y;
}

}  // namespace

TORCH_LIBRARY(gptkit, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor q, Tensor scales) -> Tensor");
}
TORCH_LIBRARY_IMPL(gptkit, CPU, m) {
  m.impl("gemv_bf16", TORCH_FN(gemv_bf16));
  m.impl("gemv_int8", TORCH_FN(gemv_int8));
}
