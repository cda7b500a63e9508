// RMS norm, and queries/keys out of the fused qkv projection with per-head RMS norm and rotary, for
// float32 and bfloat16 tensors on CPU: small ops fused, because at small batches a step pays the fixed
// cost of each op more than its arithmetic.
//
// rms_norm: the reference (inferd/models/layers.py RMSNorm) is ~10 small ops per call (to float, pow,
// mean, add, rsqrt, mul, the weight to float, add 1, mul, back to the dtype); a Gemma 3 step calls it 6
// times per layer. Same arithmetic, same order per element, in float32, in one call:
//   n = x * (1 / sqrt(mean(x^2) + eps))
//   unit_offset (Gemma):  out = to_dtype(n * (1 + w))
//   otherwise (Llama):    out = w * to_dtype(n)        (the product in the dtype, as transformers does)
// Only the sum of squares is added up in a different order from torch's reduction (16 lanes), which
// moves the result by a rounding step at most.
//
// qk_norm_rope: the reference (inferd/models/llama.py Attention.forward) is a split, three views, two RMS
// norms and two rotaries of ~8 ops each, some 30 small ops per layer. Same arithmetic, rounding to the
// dtype where the reference's ops round:
//   n   = RMSNorm(x) as above                          (if norm weights are given)
//   out = to_dtype(to_dtype(n * c) + to_dtype(rotate_half(n) * s))   over the first `rot` dims
//   out = n                                                          over the rest (partial rotary)
// with c, s the cos/sin tables already in the dtype. In float32 every to_dtype is exact.
// Given the layer's K/V caches and the tokens' slots, it also writes each token's k and v (the projection's v
// columns) into its slot, rounded to the cache's dtype (qkv's, or bfloat16 under float32) as `write_kv`'s
// cast and index_copy_ do: a decode step's K/V write was four more ops per layer.
//
// add_rms_norm: a residual add between norms, x + norm1(h) and norm2 of that, in one call (a Gemma 3 layer's
// post-attention norm, add and pre-feedforward norm; its post-feedforward norm and add), or x + h and its norm
// (a Llama layer's add and post-attention norm). Rounded as the reference rounds: x' = to_dtype(x + n1), with
// n1 the norm's output in the dtype, then norm2(x') as rms_norm computes it.
//
// gated_act: act(gate) * up from the fused gate/up projection's rows, in one pass (the reference is a split,
// the activation and a multiply: torch's vectorised GELU-tanh takes ~1.6 ms for 512 x 2048 here, most of a
// prefill step's non-matmul time). Rounding as the reference's ops round: out = to_dtype(to_dtype(act(g)) * u).
// exp (and tanh through it) is our own polynomial so the loops vectorise (AVX-512 or AVX2 from
// -march=native); it is within ~2 ulp of libm's, so float32 results may differ from torch's in the last bit.
//
// argmax_update: one vocabulary tile of logits folded into a running argmax per row (inferd/models/lm_head.py):
// the tile's first maximal index replaces the best only when strictly greater, as torch.argmax over the
// full row resolves ties. One call per tile instead of a max, two comparisons and two selects. With a grammar's
// token bitmask (int32 words, bit j of word w: token 32w + j may come next, as xgrammar lays it out) only the
// allowed tokens compete: a word of zeros is skipped, a full word is a vector max, others are walked by bit. So
// a constrained greedy row keeps the tiled LM head and never needs its 262,144 logits masked in memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "fast_exp.h"

namespace {

inline float f(float v) { return v; }
inline float f(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }  // round to T and back

template <typename T>
float inv_rms(const T* x, int64_t d, float eps) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += f(x[i + l]) * f(x[i + l]);
  float sum = 0.f;
  for (; i < d; ++i) sum += f(x[i]) * f(x[i]);
  for (int l = 0; l < 16; ++l) sum += acc[l];
  return 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
}

