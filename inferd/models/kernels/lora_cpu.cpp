// lora_add: every LoRA adapter's product of one step added to a layer's output, in one call
// (inferd/models/lora.py). For each token row t whose adapter slot s_t >= 0, and each part p of the layer
// (q, k, v of a fused q/k/v projection; one part for o and down):
//   h   = A_p[s_t] x_t                     (rank r dot products, accumulated in float32)
//   y_t[offset_p : offset_p + size_p] += h B_p[s_t]   (accumulated in float32, rounded once to y's dtype)
// A_p is [slots x r, in] and B_p [slots x r, size_p] (B transposed), a slot's r rows contiguous; rows of the
// base model (s_t < 0) are left as they are.
//
// Why a kernel: at a decode step's few rows the products are tiny (rank 8), and torch's small matmuls cost a
// fixed ~18 us each in bfloat16 here, three or more per part, so the batched torch path (a shrink and an expand
// over every slot in use) took ~1 ms per decoder layer with 16 adapters on Gemma 3 270M's shapes: more than
// the layer's base products. Here one call covers a layer's parts and rows, each row reads only its own
// adapter's rows of A and B, and the loops vectorise (`omp simd`). Many rows (prefill) go to torch's matmuls,
// which are faster there (LoRALinear picks by row count).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) {  // round to nearest even, as torch's float -> bfloat16
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
}

struct Part {
  const void* a;
  const void* b;
  int64_t offset, size;
};

template <typename T>
void add_rows(T* y, int64_t y_stride, const T* x, int64_t x_stride, int64_t in, const std::vector<Part>& parts,
              const int64_t* slots, int64_t rows, int64_t rank, int64_t max_size) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), acc(max_size), h(rank);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const T* xt = x + t * x_stride;
      for (int64_t k = 0; k < in; ++k) xf[k] = to_float(xt[k]);
      T* yt = y + t * y_stride;
      for (const Part& p : parts) {
        const T* a = static_cast<const T*>(p.a) + s * rank * in;
        const T* b = static_cast<const T*>(p.b) + s * rank * p.size;
        for (int64_t j = 0; j < rank; ++j) {
          const T* aj = a + j * in;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t k = 0; k < in; ++k) sum += xf[k] * to_float(aj[k]);
          h[j] = sum;
        }
        float* out = acc.data();
        T* yp = yt + p.offset;
        for (int64_t c = 0; c < p.size; ++c) out[c] = 0.f;
        for (int64_t j = 0; j < rank; ++j) {
          const float hj = h[j];
          const T* bj = b + j * p.size;
#pragma omp simd
          for (int64_t c = 0; c < p.size; ++c) out[c] += hj * to_float(bj[c]);
        }
        for (int64_t c = 0; c < p.size; ++c) store(&yp[c], to_float(yp[c]) + out[c]);
      }
    }
  });
}

}  // namespace

// y: [rows, out] (rows may be strided), x: [rows, in] (the same), a[p]: [slots * rank, in], b[p]:
// [slots * rank, size_p], all contiguous and of one dtype (float32 or bfloat16); slots: [rows] int64.
void lora_add(torch::Tensor y, torch::Tensor x, std::vector<torch::Tensor> a, std::vector<torch::Tensor> b,
              std::vector<int64_t> offsets, torch::Tensor slots, int64_t rank) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 &&
                  x.stride(1) == 1 && y.size(0) == x.size(0),
              "lora_add: CPU [rows, n] x and y with unit column stride");
  TORCH_CHECK(a.size() == b.size() && a.size() == offsets.size() && !a.empty(), "lora_add: one a, b, offset a part");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == x.size(0),
              "lora_add: slots [rows] int64");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "lora_add: float32 or bfloat16 only");
  TORCH_CHECK(y.scalar_type() == dtype, "lora_add: y and x of one dtype");
  const int64_t in = x.size(1);
  std::vector<Part> parts;
  int64_t max_size = 0;
  for (size_t p = 0; p < a.size(); ++p) {
    TORCH_CHECK(a[p].scalar_type() == dtype && b[p].scalar_type() == dtype && a[p].is_contiguous() &&
                    b[p].is_contiguous() && a[p].dim() == 2 && b[p].dim() == 2 && a[p].size(1) == in &&
                    a[p].size(0) == b[p].size(0) && a[p].size(0) % rank == 0,
                "lora_add: a[p] [slots * rank, in] and b[p] [slots * rank, size], contiguous, x's dtype");
    TORCH_CHECK(offsets[p] >= 0 && offsets[p] + b[p].size(1) <= y.size(1), "lora_add: a part outside y");
    parts.push_back({a[p].data_ptr(), b[p].data_ptr(), offsets[p], b[p].size(1)});
    max_size = std::max(max_size, b[p].size(1));
  }
  const int64_t num_slots = a[0].size(0) / rank;
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) TORCH_CHECK(s[t] < num_slots, "lora_add: a slot past the last");
  if (dtype == torch::kFloat32) {
    add_rows(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0), in, parts, s, x.size(0), rank,
             max_size);
  } else {
    add_rows(reinterpret_cast<uint16_t*>(y.data_ptr()), y.stride(0), reinterpret_cast<const uint16_t*>(x.data_ptr()),
             x.stride(0), in, parts, s, x.size(0), rank, max_size);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_add", &lora_add, "add every row's LoRA adapter product to a layer's output (CPU)");
}
