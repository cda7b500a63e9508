// Paged attention for prefill chunks on CPU with AMX-BF16 or AVX512_BF16: a chunk's queries attend its request's
// keys and values read from the block table (earlier chunks', a prefix cache hit's and its own, already written),
// with the causal mask, an optional sliding window and an optional logit softcap.
//
// Why: torch's CPU flash attention ran a 290-token prompt's 18 layers of Gemma 3 270M (4 query heads on one KV
// head, head_dim 256) at ~110 GFLOP/s on a Xeon, 29 ms of a ~160 ms prefill step, and at 55-85 GFLOP/s on a Zen 4
// (128-512 keys); chunks with a context went through a gather of their blocks and a masked SDPA. Here both
// matmuls are AMX tiles, or AVX512_BF16's vdpbf16ps on the same layouts where there is no AMX.
//
// Per KV head the chunk's keys [first, total) are copied once out of their blocks into the layouts AMX-BF16's
// B tiles want: K as [D / 2][keys][2] (a B row is one pair of d for 16 keys: Q K^T), V as [keys / 2][D][2] (a
// B row is one pair of keys for 16 of d: P V). Then each work item, one query head x 32 query rows, computes
//   S = Q K^T (float32, over the keys its rows can see, in steps of 32), softmax per row in float32 (scale,
//   softcap, mask, max, exp, sum), P = the exps rounded to bf16, O = P V (float32), out = O / sum (bf16).
// The whole row of scores is kept (32 x keys floats in L2), not an online softmax: prompts here are hundreds
// to a few thousand tokens. The items are claimed by the threads as they become free (work_queue.h): causal
// rows further down see more keys. Without AMX a B row is one zmm register of 16 columns' pairs, and vdpbf16ps
// adds a row's broadcast pair of A times it into 16 float sums: the same products as the tiles', in another
// order of float additions.
//
// Only on CPUs with AMX-BF16 (granted by the OS) or AVX512_BF16 (`available()`, `isa()`); elsewhere the
// caller keeps PyTorch's SDPA.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "amx.h"
#include "fast_exp.h"
#include "fp8.h"
#include "quantized_common.h"
#include "work_queue.h"

using namespace inferd;

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(__AVX512BF16__))
#define INFERD_PREFILL 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFERD_PREFILL_AMX 1
#endif
#if defined(__AVX512BF16__)
#define INFERD_PREFILL_BF16 1
#endif

constexpr int64_t kRows = 32;  // query rows per work item: two A tiles
constexpr int64_t kStep = 32;  // keys per step of either product; d per step of P V

// A thread's buffers, 64-byte aligned (tile loads and stores want rows at 64-byte strides only, but it is cheap).
template <typename T>
struct Buffer {
  std::vector<uint8_t> raw;
  T* p;
  explicit Buffer(int64_t n) : raw(n * sizeof(T) + 64) {
    p = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
  }
};

struct Chunk {
  const uint16_t* q;  // [T, H, D]
  uint16_t* out;      // [T, H, D]
  int64_t T, H, KVH, D;
  int64_t ctx, first, total, Lp;  // keys [first, total) are copied; Lp: their count rounded up to kStep
  int64_t window;                 // <= 0: none
  float scale, softcap;           // softcap <= 0: none
  bool amx;                       // the products on AMX tiles, else on vdpbf16ps
};

// A cache value's bf16 bits: itself in a bf16 cache; an fp8 cache's, looked up (exact).
struct Bf16Of {
  const uint16_t* lut = nullptr;  // fp8: its 256 values' bf16 bits
  uint16_t operator()(uint16_t x) const { return x; }
  uint16_t operator()(E4M3 x) const { return lut[x.bits]; }
  uint16_t operator()(E5M2 x) const { return lut[x.bits]; }
};

