// Few-row matrix products that stream the weights at memory speed, for decoding on a CPU (kernels.h has the math):
//   gemv(x, w, bias):             y = x @ w^T (+ bias), fp32 or bf16 w (N, K), x (M, K) in w's dtype or fp32, y in
//                                 x's dtype;
//   gemv_int8(x, q, scales, bias) y = (x @ q^T) * scales (+ bias): fp32 x, int8 q (N, K), fp32 scales (N,), fp32 y
//                                 (x rounded to int8 per block of 32 first where K is a multiple of 32: kernels.h);
//   gemv_q4(x, q, scales, bias, rows)  the Q4_0 product of kernels.h over rows (N) in groups of 8: fp32 x (M, K),
//                                 uint8 q (ceil(N / 8), K / 32, 128), fp16 scales (ceil(N / 8), K / 32, 8), fp32 y;
//   gemm(x, w, bias):             y = x @ w^T (+ bias) for fp32 x (M, K) of any M and fp32 w (N, K): a prefill's
//                                 products (gemm.h: each output's bits depend on its own rows of x and w only);
//   dequantize_q4(q, scales, rows, dtype)  gemv_q4's weight as a float (rows, K) matrix, fp32 or bf16;
//   isa()                         the instruction set the library was built for;
//   read_bandwidth(buffer, rounds) bytes/s that all threads stream from the buffer, each pinned to its own CPU for
//                                 the probe, the best of the rounds (a benchmark's ceiling for weight-bound decoding);
//   huge_pages(tensors)           asks Linux to back the tensors' memory with 2 MiB pages (bytes now so backed).
// gemv's M is 1 to 8: each weight row is read once for all M rows of x. Each thread takes one contiguous range of
// rows, so that it streams one run of memory.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

void check_x(const at::Tensor& x, const at::Tensor& w, int64_t k_per_row, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) * k_per_row, name,
              ": x (M, K) and w (N, K) expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), name, ": contiguous tensors expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, name, ": 1 to 8 rows of x expected, got ", x.size(0));
}

const float* bias_data(const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == n, "gemv: one bias value per output row expected");
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// M rows of fp32 activations rounded to int8 per block of 32 (kernels.h's to_q8), for the int8 and q4 products.
struct Rounded {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> dsum;
  const float* x;

  Rounded(const float* x, int64_t M, int64_t K) : q(M * K), d(M * (K / gk::kQ4Block)), dsum(d.size()), x(x) {
    const int64_t blocks = K / gk::kQ4Block;
    for (int64_t m = 0; m < M; ++m) gk::to_q8(x + m * K, &q[m * K], &d[m * blocks], &dsum[m * blocks], K);
  }

  gk::Input input() const {
    gk::Input in;
    in.x = x;
    in.q8 = {q.data(), d.data(), dsum.data()};
    return in;
  }
};

// y (M, N) fp32 = the product, each thread over its own rows
at::Tensor run(const gk::Weight& w, const gk::Input& in, int64_t M, const at::TensorOptions& options) {
  at::Tensor y = at::empty({M, w.N}, options.dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int T = at::get_num_threads();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t lo, hi;
      gk::split(w.N, int(t), T, 16, &lo, &hi);
      gk::product_range(w, in, M, yp, w.N, lo, hi);
    }
  });
  return y;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_x(x, w, 1, "gemv");
  TORCH_CHECK((x.scalar_type() == w.scalar_type() || x.scalar_type() == at::kFloat) &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "gemv: fp32 or bf16 w, and x in w's dtype or fp32, expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor b, x32;
  gk::Weight weight;
  weight.N = N;
  weight.K = K;
  weight.bias = bias_data(bias, N, b);
  gk::Input in;
  if (w.scalar_type() == at::kFloat) {
    weight.format = gk::kF32;
    weight.data = w.data_ptr<float>();
    in.x = x.data_ptr<float>();
    return run(weight, in, M, x.options());
  }
  weight.format = gk::kBF16;
  weight.data = w.data_ptr();
  x32 = x.to(at::kFloat);
  const at::Tensor xb = x.to(at::kBFloat16);
  in.x = x32.data_ptr<float>();
  in.xb = static_cast<const gk::bf16*>(xb.data_ptr());
  const at::Tensor y = run(weight, in, M, x.options());
  return x.scalar_type() == at::kFloat ? y : y.to(at::kBFloat16);  // (fp32 x: the sums as the fused step keeps them)
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemm: x (M, K) and w (N, K) expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemm: contiguous tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "gemm: fp32 x and w expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor keep;
  const float* b = bias_data(bias, N, keep);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t panel_count = (M + gk::kPanelRows - 1) / gk::kPanelRows;
  at::Tensor panels = at::empty({panel_count, K, gk::kPanelRows}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *pp = panels.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, panel_count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      gk::pack_panel(xp, K, p * gk::kPanelRows, std::min(gk::kPanelRows, M - p * gk::kPanelRows),
                     pp + p * K * gk::kPanelRows);
  });
  const int T = at::get_num_threads();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t lo, hi;
      gk::split(N, int(t), T, gk::kGemmRows, &lo, &hi);
      if (lo < hi) gk::gemm_rows(wp, K, lo, hi, pp, panel_count, M, b, yp, N);
    }
  });
  return y;
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias) {
  check_x(x, q, 1, "gemv_int8");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "gemv_int8: fp32 x, int8 q and fp32 scales expected");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == q.size(0), "gemv_int8: one scale per row of q expected");
  at::Tensor b;
  gk::Weight weight;
  weight.format = gk::kI8;
  weight.N = q.size(0);
  weight.K = q.size(1);
  weight.data = q.data_ptr<int8_t>();
  weight.scales = scales.data_ptr<float>();
  weight.bias = bias_data(bias, weight.N, b);
  if (gk::rounds_activations(weight)) {
    Rounded rounded(x.data_ptr<float>(), x.size(0), weight.K);
    return run(weight, rounded.input(), x.size(0), x.options());
  }
  gk::Input in;
  in.x = x.data_ptr<float>();
  return run(weight, in, x.size(0), x.options());
}

