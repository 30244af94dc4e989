// One decode step of a whole pre-norm GPT in one native call: gptkit.decoding.fused drives it.
//
// For B rows of one new token each (any number: kernels.h passes more than 8 over each tile of weights in slices),
// at their own cache positions: embeddings, then per block the norm, the fused q/k/v product, rotary positions, the
// keys and values written into the cache, attention over each row's cached positions, the output projection and
// residual, the norm, the MLP (GELU, GELU tanh, ReLU or SwiGLU) and residual; then the final norm and the LM head.
// Weights may be fp32, bf16, int8 or q4 (kernels.h) layer by layer; the cache fp32, bf16 or int8 (one fp32 scale
// per row, head and position, for keys and values alike). Activations stay fp32 between the products.
//
// Served LoRA adapters (low_rank.h) add each row's own adapter's update to the block layers it adapts.
//
// The step runs in one OpenMP region: every product is split into contiguous ranges of output rows, one per thread,
// and threads meet at a barrier where the next stage reads what the last one wrote. That is the whole saving over
// the eager step: no operator dispatch, no tensor allocation, no return to Python between operators.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "kernels.h"
#include "low_rank.h"

namespace {

enum Norm : int64_t { kLayerNorm = 0, kRmsNorm = 1 };
enum Position : int64_t { kLearned = 0, kRope = 1, kNoPosition = 2 };
enum Cache : int64_t { kCacheF32 = 0, kCacheBF16 = 1, kCacheI8 = 2 };

// The order of DecodeStep's integer settings (gptkit/decoding/fused.py writes them in this order).
enum Setting : int64_t {
  kLayers, kWidth, kHeads, kKvHeads, kHeadDim, kHidden, kVocab, kNorm, kActivation, kPosition, kLogitsBF16, kSettings
};

// The block layers an adapter may update, numbered layer * kAdapted + which (gptkit.decoding.fused's order).
enum Adapted : int64_t { kQkv, kProj, kFc, kDown, kAdapted };

struct Layer {
  const float *norm1_w, *norm1_b, *norm2_w, *norm2_b;
  gk::Weight qkv, proj, fc, down;
};

struct CacheView {  // one layer's keys or values: element (b, g, s, i) at data + b * sb + g * sg + s * ss + i
  void* data;
  const float* scales;  // int8: (b, g, s) at b * scb + g * scg + s * scs
  int64_t sb, sg, ss, scb, scg, scs;
};

class DecodeStep : public torch::CustomClassHolder {
 public:
  DecodeStep(std::vector<int64_t> settings, std::vector<double> numbers, std::vector<at::Tensor> tensors) {
    TORCH_CHECK(settings.size() == kSettings && numbers.size() == 2, "DecodeStep: settings of another gptkit");
    L_ = settings[kLayers], D_ = settings[kWidth], H_ = settings[kHeads], KV_ = settings[kKvHeads];
    HD_ = settings[kHeadDim], F_ = settings[kHidden], V_ = settings[kVocab];
    norm_ = settings[kNorm], act_ = settings[kActivation], position_ = settings[kPosition];
    logits_bf16_ = settings[kLogitsBF16] != 0;
    eps_ = float(numbers[0]);
    rope_theta_ = float(numbers[1]);
    TORCH_CHECK(int64_t(tensors.size()) == 2 + 16 * L_ + 5, "DecodeStep: ", tensors.size(), " tensors for ", L_,
                " layers");
    size_t i = 0;
    tok_emb_ = tensors[i++];
    pos_emb_ = tensors[i++];
    TORCH_CHECK(tok_emb_.is_contiguous() && tok_emb_.size(0) == V_ && tok_emb_.size(1) == D_,
                "DecodeStep: the token embedding must be a contiguous (vocab, width) matrix");
    for (int64_t l = 0; l < L_; ++l) {
      Layer layer;
      layer.norm1_w = vector(tensors[i++]);
      layer.norm1_b = vector(tensors[i++]);
      layer.qkv = weight(tensors, i, (H_ + 2 * KV_) * HD_, D_);
      layer.proj = weight(tensors, i, D_, H_ * HD_);
      layer.norm2_w = vector(tensors[i++]);
      layer.norm2_b = vector(tensors[i++]);
      layer.fc = weight(tensors, i, act_ == gk::kSwiglu ? 2 * F_ : F_, D_);
      layer.down = weight(tensors, i, D_, F_);
      layers_.push_back(layer);
    }
    normf_w_ = vector(tensors[i++]);
    normf_b_ = vector(tensors[i++]);
    head_ = weight(tensors, i, V_, D_);
    max_k_ = std::max({D_, F_, H_ * HD_});
    TORCH_CHECK(HD_ <= 512 && HD_ % 2 == 0 && H_ % KV_ == 0, "DecodeStep: heads of up to 512 values expected");
  }

