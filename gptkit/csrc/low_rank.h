// Served LoRA adapters inside the fused decode step (gptkit.multi_lora): each batch row may choose its own adapter,
// whose update of a linear layer adds scale * B (A x) to that row's output of the layer, as an AdapterSet layer
// computes it. A x (rank values) is taken per row before the layer's product; each thread then adds B's rows for the
// outputs it computed. A row's result depends on its own adapter only, never on the rows beside it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace lowrank {

struct Update {  // one layer's update under one adapter: A (rank, K) and B (N, rank), fp32, contiguous
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t rank = 0;
  float scale = 0.0f;
};

// A layer's update from its A (rank, K) and B (N, rank) (contiguous fp32, kept alive in kept) and scale.
inline Update update(const at::Tensor& a, const at::Tensor& b, const gk::Weight& w, float scale,
                     std::vector<at::Tensor>& kept) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                  b.is_contiguous() && a.dim() == 2 && b.dim() == 2 && a.size(1) == w.K && b.size(0) == w.N &&
                  a.size(0) == b.size(1) && a.size(0) >= 1,
              "DecodeStep: an adapter's A (rank, in) and B (out, rank) must be contiguous fp32 for its layer");
  kept.push_back(a);
  kept.push_back(b);
  return {a.data_ptr<float>(), b.data_ptr<float>(), a.size(0), scale};
}

// Every adapter's updates by adapter number (1, 2, ...; 0 is the base alone) and layer index.
class Adapters {
 public:
  void set(int64_t slot, std::vector<Update> updates) {
    if (int64_t(by_slot_.size()) <= slot) by_slot_.resize(slot + 1);
    by_slot_[slot] = std::move(updates);
    max_rank_ = 0;
    for (const auto& updates_of : by_slot_)
      for (const Update& u : updates_of) max_rank_ = u.rank > max_rank_ ? u.rank : max_rank_;
  }

  bool has(int64_t slot) const { return slot >= 0 && slot < int64_t(by_slot_.size()) && !by_slot_[slot].empty(); }

  // The update of layer `index` under adapter `slot`; nullptr where that adapter leaves the layer alone.
  const Update* find(int64_t slot, int64_t index) const {
    if (!has(slot) || index < 0 || index >= int64_t(by_slot_[slot].size())) return nullptr;
    const Update& u = by_slot_[slot][index];
    return u.a ? &u : nullptr;
  }

  // This step's adapter number per row (nullptr: no row has one; each number checked with has()).
  void choose(const int64_t* slots, int64_t rows) {
    slots_ = slots;
    if (slots && values_.size() < size_t(rows * max_rank_)) values_.resize(rows * max_rank_);
  }

  // Row b's A x (x: rows of K values) for its adapter's update of layer `index`, if it has one.
  void down(int64_t index, const float* x, int64_t K, int64_t b) {
    const Update* u = slots_ ? find(slots_[b], index) : nullptr;
    if (!u) return;
    float* t = values_.data() + b * max_rank_;
    for (int64_t r = 0; r < u->rank; ++r) t[r] = gk::dot(u->a + r * K, x + b * K, K);
  }

  // y[b, n] += scale * (B[n] . A x[b]) for each row b with an update of layer `index`, outputs n in [lo, hi)
  // (y's rows ldy apart): after down() for every row.
  void up(int64_t index, int64_t rows, float* y, int64_t ldy, int64_t lo, int64_t hi) const {
    if (!slots_) return;
    for (int64_t b = 0; b < rows; ++b) {
      const Update* u = find(slots_[b], index);
      if (!u) continue;
      const float* t = values_.data() + b * max_rank_;
      for (int64_t n = lo; n < hi; ++n) y[b * ldy + n] += gk::dot(u->b + n * u->rank, t, u->rank) * u->scale;
    }
  }

 private:
  std::vector<std::vector<Update>> by_slot_;
  int64_t max_rank_ = 0;
  const int64_t* slots_ = nullptr;
  std::vector<float> values_;  // (rows, max rank): each row's A x for the layer being computed
};

}  // namespace lowrank
