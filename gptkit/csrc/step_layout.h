// How gptkit.decoding.fused describes a model to the fused decode step (step.cpp): the order of its integer settings,
// numbers and tensors, the kinds each setting names, one block's pointers as the step reads them, and its RoPE tables.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "moe_step.h"

namespace layout {

enum Norm : int64_t { kLayerNorm = 0, kRmsNorm = 1 };
enum Position : int64_t { kLearned = 0, kRope = 1, kNoPosition = 2 };
enum NormPosition : int64_t { kPre = 0, kSandwich = 1, kSublayerPost = 2 };
enum QkNorm : int64_t { kNoQkNorm = 0, kQkPerHead = 1, kQkWidth = 2 };
using moestep::kGeglu;

// The order of DecodeStep's integer settings (gptkit/decoding/fused.py writes them in this order); then per layer
// its sliding window (0: full attention), then per layer its dense MLP's hidden size (a MoE layer's shared expert;
// 0: none), then per layer whether its feed-forward is a mixture of experts (1) or not (0).
enum Setting : int64_t {
  kLayers, kWidth, kHeads, kKvHeads, kHeadDim, kHidden, kVocab, kNorm, kActivation, kPosition, kLogitsBF16,
  kNormPosition, kParallel, kQkNormKind, kRotaryDim, kExperts, kExpertsPerToken, kRenormalize, kExpertHidden,
  kSettings
};
// Its numbers, in this order (a soft-cap of 0: none).
enum Number : int64_t { kEps, kEmbeddingScale, kResidualScale, kAttnScale, kAttnSoftcap, kLogitScale, kLogitSoftcap,
                        kNumbers };
constexpr int64_t kLayerTensors = 22;  // per block: 2 norms, 4 linears of 3 tensors, 2 post-norms, q and k norms
// Per MoE layer, after the final norm, the head and the RoPE tables: the router, the experts' fc and down stacks and
// the shared expert's gate, 3 tensors each (weight, scales, bias).
constexpr int64_t kMoeTensors = 12;

// The block layers an adapter may update, numbered layer * kAdapted + which (gptkit.decoding.fused's order).
enum Adapted : int64_t { kQkv, kProj, kFc, kDown, kAdapted };

struct Layer {
  const float *norm1_w, *norm1_b, *norm2_w, *norm2_b, *post1_w, *post1_b, *post2_w, *post2_b, *q_norm, *k_norm;
  gk::Weight qkv, proj, fc, down;
  int64_t window;  // 0: full attention
  const float* inv_freq;  // rotary_dim / 2 frequencies; null: no RoPE in this layer
  float rope_factor;
  int64_t rope_group;  // layers of one group share their angles (computed once per row)
  int64_t hidden;  // the dense MLP's (fc, down) hidden size: a MoE layer's shared expert, 0 where it has none
  bool moe;
  moestep::Layer experts;  // a MoE layer's router, experts and shared gate
};

// Each layer's RoPE from freqs (L, rotary / 2) fp32 and factors (L,) fp32, 0 for a layer without RoPE (kept alive in
// keep); layers with equal frequencies and factor share a group, whose angles a row computes once.
inline void rope_tables(std::vector<Layer>& layers, const at::Tensor& freqs, const at::Tensor& factors, int64_t rotary,
                        std::vector<at::Tensor>& keep) {
  const int64_t L = int64_t(layers.size()), half = rotary / 2;
  TORCH_CHECK(freqs.scalar_type() == at::kFloat && freqs.dim() == 2 && freqs.size(0) == L && freqs.size(1) == half &&
                  factors.scalar_type() == at::kFloat && factors.numel() == L,
              "DecodeStep: RoPE frequencies (layers, rotary_dim / 2) and factors (layers,) in fp32 expected");
  keep.push_back(freqs.contiguous());
  keep.push_back(factors.contiguous());
  const float* f = keep[keep.size() - 2].data_ptr<float>();
  const float* factor = keep.back().data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    Layer& layer = layers[l];
    layer.inv_freq = factor[l] != 0.0f ? f + l * half : nullptr;
    layer.rope_factor = factor[l];
    layer.rope_group = l;
    for (int64_t m = 0; m < l; ++m)
      if (layer.inv_freq && layers[m].inv_freq && layers[m].rope_factor == factor[l] &&
          std::equal(f + m * half, f + (m + 1) * half, f + l * half)) {
        layer.rope_group = layers[m].rope_group;
        break;
      }
  }
}

}  // namespace layout
