// A linear layer on a GGUF file's own quantized blocks: y[M, N] = x[M, K] @ W^T (+ bias), W read as the file
// stores it (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K rows), dequantized exactly in registers: the weights are the
// values llama.cpp computes with, and a decode step streams the file's 4.5-8.5 bits a weight.
//
// A layer is a list of segments, each a run of output rows in one GGML type ([rows, row bytes] uint8, rows
// as the file stores them: K / block values per row, blocks back to back). A fused q/k/v layer whose v rows
// the file keeps in another type than q and k is one call.
//
// gguf_linear (up to a few hundred rows): each activation row is quantized to int8 in groups of 32 with one
// float step (x ~= xq * xd, xd = max|x| / 127, as llama.cpp's Q8_0). A weight row is decoded into unsigned
// codes u in one byte (Q8_0 keeps its signed int8) with, per group of 32, a float factor A and an offset B, so
// that a weight is A * u + B (Q6_K: A * s16 * u + B16, with a signed int8 scale s16 per half group):
//   Q8_0  A = d,            u = q signed,   B = 0
//   Q4_0  A = d,            u = q (0..15),  B = -8 d
//   Q5_0  A = d,            u = q (0..31),  B = -16 d
//   Q4_K  A = d * sc,       u = q (0..15),  B = -dmin * m       (per sub-block of 32)
//   Q5_K  A = d * sc,       u = q (0..31),  B = -dmin * m
//   Q6_K  A = d,            u = q (0..63),  B16 = -32 d * s16   (per 16)
// A group's dot product is A * xd * sum(u * xq) + B * xd * sum(xq): the integer sum is exact (AVX2's
// vpmaddubsw + vpmaddwd, Q8_0's sign moved onto the activation; Q6_K's two scales applied in vpmaddwd), the
// offsets are summed apart. Three ways through, by the number of activation rows M (AVX2; a portable loop
// otherwise):
// - M <= 2: each group decoded in registers and used at once (Q8_0, whose codes need no decoding, takes the
//   next way, reading them in place);
// - M < 8: each row decoded once into a buffer in L1, four weight rows by up to two activation rows at a time;
// - M >= 8: eight decoded rows transposed into the int8 kernel's tile layout, one output row a lane.
//
// gguf_linear_dense (many rows, prefill): chunks of weight rows are dequantized into the activations' dtype
// and multiplied with torch's dense matmul, which is compute-bound there.
//
// gguf_dequantize gives a segment's weights as float32, with the same arithmetic as the `gguf` package (the
// reference the tests hold it to). Work is split over runs of output rows (parallel_claim).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "quantized_common.h"
#include "work_queue.h"

using namespace inferd;

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kSuper = 256;  // values in a k-quant super-block

// GGML's type codes (ggml.h), and each type's block: values, bytes
enum Type : int64_t { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Layout {
  int64_t values, bytes;
};

Layout layout(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q5_0: return {32, 22};
    case Q8_0: return {32, 34};
    case Q4_K: return {kSuper, 144};
    case Q5_K: return {kSuper, 176};
    case Q6_K: return {kSuper, 210};
    default: TORCH_CHECK(false, "gguf_linear: GGML type ", type, " is not supported");
  }
  return {0, 0};
}

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One weight row decoded for the integer dot products: codes u [K] (signed for Q8_0), per group of 32 the
// factor A, per 16 the offset B16 (a group's B repeated) and, for Q6_K, the int16 scale of each 16.
// Group g's 32 codes are at codes + g * stride: the buffer u (stride 32), or a Q8_0 row's own blocks (stride 34).
struct Decoded {
  std::vector<uint8_t> u;
  std::vector<float> a, b16;
  std::vector<int16_t> s16;
  const uint8_t* codes = nullptr;
  int64_t stride = kGroup;
  explicit Decoded(int64_t K) : u(K), a(K / kGroup), b16(K / 16), s16(K / 16) {}
};

#if defined(__AVX2__)
// 16 bytes of nibbles -> 32 codes in a register: the low nibbles first, then the high ones
inline __m256i nibbles32(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// bit j of qh -> `value` in byte j (byte j takes qh's byte j / 8 and tests its bit j % 8)
inline __m256i bits32(uint32_t qh, char value) {
  const __m256i shuffle = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                           3, 3, 3, 3, 3, 3, 3);
  const __m256i bits = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)), shuffle);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bits), bits), _mm256_set1_epi8(value));
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
// each byte's bits [shift, shift + width) as a number: 16-bit shifts are fine, the mask drops the neighbour's bits
inline __m256i field(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}
#endif

