// A linear layer on a GGUF file's own quantized weights: y[M, N] = x[M, K] @ W^T (+ bias), W exactly the values
// the file's blocks (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) dequantize to: the values llama.cpp computes with.
//
// gguf_pack, once at load, decodes a run of rows as the file stores them (uint8 [rows, row bytes], K / block
// values per row, blocks back to back) into tiles of 8 rows. Each weight becomes a code u in one byte (Q8_0's
// stay signed) with, per group of 32, a float factor A and an offset B, so that w = A * u + B:
//   Q8_0  A = d,            u = q signed,   B = 0
//   Q4_0  A = d,            u = q (0..15),  B = -8 d
//   Q5_0  A = d,            u = q (0..31),  B = -16 d
//   Q4_K  A = d * sc,       u = q (0..15),  B = -dmin * m       (per sub-block of 32)
//   Q5_K  A = d * sc,       u = q (0..31),  B = -dmin * m
//   Q6_K  A = d * s16,      u = q (0..63),  B = -32 d * s16     (s16 a signed int8 scale per 16, applied in
//                                                                 vpmaddwd; B per 16)
// In a tile the codes are interleaved as the int8 kernel's are (every four k of the 8 rows in one 32-byte
// vector, one output row an int32 lane), A (and the k-quants' B) stored as vectors over the 8 rows: 9 bits a
// weight, 10 for the k-quants. The other types' B is an integer multiple of A, taken in the integer sums.
//
// gguf_linear: each activation row is quantized to int8 in groups of 32 with one float step (x ~= xq * xd,
// xd = max|x| / 127, as llama.cpp's Q8_0), and a group's dot product is A * xd * sum(u * xq) + B * xd * sum(xq):
// the integer sum exact (VNNI's vpdpbusd where the CPU has it, else AVX2's vpmaddubsw + vpmaddwd; Q8_0's sign
// moved onto the activation), the float work
// one convert, multiply and FMA per group for 8 output rows (and one FMA more for a k-quant's B). A portable loop serves CPUs without AVX2. A fused
// q/k/v layer whose v rows the file keeps in another type than q and k is several segments in one call.
//
// gguf_dequantize gives rows of the blocks as float32 with the `gguf` package's arithmetic, gguf_unpack the same
// values from the tiles (the references the tests hold the kernel to). Work is split over tiles (parallel_claim).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "amx.h"
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

// One weight from its code and its group's values, with the `gguf` package's arithmetic (its order of float
// operations, so both dequantizers match the package bit for bit): d * q, d * (q - 8), d * (q - 16),
// (d * sc) * q - dmin * m, (d * s16) * (q - 32). `a` is A (d, or d * sc for a k-quant), `b` a k-quant's B.
inline float weight_value(int64_t type, uint8_t u, float a, float b, int16_t s16) {
  switch (type) {
    case Q8_0: return a * static_cast<float>(static_cast<int8_t>(u));
    case Q6_K: return (a * static_cast<float>(s16)) * static_cast<float>(u - 32);
    case Q4_K:
    case Q5_K: return a * static_cast<float>(u) + b;
    default: return a * static_cast<float>(static_cast<int>(u) - (type == Q4_0 ? 8 : 16));
  }
}

// One weight row decoded (for gguf_pack's tiles, and gguf_dequantize): codes u [K] (signed for Q8_0), per group
// of 32 the factor A and, for a k-quant, its offset B; for Q6_K the int16 scale of each 16 (1 for other types).
// The other types' offsets follow from A (weight_value). Group g's 32 codes are at codes + g * stride: the
// buffer u (stride 32), or a Q8_0 row's own blocks (stride 34).
struct Decoded {
  std::vector<uint8_t> u;
  std::vector<float> a, b;
  std::vector<int16_t> s16;
  const uint8_t* codes = nullptr;
  int64_t stride = kGroup;
  explicit Decoded(int64_t K) : u(K), a(K / kGroup), b(K / kGroup), s16(K / 16, 1) {}
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
  // the rows are read once, in order: ask for the bytes kPrefetchBytes ahead
  const int64_t row_bytes = K / layout(type).values * layout(type).bytes;
  for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + kPrefetchBytes + off, 0, 3);
  uint8_t* u = d.u.data();
  d.codes = u;
  d.stride = kGroup;
  const int64_t G = K / kGroup;
  switch (type) {
    case Q8_0:  // the codes are read in place
      d.codes = row + 2;
      d.stride = 34;
      for (int64_t g = 0; g < G; ++g) d.a[g] = half(row + g * 34);
      return;
    case Q4_0:
    case Q5_0: {  // d * (q - 8), or d * (q - 16) with q's fifth bits in a 32-bit mask after d
      const bool five = type == Q5_0;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* blk = row + g * (five ? 22 : 18);
        d.a[g] = half(blk);
        uint8_t* o = u + g * kGroup;
        if (!five) {
          nibbles_split(blk + 2, o);
          continue;
        }
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
#if defined(__AVX2__)
        store32(o, _mm256_or_si256(nibbles32(blk + 6), bits32(qh, 0x10)));
#else
        nibbles_split(blk + 6, o);
        for (int j = 0; j < 32; ++j) o[j] |= ((qh >> j) & 1) << 4;
#endif
      }
      break;
    }
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
          d.b[g] = -(dmin * static_cast<float>(m));
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
            d.s16[2 * g] = sc[2 * (h * 4 + t)];
            d.s16[2 * g + 1] = sc[2 * (h * 4 + t) + 1];
          }
        }
      }
      break;
    default: TORCH_CHECK(false, "gguf_linear: GGML type ", type, " is not supported");
  }
}

// The quantized activation rows: q [M, K]; per group of 32 its step d, its sum of xq as one int32 (isum) and as
// the two int16 sums of its halves (pair: the first in the low half), and xd * isum (xs).
struct QuantizedRows {
  int64_t K, G;
  std::vector<int8_t> q;
  std::vector<float> d, xs;
  std::vector<int32_t> isum, pair;
  const int8_t* qrow(int64_t m) const { return q.data() + m * K; }
  float dg(int64_t m, int64_t g) const { return d[m * G + g]; }
  float xsg(int64_t m, int64_t g) const { return xs[m * G + g]; }
  int32_t isumg(int64_t m, int64_t g) const { return isum[m * G + g]; }
  int32_t pairg(int64_t m, int64_t g) const { return pair[m * G + g]; }
};