// one row normalized, as floats already rounded to T (what the reference's norm hands on)
template <typename T>
inline void norm_row(const T* x, const T* w, float* n, int64_t d, float eps, bool unit_offset) {
  const float inv = inv_rms(x, d, eps);
  for (int64_t i = 0; i < d; ++i)
    n[i] = unit_offset ? rnd<T>((f(x[i]) * inv) * (1.f + f(w[i]))) : rnd<T>(f(w[i]) * rnd<T>(f(x[i]) * inv));
}

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t d, float eps, bool unit_offset) {
  // enough rows per task that a thread's share outweighs waking it
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> n(d);
    for (int64_t r = begin; r < end; ++r) {
      norm_row(x + r * d, w, n.data(), d, eps, unit_offset);
      for (int64_t i = 0; i < d; ++i) out[r * d + i] = static_cast<T>(n[i]);
    }
  });
}

template <typename T>
void one_head(const T* x, T* out, const T* w, bool unit_offset, float eps, const T* c, const T* s, int64_t d,
              int64_t rot, float* n) {
  if (w != nullptr) {
    norm_row(x, w, n, d, eps, unit_offset);
  } else {
    for (int64_t i = 0; i < d; ++i) n[i] = f(x[i]);
  }
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = static_cast<T>(rnd<T>(n[i] * f(c[i])) + rnd<T>(-n[i + half] * f(s[i])));
    out[i + half] = static_cast<T>(rnd<T>(n[i + half] * f(c[i + half])) + rnd<T>(n[i] * f(s[i + half])));
  }
  for (int64_t i = rot; i < d; ++i) out[i] = static_cast<T>(n[i]);
}

template <typename T>
void run(const torch::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t d, const torch::Tensor& cos,
         const torch::Tensor& sin, const T* qw, const T* kw, bool unit_offset, float eps, torch::Tensor& q,
         torch::Tensor& k) {
  const int64_t tokens = qkv.size(0), stride = qkv.stride(0), rot = cos.size(-1);
  const T* src = reinterpret_cast<const T*>(qkv.data_ptr());
  const T* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const T* sp = reinterpret_cast<const T*>(sin.data_ptr());
  T* qo = reinterpret_cast<T*>(q.data_ptr());
  T* ko = reinterpret_cast<T*>(k.data_ptr());
  const int64_t per_token = heads + kv_heads;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1));
  at::parallel_for(0, tokens * per_token, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> n(d);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t t = job / per_token, h = job % per_token;
      const bool is_q = h < heads;
      const T* x = src + t * stride + h * d;  // q heads, then k heads, in the projection's order
      T* out = is_q ? qo + (t * heads + h) * d : ko + (t * kv_heads + (h - heads)) * d;
      one_head<T>(x, out, is_q ? qw : kw, unit_offset, eps, cp + t * rot, sp + t * rot, d, rot, n.data());
    }
  });
}

// src's d values into dst in the cache's type C: the bytes where C is T (a bf16 row through float and back was
// a fifth of a 512-token prefill's qk_norm_rope), else float32 rounded to nearest even bfloat16
template <typename C, typename T>
inline void put_row(C* dst, const T* src, int64_t d) {
  if constexpr (std::is_same_v<C, T>) {
    std::memcpy(dst, src, d * sizeof(C));
  } else {
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<C>(f(src[i]));
  }
}

// token t's k heads (from k) and v heads (qkv's columns after q and k) into the caches' row slots[t]
template <typename C, typename T>
void write_cache(const torch::Tensor& qkv, const torch::Tensor& k, int64_t heads, int64_t kv_heads, int64_t d,
                 const int64_t* slots, torch::Tensor& k_cache, torch::Tensor& v_cache) {
  const int64_t tokens = qkv.size(0), stride = qkv.stride(0), row = kv_heads * d;
  const T* src = reinterpret_cast<const T*>(qkv.data_ptr());
  const T* ko = reinterpret_cast<const T*>(k.data_ptr());
  C* kc = reinterpret_cast<C*>(k_cache.data_ptr());
  C* vc = reinterpret_cast<C*>(v_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    put_row(kc + slots[t] * row, ko + t * row, row);
    put_row(vc + slots[t] * row, src + t * stride + (heads + kv_heads) * d, row);
  }
}