// 16 bytes of nibbles -> 32 codes: the low nibbles first, then the high ones (Q4_0/Q5_0's order)
inline void nibbles_split(const uint8_t* q, uint8_t* u) {
#if defined(__AVX2__)
  store32(u, nibbles32(q));
#else
  for (int j = 0; j < 16; ++j) {
    u[j] = q[j] & 15;
    u[j + 16] = q[j] >> 4;
  }
#endif
}

void decode_row(int64_t type, const uint8_t* row, int64_t K, Decoded& d) {
  // the rows are streamed once: ask for the bytes kPrefetchBytes ahead (the hardware prefetcher alone
  // loses the stream where threads claim runs of rows)
  const int64_t row_bytes = K / layout(type).values * layout(type).bytes;
  for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + kPrefetchBytes + off, 0, 3);
  uint8_t* u = d.u.data();
  d.codes = u;
  d.stride = kGroup;
  const int64_t G = K / kGroup;
  auto same_b = [&](int64_t g, float b) { d.b16[2 * g] = d.b16[2 * g + 1] = b; };
  switch (type) {
    case Q8_0:  // the codes are read in place
      d.codes = row + 2;
      d.stride = 34;
      for (int64_t g = 0; g < G; ++g) {
        d.a[g] = half(row + g * 34);
        same_b(g, 0.f);
      }
      return;
    case Q4_0:
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* blk = row + g * 18;
        const float dd = half(blk);
        d.a[g] = dd;
        same_b(g, -8.f * dd);
        nibbles_split(blk + 2, u + g * kGroup);
      }
      break;
    case Q5_0:
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* blk = row + g * 22;
        const float dd = half(blk);
        d.a[g] = dd;
        same_b(g, -16.f * dd);
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
        uint8_t* o = u + g * kGroup;
#if defined(__AVX2__)
        store32(o, _mm256_or_si256(nibbles32(blk + 6), bits32(qh, 0x10)));
#else
        nibbles_split(blk + 6, o);
        for (int j = 0; j < 32; ++j) o[j] |= ((qh >> j) & 1) << 4;
#endif
      }
      break;
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      const int64_t bytes = five ? 176 : 144;
      for (int64_t s = 0; s < K / kSuper; ++s) {
        const uint8_t* blk = row + s * bytes;
        const float dd = half(blk), dmin = half(blk + 2);
        const uint8_t* scales = blk + 4;
        const uint8_t* qh = five ? blk + 16 : nullptr;
        const uint8_t* qs = blk + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, m;
          scale_min_k4(j, scales, &sc, &m);
          const int64_t g = s * 8 + j;
          d.a[g] = dd * static_cast<float>(sc);
          same_b(g, -(dmin * static_cast<float>(m)));
          const uint8_t* q = qs + (j / 2) * 32;
          const int shift = (j % 2) * 4;
          uint8_t* o = u + g * kGroup;
#if defined(__AVX2__)
          __m256i v = field(load32(q), shift, 15);
          if (five) v = _mm256_or_si256(v, _mm256_slli_epi16(field(load32(qh), j, 1), 4));
          store32(o, v);
#else
          for (int l = 0; l < 32; ++l) {
            uint8_t v = (q[l] >> shift) & 15;
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            o[l] = v;
          }
#endif
        }
      }
      break;
    }
    case Q6_K:
      for (int64_t s = 0; s < K / kSuper; ++s) {
        const uint8_t* blk = row + s * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float dd = half(blk + 208);
        for (int h = 0; h < 2; ++h) {
          for (int t = 0; t < 4; ++t) {  // the 32 values at 128 h + 32 t
            const uint8_t* lo = ql + 64 * h + 32 * (t % 2);
            const int shift = 4 * (t / 2);
            const uint8_t* hi = qh + 32 * h;
            const int64_t g = s * 8 + h * 4 + t;
            uint8_t* o = u + g * kGroup;
#if defined(__AVX2__)
            store32(o, _mm256_or_si256(field(load32(lo), shift, 15), _mm256_slli_epi16(field(load32(hi), 2 * t, 3), 4)));
#else
            for (int l = 0; l < 32; ++l) o[l] = ((lo[l] >> shift) & 15) | (((hi[l] >> (2 * t)) & 3) << 4);
#endif
            d.a[g] = dd;
            for (int half16 = 0; half16 < 2; ++half16) {
              const int8_t scale = sc[(g - s * 8) * 2 + half16];
              d.s16[2 * g + half16] = scale;
              d.b16[2 * g + half16] = -32.f * dd * static_cast<float>(scale);
            }
          }
        }
      }
      break;
    default: TORCH_CHECK(false, "gguf_linear: GGML type ", type, " is not supported");
  }
}

