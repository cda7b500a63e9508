// int4 linear on CPU, group-wise and asymmetric: y[M,N] = x[M,K] @ W^T (+ bias), with
// W[n, k] = q * scale[n, g] + low[n, g] for the group g = k / 32 (q in 0..15; as llama.cpp's Q4_1).
// Storage: `packed` [N, K/2] uint8, 32 weights per group in 16 bytes; byte j of a group holds q[j] in its low
// nibble and q[j + 16] in its high one, so a load and a mask or a shift give runs of 16 consecutive weights.
// `scales` and `lows` [N, K/32] float32 (a group's step and its smallest value).
//
// Two paths, chosen by the caller from M:
// - int4_linear (a few rows, decode): the activations are quantized to int8 in groups of 32 and the products
//   summed in int32 (below); nothing is unpacked to memory, and the step streams 6 bits per weight (4 + the
//   group's step and low), what small batches are bound by.
// - int4_linear_chunked (many rows, prefill): a chunk of weight rows is unpacked into the activations'
//   dtype in a buffer that stays in cache and multiplied with torch's dense matmul (AMX/AVX512_BF16 for
//   bf16): compute-bound work keeps the fast matmul, and memory still only streams the int4 bytes.
// The instruction set comes from -march=native (quantized_common.h). Work is split over output rows
// (at::parallel_for, OpenMP).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "quantized_common.h"

using namespace inferd;

namespace {

constexpr int64_t kGroup = 32;

// One weight row, unpacked and scaled into float32: w[k] for k < K.
inline void unpack_row(const uint8_t* p, const float* s, const float* l, int64_t K, float* w) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* b = p + g * (kGroup / 2);
    const float sc = s[g], off = l[g];
    float* o = w + g * kGroup;
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      o[j] = static_cast<float>(b[j] & 15) * sc + off;
      o[j + 16] = static_cast<float>(b[j] >> 4) * sc + off;
    }
  }
}

// One weight row unpacked straight into bfloat16 bits.
inline void unpack_row_bf16(const uint8_t* p, const float* s, const float* l, int64_t K, uint16_t* w) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* b = p + g * (kGroup / 2);
    const float sc = s[g], off = l[g];
    uint16_t* o = w + g * kGroup;
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      o[j] = bf16_bits(static_cast<float>(b[j] & 15) * sc + off);
      o[j + 16] = bf16_bits(static_cast<float>(b[j] >> 4) * sc + off);
    }
  }
}

void check(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
           const torch::Tensor& lows) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && scales.dim() == 2, "int4_linear: x [M, K], packed [N, K/2]");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "int4_linear: packed must be uint8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && lows.scalar_type() == torch::kFloat32,
              "int4_linear: scales and lows must be float32");
  TORCH_CHECK(lows.sizes() == scales.sizes(), "int4_linear: scales and lows differ in shape");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "int4_linear: K must be a multiple of 32");
  TORCH_CHECK(packed.size(1) * 2 == K && scales.size(1) == K / kGroup && scales.size(0) == packed.size(0),
              "int4_linear: shapes do not match");
}

}  // namespace

// ---- A few rows: activations quantized to int8, products summed in int32 ----
//
// As llama.cpp's Q4_1 x Q8_0: each activation row is quantized per group of 32 to int8 with one float step
// (x ~= xq * xd, xd = max|x| / 127). Writing a weight as w = (q - c) * step + (low + c * step) with c = 7.5,
// the middle of q's range, a group's dot product is taken as
//   x . w ~= step * xd * sum(q[j] * xq[j]) + low * sum(x[j]) + c * step * (sum(x[j]) - xd * sum(xq[j]))
// which is exact but for x ~= xq * xd in step * sum((q[j] - c) * x[j]): the activations' rounding is weighed
// by the weights' distance from their group's middle, not from its low end (half the error, measured in
// perplexity). The integer sum is exact (u8 x s8 -> s32: VNNI's vpdpbusd, AVX2's vpmaddubsw + vpmaddwd), and
// sum(x) is taken in float from the unquantized row. One 64-byte load is four groups' weights; the quantized
// activations are laid out to match it: per block of four groups, the four groups' first 16 values, then
// their last 16.
// Unpacking into float and a float multiply-add per weight (what this replaced) bound the kernel by its
// arithmetic at 7-10 GB/s; integer products leave it bound by memory.

