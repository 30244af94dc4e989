// One decode step of a whole GPT in one native call: gptkit.decoding.fused drives it.
//
// For B rows of one new token each (any number: kernels.h passes more than 8 over each tile of weights in slices),
// at their own cache positions, each in its cache row (several may share one at distinct positions): embeddings
// (scaled), then per block the norm, the fused q/k/v product, q/k norms, rotary positions (each layer its own
// frequencies, partial or none), the keys and values written into the cache, attention over each row's cached
// positions (a sliding-window layer's ring: slot = position mod its size), the output projection and residual, the
// norm, the MLP (GELU, GELU tanh, ReLU, SwiGLU or GeGLU) and residual; then the final norm and the LM head (scaled,
// soft-capped). Norms sit before each sublayer, around it (sandwich) or after it
// (sublayer_post); a sublayer's output may be scaled before its residual add, and both may read the same input
// (parallel residual).
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
#include "moe_step.h"
#include "weights.h"
#include "kv_rows.h"
#include "step_layout.h"
#include "step_parts.h"

namespace {

using kvrows::CacheView;
using namespace layout;

class DecodeStep : public torch::CustomClassHolder {
 public:
  DecodeStep(std::vector<int64_t> settings, std::vector<double> numbers, std::vector<at::Tensor> tensors) {
    TORCH_CHECK(settings.size() >= kSettings && numbers.size() == kNumbers, "DecodeStep: settings of another gptkit");
    L_ = settings[kLayers], D_ = settings[kWidth], H_ = settings[kHeads], KV_ = settings[kKvHeads];
    HD_ = settings[kHeadDim], F_ = settings[kHidden], V_ = settings[kVocab];
    norm_ = settings[kNorm], act_ = settings[kActivation], position_ = settings[kPosition];
    logits_bf16_ = settings[kLogitsBF16] != 0;
    norm_position_ = settings[kNormPosition], parallel_ = settings[kParallel] != 0;
    qk_norm_ = settings[kQkNormKind], rotary_ = settings[kRotaryDim];
    eps_ = float(numbers[kEps]), embedding_scale_ = float(numbers[kEmbeddingScale]);
    residual_scale_ = float(numbers[kResidualScale]), attn_scale_ = float(numbers[kAttnScale]);
    attn_softcap_ = float(numbers[kAttnSoftcap]), logit_scale_ = float(numbers[kLogitScale]);
    logit_softcap_ = float(numbers[kLogitSoftcap]);
    // The residual add straight from the products (accumulate) where nothing comes between: pre-norm, unscaled.
    direct_ = norm_position_ == kPre && residual_scale_ == 1.0f;
    TORCH_CHECK(int64_t(settings.size()) == kSettings + 3 * L_,
                "DecodeStep: a window, a hidden size and a kind of feed-forward per layer expected");
    const int64_t* moe = settings.data() + kSettings + 2 * L_;
    const int64_t moe_layers = std::count(moe, moe + L_, 1);
    TORCH_CHECK(int64_t(tensors.size()) == 2 + kLayerTensors * L_ + 7 + kMoeTensors * moe_layers, "DecodeStep: ",
                tensors.size(), " tensors for ", L_, " layers");
    experts_.configure(settings[kExperts], settings[kExpertsPerToken], settings[kRenormalize] != 0,
                       settings[kExpertHidden], act_, D_, logits_bf16_);
    size_t i = 0;
    tok_emb_ = tensors[i++];
    pos_emb_ = tensors[i++];
    TORCH_CHECK(tok_emb_.is_contiguous() && tok_emb_.size(0) == V_ && tok_emb_.size(1) == D_,
                "DecodeStep: the token embedding must be a contiguous (vocab, width) matrix");
    for (int64_t l = 0; l < L_; ++l) {
      Layer layer{};  // no RoPE until rope_tables says otherwise
      layer.norm1_w = weights::vector(tensors[i++], keep_);
      layer.norm1_b = weights::vector(tensors[i++], keep_);
      layer.qkv = weights::weight(tensors, i, (H_ + 2 * KV_) * HD_, D_, keep_);
      layer.proj = weights::weight(tensors, i, D_, H_ * HD_, keep_);
      layer.norm2_w = weights::vector(tensors[i++], keep_);
      layer.norm2_b = weights::vector(tensors[i++], keep_);
      layer.hidden = settings[kSettings + L_ + l];
      layer.moe = moe[l] != 0;
      if (layer.hidden) {
        layer.fc = weights::weight(tensors, i, gated() ? 2 * layer.hidden : layer.hidden, D_, keep_);
        layer.down = weights::weight(tensors, i, D_, layer.hidden, keep_);
      } else {
        i += 6;  // a MoE layer without a shared expert
      }
      layer.post1_w = weights::vector(tensors[i++], keep_);
      layer.post1_b = weights::vector(tensors[i++], keep_);
      layer.post2_w = weights::vector(tensors[i++], keep_);
      layer.post2_b = weights::vector(tensors[i++], keep_);
      layer.q_norm = weights::vector(tensors[i++], keep_);
      layer.k_norm = weights::vector(tensors[i++], keep_);
      layer.window = settings[kSettings + l];
      layers_.push_back(layer);
    }
    normf_w_ = weights::vector(tensors[i++], keep_);
    normf_b_ = weights::vector(tensors[i++], keep_);
    head_ = weights::weight(tensors, i, V_, D_, keep_);
    if (position_ == kRope) rope_tables(layers_, tensors[i], tensors[i + 1], rotary_, keep_);
    i += 2;
    max_hidden_ = 0;
    for (Layer& layer : layers_) {
      max_hidden_ = std::max(max_hidden_, layer.hidden);
      if (layer.moe) layer.experts = experts_.layer_weights(tensors, i, keep_);
    }
    max_k_ = std::max({D_, max_hidden_, H_ * HD_});
    TORCH_CHECK(HD_ <= 512 && rotary_ <= HD_ && rotary_ % 2 == 0 && H_ % KV_ == 0,
                "DecodeStep: heads of up to 512 values and an even rotary width expected");
  }