// The quantized activation rows: q [M, K], d [M, K/32] each group's step, s16 [M, K/16] xd * sum(xq) per 16.
struct QuantizedRows {
  int64_t K, G;
  std::vector<int8_t> q;
  std::vector<float> d, s16;
  const int8_t* qrow(int64_t m) const { return q.data() + m * K; }
  const float* drow(int64_t m) const { return d.data() + m * G; }
  const float* srow(int64_t m) const { return s16.data() + m * 2 * G; }
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  QuantizedRows r{K, K / kGroup, std::vector<int8_t>(M * K), std::vector<float>(M * (K / kGroup)),
                  std::vector<float>(M * (K / 16))};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < r.G; ++g) {
        float v[kGroup], amax = 0.f;
        for (int j = 0; j < kGroup; ++j) {
          v[j] = static_cast<float>(x[m * K + g * kGroup + j]);
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f, xd = amax / 127.f;
        int8_t* q = r.q.data() + m * K + g * kGroup;
        int32_t sums[2] = {0, 0};
        for (int j = 0; j < kGroup; ++j) {
          q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
          sums[j / 16] += q[j];
        }
        r.d[m * r.G + g] = xd;
        r.s16[m * 2 * r.G + 2 * g] = xd * static_cast<float>(sums[0]);
        r.s16[m * 2 * r.G + 2 * g + 1] = xd * static_cast<float>(sums[1]);
      }
    }
  });
  return r;
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

enum class Codes { Unsigned, Signed, Scaled16 };

// NR decoded weight rows against MB activation rows (from m0): out[r * MB + m] = sum over groups of
// A * xd * sum(u * xq). NR x MB accumulators in registers; each activation load serves NR weight rows.
template <int NR, int MB, Codes C>
inline void dot_block(const Decoded* w, const QuantizedRows& a, int64_t m0, float* out) {
  const int64_t G = a.G;
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i xv[MB];
    __m256 xd[MB];
    for (int m = 0; m < MB; ++m) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + m) + g * kGroup));
      xd[m] = _mm256_set1_ps(a.drow(m0 + m)[g]);
    }
    for (int r = 0; r < NR; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r].codes + g * w[r].stride));
      __m256i uw = wv, pairs_scale = ones;
      if constexpr (C == Codes::Signed) uw = _mm256_abs_epi8(wv);
      if constexpr (C == Codes::Scaled16) {
        const __m128i lo = _mm_set1_epi16(w[r].s16[2 * g]), hi = _mm_set1_epi16(w[r].s16[2 * g + 1]);
        pairs_scale = _mm256_set_m128i(hi, lo);
      }
      const __m256 ag = _mm256_set1_ps(w[r].a[g]);
      for (int m = 0; m < MB; ++m) {
        const __m256i xs = C == Codes::Signed ? _mm256_sign_epi8(xv[m], wv) : xv[m];
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(uw, xs), pairs_scale);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ag, xd[m]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) out[r * MB + m] = hsum8(acc[r][m]);
#else
  for (int r = 0; r < NR; ++r) {
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = a.qrow(m0 + m);
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t s[2] = {0, 0};
        for (int j = 0; j < kGroup; ++j) {
          const uint8_t c = w[r].codes[g * w[r].stride + j];
          const int32_t code = C == Codes::Signed ? static_cast<int8_t>(c) : c;
          s[j / 16] += code * xq[g * kGroup + j];
        }
        const int32_t dot = C == Codes::Scaled16 ? s[0] * w[r].s16[2 * g] + s[1] * w[r].s16[2 * g + 1] : s[0] + s[1];
        total += w[r].a[g] * a.drow(m0 + m)[g] * static_cast<float>(dot);
      }
      out[r * MB + m] = total;
    }
  }
#endif
}

// sum over h of b16[h] * xs[h] (the offsets' share of a dot product)
inline float offsets(const float* b16, const float* xs, int64_t H) {
  float total = 0.f;
  int64_t h = 0;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; h + 8 <= H; h += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(b16 + h), _mm256_loadu_ps(xs + h), acc);
  total = hsum8(acc);
#endif
  for (; h < H; ++h) total += b16[h] * xs[h];
  return total;
}