// x [M, K] rounded per group; rows M .. Mp - 1 are zero (AMX's tiles read 16 rows at a time)
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K, int64_t Mp) {
  const int64_t G = K / kGroup;
  QuantizedRows r{K, G, std::vector<int8_t>(Mp * K), std::vector<float>(Mp * G), std::vector<float>(Mp * G),
                  std::vector<int32_t>(Mp * G), std::vector<int32_t>(Mp * G)};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        float v[kGroup], amax = 0.f;
        for (int j = 0; j < kGroup; ++j) {
          v[j] = static_cast<float>(x[m * K + g * kGroup + j]);
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f, xd = amax / 127.f;
        int8_t* q = r.q.data() + m * K + g * kGroup;
        int32_t sums[2] = {0, 0};  // |each| <= 16 * 127: an int16
        for (int j = 0; j < kGroup; ++j) {
          q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
          sums[j / 16] += q[j];
        }
        r.d[m * G + g] = xd;
        r.isum[m * G + g] = sums[0] + sums[1];
        r.xs[m * G + g] = xd * static_cast<float>(sums[0] + sums[1]);
        r.pair[m * G + g] = static_cast<int32_t>((static_cast<uint32_t>(sums[1]) << 16) | (sums[0] & 0xFFFF));
      }
    }
  });
  return r;
}

// How a type's offsets are taken: none (Q8_0, signed codes), a constant times each group's sum of xq in int32
// (Q4_0: 8, Q5_0: 16), -32 times each half's scale times its sum, in int32 (Q6_K), or a float offset per row
// and group (the k-quants' mins).
enum class Codes { Signed, Offset, Scaled16, Affine };


// ---- Eight weight rows interleaved, one output row a lane: the tiles ----
// Eight decoded rows laid out as the int8 kernel's tiles are: for every four k, the four codes of each of the 8
// rows in one 32-byte vector, so one broadcast of four activation bytes multiplies 8 rows at once and each
// int32 lane sums one output row's group. A group's factor A and offset B are vectors over the 8 rows, and the
// float work (convert, scale, offsets) is a few instructions per group for 8 outputs, not per output: with one
// output row a lane of 32 k, that float work shared the multiply ports with the integer products and halved
// the kernel's speed from 16 rows up. Tiles are built once, at load (gguf_pack): the file's exact values in 9
// to 10 bits a weight, against the blocks' 4.5-8.5, because decoding the blocks at every step (a Q5_0
// group's nibbles, its fifth bits spread from a mask, its fp16 step: ~20 instructions) cost more than the
// bytes it saved: on Gemma 3 270M on a Zen 3, 1.3-1.4x the time of these tiles at 2 to 16 rows, the same at 1.
constexpr int kTileRows = 8;

// One tile: codes [G][8 steps][32] (Q8_0: its signed codes), a [G][8] factors, b [G][8] the k-quants' offsets
// (-dmin * m; the other types' offsets are integers, taken in the integer sums), s [2G][16] Q6_K's scales, row
// r's in int16 lanes 2r and 2r + 1 (Q6_K only).
template <typename U, typename F, typename S>
struct TileOf {
  U* codes;
  F* a;
  F* b;
  S* s;
};
using TileOut = TileOf<uint8_t, float, int16_t>;
using TileIn = TileOf<const uint8_t, const float, const int16_t>;

// per-tile sizes in elements
inline int64_t tile_codes(int64_t G) { return G * 8 * 32; }
inline int64_t tile_a(int64_t G) { return G * kTileRows; }
inline int64_t tile_b(int64_t G) { return G * kTileRows; }
inline int64_t tile_s(int64_t G) { return 2 * G * 16; }

// rows' decoded groups -> a tile (rows past `nr` are zero: their outputs are not stored)
void build_tile(int64_t type, const Decoded* w, int nr, int64_t G, TileOut t) {
  for (int64_t g = 0; g < G; ++g) {
    for (int r = 0; r < kTileRows; ++r) {
      t.a[g * kTileRows + r] = r < nr ? w[r].a[g] : 0.f;
      if (type == Q4_K || type == Q5_K) t.b[g * kTileRows + r] = r < nr ? w[r].b[g] : 0.f;
      if (type != Q6_K) continue;
      for (int h = 0; h < 2; ++h) {
        const int16_t sc = r < nr ? w[r].s16[2 * g + h] : 1;
        t.s[(2 * g + h) * 16 + 2 * r] = t.s[(2 * g + h) * 16 + 2 * r + 1] = sc;
      }
    }
    uint8_t* out = t.codes + g * 8 * 32;
#if defined(__AVX2__)
    __m256i v[kTileRows], t4[8], u[8];
    for (int r = 0; r < kTileRows; ++r) v[r] = r < nr ? load32(w[r].codes + g * w[r].stride) : _mm256_setzero_si256();
    // 8 x 8 transpose of int32 quads: vector j holds quad j (k 4j..4j+3) of rows 0..7
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
    for (int j = 0; j < 4; ++j) {
      store32(out + j * 32, _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
      store32(out + (j + 4) * 32, _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
    }
#else
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < kTileRows; ++r)
        for (int kk = 0; kk < 4; ++kk)
          out[j * 32 + r * 4 + kk] = r < nr ? w[r].codes[g * w[r].stride + 4 * j + kk] : 0;
#endif
  }
}

#if defined(__AVX2__)
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define INFERD_GGUF_VNNI 1
// 32 unsigned bytes times 32 signed bytes, summed in fours into acc's 8 int32 lanes
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#endif

// A tile's codes stream once per call: ask for them kPrefetchBytes ahead, a group's four lines at a time (a Xeon's
// batch-1 step 15.8 against 18.9 ms with the hardware prefetcher alone)
inline void prefetch_group(const uint8_t* wg) {
  for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchBytes + 64 * l), _MM_HINT_T0);
}

// activation row m's quad j (four int8s) of group g, as one int32 to broadcast
inline int32_t quad_of(const QuantizedRows& a, int64_t m, int64_t g, int j) {
  int32_t quad;
  std::memcpy(&quad, a.qrow(m) + g * kGroup + 4 * j, 4);
  return quad;
}