at::Tensor gemv_q4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const std::optional<at::Tensor>& bias, int64_t rows) {
  const int64_t M = x.size(0), K = x.size(1), N = rows, blocks = K / gk::kQ4Block;
  const int64_t groups = (N + gk::kQ4Group - 1) / gk::kQ4Group;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && M >= 1 && M <= 8, "gemv_q4: 1 to 8 contiguous rows of x");
  TORCH_CHECK(K % gk::kQ4Block == 0, "gemv_q4: K must be a multiple of 32, got ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf,
              "gemv_q4: fp32 x, uint8 q and fp16 scales expected");
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3 && q.size(0) == groups && q.size(1) == blocks &&
                  q.size(2) == gk::kQ4GroupBytes,
              "gemv_q4: q (ceil(rows / 8), K / 32, 128) expected");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == groups && scales.size(1) == blocks &&
                  scales.size(2) == gk::kQ4Group,
              "gemv_q4: scales (ceil(rows / 8), K / 32, 8) expected");
  Rounded rounded(x.data_ptr<float>(), M, K);
  at::Tensor b;
  gk::Weight weight;
  weight.format = gk::kQ4;
  weight.N = N;
  weight.K = K;
  weight.data = q.data_ptr<uint8_t>();
  weight.scales = scales.data_ptr();
  weight.bias = bias_data(bias, N, b);
  return run(weight, rounded.input(), M, x.options());
}

// The float weight (rows, K) of gemv_q4's grouped blocks, d (q - 8), in fp32 or bf16 (rounded to nearest even, as
// a cast in PyTorch rounds): what a many-row product multiplies. One pass, every thread over its own groups, where
// the same in PyTorch ops made five passes over an fp32 copy.
at::Tensor dequantize_q4(const at::Tensor& q, const at::Tensor& scales, int64_t rows, at::ScalarType dtype) {
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3 && q.size(2) == gk::kQ4GroupBytes && q.scalar_type() == at::kByte,
              "dequantize_q4: uint8 q (ceil(rows / 8), K / 32, 128) expected");
  const int64_t groups = q.size(0), blocks = q.size(1), K = blocks * gk::kQ4Block;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.dim() == 3 &&
                  scales.size(0) == groups && scales.size(1) == blocks && scales.size(2) == gk::kQ4Group,
              "dequantize_q4: fp16 scales (ceil(rows / 8), K / 32, 8) expected");
  TORCH_CHECK(rows > (groups - 1) * gk::kQ4Group && rows <= groups * gk::kQ4Group, "dequantize_q4: ", rows,
              " rows do not fill ", groups, " groups of 8");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_q4: fp32 or bf16 out");
  at::Tensor out = at::empty({rows, K}, q.options().dtype(dtype));
  const uint8_t* data = q.data_ptr<uint8_t>();
  const uint16_t* d16 = static_cast<const uint16_t*>(scales.data_ptr());
  float* out32 = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  gk::bf16* out16 = dtype == at::kBFloat16 ? static_cast<gk::bf16*>(out.data_ptr()) : nullptr;
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    float row[gk::kQ4Block];
    for (int64_t r = 0; r < gk::kQ4Group && g * gk::kQ4Group + r < rows; ++r) {
      const int64_t n = g * gk::kQ4Group + r;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = data + (g * blocks + b) * gk::kQ4GroupBytes;
        const float d = gk::half_to_float(d16[(g * blocks + b) * gk::kQ4Group + r]);
        for (int64_t j = 0; j < 16; ++j) {
          const uint8_t byte = block[(j / 8) * 64 + r * 8 + j % 8];  // bytes 0-7 of every row, then bytes 8-15
          row[j] = d * float((byte & 15) - 8);
          row[j + 16] = d * float((byte >> 4) - 8);
        }
        if (out32)
          std::memcpy(out32 + n * K + b * gk::kQ4Block, row, sizeof(row));
        else
          gk::to_bf16(row, out16 + n * K + b * gk::kQ4Block, gk::kQ4Block);
      }
    }
  }
  return out;
}