namespace {

constexpr int64_t kBlockGroups = 4;                     // groups per 64-byte block of packed weights
constexpr int64_t kBlockValues = kBlockGroups * kGroup;  // 128 quantized activations per block
constexpr float kCenter = 7.5f;                          // the middle of q's range 0..15

// The quantized activation rows: q [M, blocks * 128] in the block layout above, d [M, blocks * 16] each
// group's step repeated 4 times (one per int32 lane its products land in), sum [M, G] each group's sum,
// rounding [M, G] each group's sum(x) - xd * sum(xq).
struct QuantizedRows {
  int64_t groups, blocks;
  std::vector<int8_t> q;
  std::vector<float> d, sum, rounding;
  const int8_t* qrow(int64_t m) const { return q.data() + m * blocks * kBlockValues; }
  const float* drow(int64_t m) const { return d.data() + m * blocks * 16; }
  const float* sumrow(int64_t m) const { return sum.data() + m * groups; }
  const float* roundingrow(int64_t m) const { return rounding.data() + m * groups; }
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  QuantizedRows r;
  r.groups = K / kGroup;
  r.blocks = (r.groups + kBlockGroups - 1) / kBlockGroups;
  r.q.assign(M * r.blocks * kBlockValues, 0);
  r.d.assign(M * r.blocks * 16, 0.f);
  r.sum.assign(M * r.groups, 0.f);
  r.rounding.assign(M * r.groups, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < r.groups; ++g) {
      float v[kGroup], amax = 0.f, total = 0.f;
      for (int j = 0; j < kGroup; ++j) {
        v[j] = static_cast<float>(x[m * K + g * kGroup + j]);
        amax = std::max(amax, std::fabs(v[j]));
        total += v[j];
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const int64_t b = g / kBlockGroups, i = g % kBlockGroups;
      int8_t* q = r.q.data() + m * r.blocks * kBlockValues + b * kBlockValues + i * 16;
      int32_t qsum = 0;
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        q[64 + j] = static_cast<int8_t>(std::nearbyint(v[j + 16] * inv));
        qsum += q[j] + q[64 + j];
      }
      float* d = r.d.data() + m * r.blocks * 16 + g * 4;
      for (int l = 0; l < 4; ++l) d[l] = amax / 127.f;
      r.sum[m * r.groups + g] = total;
      r.rounding[m * r.groups + g] = total - amax / 127.f * static_cast<float>(qsum);
    }
  }
  return r;
}

// One group's integer dot product, portable: sum(q[j] * xq[j]) over its 32 weights.
inline int32_t group_dot(const uint8_t* w, const int8_t* xlo, const int8_t* xhi) {
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += static_cast<int32_t>(w[j] & 15) * xlo[j] + static_cast<int32_t>(w[j] >> 4) * xhi[j];
  return s;
}

// The groups of blocks [b0, G) one at a time (the tail block of a row whose groups are not a multiple of 4,
// or every block on a CPU without AVX2): sum over groups of step * xd * integer dot.
inline float groups_portable(const uint8_t* w, const float* step, const int8_t* xq, const float* xd, int64_t g0,
                             int64_t G) {
  float s = 0.f;
  for (int64_t g = g0; g < G; ++g) {
    const int64_t b = g / kBlockGroups, i = g % kBlockGroups;
    const int8_t* xb = xq + b * kBlockValues + i * 16;
    s += step[g] * xd[g * 4] * static_cast<float>(group_dot(w + g * (kGroup / 2), xb, xb + 64));
  }
  return s;
}

#if defined(INFERD_AVX512_VNNI)

// MB activation rows (1..4) against one weight row, full blocks only; adds step * xd * dot per lane.
template <int MB>
inline void blocks_dot(const uint8_t* w, const float* step, const QuantizedRows& a, int64_t m0, int64_t nb,
                       float* out) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b * 64 + kPrefetchBytes), _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(w + b * 64);
    const __m512i lo = _mm512_and_si512(wv, nib);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
    const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(step + b * 4)));
    for (int m = 0; m < MB; ++m) {
      const int8_t* xb = a.qrow(m0 + m) + b * kBlockValues;
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xb));
      d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(xb + 64));
      const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(a.drow(m0 + m) + b * 16));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#elif defined(INFERD_AVX2)

template <int MB>
inline void blocks_dot(const uint8_t* w, const float* step, const QuantizedRows& a, int64_t m0, int64_t nb,
                       float* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < 2; ++h) {  // two groups per 32 bytes: lanes 0-3 the first, 4-7 the second
      _mm_prefetch(reinterpret_cast<const char*>(w + b * 64 + h * 32 + kPrefetchBytes), _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 64 + h * 32));
      const __m256i lo = _mm256_and_si256(wv, nib);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
      const float* sg = step + b * 4 + h * 2;
      const __m256 s = _mm256_set_m128(_mm_set1_ps(sg[1]), _mm_set1_ps(sg[0]));
      for (int m = 0; m < MB; ++m) {
        const int8_t* xb = a.qrow(m0 + m) + b * kBlockValues + h * 32;
        __m256i d = dot_u8s8(_mm256_setzero_si256(), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
        d = dot_u8s8(d, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 64)));
        const __m256 scale = _mm256_mul_ps(s, _mm256_loadu_ps(a.drow(m0 + m) + b * 16 + h * 8));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
}
#else

template <int MB>
inline void blocks_dot(const uint8_t* w, const float* step, const QuantizedRows& a, int64_t m0, int64_t nb,
                       float* out) {
  for (int m = 0; m < MB; ++m)
    out[m] = groups_portable(w, step, a.qrow(m0 + m), a.drow(m0 + m), 0, nb * kBlockGroups);
}
#endif