  at::Tensor step(const at::Tensor& tokens, const at::Tensor& positions, std::vector<at::Tensor> keys,
                  std::vector<at::Tensor> values, std::vector<at::Tensor> key_scales,
                  std::vector<at::Tensor> value_scales, const at::Tensor& adapters) {
    const int64_t B = tokens.numel();
    TORCH_CHECK(B >= 1 && positions.numel() == B, "DecodeStep: tokens with one position each expected");
    TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && tokens.is_contiguous() &&
                    positions.is_contiguous(),
                "DecodeStep: int64 tokens and positions expected");
    TORCH_CHECK(int64_t(keys.size()) == L_ && int64_t(values.size()) == L_, "DecodeStep: a cache of ", L_, " layers");
    const bool scaled = !key_scales.empty();
    const int64_t cache = keys[0].scalar_type() == at::kFloat ? kCacheF32
                          : keys[0].scalar_type() == at::kBFloat16 ? kCacheBF16
                                                                   : kCacheI8;
    TORCH_CHECK(cache != kCacheI8 || (keys[0].scalar_type() == at::kChar && scaled),
                "DecodeStep: an int8 cache needs its scales");
    const int64_t capacity = keys[0].size(2);
    TORCH_CHECK(keys[0].size(0) >= B && keys[0].size(1) == KV_ && keys[0].size(3) == HD_,
                "DecodeStep: the cache does not fit this model and batch");
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(tok[b] >= 0 && tok[b] < V_, "DecodeStep: token id ", tok[b], " outside the vocabulary");
      TORCH_CHECK(pos[b] >= 0 && pos[b] < capacity, "DecodeStep: position ", pos[b], " outside the cache");
      TORCH_CHECK(position_ != kLearned || pos[b] < pos_emb_.size(0), "DecodeStep: position past block_size");
      longest = std::max(longest, pos[b] + 1);
    }
    std::vector<CacheView> kv(2 * L_);
    for (int64_t l = 0; l < L_; ++l) {
      kv[l] = view(keys[l], scaled ? &key_scales[l] : nullptr, cache);
      kv[L_ + l] = view(values[l], scaled ? &value_scales[l] : nullptr, cache);
    }
    choose_adapters(adapters, B);
    const int T = at::get_num_threads();
    reserve(B, T, longest);
    if (position_ == kRope) rope_angles(pos, B);