// The chunk's keys and values of KV head g, out of their blocks, into B-tile layouts; padding keys are zero.
// K is written a row of the layout at a time (one pair of d for every key): the reads jump between the keys'
// rows, which stay in L1 across the pairs, and the writes run on, where writing each key's pairs into their
// rows (a store per cache line) cost more than the products. An fp8 cache is widened to bf16 on the way.
template <typename C>
void repack(const Chunk& c, const C* k_cache, const C* v_cache, const int64_t* table, int64_t BS, int64_t g,
            uint16_t* kb, uint16_t* vb) {
  const int64_t D = c.D, Lp = c.Lp, n_keys = c.total - c.first;
  Bf16Of bf;
  if constexpr (is_fp8<C>) bf.lut = fp8_bf16_table<C>();
  std::vector<const C*> krow(n_keys), vrow(Lp, nullptr);
  for (int64_t n = 0; n < n_keys; ++n) {
    const int64_t pos = c.first + n, slot = table[pos / BS] * BS + pos % BS;
    krow[n] = k_cache + (slot * c.KVH + g) * D;
    vrow[n] = v_cache + (slot * c.KVH + g) * D;
  }
  at::parallel_for(0, D / 2 + Lp / 2, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (i < D / 2) {  // K: [D / 2][Lp] of (d, d + 1) pairs
        uint32_t* dst = reinterpret_cast<uint32_t*>(kb) + i * Lp;
        if constexpr (is_fp8<C>) {
          for (int64_t n = 0; n < n_keys; ++n)
            dst[n] = bf(krow[n][2 * i]) | static_cast<uint32_t>(bf(krow[n][2 * i + 1])) << 16;
        } else {
          for (int64_t n = 0; n < n_keys; ++n) std::memcpy(dst + n, krow[n] + 2 * i, 4);
        }
        std::fill(dst + n_keys, dst + Lp, 0u);
        continue;
      }
      const int64_t pair = i - D / 2;  // V: [Lp / 2][D][2]
      const C *a = vrow[2 * pair], *b = vrow[2 * pair + 1];
      uint16_t* dst = vb + pair * 2 * D;
      for (int64_t d = 0; d < D; ++d) {
        dst[2 * d] = a ? bf(a[d]) : 0;
        dst[2 * d + 1] = b ? bf(b[d]) : 0;
      }
    }
  });
}

#if defined(INFERD_PREFILL_AMX)
// Two row tiles (32 query rows) x two column tiles, C tiles 4-7 = (A0, A1) x (B0, B1) over `steps` k-steps;
// a(r, s) / b(t, s) give tile r's / t's source at step s. One row tile when `two_rows` is false.
template <typename A, typename B>
inline void product(int64_t steps, bool two_rows, int64_t a_stride, int64_t b_stride, A a, B b) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(0, a(0, s), a_stride);
    _tile_loadd(2, b(0, s), b_stride);
    _tile_loadd(3, b(1, s), b_stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (two_rows) {
      _tile_loadd(1, a(1, s), a_stride);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
}

// C tiles 4-7 to c (float, row stride ld floats): [rows 0-15 | 16-31] x [columns 0-15 | 16-31].
inline void store_product(float* c, int64_t ld, bool two_rows) {
  _tile_stored(4, c, ld * 4);
  _tile_stored(5, c + 16, ld * 4);
  if (two_rows) {
    _tile_stored(6, c + 16 * ld, ld * 4);
    _tile_stored(7, c + 16 * ld + 16, ld * 4);
  }
}
#endif

#if defined(INFERD_PREFILL_BF16)
// The same product without AMX: c[rows, 32] = A B over `steps` k-steps, A's rows 32 bf16 a step (a(r, s): row
// tile r's 16 rows at step s, a_stride bytes apart), B a step's 16 rows of pairs for 16 columns (b(t, s): column
// tile t's, b_stride bytes apart), each one zmm. Eight rows at a time: 16 float accumulators over two column
// tiles, each row's pair of A broadcast once for both.
template <typename A, typename B>
inline void product_bf16(int64_t steps, bool two_rows, int64_t a_stride, int64_t b_stride, A a, B b, float* c,
                         int64_t ld) {
  constexpr int R = 8;
  for (int64_t r0 = 0; r0 < (two_rows ? 32 : 16); r0 += R) {
    __m512 acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < steps; ++s) {
      const uint8_t* ap = reinterpret_cast<const uint8_t*>(a(r0 / 16, s)) + (r0 % 16) * a_stride;
      const uint8_t* b0 = reinterpret_cast<const uint8_t*>(b(0, s));
      const uint8_t* b1 = reinterpret_cast<const uint8_t*>(b(1, s));
      for (int p = 0; p < 16; ++p) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + p * b_stride);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + p * b_stride);
        for (int i = 0; i < R; ++i) {
          int32_t pair;
          std::memcpy(&pair, ap + i * a_stride + 4 * p, 4);
          const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, x);
          acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, x);
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      _mm512_storeu_ps(c + (r0 + i) * ld, acc[i][0]);
      _mm512_storeu_ps(c + (r0 + i) * ld + 16, acc[i][1]);
    }
  }
}
#endif

// c [rows 0-15 | 16-31 (two_rows)] x [columns 0-31] (float, row stride ld floats) = A B, on whichever unit runs
template <typename A, typename B>
inline void block_product(bool amx, int64_t steps, bool two_rows, int64_t a_stride, int64_t b_stride, A a, B b,
                          float* c, int64_t ld) {
#if defined(INFERD_PREFILL_AMX)
  if (amx) {
    product(steps, two_rows, a_stride, b_stride, a, b);
    store_product(c, ld, two_rows);
    return;
  }
#endif
#if defined(INFERD_PREFILL_BF16)
  product_bf16(steps, two_rows, a_stride, b_stride, a, b, c, ld);
#else
  TORCH_CHECK(false, "prefill_attention: built without AVX512_BF16, and AMX is not granted");
#endif
}

