// Many-row fp32 products, y (M, N) = x (M, K) . w (N, K)^T (+ bias): what a prefill's linear layers run. The
// activations are copied once into panels of kPanelRows rows, k-major (panel[k][row]); each weight element is then
// broadcast against a whole panel, so the weights are read in place, row by row, with no copy of them. Every output's
// sum adds its K products one after another from zero, k = 0, 1, ...: its bits depend on its own row of x and of w
// only, never on M, on the other rows or on how the rows are split between threads.
#pragma once

#include <vector>

#include "products.h"

namespace gk {

constexpr int kPanelVectors = 2;                       // vectors of activation rows per panel
constexpr int64_t kPanelRows = kPanelVectors * kLanes;  // 16 rows on AVX2, 32 on AVX-512
constexpr int kGemmRows = 6;                            // weight rows per tile: 6 x 2 accumulators + 2 + 1 registers
// k per block, so that a panel's block (16 KiB on AVX2) stays in L1; tiles per group, so that the group's weight
// blocks (48 KiB) stay in L2 from panel to panel. The 48 products of GPT-2 small's 64-row prefill chunk, 12 layers of
// weights streamed from memory on 2 threads, ran at 96-134 GFLOP/s in blocks of 256 or 384 and groups of 8 or 16,
// the four alike within this 2-core AVX2 EPYC's noise (C++ loop, best of 5 a run, 2 interleaved runs each).
constexpr int64_t kGemmDepth = 256;
constexpr int64_t kGemmTiles = 8;
// Panels per block of rows; each block reads the weights again. With all rows in one block, GPT-2 small's 12 layers
// (bench_kernels.py --shapes gpt2-prefill) ran at 123 GFLOP/s at 256 rows but 94 at 1,024, against 112 for MKL's
// F.linear (0.84x); in blocks of 8 panels, 0.95x and 0.97x of F.linear at 512 and 1,024 rows (1.41x at 64, 1.31x at
// 128): the panels a group's tiles come back to stay in L2 and L3.
constexpr int64_t kGemmPanels = 8;

// An 8 x 8 block of floats transposed: rows r of `from` (ld_from apart) become columns of `to` (ld_to apart).
inline void transpose8(const float* from, int64_t ld_from, float* to, int64_t ld_to) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(from + i * ld_from);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);  // a0 b0 a1 b1 | a4 b4 a5 b5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0x44);  // a0 b0 c0 d0 | a4 b4 c4 d4 (j = 0)
      r[i + j + 2] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0xEE);
    }
  // r[0] = col 0|4 of rows 0-3, r[2] = col 1|5, r[1] = col 2|6, r[3] = col 3|7; r[4..7] likewise for rows 4-7
  const int order[4] = {0, 2, 1, 3};
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(to + c * ld_to, _mm256_permute2f128_ps(r[order[c]], r[order[c] + 4], 0x20));
    _mm256_storeu_ps(to + (c + 4) * ld_to, _mm256_permute2f128_ps(r[order[c]], r[order[c] + 4], 0x31));
  }
}

// Rows [m0, m0 + rows) of x as one panel: panel[k * kPanelRows + r] = x[(m0 + r) * K + k], zeros past `rows`.
inline void pack_panel(const float* x, int64_t K, int64_t m0, int64_t rows, float* panel) {
  int64_t r0 = 0, k = 0;
  for (; r0 + 8 <= rows; r0 += 8)
    for (k = 0; k + 8 <= K; k += 8) transpose8(x + (m0 + r0) * K + k, K, panel + k * kPanelRows + r0, kPanelRows);
  for (int64_t kk = 0; kk < K; ++kk) {
    float* to = panel + kk * kPanelRows;
    for (int64_t r = kk < k ? r0 : 0; r < kPanelRows; ++r) to[r] = r < rows ? x[(m0 + r) * K + kk] : 0.0f;
  }
}

