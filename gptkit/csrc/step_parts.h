// Row-wise pieces of the fused decode step (step.cpp) that are plain arithmetic over one vector: norms, rotary
// positions, soft-caps. Each follows the eager model's formula (gptkit.layers, gptkit.positions, gptkit.loss) in fp32.
#pragma once

#include <cmath>
#include <cstdint>

namespace parts {

// y = (x - mean) / sqrt(var + eps) * w + bias over n values (LayerNorm; bias may be null). y may be x.
inline void layer_norm(const float* x, float* y, int64_t n, const float* w, const float* bias, float eps) {
  float mean = 0.0f;
  for (int64_t i = 0; i < n; ++i) mean += x[i];
  mean /= float(n);
  float var = 0.0f;
  for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.0f / std::sqrt(var / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * inv * w[i] + (bias ? bias[i] : 0.0f);
}

// y = w * x / sqrt(mean(x^2) + eps) over n values (RMSNorm; a gain offset is already added into w). y may be x.
inline void rms_norm(const float* x, float* y, int64_t n, const float* w, float eps) {
  float squares = 0.0f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(squares / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

// cos then sin (each rotary / 2 values) of angles position * inv_freq[i], both times factor (yarn's scaling).
inline void rope_angles(int64_t position, const float* inv_freq, float factor, int64_t rotary, float* out) {
  const int64_t half = rotary / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = float(position) * inv_freq[i];  // as gptkit.positions.cos_sin: the angle in fp32
    out[i] = std::cos(angle) * factor;
    out[half + i] = std::sin(angle) * factor;
  }
}

// (v_i, v_{i + r/2}) of v's first r = rotary values rotated by the angles rope_angles wrote; the rest unchanged.
inline void rotate(float* v, const float* angles, int64_t rotary) {
  const int64_t half = rotary / 2;
  const float* c = angles;
  const float* s = angles + half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], z = v[i + half];
    v[i] = a * c[i] - z * s[i];
    v[i + half] = z * c[i] + a * s[i];
  }
}

// cap * tanh(x / cap) in place over n values (Gemma 2's soft-cap of scores and logits).
inline void soft_cap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

// Logits z (n values) times scale, then soft-capped at cap (0: no cap), in place.
inline void scale_and_cap(float* z, int64_t n, float scale, float cap) {
  if (scale != 1.0f)
    for (int64_t i = 0; i < n; ++i) z[i] *= scale;
  if (cap > 0.0f) soft_cap(z, n, cap);
}

// One row's q (heads x head_dim) and k (kv_heads x head_dim), the start of qkv, RMS-normed in place: each head over
// its head_dim (one gain of head_dim shared by the heads), or with width all of q and all of k over their width.
inline void qk_norm(float* qkv, int64_t heads, int64_t kv_heads, int64_t head_dim, bool width, const float* q_gain,
                    const float* k_gain, float eps) {
  float* k = qkv + heads * head_dim;
  if (width) {
    rms_norm(qkv, qkv, heads * head_dim, q_gain, eps);
    rms_norm(k, k, kv_heads * head_dim, k_gain, eps);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) rms_norm(qkv + h * head_dim, qkv + h * head_dim, head_dim, q_gain, eps);
  for (int64_t g = 0; g < kv_heads; ++g) rms_norm(k + g * head_dim, k + g * head_dim, head_dim, k_gain, eps);
}

}  // namespace parts
