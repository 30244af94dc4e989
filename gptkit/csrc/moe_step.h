// A mixture-of-experts feed-forward inside the fused decode step (step.cpp; gptkit.moe computes the same eagerly):
// the router's product, softmax and top k (ties to the lower expert index, as gptkit.moe.route's stable sort), the
// renormalised weights, then each routed expert's up and down products over only the rows routed to it, and each
// row's weighted sum over its k experts in its top-k order. Each expert's slice of a stack is in any of weights.h's
// formats (fp32, bf16, int8 with a scale per row, q4 in groups of 8 rows: gptkit.quantization's Int8Experts and
// Int4Experts), its activations prepared as the dense products prepare theirs.
//
// Rows are grouped by expert (an expert's rows side by side, in row order), so that a weight row several rows route
// to is read once per step, and an expert nobody chose is not read at all: at one row the step reads k experts, its
// floor. A product gives each row the bits it gives that row alone (products.h), and a row's sum runs over its own
// experts in its own order, so a row's result does not depend on the rows beside it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "weights.h"

namespace moestep {

constexpr int64_t kGeglu = 4;  // beside kernels.h's activations: GELU (tanh) of the gate times the up rows

// One MoE layer's weights: the router (E, D), each expert's fc (gate then up rows when gated) and down, and a shared
// expert's gate (1, D; N == 0: none). The shared expert itself is a dense MLP, which step.cpp computes.
struct Layer {
  gk::Weight router;
  std::vector<gk::Weight> fc, down;
  gk::Weight gate;
};

// act(h) over n hidden units: gated (SwiGLU, GeGLU) from the gate and up rows into out, else in place in gate.
inline void activate(int64_t act, float* gate, const float* up, float* out, int64_t n) {
  if (act == gk::kSwiglu) {
    gk::swiglu(gate, up, out, n);
  } else if (act == kGeglu) {
    gk::activate(gate, n, gk::kGeluTanh);
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * up[i];
  } else {
    gk::activate(gate, n, act);
  }
}

class Experts {
 public:
  // E experts of hidden FE, each row's top k (weights renormalised or not), the activation, the width D; with
  // round_logits, router logits rounded to bf16 as a bf16 model's router computes them.
  void configure(int64_t E, int64_t k, bool renormalize, int64_t FE, int64_t act, int64_t D, bool round_logits) {
    E_ = E, k_ = k, renormalize_ = renormalize, FE_ = FE, act_ = act, D_ = D, round_logits_ = round_logits;
    gated_ = act == gk::kSwiglu || act == kGeglu;
  }

  // A MoE layer's router (E, D), expert stacks (E, fc width, D) and (E, D, FE), and shared gate (1, D) or none, from
  // tensors[i..i + 12) (3 each: weight, scales, bias), i moved past them.
  Layer layer_weights(const std::vector<at::Tensor>& tensors, size_t& i, std::vector<at::Tensor>& keep) const {
    Layer layer;
    layer.router = weights::weight(tensors, i, E_, D_, keep);
    layer.fc = weights::stack(tensors, i, E_, gated_ ? 2 * FE_ : FE_, D_, keep);
    layer.down = weights::stack(tensors, i, E_, D_, FE_, keep);
    if (tensors[i].numel())
      layer.gate = weights::weight(tensors, i, 1, D_, keep);
    else
      i += 3;
    return layer;
  }

  void reserve(int64_t B) {
    const size_t slots = size_t(B * k_), widest = size_t(std::max(D_, FE_));
    if (logits_.size() >= size_t(B * E_)) return;
    logits_.resize(B * E_);
    gates_.resize(B);
    chosen_.resize(slots);
    weights_.resize(slots);
    slot_of_.resize(slots);
    row_of_.resize(slots);
    xe_.resize(slots * D_);
    up_.resize(slots * (gated_ ? 2 : 1) * FE_);
    ffe_.resize(slots * FE_);
    ye_.resize(slots * D_);
    staging_.resize(int64_t(slots), int64_t(widest));
  }