// NR decoded weight rows (output columns n0..n0+NR) against every activation row, written to y
template <int NR, Codes C, typename Out>
void rows_out(const Decoded* w, const QuantizedRows& a, int64_t M, const float* bias, int64_t n0, Out* y,
              int64_t N) {
  const int64_t H = 2 * a.G;
  constexpr int MB = NR == 1 ? 4 : 2;
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    float out[NR * MB];
    const int64_t mb = std::min<int64_t>(MB, M - m0);
    if (mb == MB) dot_block<NR, MB, C>(w, a, m0, out);
    else if constexpr (MB == 4) {
      if (mb == 3) dot_block<NR, 3, C>(w, a, m0, out);
      else if (mb == 2) dot_block<NR, 2, C>(w, a, m0, out);
      else dot_block<NR, 1, C>(w, a, m0, out);
    } else dot_block<NR, 1, C>(w, a, m0, out);
    for (int r = 0; r < NR; ++r) {
      const float add = bias ? bias[n0 + r] : 0.f;
      for (int64_t m = 0; m < mb; ++m) {
        const float off = C == Codes::Signed ? 0.f : offsets(w[r].b16.data(), a.srow(m0 + m), H);
        put(out[r * mb + m] + off + add, y + (m0 + m) * N + n0 + r);
      }
    }
  }
}

template <int NR, typename Out>
void rows_out(int64_t type, const Decoded* w, const QuantizedRows& a, int64_t M, const float* bias, int64_t n0,
              Out* y, int64_t N) {
  if (type == Q8_0) rows_out<NR, Codes::Signed>(w, a, M, bias, n0, y, N);
  else if (type == Q6_K) rows_out<NR, Codes::Scaled16>(w, a, M, bias, n0, y, N);
  else rows_out<NR, Codes::Unsigned>(w, a, M, bias, n0, y, N);
}

#if defined(__AVX2__)
// ---- One or two activation rows (decode): each weight group decoded in registers, used at once ----
// No row is decoded to memory first: at one row there is nothing to share the decoded codes with, and the
// store and reload cost as much as the decoding (measured on Gemma 3 270M's Q5_0/Q4_K/Q6_K layers at one row:
// 5.6 against 6.7 ms). Q8_0, whose codes are read in place, keeps the path below (6.7 against 8.6 ms here).

// One group of 32 weights (a type with unsigned codes): codes u, factor a, offsets b0/b1 (first and last 16),
// Q6_K's scales s0/s1 of its two halves.
struct Group {
  __m256i u;
  float a, b0, b1;
  int16_t s0 = 1, s1 = 1;
};

template <int64_t T>
inline Group group(const uint8_t* row, int64_t g) {
  Group r;
  if constexpr (T == Q4_0) {
    const uint8_t* blk = row + g * 18;
    r.u = nibbles32(blk + 2);
    r.a = half(blk);
    r.b0 = r.b1 = -8.f * r.a;
  } else if constexpr (T == Q5_0) {
    const uint8_t* blk = row + g * 22;
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    r.u = _mm256_or_si256(nibbles32(blk + 6), bits32(qh, 0x10));
    r.a = half(blk);
    r.b0 = r.b1 = -16.f * r.a;
  } else if constexpr (T == Q4_K || T == Q5_K) {
    constexpr bool five = T == Q5_K;
    const int j = static_cast<int>(g % 8);
    const uint8_t* blk = row + (g / 8) * (five ? 176 : 144);
    uint8_t sc, m;
    scale_min_k4(j, blk + 4, &sc, &m);
    r.a = half(blk) * static_cast<float>(sc);
    r.b0 = r.b1 = -(half(blk + 2) * static_cast<float>(m));
    r.u = field(load32(blk + (five ? 48 : 16) + (j / 2) * 32), (j % 2) * 4, 15);
    if constexpr (five) r.u = _mm256_or_si256(r.u, _mm256_slli_epi16(field(load32(blk + 16), j, 1), 4));
  } else {  // Q6_K
    const int i = static_cast<int>(g % 8), h = i / 4, t = i % 4;
    const uint8_t* blk = row + (g / 8) * 210;
    const __m256i lo = field(load32(blk + 64 * h + 32 * (t % 2)), 4 * (t / 2), 15);
    r.u = _mm256_or_si256(lo, _mm256_slli_epi16(field(load32(blk + 128 + 32 * h), 2 * t, 3), 4));
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    r.a = half(blk + 208);
    r.s0 = sc[2 * i];
    r.s1 = sc[2 * i + 1];
    r.b0 = -32.f * r.a * static_cast<float>(r.s0);
    r.b1 = -32.f * r.a * static_cast<float>(r.s1);
  }
  return r;
}

