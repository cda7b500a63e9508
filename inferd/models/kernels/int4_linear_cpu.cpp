// Weight-only int4 linear on CPU, group-wise and asymmetric: y[M,N] = x[M,K] @ W^T (+ bias), with
// W[n, k] = q * scale[n, g] + low[n, g] for the group g = k / 32 (q in 0..15; as llama.cpp's Q4_1).
// Storage: `packed` [N, K/2] uint8, 32 weights per group in 16 bytes; byte j of a group holds q[j] in its low
// nibble and q[j + 16] in its high one, so one 16-byte load and a mask or a shift give two runs of 16
// consecutive weights. `scales` and `lows` [N, K/32] float32 (a group's step and its smallest value).
//
// Two paths, chosen by the caller from M:
// - int4_linear (a few rows, decode): dequantization fused into the dot products, nothing unpacked to
//   memory; the step reads 6 bits per weight (4 + the group's step and low), what small batches are bound by.
// - int4_linear_chunked (many rows, prefill): a chunk of weight rows is unpacked into the activations'
//   dtype in a buffer that stays in cache and multiplied with torch's dense matmul (AMX/AVX512_BF16 for
//   bf16): compute-bound work keeps the fast matmul, and memory still only streams the int4 bytes.
// The loops are written for the compiler to vectorise (-O3 -march=native): AVX-512 or AVX2, whichever the
// CPU has. Work is split over output rows (at::parallel_for, OpenMP).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

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

// float32 -> bfloat16 bits, round to nearest even as torch does (no NaNs reach here): vectorisable, unlike
// at::BFloat16's constructor in a loop.
inline uint16_t bf16_bits(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
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

// A few activation rows (float32) against int4 weights; returns float32 [M, N].
// Fused: no weight row is unpacked to memory. Per group, x . w = step * (x . q) + low * sum(x), so the inner
// loop is 16 lanes of x[j] * q_lo[j] + x[j + 16] * q_hi[j] scaled into 16 running sums (one vector register
// with AVX-512, two with AVX2; no dependency chain through a single sum), and each activation row's group sums
// are taken once per call.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor lows,
                          c10::optional<torch::Tensor> bias) {
  check(x, packed, scales, lows);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "int4_linear: x must be float32");
  x = x.contiguous();
  packed = packed.contiguous();
  scales = scales.contiguous();
  lows = lows.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / kGroup;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const float* S = scales.data_ptr<float>();
  const float* L = lows.data_ptr<float>();
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  std::vector<float> xsum(M * G);  // sum of each activation row over each group
  for (int64_t i = 0; i < M * G; ++i) {
    const float* xg = X + i * kGroup;
    float t = 0.f;
    for (int j = 0; j < kGroup; ++j) t += xg[j];
    xsum[i] = t;
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* pn = P + n * (K / 2);
      const float* sn = S + n * G;
      const float* ln = L + n * G;
      const float add = B ? B[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = X + m * K;
        const float* xs = xsum.data() + m * G;
        float acc[16] = {};
        float offset = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* q = pn + g * (kGroup / 2);
          const float* xg = xm + g * kGroup;
          const float step = sn[g];
#pragma omp simd
          for (int j = 0; j < 16; ++j) {
            acc[j] += step * (xg[j] * static_cast<float>(q[j] & 15) + xg[j + 16] * static_cast<float>(q[j] >> 4));
          }
          offset += ln[g] * xs[g];
        }
        float total = 0.f;
        for (int j = 0; j < 16; ++j) total += acc[j];
        Y[m * N + n] = total + offset + add;
      }
    }
  });
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
}