  // Every thread of the step's parallel region: out (B, D) := each row's routed sum for the layer's input h (B, D);
  // with a shared gate, gates (B) := sigmoid(h w_gate). Ends at a barrier.
  void run(const Layer& m, const float* h, int64_t B, float* out, int t, int nt) {
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      staging_.prepare(m.router, h, b);
      if (m.gate.N) staging_.prepare(m.gate, h, b);
    }
    product(m.router, h, 0, B, logits_.data(), E_, t, nt);
    if (m.gate.N) product(m.gate, h, 0, B, gates_.data(), 1, t, nt);
#pragma omp barrier
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      select(b);
      if (m.gate.N) gates_[b] = 1.0f / (1.0f + std::exp(-gates_[b]));
    }
#pragma omp single
    group(B);
#pragma omp for
    for (int64_t r = 0; r < B * k_; ++r) {
      std::copy(h + row_of_[r] * D_, h + (row_of_[r] + 1) * D_, xe_.data() + r * D_);
      staging_.prepare(m.fc[0], xe_.data(), r);
    }
    const int64_t width = gated_ ? 2 * FE_ : FE_;
    for (size_t i = 0; i < active_.size(); ++i) {
      const int64_t e = active_[i], s0 = starts_[i], M = starts_[i + 1] - s0;
      int64_t lo, hi;
      gk::split(FE_, t, nt, 16, &lo, &hi);
      const gk::Input in = gk::rows_from(staging_.input(xe_.data()), s0, D_);
      float* raw = up_.data() + s0 * width;
      gk::product_range(m.fc[e], in, M, raw, width, lo, hi);
      if (gated_) gk::product_range(m.fc[e], in, M, raw, width, FE_ + lo, FE_ + hi);
      for (int64_t r = 0; r < M; ++r) {
        float* gate = raw + r * width + lo;
        activate(act_, gate, gate + FE_, gated_ ? ffe_.data() + (s0 + r) * FE_ + lo : gate, hi - lo);
        if (!gated_) std::copy(gate, gate + hi - lo, ffe_.data() + (s0 + r) * FE_ + lo);
      }
    }
#pragma omp barrier
#pragma omp for
    for (int64_t r = 0; r < B * k_; ++r) staging_.prepare(m.down[0], ffe_.data(), r);
    for (size_t i = 0; i < active_.size(); ++i) {
      const int64_t s0 = starts_[i];
      product(m.down[active_[i]], ffe_.data(), s0, starts_[i + 1] - s0, ye_.data() + s0 * D_, D_, t, nt);
    }
#pragma omp barrier
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      float* o = out + b * D_;
      std::fill(o, o + D_, 0.0f);
      for (int64_t j = 0; j < k_; ++j) {
        const float w = weights_[b * k_ + j];
        const float* y = ye_.data() + slot_of_[b * k_ + j] * D_;
        for (int64_t i = 0; i < D_; ++i) o[i] += y[i] * w;
      }
    }
  }

  const float* gates() const { return gates_.data(); }

 private:
  // Row b's top k of softmax(logits): the largest first, ties to the lower index; their probabilities (divided by
  // their sum with renormalize).
  void select(int64_t b) {
    float* p = logits_.data() + b * E_;
    if (round_logits_)
      for (int64_t e = 0; e < E_; ++e) p[e] = gk::bf16_to_float(gk::float_to_bf16(p[e]));
    float top = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E_; ++e) top = std::fmax(top, p[e]);
    for (int64_t e = 0; e < E_; ++e) sum += (p[e] = std::exp(p[e] - top));
    for (int64_t e = 0; e < E_; ++e) p[e] /= sum;
    float chosen_sum = 0.0f;
    for (int64_t j = 0; j < k_; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E_; ++e)
        if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
      chosen_[b * k_ + j] = best;
      weights_[b * k_ + j] = p[best];
      chosen_sum += p[best];
      p[best] = -1.0f;  // taken
    }
    if (renormalize_)
      for (int64_t j = 0; j < k_; ++j) weights_[b * k_ + j] /= chosen_sum;
  }

  // The routed slots sorted by expert, then by row (a counting sort): each active expert's slots side by side.
  void group(int64_t B) {
    std::vector<int64_t> counts(E_ + 1, 0);
    for (int64_t s = 0; s < B * k_; ++s) ++counts[chosen_[s] + 1];
    active_.clear();
    starts_.clear();
    for (int64_t e = 0; e < E_; ++e) {
      if (counts[e + 1]) {
        active_.push_back(e);
        starts_.push_back(counts[e]);
      }
      counts[e + 1] += counts[e];
    }
    starts_.push_back(B * k_);
    for (int64_t s = 0; s < B * k_; ++s) {
      const int64_t r = counts[chosen_[s]]++;
      slot_of_[s] = r;
      row_of_[r] = s / k_;
    }
  }

  // y (M, ldy) := rows m0.. of x (as prepared) times w, this thread's share of w's output rows.
  void product(const gk::Weight& w, const float* x, int64_t m0, int64_t M, float* y, int64_t ldy, int t, int nt) {
    int64_t lo, hi;
    gk::split(w.N, t, nt, 16, &lo, &hi);
    gk::product_range(w, gk::rows_from(staging_.input(x), m0, w.K), M, y, ldy, lo, hi);
  }

  int64_t E_ = 0, k_ = 0, FE_ = 0, act_ = 0, D_ = 0;
  bool renormalize_ = true, gated_ = false, round_logits_ = false;
  std::vector<float> logits_, gates_, weights_, xe_, up_, ffe_, ye_;
  std::vector<int64_t> chosen_, slot_of_, row_of_, active_, starts_;
  gk::Staging staging_;  // the rows' activations as each product reads them
};

}  // namespace moestep