// MB activation rows against weight row n: full blocks vectorised, the tail groups one by one, plus the lows.
template <int MB, typename Out>
inline void row_dot(const uint8_t* w, const float* step, const float* low, const QuantizedRows& a, int64_t m0,
                    float add, Out* y, int64_t N) {
  const int64_t G = a.groups, full = G / kBlockGroups;
  float out[MB];
  blocks_dot<MB>(w, step, a, m0, full, out);
  for (int m = 0; m < MB; ++m) {
    const float* xs = a.sumrow(m0 + m);
    const float* xr = a.roundingrow(m0 + m);
    float offset = 0.f;
    for (int64_t g = 0; g < G; ++g) offset += low[g] * xs[g] + kCenter * step[g] * xr[g];
    const float tail = groups_portable(w, step, a.qrow(m0 + m), a.drow(m0 + m), full * kBlockGroups, G);
    put(out[m] + tail + offset + add, y + (m0 + m) * N);
  }
}

}  // namespace

// A few activation rows (float32 or bfloat16) against int4 weights; returns [M, N] in x's dtype.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor lows,
                          c10::optional<torch::Tensor> bias) {
  check(x, packed, scales, lows);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "int4_linear: x must be float32 or bfloat16");
  x = x.contiguous();
  packed = packed.contiguous();
  scales = scales.contiguous();
  lows = lows.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / kGroup;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows a = x.scalar_type() == torch::kFloat32
                              ? quantize_rows(x.data_ptr<float>(), M, K)
                              : quantize_rows(x.data_ptr<at::BFloat16>(), M, K);
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const float* S = scales.data_ptr<float>();
  const float* L = lows.data_ptr<float>();
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  auto rows = [&](auto* Y) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = P + n * (K / 2);
        const float* step = S + n * G;
        const float* low = L + n * G;
        const float add = B ? B[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          switch (std::min<int64_t>(4, M - m0)) {
            case 4: row_dot<4>(w, step, low, a, m0, add, Y + n, N); break;
            case 3: row_dot<3>(w, step, low, a, m0, add, Y + n, N); break;
            case 2: row_dot<2>(w, step, low, a, m0, add, Y + n, N); break;
            default: row_dot<1>(w, step, low, a, m0, add, Y + n, N); break;
          }
        }
      }
    });
  };
  if (x.scalar_type() == torch::kFloat32) rows(y.data_ptr<float>());
  else rows(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

// The weights as a dense tensor of `dtype` (float32 or bfloat16), rows [lo, hi).
torch::Tensor int4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor lows, int64_t lo,
                              int64_t hi, torch::ScalarType dtype) {
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && lows.is_contiguous(), "int4: contiguous only");
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= packed.size(0), "int4_dequantize: rows out of range");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "int4_dequantize: float32 or bfloat16");
  const int64_t K = packed.size(1) * 2;
  auto out = torch::empty({hi - lo, K}, packed.options().dtype(dtype));
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const float* S = scales.data_ptr<float>();
  const float* L = lows.data_ptr<float>();
  at::parallel_for(lo, hi, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = P + n * (K / 2);
      const float* sn = S + n * (K / kGroup);
      const float* ln = L + n * (K / kGroup);
      if (dtype == torch::kFloat32) {
        unpack_row(row, sn, ln, K, out.data_ptr<float>() + (n - lo) * K);
      } else {
        auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + (n - lo) * K;
        unpack_row_bf16(row, sn, ln, K, o);
      }
    }
  });
  return out;
}

// Many activation rows (float32 or bfloat16) against int4 weights, chunk by chunk of weight rows; returns
// [M, N] in x's dtype.
torch::Tensor int4_linear_chunked(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor lows,
                                  c10::optional<torch::Tensor> bias, int64_t chunk_rows) {
  check(x, packed, scales, lows);
  TORCH_CHECK(chunk_rows > 0, "int4_linear_chunked: chunk_rows must be positive");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "int4_linear_chunked: x must be float32 or bfloat16");
  x = x.contiguous();
  packed = packed.contiguous();
  scales = scales.contiguous();
  lows = lows.contiguous();
  const int64_t M = x.size(0), N = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  for (int64_t lo = 0; lo < N; lo += chunk_rows) {
    const int64_t hi = std::min(N, lo + chunk_rows);
    auto w = int4_dequantize(packed, scales, lows, lo, hi, x.scalar_type());
    y.narrow(1, lo, hi - lo).copy_(at::mm(x, w.t()));
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(x.scalar_type()));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "weight-only int4 linear, a few float32 rows (CPU)");
  m.def("int4_linear_chunked", &int4_linear_chunked, "weight-only int4 linear, many rows, dense matmul per chunk");
  m.def("int4_dequantize", &int4_dequantize, "int4 weights to a dense float32 or bfloat16 tensor");
  m.def("isa", [] { return std::string(kIsa); }, "the instruction set int4_linear was built for");
}