template <typename T>
void add_norm_rows(const T* x, const T* h, const T* w1, const T* w2, T* xo, T* no, int64_t rows, int64_t d,
                   float eps, bool unit_offset) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> n(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* hr = h + r * d;
      if (w1 != nullptr) {
        norm_row(hr, w1, n.data(), d, eps, unit_offset);
      } else {
        for (int64_t i = 0; i < d; ++i) n[i] = f(hr[i]);
      }
      T* out = xo + r * d;
      for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(f(x[r * d + i]) + n[i]);
      if (w2 == nullptr) continue;
      norm_row(static_cast<const T*>(out), w2, n.data(), d, eps, unit_offset);
      for (int64_t i = 0; i < d; ++i) no[r * d + i] = static_cast<T>(n[i]);
    }
  });
}

}  // namespace

// x, h: [..., d] alike; norm1, norm2: [d] in their dtype, or empty (h added as is; no second norm). Returns
// [x + norm1(h), norm2 of it] (the second empty without norm2).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor h, torch::Tensor norm1, torch::Tensor norm2,
                                        double eps, bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && h.device().is_cpu(), "add_rms_norm: CPU tensors only");
  TORCH_CHECK(x.sizes() == h.sizes() && x.scalar_type() == h.scalar_type(), "add_rms_norm: x and h must be alike");
  const int64_t d = x.size(-1);
  for (const auto& w : {norm1, norm2})
    TORCH_CHECK(w.numel() == 0 || (w.dim() == 1 && w.size(0) == d && w.scalar_type() == x.scalar_type()),
                "add_rms_norm: norm weights must be [", d, "] in x's dtype, or empty");
  auto xc = x.contiguous(), hc = h.contiguous(), w1 = norm1.contiguous(), w2 = norm2.contiguous();
  auto xo = torch::empty_like(xc);
  auto no = w2.numel() > 0 ? torch::empty_like(xc) : torch::empty({0}, xc.options());
  const int64_t rows = d == 0 ? 0 : xc.numel() / d;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32) {
    auto p = [](const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; };
    add_norm_rows<float>(p(xc), p(hc), p(w1), p(w2), p(xo), p(no), rows, d, e, unit_offset);
  } else if (x.scalar_type() == torch::kBFloat16) {
    using B = c10::BFloat16;
    auto p = [](const torch::Tensor& t) { return t.numel() ? reinterpret_cast<B*>(t.data_ptr()) : nullptr; };
    add_norm_rows<B>(p(xc), p(hc), p(w1), p(w2), p(xo), p(no), rows, d, e, unit_offset);
  } else {
    TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16 only, not ", x.scalar_type());
  }
  return {xo, no};
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight need the same dtype");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, "rms_norm: weight must be [", d, "]");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t rows = d == 0 ? 0 : xc.numel() / d;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32) {
    norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, d, e, unit_offset);
  } else if (x.scalar_type() == torch::kBFloat16) {
    auto* xp = reinterpret_cast<const c10::BFloat16*>(xc.data_ptr<at::BFloat16>());
    auto* wp = reinterpret_cast<const c10::BFloat16*>(wc.data_ptr<at::BFloat16>());
    auto* op = reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>());
    norm_rows(xp, wp, op, rows, d, e, unit_offset);
  } else {
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only, not ", x.scalar_type());
  }
  return out;
}