// What turns a tile's group g of integer sums into float sums, over its 8 rows: the factors A (and a k-quant's
// B), and Q6_K's scales, row r's in int16 lanes 2r and 2r + 1 of s0 (the first 16 k; ones for the other types)
// and s1 (the last 16), and both as (s0, s1) pairs.
struct GroupScales {
  __m256 a, b;
  __m256i s0, s1, pairs;
};

template <Codes C>
inline GroupScales group_scales(TileIn t, int64_t g) {
  GroupScales s{_mm256_loadu_ps(t.a + g * kTileRows), _mm256_setzero_ps(), _mm256_set1_epi16(1),
                _mm256_set1_epi16(1), _mm256_setzero_si256()};
  if constexpr (C == Codes::Affine) s.b = _mm256_loadu_ps(t.b + g * kTileRows);
  if constexpr (C == Codes::Scaled16) {
    s.s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.s + 2 * g * 16));
    s.s1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.s + (2 * g + 1) * 16));
    s.pairs = _mm256_blend_epi16(s.s0, s.s1, 0xAA);
  }
  return s;
}

// Q6_K with its halves summed apart (vpdpbusd, AMX): each half's sums times its scale, as int32 lanes
inline __m256i scaled_halves(__m256i h0, __m256i h1, const GroupScales& s) {
  return _mm256_add_epi32(_mm256_mullo_epi32(h0, _mm256_srai_epi32(s.s0, 16)),
                          _mm256_mullo_epi32(h1, _mm256_srai_epi32(s.s1, 16)));
}

// Row m's integer sums of group g (Q6_K's already scaled) added into its float sums f: the offsets that are
// integers taken first (Offset: - c * sum(xq); Q6_K: - 32 * (s0 * sum of the first 16 xq + s1 * the last 16's)),
// then A * xd, then a k-quant's mins, B * xd * sum(xq). Every path takes its sums through here, in this order.
template <Codes C>
inline __m256 group_step(__m256i acc, const GroupScales& s, const QuantizedRows& a, int64_t m, int64_t g, int32_t c,
                         __m256 f) {
  if constexpr (C == Codes::Offset) {
    acc = _mm256_sub_epi32(acc, _mm256_set1_epi32(c * a.isumg(m, g)));
  } else if constexpr (C == Codes::Scaled16) {
    const __m256i off = _mm256_madd_epi16(s.pairs, _mm256_set1_epi32(a.pairg(m, g)));
    acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(off, 5));
  }
  f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(s.a, _mm256_set1_ps(a.dg(m, g))), f);
  if constexpr (C == Codes::Affine) f = _mm256_fmadd_ps(s.b, _mm256_set1_ps(a.xsg(m, g)), f);
  return f;
}
#endif

// MB activation rows (from m0) against a tile; out[m * 8 + r] the whole dot product of row r. `c`: Offset's
// constant (8 for Q4_0, 16 for Q5_0).
template <Codes C, int MB>
inline void tile_dot(TileIn t, const QuantizedRows& a, int64_t m0, int32_t c, float* out) {
#if defined(__AVX2__)
  __m256 f[MB];
  for (int m = 0; m < MB; ++m) f[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
    const uint8_t* wg = t.codes + g * 8 * 32;
    if (m0 == 0) prefetch_group(wg);
    const GroupScales s = group_scales<C>(t, g);
#if defined(INFERD_GGUF_VNNI)
    // vpdpbusd sums the four products in int32 (the same integers as vpmaddubsw + vpmaddwd, which never
    // saturate on these codes); Q6_K's halves are summed apart and scaled once per group
    __m256i half1[MB];
    for (int m = 0; m < MB; ++m) half1[m] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = load32(wg + j * 32);
      const __m256i uw = C == Codes::Signed ? _mm256_abs_epi8(w) : w;
      for (int m = 0; m < MB; ++m) {
        __m256i xb = _mm256_set1_epi32(quad_of(a, m0 + m, g, j));
        if constexpr (C == Codes::Signed) xb = _mm256_sign_epi8(xb, w);
        if (C == Codes::Scaled16 && j >= 4) half1[m] = dpbusd256(half1[m], uw, xb);
        else acc[m] = dpbusd256(acc[m], uw, xb);
      }
    }
    if constexpr (C == Codes::Scaled16)
      for (int m = 0; m < MB; ++m) acc[m] = scaled_halves(acc[m], half1[m], s);
#else
    for (int j = 0; j < 8; ++j) {
      const __m256i w = load32(wg + j * 32);
      const __m256i uw = C == Codes::Signed ? _mm256_abs_epi8(w) : w;
      const __m256i scale = j < 4 ? s.s0 : s.s1;
      for (int m = 0; m < MB; ++m) {
        __m256i xb = _mm256_set1_epi32(quad_of(a, m0 + m, g, j));
        if constexpr (C == Codes::Signed) xb = _mm256_sign_epi8(xb, w);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(uw, xb), scale));
      }
    }