// Row r of scores s over keys [lo, hi) (relative to c.first) -> exps rounded to bf16 in p over [a, b), zero in
// the rest of [lo, hi); returns the sum of the rounded exps. [a, b) is what the row may see. AVX-512 by hand:
// GCC left the max reduction scalar, and it was a third of the kernel's time.
float softmax_row(const Chunk& c, float* s, uint16_t* p, int64_t lo, int64_t hi, int64_t a, int64_t b) {
  const float scale = c.scale, cap = c.softcap;
  if (cap > 0.f)
    for (int64_t n = a; n < b; ++n) s[n] = cap * std::tanh(s[n] * scale / cap);
  const __m512 vscale = _mm512_set1_ps(cap > 0.f ? 1.f : scale);
  auto tail = [&](int64_t n) { return static_cast<__mmask16>(b - n >= 16 ? 0xFFFF : (1u << (b - n)) - 1); };
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t n = a; n < b; n += 16) {
    const __mmask16 m = tail(n);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + n), vscale);
    _mm512_mask_storeu_ps(s + n, m, v);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t n = a; n < b; n += 16) {
    const __mmask16 m = tail(n);
    const __m512 e = exp_approx(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + n), mx));
    // round to bf16 (nearest even) and keep the rounded value for the sum
    const __m512i bits = _mm512_castps_si512(e);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_mask_storeu_epi16(p + n, m, _mm512_cvtepi32_epi16(top));
    vsum = _mm512_mask_add_ps(vsum, m, vsum, _mm512_castsi512_ps(_mm512_slli_epi32(top, 16)));
  }
  std::fill(p + lo, p + a, uint16_t{0});
  std::fill(p + b, p + hi, uint16_t{0});
  return _mm512_reduce_add_ps(vsum);
}

// Query head h, rows [i0, i0 + 32) of the chunk (fewer at its end).
void attend_rows(const Chunk& c, const uint16_t* kb, const uint16_t* vb, int64_t h, int64_t i0, uint16_t* qbuf,
                 float* sbuf, uint16_t* pbuf, float* obuf) {
  const int64_t D = c.D, Lp = c.Lp, rows = std::min(kRows, c.T - i0);
  const bool two = rows > 16;
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < rows) std::memcpy(qbuf + r * D, c.q + ((i0 + r) * c.H + h) * D, D * 2);
    else std::memset(qbuf + r * D, 0, D * 2);
  }
  // keys the rows can see, relative to c.first: [lo, hi), widened to whole steps
  const int64_t last = c.ctx + i0 + rows - 1;  // the last row's position
  const int64_t lo_pos = c.window > 0 ? std::max(c.first, c.ctx + i0 - c.window + 1) : c.first;
  const int64_t lo = (lo_pos - c.first) / kStep * kStep;
  const int64_t hi = (last + 1 - c.first + kStep - 1) / kStep * kStep;
  for (int64_t n0 = lo; n0 < hi; n0 += kStep) {  // S = Q K^T, 32 keys at a time
    block_product(
        c.amx, D / 32, two, D * 2, Lp * 4, [&](int r, int64_t s) { return qbuf + r * 16 * D + 32 * s; },
        [&](int t, int64_t s) { return kb + (16 * s) * 2 * Lp + 2 * (n0 + 16 * t); }, sbuf + n0, Lp);
  }
  float inv[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    if (r >= rows) {
      std::fill(pbuf + r * Lp + lo, pbuf + r * Lp + hi, uint16_t{0});
      inv[r] = 0.f;
      continue;
    }
    const int64_t pos = c.ctx + i0 + r;
    const int64_t a = (c.window > 0 ? std::max(c.first, pos - c.window + 1) : c.first) - c.first;
    inv[r] = 1.f / softmax_row(c, sbuf + r * Lp, pbuf + r * Lp, lo, hi, a, pos + 1 - c.first);
  }
  for (int64_t d0 = 0; d0 < D; d0 += kStep) {  // O = P V, 32 of d at a time
    block_product(
        c.amx, (hi - lo) / kStep, two, Lp * 2, D * 4,
        [&](int r, int64_t s) { return pbuf + r * 16 * Lp + lo + kStep * s; },
        [&](int t, int64_t s) { return vb + ((lo + kStep * s) / 2) * 2 * D + 2 * (d0 + 16 * t); }, obuf + d0, D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* o = c.out + ((i0 + r) * c.H + h) * D;
    const float* acc = obuf + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = bf16_bits(acc[d] * inv[r]);
  }
}