    at::Tensor logits = at::empty({B, V_}, tokens.options().dtype(at::kFloat));
    float* out = logits.data_ptr<float>();
    // The positions of every row's attention: threads split (row, head) pairs.
#pragma omp parallel num_threads(T)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp for
      for (int64_t b = 0; b < B; ++b) embed(b, tok[b], pos[b]);
      for (int64_t l = 0; l < L_; ++l) block(l, B, kv, cache, pos, t, nt);
#pragma omp for
      for (int64_t b = 0; b < B; ++b) {
        normalize(x_.data() + b * D_, h_.data() + b * D_, normf_w_, normf_b_);
        prepare(head_, h_.data(), b);
      }
      product(head_, input(h_.data()), B, out, V_, false, t, nt, -1);
    }
    return logits_bf16_ ? logits.to(at::kBFloat16) : logits;
  }

  // Adapter `slot` (1, 2, ...): for each block layer in Adapted order, its A and B (fp32; both empty where the
  // adapter leaves the layer alone) and its scale (alpha / rank).
  void set_adapter(int64_t slot, std::vector<at::Tensor> tensors, std::vector<double> scales) {
    TORCH_CHECK(slot >= 1 && int64_t(tensors.size()) == 2 * kAdapted * L_ &&
                    int64_t(scales.size()) == kAdapted * L_,
                "DecodeStep: an adapter number from 1, an A and a B and a scale per block layer expected");
    std::vector<lowrank::Update> updates(kAdapted * L_);
    auto& kept = adapter_keep_[slot];
    kept.clear();
    for (int64_t i = 0; i < kAdapted * L_; ++i) {
      const at::Tensor &a = tensors[2 * i], &b = tensors[2 * i + 1];
      if (a.numel() == 0 && b.numel() == 0) continue;
      const Layer& layer = layers_[i / kAdapted];
      const gk::Weight& w = i % kAdapted == kQkv    ? layer.qkv
                            : i % kAdapted == kProj ? layer.proj
                            : i % kAdapted == kFc   ? layer.fc
                                                    : layer.down;
      TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                      b.is_contiguous() && a.dim() == 2 && b.dim() == 2 && a.size(1) == w.K && b.size(0) == w.N &&
                      a.size(0) == b.size(1) && a.size(0) >= 1,
                  "DecodeStep: an adapter's A (rank, in) and B (out, rank) must be contiguous fp32 for its layer");
      kept.push_back(a);
      kept.push_back(b);
      updates[i] = {a.data_ptr<float>(), b.data_ptr<float>(), a.size(0), float(scales[i])};
    }
    adapters_.set(slot, std::move(updates));
  }

 private:
  // ----- building -----

  const float* vector(const at::Tensor& t) {  // a norm gain or bias as fp32 (none: nullptr)
    if (!t.defined() || t.numel() == 0) return nullptr;
    keep_.push_back(t.to(at::kFloat).contiguous());
    return keep_.back().data_ptr<float>();
  }

  // The (N, K) product of one linear layer; a q4 one is held in groups of 8 rows (kernels.h).
  gk::Weight weight(const std::vector<at::Tensor>& tensors, size_t& i, int64_t N, int64_t K) {
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
    keep_.push_back(w);
    if (w.scalar_type() == at::kFloat) {
      out.format = gk::kF32;
    } else if (w.scalar_type() == at::kBFloat16) {
      out.format = gk::kBF16;
    } else if (w.scalar_type() == at::kChar) {
      out.format = gk::kI8;
      TORCH_CHECK(scales.numel() == out.N, "DecodeStep: int8 weights need one scale per row");
      keep_.push_back(scales.to(at::kFloat).contiguous());
      out.scales = keep_.back().data_ptr<float>();
    } else {
      const int64_t groups = (N + gk::kQ4Group - 1) / gk::kQ4Group;
      TORCH_CHECK(w.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
                  "DecodeStep: unknown weight format ", w.scalar_type());
      TORCH_CHECK(K % gk::kQ4Block == 0 && w.numel() == groups * (K / gk::kQ4Block) * gk::kQ4GroupBytes &&
                      scales.numel() == groups * (K / gk::kQ4Block) * gk::kQ4Group,
                  "DecodeStep: q4 weights must be groups of 8 rows with a scale per block");
      out.format = gk::kQ4;
      keep_.push_back(scales);
      out.scales = scales.data_ptr();
    }
    out.bias = vector(bias);
    return out;
  }

  static CacheView view(const at::Tensor& t, const at::Tensor* scales, int64_t cache) {
    TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "DecodeStep: cache tensors (B, KV, S, head_dim) expected");
    CacheView v{t.data_ptr(), nullptr, t.stride(0), t.stride(1), t.stride(2), 0, 0, 0};
    if (cache == kCacheI8) {
      TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->dim() == 3, "DecodeStep: fp32 cache scales expected");
      v.scales = scales->data_ptr<float>();
      v.scb = scales->stride(0), v.scg = scales->stride(1), v.scs = scales->stride(2);
    }
    return v;
  }

  void reserve(int64_t B, int T, int64_t longest) {
    const size_t rows = size_t(B);
    if (x_.size() < rows * D_) {
      x_.resize(rows * D_);
      h_.resize(rows * D_);
      qkv_.resize(rows * qkv_width());
      att_.resize(rows * H_ * HD_);
      up_.resize(rows * 2 * F_);
      ff_.resize(rows * F_);
      xb_.resize(rows * max_k_);
      xq_.resize(rows * max_k_);
      dx_.resize(rows * (max_k_ / gk::kQ4Block + 1));
      dsum_.resize(rows * (max_k_ / gk::kQ4Block + 1));
      rope_.resize(rows * HD_);
    }
    if (scores_.size() < size_t(T) * (longest + HD_)) scores_.resize(size_t(T) * (longest + HD_) * 2);
    scores_stride_ = scores_.size() / T;
  }

  int64_t qkv_width() const { return (H_ + 2 * KV_) * HD_; }

  // ----- the stages -----

  // Block l for rows 0..B-1, called by every thread of step()'s parallel region (its worksharing loops and
  // barriers bind to that region).
  void block(int64_t l, int64_t B, const std::vector<CacheView>& kv, int64_t cache, const int64_t* pos, int t,
             int nt) {
    const Layer& layer = layers_[l];
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      normalize(x_.data() + b * D_, h_.data() + b * D_, layer.norm1_w, layer.norm1_b);
      prepare(layer.qkv, h_.data(), b);
      adapters_.down(l * kAdapted + kQkv, h_.data(), D_, b);
    }
    product(layer.qkv, input(h_.data()), B, qkv_.data(), qkv_width(), false, t, nt, l * kAdapted + kQkv);