#endif
    for (int m = 0; m < MB; ++m) f[m] = group_step<C>(acc[m], s, a, m0 + m, g, c, f[m]);
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * 8, f[m]);
#else
  for (int m = 0; m < MB; ++m) {
    const int8_t* xq = a.qrow(m0 + m);
    for (int r = 0; r < kTileRows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < a.G; ++g) {
        int32_t sums[2] = {0, 0};
        for (int j = 0; j < 8; ++j)
          for (int kk = 0; kk < 4; ++kk) {
            const uint8_t u = t.codes[g * 256 + j * 32 + r * 4 + kk];
            const int32_t code = C == Codes::Signed ? static_cast<int8_t>(u) : u;
            sums[j / 4] += code * xq[g * kGroup + 4 * j + kk];
          }
        int32_t dot = sums[0] + sums[1];
        const int32_t pair = a.pairg(m0 + m, g);
        const int32_t half0 = static_cast<int16_t>(pair & 0xFFFF), half1 = pair >> 16;
        if (C == Codes::Offset) dot -= c * a.isumg(m0 + m, g);
        if (C == Codes::Scaled16) {
          const int32_t sa = t.s[2 * g * 16 + 2 * r], sb = t.s[(2 * g + 1) * 16 + 2 * r];
          dot = sums[0] * sa + sums[1] * sb - 32 * (sa * half0 + sb * half1);
        }
        total += t.a[g * kTileRows + r] * a.dg(m0 + m, g) * static_cast<float>(dot);
        if (C == Codes::Affine) total += t.b[g * kTileRows + r] * a.xsg(m0 + m, g);
      }
      out[m * 8 + r] = total;
    }
  }
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(INFERD_GGUF_VNNI)
#define INFERD_GGUF_AMX 1
// AMX (Intel Sapphire Rapids and later), from 8 activation rows: a tile's group of 32 k is exactly an AMX B tile of
// 8 quads x 8 outputs (its 256 code bytes as they lie), so one TDPBSUD (TDPBSSD for Q8_0's signed codes) takes
// 16 rows x 32 k x 8 outputs, 128 vpdpbusd's work. The int32 sums go through memory (a tile store) to take the
// group's float step as the vpdpbusd path takes it, in the same order: the two give the same bits, so a row's
// outputs do not depend on how many rows share the call.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxMinRows = 8;  // below, a row tile would be mostly padding
bool amx_enabled = true;            // tests switch it off to compare the two paths
bool use_amx(int64_t M) { return amx_enabled && M >= kAmxMinRows && amx_permitted(); }

// Per thread (tile configuration is thread state): A 0 (16 rows x 32 k), B 1 (a group's 8 quads x 8 rows), C 2
// (16 x 8 int32); Q6_K's halves of 16 k: A 3, B 4 (4 quads), C 5 and 6.
void configure_tiles() {
  TileConfig c;
  const int rows[7] = {kAmxRows, 8, kAmxRows, kAmxRows, 4, kAmxRows, kAmxRows};
  const int colsb[7] = {32, 32, 32, 16, 32, 32, 32};
  for (int i = 0; i < 7; ++i) c.rows[i] = static_cast<uint8_t>(rows[i]), c.colsb[i] = static_cast<uint16_t>(colsb[i]);
  load_tile_config(c);
}

// Rows m0 .. m0 + 15 (zero past M) against a tile: out[m * 8 + r], as tile_dot computes it.
template <Codes C>
void amx_tile_dot(TileIn t, const QuantizedRows& a, int64_t m0, int32_t c, float* out) {
  __m256 f[kAmxRows];
  for (auto& v : f) v = _mm256_setzero_ps();
  alignas(64) int32_t sums[2][kAmxRows][kTileRows];
  const int8_t* A = a.qrow(m0);
  const int lda = static_cast<int>(a.K);
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = t.codes + g * 8 * 32;
    if (m0 == 0) prefetch_group(wg);
    if constexpr (C == Codes::Scaled16) {  // the two halves of 16 k apart: each has its own scale
      _tile_zero(5);
      _tile_zero(6);
      _tile_loadd(3, A + g * kGroup, lda);
      _tile_loadd(4, wg, 32);
      _tile_dpbsud(5, 3, 4);
      _tile_loadd(3, A + g * kGroup + 16, lda);
      _tile_loadd(4, wg + 4 * 32, 32);
      _tile_dpbsud(6, 3, 4);
      _tile_stored(5, sums[0], 32);
      _tile_stored(6, sums[1], 32);
    } else {
      _tile_zero(2);
      _tile_loadd(0, A + g * kGroup, lda);
      _tile_loadd(1, wg, 32);
      if constexpr (C == Codes::Signed) _tile_dpbssd(2, 0, 1);
      else _tile_dpbsud(2, 0, 1);
      _tile_stored(2, sums[0], 32);
    }
    const GroupScales s = group_scales<C>(t, g);
    for (int m = 0; m < kAmxRows; ++m) {
      __m256i acc = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums[0][m]));
      if constexpr (C == Codes::Scaled16)
        acc = scaled_halves(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(sums[1][m])), s);
      f[m] = group_step<C>(acc, s, a, m0 + m, g, c, f[m]);
    }
  }
  for (int m = 0; m < kAmxRows; ++m) _mm256_storeu_ps(out + m * 8, f[m]);
}
#endif

template <Codes C, typename Out>
void tile_out(TileIn t, const QuantizedRows& a, int64_t M, int32_t c, const float* bias, int64_t n0, int nr, Out* y,
              int64_t N, bool amx) {
#if defined(INFERD_GGUF_AMX)
  if (amx) {
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      float out[kAmxRows * kTileRows];
      amx_tile_dot<C>(t, a, m0, c, out);
      for (int64_t m = 0; m < std::min<int64_t>(kAmxRows, M - m0); ++m)
        for (int r = 0; r < nr; ++r) put(out[m * 8 + r] + (bias ? bias[n0 + r] : 0.f), y + (m0 + m) * N + n0 + r);
    }
    return;
  }
#endif
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    float out[4 * kTileRows];
    const int64_t mb = std::min<int64_t>(4, M - m0);
    switch (mb) {
      case 4: tile_dot<C, 4>(t, a, m0, c, out); break;
      case 3: tile_dot<C, 3>(t, a, m0, c, out); break;
      case 2: tile_dot<C, 2>(t, a, m0, c, out); break;
      default: tile_dot<C, 1>(t, a, m0, c, out); break;
    }
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < nr; ++r) put(out[m * 8 + r] + (bias ? bias[n0 + r] : 0.f), y + (m0 + m) * N + n0 + r);
  }
}

template <typename Out>
void tile_out(int64_t type, TileIn t, const QuantizedRows& a, int64_t M, const float* bias, int64_t n0, int nr,
              Out* y, int64_t N, bool amx) {
  switch (type) {
    case Q8_0: tile_out<Codes::Signed>(t, a, M, 0, bias, n0, nr, y, N, amx); break;
    case Q4_0: tile_out<Codes::Offset>(t, a, M, 8, bias, n0, nr, y, N, amx); break;
    case Q5_0: tile_out<Codes::Offset>(t, a, M, 16, bias, n0, nr, y, N, amx); break;
    case Q6_K: tile_out<Codes::Scaled16>(t, a, M, 0, bias, n0, nr, y, N, amx); break;
    default: tile_out<Codes::Affine>(t, a, M, 0, bias, n0, nr, y, N, amx); break;
  }
}

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