  // slots: each row's cache row (int64, one per row), or empty for row b's own. Several rows may share one cache
  // row at distinct positions (a proposal checked beside its request's own token, p, p + 1, ...): every row's keys
  // and values are stored before any row attends, and a row attends only up to its own position. shared: each row's
  // shared prefix, a cache row and a length (int64 pairs; empty: none), whose positions below that length the row
  // reads there instead of in its own cache row (kvrows::shared_prefixes).
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& positions, std::vector<at::Tensor> keys,
                  std::vector<at::Tensor> values, std::vector<at::Tensor> key_scales,
                  std::vector<at::Tensor> value_scales, const at::Tensor& adapters, const at::Tensor& slots,
                  const at::Tensor& shared) {
    const int64_t B = tokens.numel();
    TORCH_CHECK(B >= 1 && positions.numel() == B, "DecodeStep: tokens with one position each expected");
    TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && tokens.is_contiguous() &&
                    positions.is_contiguous(),
                "DecodeStep: int64 tokens and positions expected");
    TORCH_CHECK(int64_t(keys.size()) == L_ && int64_t(values.size()) == L_, "DecodeStep: a cache of ", L_, " layers");
    const int64_t cache = kvrows::kind(keys[0], !key_scales.empty());
    TORCH_CHECK(keys[0].size(1) == KV_ && keys[0].size(3) == HD_, "DecodeStep: the cache does not fit this model");
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(tok[b] >= 0 && tok[b] < V_, "DecodeStep: token id ", tok[b], " outside the vocabulary");
      TORCH_CHECK(pos[b] >= 0, "DecodeStep: negative position ", pos[b]);
      TORCH_CHECK(position_ != kLearned || pos[b] < pos_emb_.size(0), "DecodeStep: position past block_size");
      longest = std::max(longest, pos[b] + 1);
    }
    const int64_t shared_end = kvrows::cache_rows(slots, pos, B, keys[0].size(0), rows_);
    bool rings = false;
    for (const Layer& layer : layers_) rings = rings || layer.window > 0;
    kvrows::shared_prefixes(shared, pos, rows_, keys[0].size(0), rings, prefix_rows_, prefix_lens_);
    std::vector<CacheView> kv(2 * L_);
    for (int64_t l = 0; l < L_; ++l) {
      kvrows::check_slots(keys[l].size(2), layers_[l].window, longest, l);
      kvrows::check_shared(keys[l].size(2), shared_end, l);
      kv[l] = kvrows::view(keys[l], key_scales.empty() ? nullptr : &key_scales[l], cache);
      kv[L_ + l] = kvrows::view(values[l], value_scales.empty() ? nullptr : &value_scales[l], cache);
    }
    choose_adapters(adapters, B);
    const int T = at::get_num_threads();
    reserve(B, T, longest);

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
        staging_.prepare(head_, h_.data(), b);
      }
      product(head_, staging_.input(h_.data()), B, out, V_, false, t, nt, -1);
      if (logit_scale_ != 1.0f || logit_softcap_ > 0.0f) {
#pragma omp barrier
#pragma omp for
        for (int64_t b = 0; b < B; ++b) parts::scale_and_cap(out + b * V_, V_, logit_scale_, logit_softcap_);
      }
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
      updates[i] = lowrank::update(a, b, w, float(scales[i]), kept);
    }
    adapters_.set(slot, std::move(updates));
  }

 private:
  // ----- building -----

  void reserve(int64_t B, int T, int64_t longest) {
    const size_t rows = size_t(B);
    if (x_.size() < rows * D_) {
      x_.resize(rows * D_);
      h_.resize(rows * D_);
      qkv_.resize(rows * qkv_width());
      att_.resize(rows * H_ * HD_);
      up_.resize(rows * 2 * max_hidden_);
      ff_.resize(rows * max_hidden_);
      moe_out_.resize(rows * D_);
      shared_.resize(rows * D_);
      staging_.resize(B, max_k_);
      rope_.resize(rows * HD_);
      if (parallel_) h2_.resize(rows * D_);
    }
    experts_.reserve(B);
    if (scores_.size() < size_t(T) * (longest + HD_)) scores_.resize(size_t(T) * (longest + HD_) * 2);
    scores_stride_ = scores_.size() / T;
  }

  int64_t qkv_width() const { return (H_ + 2 * KV_) * HD_; }

  // ----- the stages -----

  bool gated() const { return act_ == gk::kSwiglu || act_ == kGeglu; }

  // Block l for rows 0..B-1, called by every thread of step()'s parallel region (its worksharing loops and
  // barriers bind to that region).
  void block(int64_t l, int64_t B, const std::vector<CacheView>& kv, int64_t cache, const int64_t* pos, int t,
             int nt) {
    attention(l, B, kv, cache, pos, t, nt);
    feed_forward(l, B, t, nt);
  }

  // The attention sublayer of block l, its output in x (added) or in h (for residual_add).
  void attention(int64_t l, int64_t B, const std::vector<CacheView>& kv, int64_t cache, const int64_t* pos, int t,
                 int nt) {
    const Layer& layer = layers_[l];
    const bool angles = layer.inv_freq && (l == 0 || layers_[l - 1].rope_group != layer.rope_group ||
                                           !layers_[l - 1].inv_freq);
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      sublayer_input(x_.data() + b * D_, h_.data() + b * D_, layer.norm1_w, layer.norm1_b);
      if (parallel_) sublayer_input(x_.data() + b * D_, h2_.data() + b * D_, layer.norm2_w, layer.norm2_b);
      if (angles) parts::rope_angles(pos[b], layer.inv_freq, layer.rope_factor, rotary_, rope_.data() + b * HD_);
      staging_.prepare(layer.qkv, h_.data(), b);
      adapters_.down(l * kAdapted + kQkv, h_.data(), D_, b);
    }
    product(layer.qkv, staging_.input(h_.data()), B, qkv_.data(), qkv_width(), false, t, nt, l * kAdapted + kQkv);