#pragma omp barrier
#pragma omp for collapse(2)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV_; ++g) store(kv[l], kv[L_ + l], cache, b, g, pos[b]);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = 0; hh < H_; ++hh) attend(kv[l], kv[L_ + l], cache, b, hh, pos[b], t);
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      prepare(layer.proj, att_.data(), b);
      adapters_.down(l * kAdapted + kProj, att_.data(), H_ * HD_, b);
    }
    product(layer.proj, input(att_.data()), B, x_.data(), D_, true, t, nt, l * kAdapted + kProj);
#pragma omp barrier
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      normalize(x_.data() + b * D_, h_.data() + b * D_, layer.norm2_w, layer.norm2_b);
      prepare(layer.fc, h_.data(), b);
      adapters_.down(l * kAdapted + kFc, h_.data(), D_, b);
    }
    mlp_up(layer.fc, B, t, nt, l * kAdapted + kFc);
#pragma omp barrier
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      prepare(layer.down, ff_.data(), b);
      adapters_.down(l * kAdapted + kDown, ff_.data(), F_, b);
    }
    product(layer.down, input(ff_.data()), B, x_.data(), D_, true, t, nt, l * kAdapted + kDown);
#pragma omp barrier
  }

  void embed(int64_t b, int64_t token, int64_t position) {
    float* x = x_.data() + b * D_;
    for (int64_t i = 0; i < D_; ++i) x[i] = element(tok_emb_, token * D_ + i);
    if (position_ == kLearned)
      for (int64_t i = 0; i < D_; ++i) x[i] += element(pos_emb_, position * D_ + i);
  }

  static float element(const at::Tensor& t, int64_t i) {
    if (t.scalar_type() == at::kFloat) return static_cast<const float*>(t.data_ptr())[i];
    return gk::bf16_to_float(static_cast<const gk::bf16*>(t.data_ptr())[i]);
  }

  void normalize(const float* x, float* y, const float* w, const float* bias) const {
    if (norm_ == kLayerNorm) {
      float mean = 0.0f;
      for (int64_t i = 0; i < D_; ++i) mean += x[i];
      mean /= float(D_);
      float var = 0.0f;
      for (int64_t i = 0; i < D_; ++i) var += (x[i] - mean) * (x[i] - mean);
      const float inv = 1.0f / std::sqrt(var / float(D_) + eps_);
      for (int64_t i = 0; i < D_; ++i) y[i] = (x[i] - mean) * inv * w[i] + (bias ? bias[i] : 0.0f);
    } else {
      float squares = 0.0f;
      for (int64_t i = 0; i < D_; ++i) squares += x[i] * x[i];
      const float inv = 1.0f / std::sqrt(squares / float(D_) + eps_);
      for (int64_t i = 0; i < D_; ++i) y[i] = w[i] * (x[i] * inv);
    }
  }

  // Row b of x (K values of the weight's input width) in the form w's product reads.
  void prepare(const gk::Weight& w, const float* x, int64_t b) {
    const int64_t K = w.K;
    if (w.format == gk::kBF16) {
#if defined(__AVX512BF16__)
      gk::to_bf16(x + b * K, xb_.data() + b * K, K);
#endif
    } else if (gk::rounds_activations(w)) {
      const int64_t blocks = K / gk::kQ4Block;
      gk::to_q8(x + b * K, xq_.data() + b * K, dx_.data() + b * blocks, dsum_.data() + b * blocks, K);
    }
  }

  gk::Input input(const float* x) const {
    gk::Input in;
    in.x = x;
    in.xb = xb_.data();
    in.q8 = {xq_.data(), dx_.data(), dsum_.data()};
    return in;
  }

  // y[b, n] (= or +=) w[n] . x[b] for this thread's rows n, plus each row's adapter's update of layer `adapted`
  void product(const gk::Weight& w, const gk::Input& in, int64_t B, float* y, int64_t ldy, bool accumulate, int t,
               int nt, int64_t adapted) {
    int64_t lo, hi;
    gk::split(w.N, t, nt, 16, &lo, &hi);
    gk::product_range(w, in, B, y, ldy, lo, hi, accumulate);
    adapters_.up(adapted, B, y, ldy, lo, hi);
  }

  // ff = act(h W_fc + b) over this thread's hidden units; SwiGLU's fc holds the gate rows, then the up rows.
  void mlp_up(const gk::Weight& fc, int64_t B, int t, int nt, int64_t adapted) {
    const gk::Input in = input(h_.data());
    int64_t lo, hi;
    gk::split(F_, t, nt, 16, &lo, &hi);
    if (act_ == gk::kSwiglu) {
      float* raw = up_.data();  // (B, 2F): gate then up
      gk::product_range(fc, in, B, raw, 2 * F_, lo, hi);
      gk::product_range(fc, in, B, raw, 2 * F_, F_ + lo, F_ + hi);  // the up rows land after the gate rows
      adapters_.up(adapted, B, raw, 2 * F_, lo, hi);
      adapters_.up(adapted, B, raw, 2 * F_, F_ + lo, F_ + hi);
      for (int64_t b = 0; b < B; ++b)
        gk::swiglu(raw + b * 2 * F_ + lo, raw + b * 2 * F_ + F_ + lo, ff_.data() + b * F_ + lo, hi - lo);
      return;
    }
    gk::product_range(fc, in, B, ff_.data(), F_, lo, hi);
    adapters_.up(adapted, B, ff_.data(), F_, lo, hi);
    for (int64_t b = 0; b < B; ++b) gk::activate(ff_.data() + b * F_ + lo, hi - lo, act_);
  }

  // ----- served adapters -----

  void choose_adapters(const at::Tensor& adapters, int64_t B) {
    if (adapters.numel() == 0) return adapters_.choose(nullptr, B);
    TORCH_CHECK(adapters.scalar_type() == at::kLong && adapters.is_contiguous() && adapters.numel() == B,
                "DecodeStep: one int64 adapter number per row expected");
    const int64_t* slots = adapters.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(slots[b] == 0 || adapters_.has(slots[b]), "DecodeStep: adapter ", slots[b], " was not added");
    adapters_.choose(slots, B);
  }

  void rope_angles(const int64_t* pos, int64_t B) {
    const int64_t half = HD_ / 2;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < half; ++i) {
        // as gptkit.model.rope_cos_sin: inv_freq = 1 / theta^(2i / d) and the angle in fp32
        const float inv_freq = 1.0f / std::pow(rope_theta_, float(2 * i) / float(HD_));
        const float angle = float(pos[b]) * inv_freq;
        rope_[b * HD_ + i] = std::cos(angle);
        rope_[b * HD_ + half + i] = std::sin(angle);
      }
    }
  }

  void rotate(float* v, int64_t b) const {  // (v_i, v_{i + d/2}) rotated by row b's angle i
    const int64_t half = HD_ / 2;
    const float* c = rope_.data() + b * HD_;
    const float* s = c + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], z = v[i + half];
      v[i] = a * c[i] - z * s[i];
      v[i + half] = z * c[i] + a * s[i];
    }
  }

  // Key and value head g of row b into the cache at position p (the key rotated first).
  void store(const CacheView& keys, const CacheView& values, int64_t cache, int64_t b, int64_t g, int64_t p) {
    float k[512];
    const float* qkv = qkv_.data() + b * qkv_width();
    std::copy(qkv + (H_ + g) * HD_, qkv + (H_ + g + 1) * HD_, k);
    if (position_ == kRope) rotate(k, b);
    write(keys, cache, b, g, p, k);
    write(values, cache, b, g, p, qkv + (H_ + KV_ + g) * HD_);
  }

  void write(const CacheView& c, int64_t cache, int64_t b, int64_t g, int64_t p, const float* v) const {
    const int64_t at = b * c.sb + g * c.sg + p * c.ss;
    if (cache == kCacheF32) {
      std::copy(v, v + HD_, static_cast<float*>(c.data) + at);
    } else if (cache == kCacheBF16) {
      gk::bf16* dst = static_cast<gk::bf16*>(c.data) + at;
      for (int64_t i = 0; i < HD_; ++i) dst[i] = gk::float_to_bf16(v[i]);
    } else {  // as gptkit.kv_cache quantises: scale = max|v| / 127, q = round(v / scale)
      float amax = 0.0f;
      for (int64_t i = 0; i < HD_; ++i) amax = std::fmax(amax, std::fabs(v[i]));
      const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* dst = static_cast<int8_t*>(c.data) + at;
      for (int64_t i = 0; i < HD_; ++i) dst[i] = int8_t(std::nearbyint(v[i] * inv));
      const_cast<float*>(c.scales)[b * c.scb + g * c.scg + p * c.scs] = scale;
    }
  }

  // Attention of query head hh of row b over its positions 0..p (softmax(q k / sqrt(d)) v) into att_.
  void attend(const CacheView& keys, const CacheView& values, int64_t cache, int64_t b, int64_t hh, int64_t p,
              int t) {
    float q[512];
    const float* src = qkv_.data() + b * qkv_width() + hh * HD_;
    std::copy(src, src + HD_, q);
    if (position_ == kRope) rotate(q, b);
    const int64_t g = hh / (H_ / KV_), S = p + 1;
    const float scale = 1.0f / std::sqrt(float(HD_));
    float* scores = scores_.data() + size_t(t) * scores_stride_;
    float* row = scores + S;  // one dequantised key or value row
    for (int64_t s = 0; s < S; ++s) scores[s] = gk::dot(q, cached(keys, cache, b, g, s, row), HD_) * scale;
    float top = -INFINITY;
    for (int64_t s = 0; s < S; ++s) top = std::fmax(top, scores[s]);
    int64_t s = 0;
    gk::V total = gk::vzero();
    for (; s + gk::kLanes <= S; s += gk::kLanes) {
      const gk::V e = gk::vexp(gk::vsub(gk::vload(scores + s), gk::vset(top)));
      gk::vstore(scores + s, e);
      total = gk::vadd(total, e);
    }
    float sum = gk::vsum(total);
    for (; s < S; ++s) {
      scores[s] = std::exp(scores[s] - top);
      sum += scores[s];
    }
    float* out = att_.data() + b * H_ * HD_ + hh * HD_;
    std::fill(out, out + HD_, 0.0f);
    for (int64_t j = 0; j < S; ++j) gk::axpy(scores[j], cached(values, cache, b, g, j, row), out, HD_);
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < HD_; ++i) out[i] *= inv;
  }

  // Cached row (b, g, s) as fp32: the cache itself when it is fp32, else converted into buffer.
  const float* cached(const CacheView& c, int64_t cache, int64_t b, int64_t g, int64_t s, float* buffer) const {
    const int64_t at = b * c.sb + g * c.sg + s * c.ss;
    if (cache == kCacheF32) return static_cast<const float*>(c.data) + at;
    if (cache == kCacheBF16) {
      const gk::bf16* v = static_cast<const gk::bf16*>(c.data) + at;
      for (int64_t i = 0; i < HD_; ++i) buffer[i] = gk::bf16_to_float(v[i]);
    } else {
      const int8_t* v = static_cast<const int8_t*>(c.data) + at;
      const float scale = c.scales[b * c.scb + g * c.scg + s * c.scs];
      for (int64_t i = 0; i < HD_; ++i) buffer[i] = float(v[i]) * scale;
    }
    return buffer;
  }

  int64_t L_, D_, H_, KV_, HD_, F_, V_, norm_, act_, position_, max_k_;
  bool logits_bf16_;
  float eps_, rope_theta_;
  at::Tensor tok_emb_, pos_emb_;
  std::vector<Layer> layers_;
  const float *normf_w_, *normf_b_;
  gk::Weight head_;
  std::vector<at::Tensor> keep_;  // every tensor the raw pointers above point into
  std::vector<float> x_, h_, qkv_, att_, up_, ff_, dx_, rope_, scores_;
  std::vector<gk::bf16> xb_;
  std::vector<int8_t> xq_;
  std::vector<float> dsum_;
  size_t scores_stride_ = 0;
  lowrank::Adapters adapters_;
  std::map<int64_t, std::vector<at::Tensor>> adapter_keep_;  // the tensors each adapter's pointers point into
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptkit, m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<std::vector<int64_t>, std::vector<double>, std::vector<at::Tensor>>())
      .def("step", &DecodeStep::step)
      .def("set_adapter", &DecodeStep::set_adapter);
}