// qkv: [tokens, >= (heads + 2 kv_heads) * d] (rows may be strided); cos, sin: [tokens, rot] in qkv's dtype;
// q_weight, k_weight: [d] or empty (no norm). Returns q [tokens, heads, d], k [tokens, kv_heads, d].
// k_cache, v_cache: empty, or contiguous [blocks, block_size, kv_heads, d] in qkv's dtype or bfloat16, with
// slots: [tokens] int64, each token's row (block * block_size + offset), where its k and v are written.
std::vector<torch::Tensor> qk_norm_rope(torch::Tensor qkv, int64_t heads, int64_t kv_heads, int64_t d,
                                        torch::Tensor cos, torch::Tensor sin, torch::Tensor q_weight,
                                        torch::Tensor k_weight, bool unit_offset, double eps,
                                        std::optional<torch::Tensor> k_cache_opt,
                                        std::optional<torch::Tensor> v_cache_opt,
                                        std::optional<torch::Tensor> slots_opt) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1, "qk_norm_rope: CPU [tokens, n] rows");
  const bool write = k_cache_opt.has_value();
  TORCH_CHECK(write == v_cache_opt.has_value() && write == slots_opt.has_value(),
              "qk_norm_rope: k_cache, v_cache and slots come together");
  TORCH_CHECK(qkv.size(1) >= (heads + (write ? 2 : 1) * kv_heads) * d, "qk_norm_rope: qkv is narrower than its heads");
  const int64_t tokens = qkv.size(0);
  auto c = cos.reshape({tokens, -1}).contiguous(), s = sin.reshape({tokens, -1}).contiguous();
  TORCH_CHECK(c.sizes() == s.sizes() && c.size(1) <= d && c.size(1) % 2 == 0, "qk_norm_rope: bad cos/sin");
  TORCH_CHECK(c.scalar_type() == qkv.scalar_type(), "qk_norm_rope: cos/sin must be in qkv's dtype");
  const bool norm = q_weight.numel() > 0;
  TORCH_CHECK(!norm || (q_weight.numel() == d && k_weight.numel() == d), "qk_norm_rope: norm weights must be [d]");
  TORCH_CHECK(!norm || (q_weight.scalar_type() == qkv.scalar_type() && k_weight.scalar_type() == qkv.scalar_type()),
              "qk_norm_rope: norm weights must be in qkv's dtype");
  auto q = torch::empty({tokens, heads, d}, qkv.options());
  auto k = torch::empty({tokens, kv_heads, d}, qkv.options());
  auto qw = q_weight.contiguous(), kw = k_weight.contiguous();
  const float e = static_cast<float>(eps);
  if (qkv.scalar_type() == torch::kFloat32) {
    run<float>(qkv, heads, kv_heads, d, c, s, norm ? qw.data_ptr<float>() : nullptr,
               norm ? kw.data_ptr<float>() : nullptr, unit_offset, e, q, k);
  } else if (qkv.scalar_type() == torch::kBFloat16) {
    using B = c10::BFloat16;
    run<B>(qkv, heads, kv_heads, d, c, s, norm ? reinterpret_cast<const B*>(qw.data_ptr()) : nullptr,
           norm ? reinterpret_cast<const B*>(kw.data_ptr()) : nullptr, unit_offset, e, q, k);
  } else {
    TORCH_CHECK(false, "qk_norm_rope: float32 or bfloat16 only, not ", qkv.scalar_type());
  }
  if (!write) return {q, k};
  torch::Tensor k_cache = *k_cache_opt, v_cache = *v_cache_opt, slots = *slots_opt;
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_type && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4 && k_cache.size(2) == kv_heads &&
                  k_cache.size(3) == d,
              "qk_norm_rope: caches must be contiguous [blocks, block_size, kv_heads, d], alike");
  TORCH_CHECK(cache_type == qkv.scalar_type() || cache_type == torch::kBFloat16,
              "qk_norm_rope: the cache's dtype must be qkv's or bfloat16");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.size(0) == tokens,
              "qk_norm_rope: slots must be [tokens] int64");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t rows = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < rows, "qk_norm_rope: slot out of range");
  using B = c10::BFloat16;
  if (qkv.scalar_type() == torch::kFloat32 && cache_type == torch::kFloat32) {
    write_cache<float, float>(qkv, k, heads, kv_heads, d, sp, k_cache, v_cache);
  } else if (qkv.scalar_type() == torch::kFloat32) {
    write_cache<B, float>(qkv, k, heads, kv_heads, d, sp, k_cache, v_cache);
  } else {
    write_cache<B, B>(qkv, k, heads, kv_heads, d, sp, k_cache, v_cache);
  }
  return {q, k};
}

namespace {

using inferd::exp_approx;

inline float bits_to_float(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}
inline uint32_t float_to_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bits_to_float(static_cast<uint32_t>(p[i]) << 16); }
// round to nearest even, as torch's float -> bfloat16 does (finite values; activations here are)
inline uint16_t bf16_bits(float v) {
  const uint32_t b = float_to_bits(v);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
inline float round_as(const float*, float v) { return v; }
inline float round_as(const uint16_t*, float v) { return bits_to_float(static_cast<uint32_t>(bf16_bits(v)) << 16); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = bf16_bits(v); }

// torch's GELU, approximate="tanh", in torch's order: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
// tanh(u) = 1 - 2 / (e^2u + 1). Like torch's, 1 + tanh(u) cancels where tanh(u) nears -1 (an error of ~|x|
// 1e-7 for negative x); x / (1 + e^-2u) would avoid that but agree with torch's results less often.
inline float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
  return 0.5f * x * (1.0f + (1.0f - 2.0f / (exp_approx(2.0f * u) + 1.0f)));
}
inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