// NR weight rows of type T (not Q8_0) against MB activation rows (from m0); out[r * MB + m] is the whole dot product
template <int64_t T, int NR, int MB>
inline void fused_block(const uint8_t* const* rows, int64_t group_bytes, const QuantizedRows& a, int64_t m0,
                        float* out) {
  __m256 acc[NR][MB];
  float off[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) {
      acc[r][m] = _mm256_setzero_ps();
      off[r][m] = 0.f;
    }
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i xv[MB];
    float xd[MB], xs0[MB], xs1[MB];
    for (int m = 0; m < MB; ++m) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + m) + g * kGroup));
      xd[m] = a.drow(m0 + m)[g];
      xs0[m] = a.srow(m0 + m)[2 * g];
      xs1[m] = a.srow(m0 + m)[2 * g + 1];
    }
    for (int r = 0; r < NR; ++r) {
      __builtin_prefetch(rows[r] + g * group_bytes + kPrefetchBytes, 0, 3);
      const Group w = group<T>(rows[r], g);
      const __m256i pairs_scale = T == Q6_K ? _mm256_set_m128i(_mm_set1_epi16(w.s1), _mm_set1_epi16(w.s0))
                                            : _mm256_set1_epi16(1);
      for (int m = 0; m < MB; ++m) {
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, xv[m]), pairs_scale);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(w.a * xd[m]), acc[r][m]);
        off[r][m] += w.b0 * xs0[m] + w.b1 * xs1[m];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) out[r * MB + m] = hsum8(acc[r][m]) + off[r][m];
}

// rows [r0, r1) of a segment of type T against every activation row (M <= kFusedRows)
template <int64_t T, typename Out>
void fused_rows(const uint8_t* data, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedRows& a, int64_t M,
                const float* bias, int64_t first, Out* y, int64_t N) {
  const int64_t group_bytes = row_bytes / a.G;
  auto emit = [&](const float* out, int64_t r, int nr, int mb) {
    for (int i = 0; i < nr; ++i)
      for (int m = 0; m < mb; ++m)
        put(out[i * mb + m] + (bias ? bias[first + r + i] : 0.f), y + m * N + first + r + i);
  };
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint8_t* rows[4] = {data + r * row_bytes, data + (r + 1) * row_bytes, data + (r + 2) * row_bytes,
                              data + (r + 3) * row_bytes};
    float out[8];
    if (M == 2) fused_block<T, 4, 2>(rows, group_bytes, a, 0, out);
    else fused_block<T, 4, 1>(rows, group_bytes, a, 0, out);
    emit(out, r, 4, static_cast<int>(M));
  }
  for (; r < r1; ++r) {
    const uint8_t* rows[1] = {data + r * row_bytes};
    float out[2];
    if (M == 2) fused_block<T, 1, 2>(rows, group_bytes, a, 0, out);
    else fused_block<T, 1, 1>(rows, group_bytes, a, 0, out);
    emit(out, r, 1, static_cast<int>(M));
  }
}

template <typename Out>
void fused_rows(int64_t type, const uint8_t* data, int64_t row_bytes, int64_t r0, int64_t r1,
                const QuantizedRows& a, int64_t M, const float* bias, int64_t first, Out* y, int64_t N) {
  switch (type) {
    case Q4_0: fused_rows<Q4_0>(data, row_bytes, r0, r1, a, M, bias, first, y, N); break;
    case Q5_0: fused_rows<Q5_0>(data, row_bytes, r0, r1, a, M, bias, first, y, N); break;
    case Q4_K: fused_rows<Q4_K>(data, row_bytes, r0, r1, a, M, bias, first, y, N); break;
    case Q5_K: fused_rows<Q5_K>(data, row_bytes, r0, r1, a, M, bias, first, y, N); break;
    default: fused_rows<Q6_K>(data, row_bytes, r0, r1, a, M, bias, first, y, N); break;
  }
}
constexpr int64_t kFusedRows = 2;
#else
constexpr int64_t kFusedRows = 0;
#endif

#if defined(__AVX2__)
// ---- Three activation rows and more: eight weight rows interleaved, one output row a lane ----
// Eight decoded rows are laid out as the int8 kernel's tiles are: for every four k, the four codes of each of
// the 8 rows in one 32-byte vector, so one broadcast of four activation bytes multiplies 8 rows at once and
// each int32 lane sums one output row's group. A group's factor A and offset B are then vectors over the 8
// rows, and the float work (convert, scale, offsets) is a few instructions per group for 8 outputs, not per
// output: with one row a lane of 32 k, that float work shared the multiply ports with the integer products
// and halved the kernel's speed from 16 rows up.
constexpr int kTileRows = 8;
// activation rows from which the tiles pay for their transposes (Gemma 3 270M's layers on a Zen 3: at 4 rows
// the per-row path took 14-16 ms against the tiles' 17-20, at 16 rows 39-58 against 34-47)
constexpr int64_t kTileMinRows = 8;

struct Tile {
  std::vector<uint8_t> codes, signs;  // [G][8 steps][32]: Q8_0 keeps |w| in codes and w in signs
  std::vector<float> a, b;            // [G][8] factors, [2G][8] offsets of each half group
  std::vector<int16_t> s;             // [2G][16] Q6_K's scales: row r's in int16 lanes 2r and 2r + 1
  explicit Tile(int64_t K)
      : codes(K * kTileRows), signs(K * kTileRows), a(K / kGroup * kTileRows), b(K / 16 * kTileRows),
        s(K / 16 * 16) {}
};