// R weight rows (w, K apart) against PV vectors of a panel over k in [k0, k1): acc[r * kPanelVectors + v] carries
// the sums (from zero where fresh). With `next`, the tile after this one is asked for line by line on the way, as
// integer addresses: a last tile of fewer rows ends before R rows do, harmless for a prefetch, not for a pointer.
template <int R, int PV>
inline void gemm_tile(const float* w, int64_t K, const float* panel, int64_t k0, int64_t k1, V* acc, bool fresh,
                      const float* next) {
  V a[R][PV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < PV; ++v) a[r][v] = fresh ? vzero() : acc[r * kPanelVectors + v];
  for (int64_t k = k0; k < k1; ++k) {
    if (next && (k & 15) == 0)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(next) + uintptr_t((r * K + k) * 4)),
                     _MM_HINT_T0);
    V p[PV];
    for (int v = 0; v < PV; ++v) p[v] = vload(panel + k * kPanelRows + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const V wv = vset(w[r * K + k]);
      for (int v = 0; v < PV; ++v) a[r][v] = vfma(wv, p[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < PV; ++v) acc[r * kPanelVectors + v] = a[r][v];
}

// gemm_tile for a last panel of kLanes rows or fewer (one vector), R <= 2 kGemmRows weight rows at a time: one vector
// gives a tile of 6 only 6 chains of multiply-adds, too few to hide their latency, so two tiles go together; rows
// from kGemmRows on carry their sums in the next tile's place (acc + next_tile).
template <int R>
inline void gemm_tile_narrow(const float* w, int64_t K, const float* panel, int64_t k0, int64_t k1, V* acc,
                             int64_t next_tile, bool fresh) {
  auto sum = [&](int r) -> V& { return acc[(r < kGemmRows ? 0 : next_tile) + r % kGemmRows * kPanelVectors]; };
  V a[R];
  for (int r = 0; r < R; ++r) a[r] = fresh ? vzero() : sum(r);
  for (int64_t k = k0; k < k1; ++k) {
    const V p = vload(panel + k * kPanelRows);
    for (int r = 0; r < R; ++r) a[r] = vfma(vset(w[r * K + k]), p, a[r]);
  }
  for (int r = 0; r < R; ++r) sum(r) = a[r];
}

// y[m * N + n] = x[m] . w[n] (+ bias[n]) for the weight rows [n0, n1) and the M rows of x packed in `panel_count`
// panels (at most kGemmPanels: gemm_rows' blocks). A group of kGemmTiles tiles is done before the next: block by
// block of k, each panel's block meets every tile of the group while it sits in L1, and the group's weights stay in
// L2 from one panel to the next; the first panel's pass also asks for the next tile's weights line by line.
inline void gemm_block(const float* w, int64_t K, int64_t n0, int64_t n1, const float* panels, int64_t panel_count,
                       int64_t M, const float* bias, float* y, int64_t N) {
  constexpr int64_t per = kGemmRows * kPanelVectors;  // vectors of sums per (tile, panel)
  std::vector<V> sums(size_t(kGemmTiles * panel_count * per));
  const int64_t last_rows = M - (panel_count - 1) * kPanelRows;
  for (int64_t g0 = n0; g0 < n1; g0 += kGemmTiles * kGemmRows) {
    const int64_t g1 = g0 + kGemmTiles * kGemmRows < n1 ? g0 + kGemmTiles * kGemmRows : n1;
    for (int64_t k0 = 0; k0 < K; k0 += kGemmDepth) {
      const int64_t k1 = k0 + kGemmDepth < K ? k0 + kGemmDepth : K;
      for (int64_t p = 0; p < panel_count; ++p) {
        const float* panel = panels + p * K * kPanelRows;
        if (p + 1 == panel_count && p > 0 && last_rows <= kLanes) {
          for (int64_t n = g0; n < g1; n += 2 * kGemmRows) {
            V* acc = sums.data() + ((n - g0) / kGemmRows * panel_count + p) * per;
            with_value<1, 2 * kGemmRows>(g1 - n, [&](auto r) {
              gemm_tile_narrow<decltype(r)::value>(w + n * K, K, panel, k0, k1, acc, panel_count * per, k0 == 0);
            });
          }
          continue;
        }
        for (int64_t n = g0; n < g1; n += kGemmRows) {
          const int64_t nr = g1 - n < kGemmRows ? g1 - n : kGemmRows;
          const float* next = p == 0 && n + nr < g1 ? w + (n + nr) * K : nullptr;
          V* acc = sums.data() + ((n - g0) / kGemmRows * panel_count + p) * per;
          with_value<1, kGemmRows>(nr, [&](auto r) {
            if ((p + 1 < panel_count ? kPanelRows : last_rows) > kLanes)
              gemm_tile<decltype(r)::value, 2>(w + n * K, K, panel, k0, k1, acc, k0 == 0, next);
            else
              gemm_tile<decltype(r)::value, 1>(w + n * K, K, panel, k0, k1, acc, k0 == 0, next);
          });
        }
      }
    }
    // Row by row of y, so that each row's stores run along n; lane i of a panel's sums is that panel's row i.
    const float* lanes = reinterpret_cast<const float*>(sums.data());
    for (int64_t m = 0; m < M; ++m) {
      const int64_t p = m / kPanelRows, v = m % kPanelRows / kLanes, lane = m % kLanes;
      for (int64_t n = g0; n < g1; ++n) {
        const int64_t tile = (n - g0) / kGemmRows, row = (n - g0) % kGemmRows;
        const int64_t at = ((tile * panel_count + p) * per + row * kPanelVectors + v) * kLanes + lane;
        y[m * N + n] = lanes[at] + (bias ? bias[n] : 0.0f);
      }
    }
  }
}

// gemm_block over all M rows of x, kGemmPanels panels at a time: the weights are read from memory once per block.
inline void gemm_rows(const float* w, int64_t K, int64_t n0, int64_t n1, const float* panels, int64_t panel_count,
                      int64_t M, const float* bias, float* y, int64_t N) {
  for (int64_t p0 = 0; p0 < panel_count; p0 += kGemmPanels) {
    const int64_t count = panel_count - p0 < kGemmPanels ? panel_count - p0 : kGemmPanels, m0 = p0 * kPanelRows;
    const int64_t rows = M - m0 < count * kPanelRows ? M - m0 : count * kPanelRows;
    gemm_block(w, K, n0, n1, panels + p0 * K * kPanelRows, count, rows, bias, y + m0 * N, N);
  }
}

}  // namespace gk