// Each thread sums its contiguous part of the buffer with four independent accumulators, on a CPU of its own
// (its affinity restored after).
double read_bandwidth(const at::Tensor& buffer, int64_t rounds) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(), "read_bandwidth: a contiguous fp32 buffer");
  const float* data = buffer.data_ptr<float>();
  const int64_t n = buffer.numel() / (4 * gk::kLanes) * (4 * gk::kLanes);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  sched_getaffinity(0, sizeof(allowed), &allowed);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  const int T = at::get_num_threads();
  double best = 0.0;
  float sink = 0.0f;
  for (int64_t r = 0; r < rounds; ++r) {
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(T) reduction(+ : sink)
    {
      const int t = omp_get_thread_num();
      cpu_set_t own, before;
      pthread_getaffinity_np(pthread_self(), sizeof(before), &before);
      CPU_ZERO(&own);
      CPU_SET(cpus[t % cpus.size()], &own);
      pthread_setaffinity_np(pthread_self(), sizeof(own), &own);
      int64_t lo, hi;
      gk::split(n, t, omp_get_num_threads(), 4 * gk::kLanes, &lo, &hi);
      gk::V a = gk::vzero(), b = gk::vzero(), c = gk::vzero(), d = gk::vzero();
      for (int64_t i = lo; i < hi; i += 4 * gk::kLanes) {
        a = gk::vadd(a, gk::vload(data + i));
        b = gk::vadd(b, gk::vload(data + i + gk::kLanes));
        c = gk::vadd(c, gk::vload(data + i + 2 * gk::kLanes));
        d = gk::vadd(d, gk::vload(data + i + 3 * gk::kLanes));
      }
      sink += gk::vsum(gk::vadd(gk::vadd(a, b), gk::vadd(c, d)));
      pthread_setaffinity_np(pthread_self(), sizeof(before), &before);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, double(n) * 4.0 / seconds);
  }
  return sink == -1.0f ? 0.0 : best;  // (the sum is used, so that the reads are not optimised away)
}

// Streaming hundreds of megabytes of weights a step through 4 KiB pages costs a page-table walk every 4 KiB: on a
// 2-core AMD EPYC a GPT-2-small decode step read its fp32 weights at 31 GB/s through 4 KiB pages and 36 GB/s through
// 2 MiB ones (the same matrices, interleaved runs). MADV_HUGEPAGE marks each tensor's whole 2 MiB spans and
// MADV_COLLAPSE (Linux 6.1) moves their present pages into huge ones in place: same addresses, same values. On an
// older kernel, or where the system turned transparent huge pages off, the calls fail and nothing changes.
int64_t huge_pages(const std::vector<at::Tensor>& tensors) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
#ifndef MADV_COLLAPSE
  constexpr int MADV_COLLAPSE = 25;
#endif
  int64_t collapsed = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.device().type() != at::kCPU) continue;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (begin + kHuge - 1) / kHuge * kHuge;
    const uintptr_t last = (begin + uintptr_t(t.nbytes())) / kHuge * kHuge;
    if (last <= first) continue;  // no whole 2 MiB span inside the tensor
    void* span = reinterpret_cast<void*>(first);
    if (madvise(span, last - first, MADV_HUGEPAGE) == 0 && madvise(span, last - first, MADV_COLLAPSE) == 0)
      collapsed += int64_t(last - first);
  }
  return collapsed;
}

// The instruction set the library was compiled for (native/cpu.py's ISA_LEVELS, in that order).
int64_t isa() {
#if defined(__AVX512BF16__)
  return 4;
#elif defined(__AVX512VNNI__)
  return 3;
#elif defined(__AVX512F__)
  return 2;
#else
  return 1;
#endif
}

}  // namespace

TORCH_LIBRARY(gptkit, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("gemv_q4(Tensor x, Tensor q, Tensor scales, Tensor? bias, int rows) -> Tensor");
  m.def("dequantize_q4(Tensor q, Tensor scales, int rows, ScalarType dtype) -> Tensor");
  m.def("isa() -> int", isa);
  m.def("read_bandwidth(Tensor buffer, int rounds) -> float", read_bandwidth);
  m.def("huge_pages(Tensor[] tensors) -> int", huge_pages);
}
TORCH_LIBRARY_IMPL(gptkit, CPU, m) {
  m.impl("gemv", TORCH_FN(gemv));
  m.impl("gemm", TORCH_FN(gemm));
  m.impl("gemv_int8", TORCH_FN(gemv_int8));
  m.impl("gemv_q4", TORCH_FN(gemv_q4));
  m.impl("dequantize_q4", TORCH_FN(dequantize_q4));
}
