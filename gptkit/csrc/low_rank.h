// Served LoRA adapters inside the fused decode step (gptkit.multi_lora): each batch row may choose its own adapter,
// whose update of a linear layer adds scale * B (A x) to that row's output of the layer, as an AdapterSet layer
// computes it. A x (rank values) is taken per row before the layer's product; each thread then adds B's rows for the
// outputs it computed. A row's result depends on its own adapter only, never on the rows beside it.
#pragma once

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

  int64_t max_rank() const { return max_rank_; }

 private:
  std::vector<std::vector<Update>> by_slot_;
  int64_t max_rank_ = 0;
};

// t = A x for one row (K inputs, rank outputs).
inline void down(const Update& u, const float* x, int64_t K, float* t) {
  for (int64_t r = 0; r < u.rank; ++r) t[r] = gk::dot(u.a + r * K, x, K);
}

// y[n] += scale * (B[n] . t) for the outputs n in [lo, hi) of one row.
inline void up(const Update& u, const float* t, float* y, int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; ++n) y[n] += gk::dot(u.b + n * u.rank, t, u.rank) * u.scale;
}

}  // namespace lowrank