// ---- Compact tiles: a few activation rows on the file's own bits (AVX-512 VNNI) ----
// The tiles above hold a code a byte (9-10 bits a weight with the factors), which reads more bytes than int8 at
// batch 1. Compact tiles keep the file's bits: 16 rows a tile (one int32 lane each, as the int8 kernel's), a
// group of 32 k in one run of bytes: for the 4- and 5-bit types the codes as nibbles (quads j and j + 4 of the
// 16 rows in one 64-byte vector, low and high nibbles), Q5_0/Q5_K's fifth bits in 64 bytes more (byte i: bit j
// the fifth bit of quad j's byte i), then A (fp16 where it is the file's fp16 step: Q4_0, Q5_0, Q8_0; else
// float32) and a k-quant's B. Q5_0 is 5.5 bits a weight as in the file, Q4_0 4.5, Q4_K 6, Q8_0 8.5 (its codes
// stored + 128, unsigned, the offset taken off as Q5_0's 16 is). Q6_K has none. The integer sums and the
// float steps are those of tile_dot, in the same order: the same bits as the 8-row tiles.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define INFERD_GGUF_COMPACT 1
#endif

constexpr int64_t kCRows = 16;

inline bool compact_type(int64_t type) { return type == Q4_0 || type == Q5_0 || type == Q8_0 || type == Q4_K || type == Q5_K; }
inline bool k_quant(int64_t type) { return type == Q4_K || type == Q5_K; }
inline bool nibbles(int64_t type) { return type != Q8_0; }                   // codes as nibbles (else bytes)
inline bool fifth_bits(int64_t type) { return type == Q5_0 || type == Q5_K; }  // and a plane of fifth bits

// Where the parts of a group start in a compact tile, and its bytes
struct CompactGroup {
  int64_t hb, a, b, bytes;
  explicit CompactGroup(int64_t type) {
    hb = nibbles(type) ? 4 * 64 : 8 * 64;
    a = hb + (fifth_bits(type) ? 64 : 0);
    b = a + (k_quant(type) ? 64 : 32);
    bytes = b + (k_quant(type) ? 64 : 0);
  }
};

// Offset's constant of a compact type (Q8_0's codes are stored + 128)
inline int32_t compact_offset(int64_t type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0; }

// 16 decoded rows (rows past nr zero) -> one compact tile of G groups at out
void build_compact(int64_t type, const Decoded* w, int nr, int64_t G, uint8_t* out) {
  const CompactGroup cg(type);
  const bool nib = nibbles(type), five = fifth_bits(type);
  for (int64_t g = 0; g < G; ++g) {
    uint8_t* o = out + g * cg.bytes;
    std::memset(o, 0, cg.bytes);
    auto code = [&](int r, int j, int kk) -> uint8_t {
      return r < nr ? w[r].codes[g * w[r].stride + 4 * j + kk] : 0;
    };
    for (int r = 0; r < kCRows; ++r)
      for (int kk = 0; kk < 4; ++kk) {
        const int at = r * 4 + kk;
        if (!nib) {
          for (int j = 0; j < 8; ++j) o[j * 64 + at] = static_cast<uint8_t>(code(r, j, kk) ^ 0x80);
          continue;
        }
        for (int q = 0; q < 4; ++q) {
          const uint8_t lo = code(r, q, kk), hi = code(r, q + 4, kk);
          o[q * 64 + at] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
          if (five) o[cg.hb + at] |= static_cast<uint8_t>((((lo >> 4) & 1) << q) | (((hi >> 4) & 1) << (q + 4)));
        }
      }
    for (int r = 0; r < kCRows; ++r) {
      const float a = r < nr ? w[r].a[g] : 0.f;
      if (k_quant(type)) {
        const float b = r < nr ? w[r].b[g] : 0.f;
        std::memcpy(o + cg.a + 4 * r, &a, 4);
        std::memcpy(o + cg.b + 4 * r, &b, 4);
        continue;
      }
      const uint16_t h = c10::Half(a).x;
      TORCH_CHECK(static_cast<float>(c10::Half(h, c10::Half::from_bits())) == a, "gguf_pack_compact: a step is not fp16");
      std::memcpy(o + cg.a + 2 * r, &h, 2);
    }
  }
}

// A compact group's code of row r at k = 4j + kk, as decode_row gives it (Q8_0's back to its signed byte)
inline uint8_t compact_code(int64_t type, const uint8_t* o, const CompactGroup& cg, int r, int j, int kk) {
  const int at = r * 4 + kk;
  if (!nibbles(type)) return static_cast<uint8_t>(o[j * 64 + at] ^ 0x80);
  const uint8_t v = o[(j % 4) * 64 + at];
  uint8_t u = j < 4 ? (v & 15) : (v >> 4);
  if (fifth_bits(type)) u |= ((o[cg.hb + at] >> j) & 1) << 4;
  return u;
}

