// RMS norm in one pass per row, for float32 and bfloat16 tensors on CPU.
//
// The PyTorch reference (inferd/models/layers.py RMSNorm) is ~10 small ops per call (to float, pow, mean,
// add, rsqrt, mul, the weight to float, add 1, mul, back to the dtype); a Gemma 3 step calls it 6 times
// per layer, so at small batches the ops' fixed cost, not the arithmetic, is what a step pays. This does
// the same arithmetic in the same order per element, in float32, in one call:
//   n = x * (1 / sqrt(mean(x^2) + eps))
//   unit_offset (Gemma):  out = to_dtype(n * (1 + w))
//   otherwise (Llama):    out = w * to_dtype(n)        (the product in the dtype, as transformers does)
// Only the sum of squares is added up in a different order from torch's reduction (16 lanes), which
// moves the result by a rounding step at most.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

template <typename T>
float inv_rms(const T* x, int64_t d, float eps) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; ++l) {
      float v = to_float(x[i + l]);
      acc[l] += v * v;
    }
  float tail = 0.f;
  for (; i < d; ++i) {
    float v = to_float(x[i]);
    tail += v * v;
  }
  float sum = tail;
  for (int l = 0; l < 16; ++l) sum += acc[l];
  return 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
}

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t d, float eps, bool unit_offset) {
  // enough rows per task that a thread's share outweighs waking it
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* o = out + r * d;
      const float s = inv_rms(xr, d, eps);
      if (unit_offset) {
        for (int64_t i = 0; i < d; ++i) o[i] = from_float<T>((to_float(xr[i]) * s) * (1.f + to_float(w[i])));
      } else {
        for (int64_t i = 0; i < d; ++i) {
          const T n = from_float<T>(to_float(xr[i]) * s);
          o[i] = from_float<T>(to_float(w[i]) * to_float(n));
        }
      }
    }
  });
}

}  // namespace

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMS norm over the last dimension (CPU, float32 or bfloat16)");
}