#pragma omp barrier
    if (qk_norm_ != kNoQkNorm) {
#pragma omp for
      for (int64_t b = 0; b < B; ++b)
        parts::qk_norm(qkv_.data() + b * qkv_width(), H_, KV_, HD_, qk_norm_ == kQkWidth, layer.q_norm,
                       layer.k_norm, eps_);
    }
    // The loop's closing barrier (no nowait) is what lets rows share a cache row: every row's keys and values are
    // stored before any row attends.
#pragma omp for collapse(2)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV_; ++g) store(layer, kv[l], kv[L_ + l], cache, b, g, pos[b]);
    // Head by head, so that rows reading one shared prefix read each head's part of it while it is in cache (at
    // 32 rows sharing 1,085 positions of GPT-2 small, a step took about a tenth less than row by row).
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t hh = 0; hh < H_; ++hh)
      for (int64_t b = 0; b < B; ++b) attend(layer, kv[l], kv[L_ + l], cache, b, hh, pos[b], t);
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      staging_.prepare(layer.proj, att_.data(), b);
      adapters_.down(l * kAdapted + kProj, att_.data(), H_ * HD_, b);
    }
    // The attention's output goes to x (its residual add) or, to be normed or scaled first, to h.
    float* attn_out = direct_ ? x_.data() : h_.data();
    product(layer.proj, staging_.input(att_.data()), B, attn_out, D_, direct_, t, nt, l * kAdapted + kProj);