#if defined(INFERD_GGUF_COMPACT)
// MB activation rows (from m0) against one compact tile: f[m] its 16 outputs' sums
template <Codes C, bool Nib, bool Five, int MB>
void compact_dot(const uint8_t* tile, int64_t G, const CompactGroup& cg, const QuantizedRows& a, int64_t m0,
                 int32_t c, __m512* f) {
  for (int m = 0; m < MB; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = tile + g * cg.bytes;
    if (m0 == 0)
      for (int64_t off = 0; off < cg.bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + off), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (Nib) {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(p + q * 64);
        w[q] = _mm512_and_si512(v, low);
        w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      if constexpr (Five) {  // bit j of the plane's byte -> bit 4 of w[j]'s: w | (shifted & 0x10) in one op
        const __m512i h = _mm512_loadu_si512(p + cg.hb), bit = _mm512_set1_epi8(0x10);
        w[0] = _mm512_ternarylogic_epi32(w[0], _mm512_slli_epi16(h, 4), bit, 0xF8);
        w[1] = _mm512_ternarylogic_epi32(w[1], _mm512_slli_epi16(h, 3), bit, 0xF8);
        w[2] = _mm512_ternarylogic_epi32(w[2], _mm512_slli_epi16(h, 2), bit, 0xF8);
        w[3] = _mm512_ternarylogic_epi32(w[3], _mm512_slli_epi16(h, 1), bit, 0xF8);
        w[4] = _mm512_ternarylogic_epi32(w[4], h, bit, 0xF8);
        w[5] = _mm512_ternarylogic_epi32(w[5], _mm512_srli_epi16(h, 1), bit, 0xF8);
        w[6] = _mm512_ternarylogic_epi32(w[6], _mm512_srli_epi16(h, 2), bit, 0xF8);
        w[7] = _mm512_ternarylogic_epi32(w[7], _mm512_srli_epi16(h, 3), bit, 0xF8);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(p + j * 64);
    }
    const __m512 A = C == Codes::Affine
                         ? _mm512_loadu_ps(reinterpret_cast<const float*>(p + cg.a))
                         : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + cg.a)));
    for (int m = 0; m < MB; ++m) {
      __m512i acc = C == Codes::Offset ? _mm512_set1_epi32(-c * a.isumg(m0 + m, g)) : _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) acc = _mm512_dpbusd_epi32(acc, w[j], _mm512_set1_epi32(quad_of(a, m0 + m, g, j)));
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(A, _mm512_set1_ps(a.dg(m0 + m, g))), f[m]);
      if constexpr (C == Codes::Affine)
        f[m] = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(p + cg.b)),
                               _mm512_set1_ps(a.xsg(m0 + m, g)), f[m]);
    }
  }
}

template <Codes C, bool Nib, bool Five, typename Out>
void compact_out(const uint8_t* tile, int64_t G, const CompactGroup& cg, const QuantizedRows& a, int64_t M,
                 int32_t c, const float* bias, int64_t n0, int nr, Out* y, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    __m512 f[4];
    const int64_t mb = std::min<int64_t>(4, M - m0);
    switch (mb) {
      case 4: compact_dot<C, Nib, Five, 4>(tile, G, cg, a, m0, c, f); break;
      case 3: compact_dot<C, Nib, Five, 3>(tile, G, cg, a, m0, c, f); break;
      case 2: compact_dot<C, Nib, Five, 2>(tile, G, cg, a, m0, c, f); break;
      default: compact_dot<C, Nib, Five, 1>(tile, G, cg, a, m0, c, f); break;
    }
    for (int64_t m = 0; m < mb; ++m) {
      alignas(64) float out[kCRows];
      _mm512_store_ps(out, f[m]);
      for (int r = 0; r < nr; ++r) put(out[r] + (bias ? bias[n0 + r] : 0.f), y + (m0 + m) * N + n0 + r);
    }
  }
}

template <typename Out>
void compact_out(int64_t type, const uint8_t* tile, int64_t G, const QuantizedRows& a, int64_t M, const float* bias,
                 int64_t n0, int nr, Out* y, int64_t N) {
  const CompactGroup cg(type);
  const int32_t c = compact_offset(type);
  switch (type) {
    case Q4_0: return compact_out<Codes::Offset, true, false>(tile, G, cg, a, M, c, bias, n0, nr, y, N);
    case Q5_0: return compact_out<Codes::Offset, true, true>(tile, G, cg, a, M, c, bias, n0, nr, y, N);
    case Q8_0: return compact_out<Codes::Offset, false, false>(tile, G, cg, a, M, c, bias, n0, nr, y, N);
    case Q4_K: return compact_out<Codes::Affine, true, false>(tile, G, cg, a, M, c, bias, n0, nr, y, N);
    default: return compact_out<Codes::Affine, true, true>(tile, G, cg, a, M, c, bias, n0, nr, y, N);
  }
}
#endif

// A call's segments laid out: each one's first output column, its tiles as (segment, tile) items, the outputs'
// count N and the bias in float32. `fits(i, tiles)` checks segment i's tiles (it has `tiles` of `tile_rows` rows).
struct Plan {
  std::vector<int64_t> first;
  std::vector<std::pair<int64_t, int64_t>> items;
  int64_t N = 0;
  torch::Tensor bias;
  const float* B() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

template <typename Fits>
Plan plan(const std::vector<int64_t>& rows, int64_t tile_rows, const c10::optional<torch::Tensor>& bias, Fits fits) {
  Plan p;
  p.first.assign(rows.size() + 1, 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t T = (rows[i] + tile_rows - 1) / tile_rows;
    fits(i, T);
    p.first[i + 1] = p.first[i] + rows[i];
    for (int64_t t = 0; t < T; ++t) p.items.emplace_back(i, t);
  }
  p.N = p.first.back();
  if (bias.has_value() && bias->defined()) p.bias = bias->to(torch::kFloat32).contiguous();
  return p;
}

}  // namespace

// One segment's rows [lo, hi) as float32 [hi - lo, K], computed as the `gguf` package's dequantize does
// (weight_value).
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
        for (int j = 0; j < kGroup; ++j)
          o[g * kGroup + j] = weight_value(type, u[j], w.a[g], w.b[g], w.s16[2 * g + j / 16]);
      }
    }
  });
  return out;
}

// ---- A layer's tiles built once at load ----

// One segment's rows as tiles: [codes uint8 [T, G*256], a float32 [T, G*8], b float32 [T, G*8] (k-quants; else
// empty), s int16 [T, 2G*16] (Q6_K; else empty)] for T = ceil(rows / 8) tiles (the last one's missing rows zero).
std::vector<torch::Tensor> gguf_pack(torch::Tensor weight, int64_t type, int64_t K) {
  const std::vector<Segment> segs = segments({weight}, {type}, K);
  const Segment& sg = segs[0];
  const int64_t G = K / kGroup, T = (sg.rows + kTileRows - 1) / kTileRows;
  auto u8 = weight.options(), f32 = weight.options().dtype(torch::kFloat32);
  torch::Tensor codes = torch::empty({T, tile_codes(G)}, u8), a = torch::empty({T, tile_a(G)}, f32),
                b = torch::empty({T, type == Q4_K || type == Q5_K ? tile_b(G) : 0}, f32),
                s = torch::ones({T, type == Q6_K ? tile_s(G) : 0}, weight.options().dtype(torch::kInt16));
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<Decoded> w(kTileRows, Decoded(K));
    for (int64_t t = t0; t < t1; ++t) {
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, sg.rows - t * kTileRows));
      for (int j = 0; j < nr; ++j) decode_row(type, sg.data + (t * kTileRows + j) * sg.row_bytes, K, w[j]);
      TileOut out{codes.data_ptr<uint8_t>() + t * tile_codes(G), a.data_ptr<float>() + t * tile_a(G),
                  b.numel() ? b.data_ptr<float>() + t * tile_b(G) : nullptr,
                  type == Q6_K ? s.data_ptr<int16_t>() + t * tile_s(G) : nullptr};
      build_tile(type, w.data(), nr, G, out);  // Q8_0's tile holds its codes signed, as the file does
    }
  });
  return {codes, a, b, s};
}

