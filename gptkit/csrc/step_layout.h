// How gptkit.decoding.fused describes a model to the fused decode step (step.cpp): the order of its integer settings,
// numbers and tensors, the kinds each setting names, and one block's pointers as the step reads them.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace layout {

enum Norm : int64_t { kLayerNorm = 0, kRmsNorm = 1 };
enum Position : int64_t { kLearned = 0, kRope = 1, kNoPosition = 2 };
enum NormPosition : int64_t { kPre = 0, kSandwich = 1, kSublayerPost = 2 };
enum QkNorm : int64_t { kNoQkNorm = 0, kQkPerHead = 1, kQkWidth = 2 };
constexpr int64_t kGeglu = 4;  // beside kernels.h's activations: GELU (tanh) of the gate times the up rows

// The order of DecodeStep's integer settings (gptkit/decoding/fused.py writes them in this order); then one
// sliding window per layer (0: full attention).
enum Setting : int64_t {
  kLayers, kWidth, kHeads, kKvHeads, kHeadDim, kHidden, kVocab, kNorm, kActivation, kPosition, kLogitsBF16,
  kNormPosition, kParallel, kQkNormKind, kRotaryDim, kSettings
};
// Its numbers, in this order (a soft-cap of 0: none).
enum Number : int64_t { kEps, kEmbeddingScale, kResidualScale, kAttnScale, kAttnSoftcap, kLogitScale, kLogitSoftcap,
                        kNumbers };
constexpr int64_t kLayerTensors = 22;  // per block: 2 norms, 4 linears of 3 tensors, 2 post-norms, q and k norms

// The block layers an adapter may update, numbered layer * kAdapted + which (gptkit.decoding.fused's order).
enum Adapted : int64_t { kQkv, kProj, kFc, kDown, kAdapted };

struct Layer {
  const float *norm1_w, *norm1_b, *norm2_w, *norm2_b, *post1_w, *post1_b, *post2_w, *post2_b, *q_norm, *k_norm;
  gk::Weight qkv, proj, fc, down;
  int64_t window;  // 0: full attention
  const float* inv_freq;  // rotary_dim / 2 frequencies; null: no RoPE in this layer
  float rope_factor;
  int64_t rope_group;  // layers of one group share their angles (computed once per row)
};

}  // namespace layout