#pragma omp barrier
  }

  // The feed-forward sublayer of block l (after the attention's residual add, where it was left in h).
  void feed_forward(int64_t l, int64_t B, int t, int nt) {
    const Layer& layer = layers_[l];
    if (layer.moe) return moe_feed_forward(layer, B, t, nt);
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      feed_forward_input(layer, b);
      staging_.prepare(layer.fc, h_.data(), b);
      adapters_.down(l * kAdapted + kFc, h_.data(), D_, b);
    }
    mlp_up(layer.fc, layer.hidden, B, t, nt, l * kAdapted + kFc);
#pragma omp barrier
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      staging_.prepare(layer.down, ff_.data(), b);
      adapters_.down(l * kAdapted + kDown, ff_.data(), layer.hidden, b);
    }
    product(layer.down, staging_.input(ff_.data()), B, direct_ ? x_.data() : h_.data(), D_, direct_, t, nt,
            l * kAdapted + kDown);
#pragma omp barrier
    if (!direct_) {
#pragma omp for
      for (int64_t b = 0; b < B; ++b)
        residual_add(x_.data() + b * D_, h_.data() + b * D_, layer.norm2_w, layer.norm2_b, layer.post2_w,
                     layer.post2_b);
    }
  }

  // A mixture-of-experts feed-forward (moe_step.h): the routed experts' sum, plus the shared expert's output (times
  // its gate, where it has one), added to x as the dense MLP's output is.
  void moe_feed_forward(const Layer& layer, int64_t B, int t, int nt) {
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      feed_forward_input(layer, b);
      if (layer.hidden) staging_.prepare(layer.fc, h_.data(), b);
    }
    experts_.run(layer.experts, h_.data(), B, moe_out_.data(), t, nt);
    if (layer.hidden) {
      mlp_up(layer.fc, layer.hidden, B, t, nt, -1);
#pragma omp barrier
#pragma omp for
      for (int64_t b = 0; b < B; ++b) staging_.prepare(layer.down, ff_.data(), b);
      product(layer.down, staging_.input(ff_.data()), B, shared_.data(), D_, false, t, nt, -1);
#pragma omp barrier
    }