// rows' decoded groups -> the tile (rows past `nr` are zero: their outputs are not stored)
void build_tile(int64_t type, const Decoded* w, int nr, int64_t G, Tile& t) {
  for (int64_t g = 0; g < G; ++g) {
    __m256i v[kTileRows];
    for (int r = 0; r < kTileRows; ++r) {
      v[r] = r < nr ? load32(w[r].codes + g * w[r].stride) : _mm256_setzero_si256();
      t.a[g * kTileRows + r] = r < nr ? w[r].a[g] : 0.f;
      if (type == Q8_0) continue;  // no offsets, one scale
      t.b[2 * g * kTileRows + r] = r < nr ? w[r].b16[2 * g] : 0.f;
      t.b[(2 * g + 1) * kTileRows + r] = r < nr ? w[r].b16[2 * g + 1] : 0.f;
      if (type != Q6_K) continue;
      for (int h = 0; h < 2; ++h) {
        const int16_t sc = r < nr ? w[r].s16[2 * g + h] : 1;
        t.s[(2 * g + h) * 16 + 2 * r] = t.s[(2 * g + h) * 16 + 2 * r + 1] = sc;
      }
    }
    // 8 x 8 transpose of int32 quads: out[j] holds quad j (k 4j..4j+3) of rows 0..7
    __m256i t4[8], u[8];
    for (int r = 0; r < 8; r += 2) {
      t4[r] = _mm256_unpacklo_epi32(v[r], v[r + 1]);
      t4[r + 1] = _mm256_unpackhi_epi32(v[r], v[r + 1]);
    }
    for (int q = 0; q < 8; q += 4) {
      u[q] = _mm256_unpacklo_epi64(t4[q], t4[q + 2]);
      u[q + 1] = _mm256_unpackhi_epi64(t4[q], t4[q + 2]);
      u[q + 2] = _mm256_unpacklo_epi64(t4[q + 1], t4[q + 3]);
      u[q + 3] = _mm256_unpackhi_epi64(t4[q + 1], t4[q + 3]);
    }
    uint8_t* out = t.codes.data() + g * 8 * 32;
    uint8_t* sout = t.signs.data() + g * 8 * 32;
    for (int j = 0; j < 4; ++j) {
      const __m256i lo = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);  // quad j
      const __m256i hi = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);  // quad j + 4
      if (type == Q8_0) {
        store32(sout + j * 32, lo);
        store32(sout + (j + 4) * 32, hi);
        store32(out + j * 32, _mm256_abs_epi8(lo));
        store32(out + (j + 4) * 32, _mm256_abs_epi8(hi));
      } else {
        store32(out + j * 32, lo);
        store32(out + (j + 4) * 32, hi);
      }
    }
  }
}

