// Paged attention for decode tokens on CPU: one query per request, keys and values read in place from
// the block tables, so nothing is gathered or padded. Work is split over (request, kv head) pairs;
// each pair computes its query group's scores, a softmax, and the weighted sum of values.
// K/V are float32 or bfloat16 (read as bf16 and widened in registers: half the bytes of the cache,
// which is what a decode step is bound by); the arithmetic is float32 either way.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// bfloat16 is the top half of a float32: widening is a shift, which the compiler vectorises.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * widen(b[i]);
  return s;
}

// Four dot products against the same query: four independent accumulators keep the FMA units busy
// instead of waiting on one reduction chain.
template <typename T>
inline void dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t n, float* out) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    const float qi = q[i];
    s0 += qi * widen(k0[i]);
    s1 += qi * widen(k1[i]);
    s2 += qi * widen(k2[i]);
    s3 += qi * widen(k3[i]);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * widen(x[i]);
}

// T: the storage type of q, K/V and the output (float, or uint16_t holding bfloat16 bits).
template <typename T>
void decode(const T* qp, const T* kp, const T* vp, const int64_t* btp, const int64_t* lp, T* op, int64_t B,
            int64_t H, int64_t D, int64_t BS, int64_t KVH, int64_t MB, float fscale, int64_t window, float fcap) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query(G * D), acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kvh = item % KVH;
      const int64_t len = lp[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      scores.assign(G * n, 0.f);
      const T* q_in = qp + (b * H + kvh * G) * D;
      for (int64_t i = 0; i < G * D; ++i) query[i] = widen(q_in[i]);
      auto key_at = [&](int64_t t) {
        const int64_t pos = start + t;
        return kp + ((btp[b * MB + pos / BS] * BS + pos % BS) * KVH + kvh) * D;
      };
      // tokens outer, heads inner: four keys stay in L1 while every head of the group uses them
      int64_t t = 0;
      float four[4];
      for (; t + 4 <= n; t += 4) {
        const T *k0 = key_at(t), *k1 = key_at(t + 1), *k2 = key_at(t + 2), *k3 = key_at(t + 3);
        for (int64_t g = 0; g < G; ++g) {
          dot4(query.data() + g * D, k0, k1, k2, k3, D, four);
          std::copy(four, four + 4, scores.data() + g * n + t);
        }
      }
      for (; t < n; ++t)
        for (int64_t g = 0; g < G; ++g) scores[g * n + t] = dot(query.data() + g * D, key_at(t), D);
      for (float& s : scores) {
        s *= fscale;
        if (fcap > 0.f) s = std::tanh(s / fcap) * fcap;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * n;
        const float mx = *std::max_element(row, row + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          row[t] = std::exp(row[t] - mx);
          sum += row[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const int64_t block = btp[b * MB + pos / BS];
        const T* val = vp + ((block * BS + pos % BS) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + t], val, acc.data() + g * D, D);
      }
      T* o = op + (b * H + kvh * G) * D;
      if constexpr (std::is_same_v<T, float>) {
        std::copy(acc.begin(), acc.end(), o);
      } else {  // round to nearest even, as torch's float -> bfloat16 does (no NaNs reach here)
        for (int64_t i = 0; i < G * D; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &acc[i], sizeof bits);
          o[i] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
        }
      }
    }
  });
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64 (including the token being decoded); window <= 0 means none. Returns [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           int64_t window, double softcap) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "paged_decode runs on float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, "q and the KV cache differ in dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t MB = bt.size(1);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  if (dtype == torch::kFloat32) {
    decode<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), btp, lp,
                  out.data_ptr<float>(), B, H, D, BS, KVH, MB, fscale, window, fcap);
  } else {
    auto bits = [](torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    decode<uint16_t>(bits(q), bits(k_cache), bits(v_cache), btp, lp, bits(out), B, H, D, BS, KVH, MB, fscale,
                     window, fcap);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention for decode tokens (CPU, float32 or bfloat16)");
}