// A few hundred activation rows (float32 or bfloat16) against layers packed by gguf_pack: per segment its
// type, number of rows and (codes, a, b, s); returns [M, N] in x's dtype.
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> tiles, std::vector<int64_t> types,
                          std::vector<int64_t> rows, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "gguf_linear: x is float32 or bfloat16 [M, K]");
  TORCH_CHECK(tiles.size() == 4 * types.size() && rows.size() == types.size() && !types.empty(),
              "gguf_linear: four tensors (codes, a, b, s) and a row count per segment");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "gguf_linear: K must be a multiple of 32");
  const Plan pl = plan(rows, kTileRows, bias, [&](size_t i, int64_t T) {
    layout(types[i]);
    TORCH_CHECK(tiles[4 * i].is_contiguous() && tiles[4 * i].size(0) == T && tiles[4 * i].size(1) == tile_codes(G),
                "gguf_linear: segment ", i, "'s tiles do not fit K = ", K, " and ", rows[i], " rows");
  });
  auto y = torch::empty({M, pl.N}, x.options());
  if (M == 0) return y;
#if defined(INFERD_GGUF_AMX)
  const bool amx = use_amx(M);
  const int64_t Mp = amx ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M;
#else
  const bool amx = false;
  const int64_t Mp = M;
#endif
  const QuantizedRows a = x.scalar_type() == torch::kFloat32 ? quantize_rows(x.data_ptr<float>(), M, K, Mp)
                                                              : quantize_rows(x.data_ptr<at::BFloat16>(), M, K, Mp);
  auto run = [&](auto* Y) {
    parallel_claim(static_cast<int64_t>(pl.items.size()), 2, [&](auto each) {
#if defined(INFERD_GGUF_AMX)
      if (amx) configure_tiles();
#endif
      each([&](int64_t i) {
        const auto [seg, t] = pl.items[i];
        const torch::Tensor* p = &tiles[4 * seg];
        TileIn in{p[0].data_ptr<uint8_t>() + t * tile_codes(G), p[1].data_ptr<float>() + t * tile_a(G),
                  p[2].numel() ? p[2].data_ptr<float>() + t * tile_b(G) : nullptr,
                  types[seg] == Q6_K ? p[3].data_ptr<int16_t>() + t * tile_s(G) : nullptr};
        const int nr = static_cast<int>(std::min<int64_t>(kTileRows, rows[seg] - t * kTileRows));
        __builtin_prefetch(in.codes + tile_codes(G), 0, 3);
        tile_out(types[seg], in, a, M, pl.B(), pl.first[seg] + t * kTileRows, nr, Y, pl.N, amx);
      });
#if defined(INFERD_GGUF_AMX)
      if (amx) _tile_release();
#endif
    });
  };
  if (x.scalar_type() == torch::kFloat32) run(y.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

// Rows [lo, hi) of a packed segment as float32 [hi - lo, K], computed as gguf_dequantize (and the gguf
// package) computes them from the blocks.
torch::Tensor gguf_unpack(std::vector<torch::Tensor> tile, int64_t type, int64_t K, int64_t lo, int64_t hi) {
  TORCH_CHECK(tile.size() == 4, "gguf_unpack: (codes, a, b, s)");
  const int64_t G = K / kGroup;
  auto out = torch::empty({hi - lo, K}, tile[1].options());
  const uint8_t* C = tile[0].data_ptr<uint8_t>();
  const float* A = tile[1].data_ptr<float>();
  const float* Bf = tile[2].numel() ? tile[2].data_ptr<float>() : nullptr;
  const int16_t* S = type == Q6_K ? tile[3].data_ptr<int16_t>() : nullptr;
  float* O = out.data_ptr<float>();
  at::parallel_for(lo, hi, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t t = row / kTileRows, r = row % kTileRows;
      for (int64_t g = 0; g < G; ++g) {
        const float a = A[t * tile_a(G) + g * kTileRows + r];
        const float b = Bf ? Bf[t * tile_b(G) + g * kTileRows + r] : 0.f;
        for (int j = 0; j < 8; ++j)
          for (int kk = 0; kk < 4; ++kk) {
            const uint8_t c = C[t * tile_codes(G) + g * 256 + j * 32 + r * 4 + kk];
            const int16_t s16 = S ? S[t * tile_s(G) + (2 * g + j / 4) * 16 + 2 * r] : 1;
            O[(row - lo) * K + g * kGroup + 4 * j + kk] = weight_value(type, c, a, b, s16);
          }
      }
    }
  });
  return out;
}

// One segment's rows as compact tiles (above): uint8 [T, G * group bytes] for T = ceil(rows / 16) tiles.
torch::Tensor gguf_pack_compact(torch::Tensor weight, int64_t type, int64_t K) {
  TORCH_CHECK(compact_type(type), "gguf_pack_compact: GGML type ", type, " has no compact tiles");
  const std::vector<Segment> segs = segments({weight}, {type}, K);
  const Segment& sg = segs[0];
  const int64_t G = K / kGroup, T = (sg.rows + kCRows - 1) / kCRows, bytes = G * CompactGroup(type).bytes;
  torch::Tensor out = torch::empty({T, bytes}, weight.options());
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<Decoded> w(kCRows, Decoded(K));
    for (int64_t t = t0; t < t1; ++t) {
      const int nr = static_cast<int>(std::min<int64_t>(kCRows, sg.rows - t * kCRows));
      for (int j = 0; j < nr; ++j) decode_row(type, sg.data + (t * kCRows + j) * sg.row_bytes, K, w[j]);
      build_compact(type, w.data(), nr, G, O + t * bytes);
    }
  });
  return out;
}