// MB activation rows (from m0) against a tile; out[m][r] the whole dot product of row r
template <Codes C, int MB>
inline void tile_dot(const Tile& t, const QuantizedRows& a, int64_t m0, __m256* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[MB];
  for (int m = 0; m < MB; ++m) f[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
    const uint8_t* wg = t.codes.data() + g * 8 * 32;
    const uint8_t* sg = t.signs.data() + g * 8 * 32;
    for (int j = 0; j < 8; ++j) {
      const __m256i w = load32(wg + j * 32);
      __m256i sw = w, scale = ones;
      if constexpr (C == Codes::Signed) sw = load32(sg + j * 32);
      if constexpr (C == Codes::Scaled16)
        scale = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.s.data() + (2 * g + j / 4) * 16));
      for (int m = 0; m < MB; ++m) {
        int32_t quad;
        std::memcpy(&quad, a.qrow(m0 + m) + g * kGroup + 4 * j, 4);
        __m256i xb = _mm256_set1_epi32(quad);
        if constexpr (C == Codes::Signed) xb = _mm256_sign_epi8(xb, sw);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xb), scale));
      }
    }
    const __m256 ag = _mm256_loadu_ps(t.a.data() + g * kTileRows);
    const __m256 b0 = _mm256_loadu_ps(t.b.data() + 2 * g * kTileRows);
    const __m256 b1 = _mm256_loadu_ps(t.b.data() + (2 * g + 1) * kTileRows);
    for (int m = 0; m < MB; ++m) {
      f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(ag, _mm256_set1_ps(a.drow(m0 + m)[g])), f[m]);
      if constexpr (C != Codes::Signed) {
        f[m] = _mm256_fmadd_ps(b0, _mm256_set1_ps(a.srow(m0 + m)[2 * g]), f[m]);
        f[m] = _mm256_fmadd_ps(b1, _mm256_set1_ps(a.srow(m0 + m)[2 * g + 1]), f[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = f[m];
}

template <Codes C, typename Out>
void tile_out(const Tile& t, const QuantizedRows& a, int64_t M, const float* bias, int64_t n0, int nr, Out* y,
              int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    __m256 out[4];
    const int64_t mb = std::min<int64_t>(4, M - m0);
    switch (mb) {
      case 4: tile_dot<C, 4>(t, a, m0, out); break;
      case 3: tile_dot<C, 3>(t, a, m0, out); break;
      case 2: tile_dot<C, 2>(t, a, m0, out); break;
      default: tile_dot<C, 1>(t, a, m0, out); break;
    }
    for (int64_t m = 0; m < mb; ++m) {
      alignas(32) float v[kTileRows];
      _mm256_store_ps(v, out[m]);
      for (int r = 0; r < nr; ++r) put(v[r] + (bias ? bias[n0 + r] : 0.f), y + (m0 + m) * N + n0 + r);
    }
  }
}

template <typename Out>
void tile_out(int64_t type, const Tile& t, const QuantizedRows& a, int64_t M, const float* bias, int64_t n0, int nr,
              Out* y, int64_t N) {
  if (type == Q8_0) tile_out<Codes::Signed>(t, a, M, bias, n0, nr, y, N);
  else if (type == Q6_K) tile_out<Codes::Scaled16>(t, a, M, bias, n0, nr, y, N);
  else tile_out<Codes::Unsigned>(t, a, M, bias, n0, nr, y, N);
}
#endif

struct Segment {
  int64_t type, rows, row_bytes, first;  // first: its first output column
  const uint8_t* data;
};

std::vector<Segment> segments(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& types,
                              int64_t K) {
  TORCH_CHECK(weights.size() == types.size() && !weights.empty(), "gguf_linear: one type per weight segment");
  std::vector<Segment> out;
  int64_t first = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    const Layout l = layout(types[i]);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
                "gguf_linear: a segment is a contiguous uint8 [rows, row bytes] tensor");
    TORCH_CHECK(K % l.values == 0 && w.size(1) == K / l.values * l.bytes, "gguf_linear: segment ", i,
                " holds rows of ", w.size(1), " bytes; K = ", K, " needs ", K / l.values * l.bytes);
    out.push_back({types[i], w.size(0), w.size(1), first, w.data_ptr<uint8_t>()});
    first += w.size(0);
  }
  return out;
}

constexpr int64_t kRowsPerItem = 16;  // rows a thread claims at a time
constexpr int kRowsPerBlock = 4;      // weight rows whose dot products run together

}  // namespace

