// Few-row matrix products that stream the weights at memory speed, for decoding on a CPU:
//   gemv(x, w, bias):          y = x @ w^T (+ bias) for fp32 or bf16 w (N, K), x (M, K) in w's dtype, y in x's dtype;
//   gemv_int8(x, q, scales):   y = (x @ q^T) * scales, fp32 x (M, K), int8 q (N, K), fp32 scales (N,), fp32 y.
// Decoding one token is a matrix-vector product per weight matrix: its speed is how fast the weights stream from
// memory, which PyTorch 2.13's few-row kernels do not reach on a CPU (measurements in gptkit/cpu_kernels.py).
// Every product accumulates in fp32. M is 1 to 8: each weight is loaded once for all M rows of x.
//
// One library holds three variants, each compiled for its instruction set with a function attribute, and the
// best one the CPU has is picked when the library loads (whether to use the kernels at all is decided by
// cpu_kernels.py from a measurement):
//   - AVX-512 BF16: bf16 weights and x through vdpbf16ps (fp32 += pairs of bf16 products);
//   - AVX-512 F/BW/VL: 16 fp32 lanes; bf16 and int8 weights widened to fp32;
//   - AVX2 + FMA: 8 fp32 lanes, the same widening; the last K % 8 columns in scalar code.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kPrefetchBytes = 512;  // software prefetch ahead of each weight row stream

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Where the pieces of one product are: x as fp32 (M, K), weights (N, K), and per output row an optional scale
// (int8) and bias (fp32); y (M, N) in Out.
template <typename W, typename Out>
struct Product {
  const float* x;
  const W* w;
  const float* scales;
  const float* bias;
  Out* y;
  int64_t K, N;

  void store(int m, int64_t n, float v) const {
    if (scales) v *= scales[n];
    if (bias) v += bias[n];
    y[m * N + n] = Out(v);
  }
};

// ----- AVX2 + FMA: 8 lanes -----

AVX2 inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 widen8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));  // bf16 is fp32's top half
}
AVX2 inline __m256 widen8(const int8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}
AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [n, n + RR) of y. (Separate functions rather than lambdas: a lambda does not inherit the target.)
template <int M, int RR, typename W, typename Out>
AVX2 void avx2_block(const Product<W, Out>& p, int64_t n) {
  const int64_t K = p.K, k_full = K - K % 8;
  __m256 acc[RR][M];
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const W* rows = p.w + n * K;
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line: one prefetch per line and row
  for (int64_t k = 0; k < k_full; k += 8) {
    __m256 wv[RR];
    if (k % kLine == 0) {
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(rows + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r) wv[r] = widen8(rows + r * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(p.x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) acc[r][m] = _mm256_fmadd_ps(xv, wv[r], acc[r][m]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) {
      float v = hsum8(acc[r][m]);
      for (int64_t k = k_full; k < K; ++k) v += p.x[m * K + k] * float(rows[r * K + k]);
      p.store(m, n + r, v);
    }
}

// Rows [n0, n1) of y, R weight rows at a time.
template <int M, int R, typename W, typename Out>
AVX2 void avx2_rows(const Product<W, Out>& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) avx2_block<M, R>(p, n);
  for (; n < n1; ++n) avx2_block<M, 1>(p, n);
}

// ----- AVX-512 F/BW/VL: 16 lanes, masked tails -----

AVX512 inline __m512 widen16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
AVX512 inline __m512 widen16(const bf16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
AVX512 inline __m512 widen16(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}

template <int M, int RR, typename W, typename Out>
AVX512 void avx512_block(const Product<W, Out>& p, int64_t n) {
  const int64_t K = p.K, k_full = K - K % 16;
  const __mmask16 all = ~__mmask16(0);
  const __mmask16 tail = K % 16 ? __mmask16((1u << (K % 16)) - 1) : all;
  __m512 acc[RR][M];
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const W* rows = p.w + n * K;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = k < k_full ? all : tail;
    __m512 wv[RR];
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
      wv[r] = widen16(rows + r * K + k, mask);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, p.x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) acc[r][m] = _mm512_fmadd_ps(xv, wv[r], acc[r][m]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) p.store(m, n + r, _mm512_reduce_add_ps(acc[r][m]));
}

template <int M, int R, typename W, typename Out>
AVX512 void avx512_rows(const Product<W, Out>& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) avx512_block<M, R>(p, n);
  for (; n < n1; ++n) avx512_block<M, 1>(p, n);
}

// ----- AVX-512 BF16: x stays bf16, pairs of products per lane -----

AVX512BF16 inline __m512bh load_bh(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

template <int M, int RR>
AVX512BF16 void dpbf16_block(const bf16* x, const Product<bf16, bf16>& p, int64_t n) {
  const int64_t K = p.K, k_full = K - K % 32;
  const __mmask32 all = ~__mmask32(0);
  const __mmask32 tail = K % 32 ? __mmask32((1u << (K % 32)) - 1) : all;
  __m512 acc[RR][M];
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const bf16* rows = p.w + n * K;
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = k < k_full ? all : tail;
    __m512bh wv[RR];
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
      wv[r] = load_bh(rows + r * K + k, mask);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bh(x + m * K + k, mask);
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) p.store(m, n + r, _mm512_reduce_add_ps(acc[r][m]));
}

template <int M, int R>
AVX512BF16 void dpbf16_rows(const bf16* x, const Product<bf16, bf16>& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) dpbf16_block<M, R>(x, p, n);
  for (; n < n1; ++n) dpbf16_block<M, 1>(x, p, n);
}