template <typename C>
void attend_chunk(const Chunk& c, const C* k_cache, const C* v_cache, const int64_t* table, int64_t BS) {
  const int64_t D = c.D, Lp = c.Lp, G = c.H / c.KVH, blocks = (c.T + kRows - 1) / kRows;
  std::vector<uint16_t> kb(c.KVH * Lp * D), vb(c.KVH * Lp * D);
  for (int64_t g = 0; g < c.KVH; ++g) repack(c, k_cache, v_cache, table, BS, g, kb.data() + g * Lp * D, vb.data() + g * Lp * D);
  // items: (query head, row block), the last row blocks (the most keys) first
  parallel_claim(c.H * blocks, 1, [&](auto each) {
#if defined(INFERD_PREFILL_AMX)
    if (c.amx) configure_full_tiles();
#endif
    Buffer<uint16_t> qbuf(kRows * D), pbuf(kRows * Lp);
    Buffer<float> sbuf(kRows * Lp), obuf(kRows * D);
    each([&](int64_t item) {
      const int64_t h = item % c.H, block = blocks - 1 - item / c.H;
      const int64_t g = h / G;
      attend_rows(c, kb.data() + g * Lp * D, vb.data() + g * Lp * D, h, block * kRows, qbuf.p, sbuf.p, pbuf.p, obuf.p);
    });
#if defined(INFERD_PREFILL_AMX)
    if (c.amx) _tile_release();
#endif
  });
}
#endif

}  // namespace

// AMX's tiles where the build has them and the OS grants them, else AVX512_BF16's vdpbf16ps where built with it
bool use_amx() {
#if defined(INFERD_PREFILL_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

bool available() {
#if defined(INFERD_PREFILL_BF16)
  return true;
#else
  return use_amx();
#endif
}

std::string isa() {
  if (use_amx()) return "amx-bf16";
  return available() ? "avx512-bf16" : "none";
}

// q, out: [T, H, D] bfloat16 (out may be a slice of a larger contiguous tensor); k_cache, v_cache: [num_blocks,
// block_size, KVH, D] bfloat16 or fp8 (e4m3fn, e5m2) holding the chunk's own K/V already; block_table: [>= ceil((context_len + T) /
// block_size)] int64; the chunk's queries sit at positions context_len .. context_len + T - 1. window <= 0 and
// softcap <= 0 mean none.
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                       int64_t context_len, double scale, int64_t window, double softcap, torch::Tensor out) {
  TORCH_CHECK(available(), "prefill_attention: needs AMX-BF16 (granted by the OS) or AVX512_BF16");
  const auto kv = k_cache.scalar_type();
  const bool kv_ok = kv == torch::kBFloat16 || is_fp8_type(kv);
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 && kv_ok &&
                  v_cache.scalar_type() == kv,
              "prefill_attention: q and out bfloat16, the cache bfloat16 or fp8");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && out.is_contiguous() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && out.sizes() == q.sizes(),
              "prefill_attention: q/out [T, H, D] and caches [blocks, block_size, KVH, D], contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 32 == 0 && H % KVH == 0, "prefill_attention: head_dim a multiple of 32");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 1, "prefill_attention: int64 table");
  const int64_t total = context_len + T;
  TORCH_CHECK(context_len >= 0 && block_table.numel() * BS >= total, "prefill_attention: the table is too short");
#if defined(INFERD_PREFILL)
  const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window + 1) : 0;
  auto table = block_table.contiguous();
  auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const Chunk c{bits(q), bits(out), T, H, KVH, D, context_len, first, total,
                (total - first + kStep - 1) / kStep * kStep, window, static_cast<float>(scale),
                static_cast<float>(softcap), use_amx()};
  with_cache_type(kv, uint16_t{0}, [&](auto tag) {
    using C = decltype(tag);
    attend_chunk(c, reinterpret_cast<const C*>(k_cache.data_ptr()), reinterpret_cast<const C*>(v_cache.data_ptr()),
                 table.data_ptr<int64_t>(), BS);
  });
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this CPU and OS run the kernel (AMX-BF16 or AVX512_BF16)");
  m.def("isa", &isa, "what the products run on: amx-bf16, avx512-bf16 or none");
  m.def("prefill_attention", &prefill_attention,
        "paged causal attention for a prefill chunk (CPU, AMX-BF16 or AVX512_BF16)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("context_len"),
        py::arg("scale"), py::arg("window"), py::arg("softcap"), py::arg("out"));
}