// A few activation rows (float32 or bfloat16) against the segments' rows; returns [M, N] in x's dtype.
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x is [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "gguf_linear: x must be float32 or bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "gguf_linear: K must be a multiple of 32");
  const std::vector<Segment> segs = segments(weights, types, K);
  const int64_t N = segs.back().first + segs.back().rows;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows a = x.scalar_type() == torch::kFloat32 ? quantize_rows(x.data_ptr<float>(), M, K)
                                                              : quantize_rows(x.data_ptr<at::BFloat16>(), M, K);
  // work items: runs of kRowsPerItem rows of one segment
  std::vector<std::pair<int64_t, int64_t>> items;  // (segment, first row)
  for (size_t s = 0; s < segs.size(); ++s)
    for (int64_t r = 0; r < segs[s].rows; r += kRowsPerItem) items.emplace_back(s, r);
  auto run = [&](auto* Y) {
    parallel_claim(static_cast<int64_t>(items.size()), 1, [&](auto each) {
      std::vector<Decoded> w(std::max<int64_t>(kRowsPerBlock, 8), Decoded(K));
#if defined(__AVX2__)
      std::unique_ptr<Tile> tile = M >= kTileMinRows ? std::make_unique<Tile>(K) : nullptr;
#endif
      each([&](int64_t i) {
        const Segment& s = segs[items[i].first];
        const int64_t r1 = std::min(s.rows, items[i].second + kRowsPerItem);
#if defined(__AVX2__)
        if (M <= kFusedRows && s.type != Q8_0) {  // Q8_0 codes need no decoding: read in place below
          fused_rows(s.type, s.data, s.row_bytes, items[i].second, r1, a, M, B, s.first, Y, N);
          return;
        }
        if (M >= kTileMinRows) {
          for (int64_t r = items[i].second; r < r1; r += kTileRows) {
            const int nr = static_cast<int>(std::min<int64_t>(kTileRows, r1 - r));
            for (int j = 0; j < nr; ++j) decode_row(s.type, s.data + (r + j) * s.row_bytes, K, w[j]);
            build_tile(s.type, w.data(), nr, K / kGroup, *tile);
            tile_out(s.type, *tile, a, M, B, s.first + r, nr, Y, N);
          }
          return;
        }
#endif
        for (int64_t r = items[i].second; r < r1; r += kRowsPerBlock) {
          const int64_t nr = std::min<int64_t>(kRowsPerBlock, r1 - r);
          for (int64_t j = 0; j < nr; ++j) decode_row(s.type, s.data + (r + j) * s.row_bytes, K, w[j]);
          if (nr == kRowsPerBlock) {
            rows_out<kRowsPerBlock>(s.type, w.data(), a, M, B, s.first + r, Y, N);
          } else {
            for (int64_t j = 0; j < nr; ++j) rows_out<1>(s.type, w.data() + j, a, M, B, s.first + r + j, Y, N);
          }
        }
      });
    });
  };
  if (x.scalar_type() == torch::kFloat32) run(y.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

// One segment's rows [lo, hi) as float32 [hi - lo, K], computed as the `gguf` package's dequantize does
// (per type: d * q, d * (q - 8), d * (q - 16), (d * sc) * q - dmin * m, (d * s16) * (q - 32)).
torch::Tensor gguf_dequantize(torch::Tensor weight, int64_t type, int64_t K, int64_t lo, int64_t hi) {
  const std::vector<Segment> segs = segments({weight}, {type}, K);
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= weight.size(0), "gguf_dequantize: rows out of range");
  auto out = torch::empty({hi - lo, K}, weight.options().dtype(torch::kFloat32));
  float* O = out.data_ptr<float>();
  const Segment& s = segs[0];
  at::parallel_for(lo, hi, 16, [&](int64_t r0, int64_t r1) {
    Decoded w(K);
    for (int64_t r = r0; r < r1; ++r) {
      decode_row(type, s.data + r * s.row_bytes, K, w);
      float* o = O + (r - lo) * K;
      for (int64_t g = 0; g < K / kGroup; ++g) {
        const uint8_t* u = w.codes + g * w.stride;
        float* og = o + g * kGroup;
        if (type == Q8_0) {
          for (int j = 0; j < kGroup; ++j) og[j] = w.a[g] * static_cast<float>(static_cast<int8_t>(u[j]));
        } else if (type == Q6_K) {
          for (int j = 0; j < kGroup; ++j)
            og[j] = (w.a[g] * static_cast<float>(w.s16[2 * g + j / 16])) * static_cast<float>(u[j] - 32);
        } else if (type == Q4_K || type == Q5_K) {
          for (int j = 0; j < kGroup; ++j) og[j] = w.a[g] * static_cast<float>(u[j]) + w.b16[2 * g];
        } else {  // Q4_0 / Q5_0: d * (q - offset), offset = -B / d
          const int offset = type == Q4_0 ? 8 : 16;
          for (int j = 0; j < kGroup; ++j) og[j] = w.a[g] * static_cast<float>(static_cast<int>(u[j]) - offset);
        }
      }
    }
  });
  return out;
}

// Many activation rows against the segments' rows, chunk by chunk of weight rows dequantized into x's dtype
// for the dense matmul; returns [M, N] in x's dtype.
torch::Tensor gguf_linear_dense(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                                c10::optional<torch::Tensor> bias, int64_t chunk_rows) {
  TORCH_CHECK(x.dim() == 2 && chunk_rows > 0, "gguf_linear_dense: x is [M, K], chunk_rows > 0");
  const int64_t M = x.size(0), K = x.size(1);
  const std::vector<Segment> segs = segments(weights, types, K);
  const int64_t N = segs.back().first + segs.back().rows;
  auto y = torch::empty({M, N}, x.options());
  for (size_t i = 0; i < segs.size(); ++i) {
    for (int64_t lo = 0; lo < segs[i].rows; lo += chunk_rows) {
      const int64_t hi = std::min(segs[i].rows, lo + chunk_rows);
      auto w = gguf_dequantize(weights[i], types[i], K, lo, hi).to(x.scalar_type());
      y.narrow(1, segs[i].first + lo, hi - lo).copy_(at::mm(x, w.t()));
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(x.scalar_type()));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear, "a linear layer on GGUF blocks, a few float32/bfloat16 rows (CPU)");
  m.def("gguf_linear_dense", &gguf_linear_dense, "a linear layer on GGUF blocks, many rows, dense matmul per chunk");
  m.def("gguf_dequantize", &gguf_dequantize, "a segment's rows as float32, as the gguf package dequantizes");
  m.def("isa", [] { return std::string(kIsa); }, "the instruction set gguf_linear was built for");
}