#pragma omp for
    for (int64_t b = 0; b < B; ++b) {
      float *out = moe_out_.data() + b * D_, *x = x_.data() + b * D_;
      const float* shared = shared_.data() + b * D_;
      const float gate = layer.experts.gate.N ? experts_.gates()[b] : 1.0f;
      if (layer.hidden)
        for (int64_t i = 0; i < D_; ++i) out[i] += gate * shared[i];
      if (direct_) {
        for (int64_t i = 0; i < D_; ++i) x[i] += out[i];
      } else {
        residual_add(x, out, layer.norm2_w, layer.norm2_b, layer.post2_w, layer.post2_b);
      }
    }
  }

  // Row b's feed-forward input in h (the attention's output added to x first, where it was left in h).
  void feed_forward_input(const Layer& layer, int64_t b) {
    float *x = x_.data() + b * D_, *h = h_.data() + b * D_;
    if (!direct_) residual_add(x, h, layer.norm1_w, layer.norm1_b, layer.post1_w, layer.post1_b);
    if (parallel_)
      std::copy(h2_.data() + b * D_, h2_.data() + (b + 1) * D_, h);
    else
      sublayer_input(x, h, layer.norm2_w, layer.norm2_b);
  }

  // A sublayer's input from the residual stream x: its norm's output (pre, sandwich), or x itself (sublayer_post).
  void sublayer_input(const float* x, float* h, const float* w, const float* bias) const {
    if (norm_position_ == kSublayerPost)
      std::copy(x, x + D_, h);
    else
      normalize(x, h, w, bias);
  }

  // x += residual_scale * out, out first normed after the sublayer: by the block's norm (sublayer_post) or its
  // post-norm (sandwich). out is overwritten.
  void residual_add(float* x, float* out, const float* norm_w, const float* norm_b, const float* post_w,
                    const float* post_b) const {
    if (norm_position_ == kSublayerPost) normalize(out, out, norm_w, norm_b);
    if (norm_position_ == kSandwich) normalize(out, out, post_w, post_b);
    for (int64_t i = 0; i < D_; ++i) x[i] += residual_scale_ * out[i];
  }

  void embed(int64_t b, int64_t token, int64_t position) {
    float* x = x_.data() + b * D_;
    for (int64_t i = 0; i < D_; ++i) x[i] = element(tok_emb_, token * D_ + i) * embedding_scale_;
    if (position_ == kLearned)
      for (int64_t i = 0; i < D_; ++i) x[i] += element(pos_emb_, position * D_ + i);
  }

  static float element(const at::Tensor& t, int64_t i) {
    if (t.scalar_type() == at::kFloat) return static_cast<const float*>(t.data_ptr())[i];
    return gk::bf16_to_float(static_cast<const gk::bf16*>(t.data_ptr())[i]);
  }

  void normalize(const float* x, float* y, const float* w, const float* bias) const {
    if (norm_ == kLayerNorm)
      parts::layer_norm(x, y, D_, w, bias, eps_);
    else
      parts::rms_norm(x, y, D_, w, eps_);
  }

  // y[b, n] (= or +=) w[n] . x[b] for this thread's rows n, plus each row's adapter's update of layer `adapted`
  void product(const gk::Weight& w, const gk::Input& in, int64_t B, float* y, int64_t ldy, bool accumulate, int t,
               int nt, int64_t adapted) {
    int64_t lo, hi;
    gk::split(w.N, t, nt, 16, &lo, &hi);
    gk::product_range(w, in, B, y, ldy, lo, hi, accumulate);
    adapters_.up(adapted, B, y, ldy, lo, hi);
  }

  // ff = act(h W_fc + b) over this thread's hidden units; a gated activation's fc holds the gate rows, then the up
  // rows (SwiGLU: silu(gate) * up; GeGLU: gelu_tanh(gate) * up).
  void mlp_up(const gk::Weight& fc, int64_t F, int64_t B, int t, int nt, int64_t adapted) {
    const gk::Input in = staging_.input(h_.data());
    int64_t lo, hi;
    gk::split(F, t, nt, 16, &lo, &hi);
    if (gated()) {
      float* raw = up_.data();  // (B, 2F): gate then up
      gk::product_range(fc, in, B, raw, 2 * F, lo, hi);
      gk::product_range(fc, in, B, raw, 2 * F, F + lo, F + hi);  // the up rows land after the gate rows
      adapters_.up(adapted, B, raw, 2 * F, lo, hi);
      adapters_.up(adapted, B, raw, 2 * F, F + lo, F + hi);
      for (int64_t b = 0; b < B; ++b) {
        float* gate = raw + b * 2 * F + lo;
        moestep::activate(act_, gate, gate + F, ff_.data() + b * F + lo, hi - lo);
      }
      return;
    }
    gk::product_range(fc, in, B, ff_.data(), F, lo, hi);
    adapters_.up(adapted, B, ff_.data(), F, lo, hi);
    for (int64_t b = 0; b < B; ++b) gk::activate(ff_.data() + b * F + lo, hi - lo, act_);
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

  // Key and value head g of row b into its cache row at position p's slot (the key rotated first).
  void store(const Layer& layer, const CacheView& keys, const CacheView& values, int64_t cache, int64_t b, int64_t g,
             int64_t p) {
    float k[512];
    const float* qkv = qkv_.data() + b * qkv_width();
    std::copy(qkv + (H_ + g) * HD_, qkv + (H_ + g + 1) * HD_, k);
    if (layer.inv_freq) parts::rotate(k, rope_.data() + b * HD_, rotary_);
    kvrows::write(keys, cache, HD_, rows_[b], g, p % keys.slots, k);
    kvrows::write(values, cache, HD_, rows_[b], g, p % values.slots, qkv + (H_ + KV_ + g) * HD_);
  }

  // Attention of query head hh of row b over the keys its layer holds for position p (softmax(q k * scale) v) into
  // att_: positions 0..p, or a windowed layer's ring of its last W (once written, its first min(p + 1, W) slots).
  void attend(const Layer& layer, const CacheView& keys, const CacheView& values, int64_t cache, int64_t b,
              int64_t hh, int64_t p, int t) {
    float q[512];
    const float* src = qkv_.data() + b * qkv_width() + hh * HD_;
    std::copy(src, src + HD_, q);
    if (layer.inv_freq) parts::rotate(q, rope_.data() + b * HD_, rotary_);
    const int64_t g = hh / (H_ / KV_), S = std::min(p + 1, keys.slots);
    const float scale = attn_scale_ > 0.0f ? attn_scale_ : 1.0f / std::sqrt(float(HD_));
    float* scores = scores_.data() + size_t(t) * scores_stride_;
    kvrows::attend(q, keys, values, cache, HD_, rows_[b], g, S, prefix_rows_[b], prefix_lens_[b], scale,
                   attn_softcap_, scores, att_.data() + b * H_ * HD_ + hh * HD_);
  }

  int64_t L_, D_, H_, KV_, HD_, F_, V_, norm_, act_, position_, max_k_, max_hidden_, norm_position_, qk_norm_, rotary_;
  moestep::Experts experts_;
  bool logits_bf16_, parallel_, direct_;
  float eps_, embedding_scale_, residual_scale_, attn_scale_, attn_softcap_, logit_scale_, logit_softcap_;
  at::Tensor tok_emb_, pos_emb_;
  std::vector<Layer> layers_;
  const float *normf_w_, *normf_b_;
  gk::Weight head_;
  std::vector<at::Tensor> keep_;  // every tensor the raw pointers above point into
  std::vector<float> x_, h_, h2_, qkv_, att_, up_, ff_, rope_, scores_, moe_out_, shared_;
  std::vector<int64_t> rows_;  // each row's cache row (step's slots)
  std::vector<int64_t> prefix_rows_, prefix_lens_;  // each row's shared prefix (step's shared; length 0: none)
  gk::Staging staging_;  // the rows' activations as each product reads them
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