// ----- choosing the variant -----

enum Isa { kNone = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

Isa detect() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (avx512) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kNone;
}

const Isa kIsa = detect();

// Weight rows per pass, measured on a 2-core AVX-512 machine (50 GPT-2-small matrices): more rows share each x
// load but add streams and registers; 4 is best at M = 1-2, 2 at M = 3-4, 1 above.
template <int M>
constexpr int rows_per_pass() {
  return M <= 2 ? 4 : (M <= 4 ? 2 : 1);
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

template <typename W, typename Out>
void run_widened(int64_t M, const Product<W, Out>& p) {
  with_rows(M, [&](auto rows) {
    constexpr int m = decltype(rows)::value, r = rows_per_pass<m>();
    at::parallel_for(0, p.N, 16, [&](int64_t n0, int64_t n1) {
      if (kIsa >= kAvx512)
        avx512_rows<m, r>(p, n0, n1);
      else
        avx2_rows<m, r>(p, n0, n1);
    });
  });
}

void check_x(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(kIsa != kNone, name, ": this CPU has neither AVX2 nor AVX-512");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x (M, K) and w (N, K) expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), name, ": contiguous tensors expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, name, ": 1 to 8 rows of x expected, got ", x.size(0));
}

const float* float_data(const std::optional<at::Tensor>& t, int64_t n, at::Tensor& keep, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->numel() == n, what, ": one value per output row expected");
  keep = t->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_x(x, w, "gemv");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "gemv: fp32 or bf16 x and w of one dtype expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options()), b, x32;
  const float* bp = float_data(bias, N, b, "gemv bias");
  if (w.scalar_type() == at::kFloat) {
    run_widened(M, Product<float, float>{x.data_ptr<float>(), w.data_ptr<float>(), nullptr, bp, y.data_ptr<float>(),
                                          K, N});
    return y;
  }
  Product<bf16, bf16> p{nullptr, w.data_ptr<bf16>(), nullptr, bp, y.data_ptr<bf16>(), K, N};
  if (kIsa == kAvx512Bf16) {
    const bf16* xp = x.data_ptr<bf16>();
    with_rows(M, [&](auto rows) {
      constexpr int m = decltype(rows)::value, r = rows_per_pass<m>();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { dpbf16_rows<m, r>(xp, p, n0, n1); });
    });
    return y;
  }
  x32 = x.to(at::kFloat);
  p.x = x32.data_ptr<float>();
  run_widened(M, p);
  return y;
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias) {
  check_x(x, q, "gemv_int8");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "gemv_int8: fp32 x, int8 q and fp32 scales expected");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == q.size(0), "gemv_int8: one scale per row of q expected");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  at::Tensor y = at::empty({M, N}, x.options()), b;
  const float* bp = float_data(bias, N, b, "gemv_int8 bias");
  run_widened(M, Product<int8_t, float>{x.data_ptr<float>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), bp,
                                        y.data_ptr<float>(), K, N});
  return y;
}

int64_t isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY(gptkit, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("isa() -> int", isa);  // 0 none, 1 AVX2, 2 AVX-512, 3 AVX-512 BF16: the variant this CPU runs
}
TORCH_LIBRARY_IMPL(gptkit, CPU, m) {
  m.impl("gemv", TORCH_FN(gemv));
  m.impl("gemv_int8", TORCH_FN(gemv_int8));
}