// Rows [lo, hi) of a compact segment as float32 [hi - lo, K], the values its blocks dequantize to (weight_value)
torch::Tensor gguf_unpack_compact(torch::Tensor tiles, int64_t type, int64_t K, int64_t lo, int64_t hi) {
  TORCH_CHECK(compact_type(type) && K % kGroup == 0, "gguf_unpack_compact: a compact type and K a multiple of 32");
  const CompactGroup cg(type);
  const int64_t G = K / kGroup;
  TORCH_CHECK(tiles.dim() == 2 && tiles.size(1) == G * cg.bytes && 0 <= lo && lo <= hi && hi <= tiles.size(0) * kCRows,
              "gguf_unpack_compact: tiles [T, G * group bytes] and rows in range");
  auto out = torch::empty({hi - lo, K}, tiles.options().dtype(torch::kFloat32));
  const uint8_t* P = tiles.data_ptr<uint8_t>();
  float* O = out.data_ptr<float>();
  for (int64_t row = lo; row < hi; ++row) {
    const int64_t t = row / kCRows;
    const int r = static_cast<int>(row % kCRows);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* o = P + t * G * cg.bytes + g * cg.bytes;
      float a, b = 0.f;
      if (k_quant(type)) {
        std::memcpy(&a, o + cg.a + 4 * r, 4);
        std::memcpy(&b, o + cg.b + 4 * r, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, o + cg.a + 2 * r, 2);
        a = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
      }
      for (int j = 0; j < 8; ++j)
        for (int kk = 0; kk < 4; ++kk)
          O[(row - lo) * K + g * kGroup + 4 * j + kk] = weight_value(type, compact_code(type, o, cg, r, j, kk), a, b, 1);
    }
  }
  return out;
}

// A few activation rows (float32 or bfloat16) against layers packed by gguf_pack_compact: per segment its type,
// number of rows and tiles; returns [M, N] in x's dtype, the bits gguf_linear gives on the same blocks.
torch::Tensor gguf_linear_compact(torch::Tensor x, std::vector<torch::Tensor> tiles, std::vector<int64_t> types,
                                  std::vector<int64_t> rows, c10::optional<torch::Tensor> bias) {
#if defined(INFERD_GGUF_COMPACT)
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "gguf_linear_compact: x is float32 or bfloat16 [M, K]");
  TORCH_CHECK(tiles.size() == types.size() && rows.size() == types.size() && !types.empty(),
              "gguf_linear_compact: one tiles tensor, type and row count per segment");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "gguf_linear_compact: K must be a multiple of 32");
  const Plan pl = plan(rows, kCRows, bias, [&](size_t i, int64_t T) {
    TORCH_CHECK(compact_type(types[i]), "gguf_linear_compact: GGML type ", types[i], " has no compact tiles");
    TORCH_CHECK(tiles[i].is_contiguous() && tiles[i].dim() == 2 && tiles[i].size(0) == T &&
                    tiles[i].size(1) == G * CompactGroup(types[i]).bytes,
                "gguf_linear_compact: segment ", i, "'s tiles do not fit K = ", K, " and ", rows[i], " rows");
  });
  auto y = torch::empty({M, pl.N}, x.options());
  if (M == 0) return y;
  const QuantizedRows a = x.scalar_type() == torch::kFloat32 ? quantize_rows(x.data_ptr<float>(), M, K, M)
                                                              : quantize_rows(x.data_ptr<at::BFloat16>(), M, K, M);
  auto run = [&](auto* Y) {
    parallel_claim(static_cast<int64_t>(pl.items.size()), 2, [&](auto each) {
      each([&](int64_t i) {
        const auto [seg, t] = pl.items[i];
        const int64_t type = types[seg];
        const uint8_t* tile = tiles[seg].data_ptr<uint8_t>() + t * tiles[seg].size(1);
        const int nr = static_cast<int>(std::min<int64_t>(kCRows, rows[seg] - t * kCRows));
        compact_out(type, tile, G, a, M, pl.B(), pl.first[seg] + t * kCRows, nr, Y, pl.N);
      });
    });
  };
  if (x.scalar_type() == torch::kFloat32) run(y.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
#else
  TORCH_CHECK(false, "gguf_linear_compact: needs AVX-512 VNNI");
  return x;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_dequantize", &gguf_dequantize, "a segment's rows as float32, as the gguf package dequantizes");
  m.def("gguf_pack", &gguf_pack, "a segment's blocks as tiles of 8 rows: (codes, a, b, s)");
  m.def("gguf_linear", &gguf_linear, "a linear layer on packed tiles, float32/bfloat16 rows (CPU)");
  m.def("gguf_unpack", &gguf_unpack, "a packed segment's rows as float32");
  m.def("gguf_pack_compact", &gguf_pack_compact, "a segment's blocks as compact tiles of 16 rows, at the file's bits");
  m.def("gguf_unpack_compact", &gguf_unpack_compact, "a compact segment's rows as float32");
  m.def("gguf_linear_compact", &gguf_linear_compact, "a linear layer on compact tiles, for a few rows (AVX-512 VNNI)");
  m.def("compact_available", [] {
#if defined(INFERD_GGUF_COMPACT)
    return true;
#else
    return false;
#endif
  }, "whether gguf_linear_compact is built (AVX-512 VNNI)");
#if defined(INFERD_GGUF_AMX)
  m.def("set_amx", [](bool on) { amx_enabled = on; }, "use AMX from 8 rows (on by default where the CPU has it)");
#endif
  m.def("isa", [] {
#if defined(INFERD_GGUF_AMX)
    return std::string(amx_permitted() ? "avx2-vnni+amx" : "avx2-vnni");
#elif defined(INFERD_GGUF_VNNI)
    return std::string("avx2-vnni");  // the tiles are 8 rows wide: 256-bit vpdpbusd on any VNNI CPU
#elif defined(__AVX2__)
    return std::string("avx2");
#else
    return std::string("portable");
#endif
  }, "the instruction set gguf_linear was built for");
}