template <typename T>
void gated_rows(const T* src, int64_t stride, T* out, int64_t rows, int64_t inter, Act act) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = src + r * stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      if (act == kGeluTanh) {
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) store(o, i, round_as(o, gelu_tanh(load(g, i))) * load(u, i));
      } else {
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) store(o, i, round_as(o, silu(load(g, i))) * load(u, i));
      }
    }
  });
}

template <typename T>
void argmax_rows(const T* logits, int64_t rows, int64_t n, int64_t offset, float* best_val, int64_t* best_idx) {
  // chunks of a row are maxed in parallel (one row at batch 1 would leave a thread idle), in 16 lanes of vector
  // maxes; then only the first chunk holding the row's max is searched for its first index (a search from the
  // row's start went half a row on average: 262,144 logits took 70 us, chunked ~20 on the Zen 3)
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<float> top(rows * chunks);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const T* row = logits + (j / chunks) * n;
      const int64_t lo = (j % chunks) * kChunk, hi = std::min(n, lo + kChunk);
      float lanes[16];
      std::fill(lanes, lanes + 16, -std::numeric_limits<float>::infinity());
      int64_t i = lo;
      for (; i + 16 <= hi; i += 16) {
#pragma omp simd
        for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], load(row, i + l));
      }
      float mx = *std::max_element(lanes, lanes + 16);
      for (; i < hi; ++i) mx = std::max(mx, load(row, i));
      top[j] = mx;
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    const float* t = top.data() + r * chunks;
    const int64_t c = std::max_element(t, t + chunks) - t;  // the first chunk holding the largest
    if (!(t[c] > best_val[r])) continue;
    const T* row = logits + r * n;
    int64_t at = c * kChunk;
    while (load(row, at) != t[c]) ++at;
    best_val[r] = t[c];
    best_idx[r] = offset + at;
  }
}

// as argmax_rows, over the tokens `mask` allows (row r's words at mask + r * words; `offset` a multiple of 32;
// tokens past the mask's last word are not allowed)
template <typename T>
void masked_argmax_rows(const T* logits, int64_t rows, int64_t n, int64_t offset, const uint32_t* mask, int64_t words,
                        float* best_val, int64_t* best_idx) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * n;
      const uint32_t* m = mask + r * words;
      float mx = best_val[r];
      int64_t at = -1;
      for (int64_t base = 0; base < n; base += 32) {
        const int64_t word = (offset + base) >> 5;
        if (word >= words) break;
        uint32_t w = m[word];
        if (w == 0) continue;
        const int64_t len = std::min<int64_t>(32, n - base);
        if (w == 0xFFFFFFFFu && len == 32) {
          float group = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : group)
          for (int64_t i = 0; i < 32; ++i) group = std::max(group, load(row, base + i));
          if (!(group > mx)) continue;
          int64_t k = 0;
          while (load(row, base + k) != group) ++k;
          mx = group;
          at = base + k;
          continue;
        }
        while (w != 0) {
          const int64_t j = __builtin_ctz(w);
          w &= w - 1;
          if (j >= len) break;
          const float v = load(row, base + j);
          if (v > mx) {
            mx = v;
            at = base + j;
          }
        }
      }
      if (at >= 0) {
        best_val[r] = mx;
        best_idx[r] = offset + at;
      }
    }
  });
}

template <typename T>
const T* bits(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

}  // namespace

