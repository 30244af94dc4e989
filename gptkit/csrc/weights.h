// The model's tensors as the fused decode step (step.cpp) reads them: norms and biases as fp32 copies, each linear
// layer's weight in its own format (fp32, bf16, int8 with a scale per row, q4; kernels.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace weights {

// A norm's gain or a bias as fp32, kept alive in keep (none: nullptr).
inline const float* vector(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  if (!t.defined() || t.numel() == 0) return nullptr;
  keep.push_back(t.to(at::kFloat).contiguous());
  return keep.back().data_ptr<float>();
}

// The (N, K) product of one linear layer from tensors[i..i+2] (weight, scales, bias), i moved past them; a q4 one
// is held in groups of 8 rows (kernels.h). What it points into is kept alive in keep.
inline gk::Weight weight(const std::vector<at::Tensor>& tensors, size_t& i, int64_t N, int64_t K,
                         std::vector<at::Tensor>& keep) {
  const at::Tensor& w = tensors[i];
  const at::Tensor& scales = tensors[i + 1];
  const at::Tensor& bias = tensors[i + 2];
  i += 3;
  TORCH_CHECK(w.is_contiguous() && (w.dim() == 2 ? w.size(0) == N && w.size(1) == K : w.dim() == 3),
              "DecodeStep: a weight is not the contiguous (", N, ", ", K, ") matrix the model needs");
  gk::Weight out;
  out.N = N;
  out.K = K;
  out.data = w.data_ptr();
  keep.push_back(w);
  if (w.scalar_type() == at::kFloat) {
    out.format = gk::kF32;
  } else if (w.scalar_type() == at::kBFloat16) {
    out.format = gk::kBF16;
  } else if (w.scalar_type() == at::kChar) {
    out.format = gk::kI8;
    TORCH_CHECK(scales.numel() == out.N, "DecodeStep: int8 weights need one scale per row");
    keep.push_back(scales.to(at::kFloat).contiguous());
    out.scales = keep.back().data_ptr<float>();
  } else {
    const int64_t groups = (N + gk::kQ4Group - 1) / gk::kQ4Group;
    TORCH_CHECK(w.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
                "DecodeStep: unknown weight format ", w.scalar_type());
    TORCH_CHECK(K % gk::kQ4Block == 0 && w.numel() == groups * (K / gk::kQ4Block) * gk::kQ4GroupBytes &&
                    scales.numel() == groups * (K / gk::kQ4Block) * gk::kQ4Group,
                "DecodeStep: q4 weights must be groups of 8 rows with a scale per block");
    out.format = gk::kQ4;
    keep.push_back(scales);
    out.scales = scales.data_ptr();
  }
  out.bias = vector(bias, keep);
  return out;
}

// E experts' (N, K) products from one stack tensors[i..i+2] (weight (E, ...), scales (E, ...), bias (E, N); each
// expert's slice in weight()'s format), i moved past them.
inline std::vector<gk::Weight> stack(const std::vector<at::Tensor>& tensors, size_t& i, int64_t E, int64_t N, int64_t K,
                                     std::vector<at::Tensor>& keep) {
  TORCH_CHECK(tensors[i].dim() >= 3 && tensors[i].size(0) == E, "DecodeStep: a stack of ", E, " experts expected");
  std::vector<gk::Weight> out;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<at::Tensor> one;
    for (size_t j = i; j < i + 3; ++j) one.push_back(tensors[j].numel() ? tensors[j][e] : tensors[j]);
    size_t at = 0;
    out.push_back(weight(one, at, N, K, keep));
  }
  i += 3;
  return out;
}

}  // namespace weights
