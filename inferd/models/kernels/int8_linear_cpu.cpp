// Weight-only int8 linear for a few activation rows on CPU: y[M,N] = x[M,K] @ (q[N,K] * scale[N])^T + bias,
// with x float32 or bfloat16.
//
// As llama.cpp's Q8_0 x Q8_0: each activation row is quantized per group of 32 to int8 with one float step
// (x ~= xq * xd, xd = max|x| / 127), and a group's products are summed exactly in int32 before the float
// steps apply: y = scale[n] * sum over groups of xd[g] * sum(q[k] * xq[k]). The integer products are
// VNNI's vpdpbusd (AVX-512) or AVX2's vpmaddubsw + vpmaddwd (AVX-VNNI's vpdpbusd where present); both
// multiply unsigned by signed bytes, so each weight's sign moves onto its activation (|q| * (sign(q) * xq),
// |q| <= 127). Widening every weight to float for a float multiply-add (what this replaced) bound the
// kernel by its arithmetic at 7-10 GB/s; integer products leave a decode step bound by the int8 bytes it
// streams, half of bf16's. Work is split over output rows (at::parallel_for, OpenMP); -march=native picks
// the instruction set, and a portable loop serves CPUs without AVX2 and the row tails.
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

// The quantized activation rows: q [M, K] int8, d [M, G * 8] each group's step repeated 8 times (one per
// int32 lane its products land in with AVX-512; AVX2 reads every 8th).
struct QuantizedRows {
  int64_t K, groups;
  std::vector<int8_t> q;
  std::vector<float> d;
  const int8_t* qrow(int64_t m) const { return q.data() + m * K; }
  const float* drow(int64_t m) const { return d.data() + m * groups * 8; }
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  QuantizedRows r{K, (K + kGroup - 1) / kGroup, std::vector<int8_t>(M * K), std::vector<float>()};
  r.d.assign(M * r.groups * 8, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < r.groups; ++g) {
      const int64_t k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[m * K + k])));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t k = k0; k < k1; ++k)
        r.q[m * K + k] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[m * K + k]) * inv));
      for (int l = 0; l < 8; ++l) r.d[(m * r.groups + g) * 8 + l] = amax / 127.f;
    }
  }
  return r;
}

// Groups [g0, groups) of one weight row against one activation row, one at a time.
inline float groups_portable(const int8_t* w, const QuantizedRows& a, int64_t m, int64_t g0) {
  const int8_t* x = a.qrow(m);
  const float* d = a.drow(m);
  float s = 0.f;
  for (int64_t g = g0; g < a.groups; ++g) {
    int32_t dot = 0;
    for (int64_t k = g * kGroup; k < std::min(a.K, (g + 1) * kGroup); ++k)
      dot += static_cast<int32_t>(w[k]) * x[k];
    s += d[g * 8] * static_cast<float>(dot);
  }
  return s;
}

#if defined(INFERD_AVX512_VNNI)
constexpr int64_t kStepGroups = 2;  // 64 bytes a step: lanes 0-7 hold the first group's sums, 8-15 the second's

// MB activation rows (1..4) against one weight row, over its first `steps` * 64 weights.
template <int MB>
inline void steps_dot(const int8_t* w, const QuantizedRows& a, int64_t m0, int64_t steps, float* out) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    _mm_prefetch(reinterpret_cast<const char*>(w + s * 64 + kPrefetchBytes), _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(w + s * 64);
    const __m512i mag = _mm512_abs_epi8(wv);
    const __mmask64 negative = _mm512_movepi8_mask(wv);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(a.qrow(m0 + m) + s * 64);
      const __m512i signed_x = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
      const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mag, signed_x);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(a.drow(m0 + m) + s * 16), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#elif defined(INFERD_AVX2)
constexpr int64_t kStepGroups = 1;  // 32 bytes a step: one group

template <int MB>
inline void steps_dot(const int8_t* w, const QuantizedRows& a, int64_t m0, int64_t steps, float* out) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    _mm_prefetch(reinterpret_cast<const char*>(w + s * 32 + kPrefetchBytes), _MM_HINT_T0);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * 32));
    const __m256i mag = _mm256_sign_epi8(wv, wv);
    for (int m = 0; m < MB; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + m) + s * 32));
      const __m256i signed_x = _mm256_sign_epi8(xv, wv);
      const __m256i d = dot_u8s8(_mm256_setzero_si256(), mag, signed_x);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(a.drow(m0 + m)[s * 8]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
}
#else
constexpr int64_t kStepGroups = 1;

template <int MB>
inline void steps_dot(const int8_t*, const QuantizedRows&, int64_t, int64_t, float* out) {
  for (int m = 0; m < MB; ++m) out[m] = 0.f;  // every group goes through groups_portable
}
#endif

// MB activation rows against weight row n: whole steps vectorised (none without AVX2), the rest one group
// at a time.
template <int MB, typename Out>
inline void row_dot(const int8_t* w, const QuantizedRows& a, int64_t m0, float scale, float add, Out* y,
                    int64_t N) {
#if defined(INFERD_AVX512_VNNI) || defined(INFERD_AVX2)
  const int64_t steps = a.K / (kStepGroups * kGroup);
#else
  const int64_t steps = 0;
#endif
  float out[MB];
  steps_dot<MB>(w, a, m0, steps, out);
  for (int m = 0; m < MB; ++m)
    put((out[m] + groups_portable(w, a, m0 + m, steps * kStepGroups)) * scale + add, y + (m0 + m) * N);
}

}  // namespace

// q must lie in -127..127 (as quantize_int8 makes it: |-128| does not fit the unsigned-times-signed product).
// Returns [M, N] in x's dtype.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2, "int8_linear: x [M, K] and q [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "int8_linear: x must be float32 or bfloat16");
  TORCH_CHECK(q.scalar_type() == torch::kInt8, "int8_linear: q must be int8");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32, "int8_linear: scale must be float32");
  x = x.contiguous();
  q = q.contiguous();
  scale = scale.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && scale.numel() == N, "int8_linear: shapes do not match");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == N, "int8_linear: bias has the wrong size");
  }
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows a = x.scalar_type() == torch::kFloat32
                              ? quantize_rows(x.data_ptr<float>(), M, K)
                              : quantize_rows(x.data_ptr<at::BFloat16>(), M, K);
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  auto rows = [&](auto* Y) {
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* w = Q + n * K;
        const float s = S[n], add = B ? B[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          switch (std::min<int64_t>(4, M - m0)) {
            case 4: row_dot<4>(w, a, m0, s, add, Y + n, N); break;
            case 3: row_dot<3>(w, a, m0, s, add, Y + n, N); break;
            case 2: row_dot<2>(w, a, m0, s, add, Y + n, N); break;
            default: row_dot<1>(w, a, m0, s, add, Y + n, N); break;
          }
        }
      }
    });
  };
  if (x.scalar_type() == torch::kFloat32) rows(y.data_ptr<float>());
  else rows(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "int8 weights x int8-quantized activations (groups of 32), a few rows (CPU)");
  m.def("isa", [] { return std::string(kIsa); }, "the instruction set int8_linear was built for");
}