// gate_up: [tokens, >= 2 * inter] rows (gate first, up after; rows may be strided). Returns [tokens, inter].
torch::Tensor gated_act(torch::Tensor gate_up, int64_t inter, int64_t act) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1,
              "gated_act: CPU [tokens, n] rows");
  TORCH_CHECK(gate_up.size(1) >= 2 * inter, "gated_act: rows narrower than gate and up");
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "gated_act: act is 0 (silu) or 1 (gelu tanh)");
  const int64_t rows = gate_up.size(0), stride = gate_up.stride(0);
  auto out = torch::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    gated_rows(bits<float>(gate_up), stride, out.data_ptr<float>(), rows, inter, static_cast<Act>(act));
  } else if (gate_up.scalar_type() == torch::kBFloat16) {
    gated_rows(bits<uint16_t>(gate_up), stride, reinterpret_cast<uint16_t*>(out.data_ptr()), rows, inter,
               static_cast<Act>(act));
  } else {
    TORCH_CHECK(false, "gated_act: float32 or bfloat16 only, not ", gate_up.scalar_type());
  }
  return out;
}

// logits: [rows, n] contiguous (float32 or bfloat16); best_val: [rows] float32, best_idx: [rows] int64, both
// updated in place where the tile holds a strictly greater value (its index + offset). mask: empty, or int32
// [rows, words] over the whole vocabulary (then offset must be a multiple of 32).
void argmax_update(torch::Tensor logits, torch::Tensor best_val, torch::Tensor best_idx, int64_t offset,
                   torch::Tensor mask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(), "argmax_update: CPU [rows, n]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(best_val.scalar_type() == torch::kFloat32 && best_idx.scalar_type() == torch::kInt64 &&
                  best_val.is_contiguous() && best_idx.is_contiguous() && best_val.numel() == rows &&
                  best_idx.numel() == rows,
              "argmax_update: best_val [rows] float32, best_idx [rows] int64");
  if (n == 0) return;
  float* bv = best_val.data_ptr<float>();
  int64_t* bi = best_idx.data_ptr<int64_t>();
  if (mask.numel() > 0) {
    TORCH_CHECK(mask.scalar_type() == torch::kInt32 && mask.dim() == 2 && mask.size(0) == rows &&
                    mask.is_contiguous() && offset % 32 == 0,
                "argmax_update: mask int32 [rows, words], contiguous, and offset a multiple of 32");
    const auto* words = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
    if (logits.scalar_type() == torch::kFloat32) {
      masked_argmax_rows(bits<float>(logits), rows, n, offset, words, mask.size(1), bv, bi);
    } else if (logits.scalar_type() == torch::kBFloat16) {
      masked_argmax_rows(bits<uint16_t>(logits), rows, n, offset, words, mask.size(1), bv, bi);
    } else {
      TORCH_CHECK(false, "argmax_update: float32 or bfloat16 only, not ", logits.scalar_type());
    }
    return;
  }
  if (logits.scalar_type() == torch::kFloat32) {
    argmax_rows(bits<float>(logits), rows, n, offset, bv, bi);
  } else if (logits.scalar_type() == torch::kBFloat16) {
    argmax_rows(bits<uint16_t>(logits), rows, n, offset, bv, bi);
  } else {
    TORCH_CHECK(false, "argmax_update: float32 or bfloat16 only, not ", logits.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gated_act", &gated_act, "act(gate) * up from the fused gate/up rows (CPU; act 0 silu, 1 gelu tanh)");
  m.def("argmax_update", &argmax_update, "fold a tile of logits into a running per-row argmax, under an optional "
        "token bitmask (CPU)", py::arg("logits"), py::arg("best_val"), py::arg("best_idx"), py::arg("offset"),
        py::arg("mask") = torch::Tensor());
  m.def("rms_norm", &rms_norm, "RMS norm over the last dimension (CPU, float32 or bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "x + norm1(h) and norm2 of it, a residual add between norms (CPU)");
  m.def("qk_norm_rope", &qk_norm_rope,
        "q and k from the qkv projection: per-head RMS norm and rotary, k and v written to the caches if given (CPU)",
        py::arg("qkv"), py::arg("heads"), py::arg("kv_heads"), py::arg("d"), py::arg("cos"), py::arg("sin"),
        py::arg("q_weight"), py::arg("k_weight"), py::arg("unit_offset"), py::arg("eps"),
        py::arg("k_cache") = py::none(), py::arg("v_cache") = py::none(), py::arg("slots") = py::none());
}
