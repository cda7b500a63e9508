// Paged attention for decode tokens on CPU: one query per request, keys and values read in place from
// the block tables, so nothing is gathered or padded. Work is split over (request, kv head) pairs;
// each pair computes its query group's scores, a softmax, and the weighted sum of values. With fewer pairs
// than threads (one or two requests decoding) a pair's tokens are split into parts on different threads,
// merged as flash decoding does; otherwise no pair is split, and the sums are those of one pass.
// K/V are float32 or bfloat16 (read as bf16 and widened in registers: half the bytes of the cache,
// which is what a decode step is bound by); the arithmetic is float32 either way. Each pair first walks its
// block table into row pointers (a division per block rather than two per token: a quarter of the kernel's
// time at batch 32 went to them). With AVX-512 the weighted values are summed in registers (4 heads x 64 of
// D) over runs of 16 tokens, with AVX2 the same in 8 lanes (4 heads x 16 of D), its scores two heads x four
// keys in registers (a bf16 cache widened as loaded); elsewhere four rows at a time, each accumulator loaded and
// stored once per four tokens. The values' sums keep their order every way, so they are bitwise those of one row
// at a time. The softmax's
// exp is a polynomial that vectorises (fast_exp.h; within 2 ulp of std::exp): at batch 32 these two took a
// step's attention from 20.3 to 16.6 ms here, and what remains is mostly moving the cache's rows into L1. Its
// largest score is 16 running maxima (row_max), where std::max_element was a scalar chain.
// The cache may also be fp8 (e4m3 or e5m2, with q and the output in float32 or bf16): its rows are widened
// to float32 like bf16's (fp8.h), for half the bytes read. A bf16 cache may serve float32 queries too (a
// float32 model on a CPU without native bf16): its rows are widened as read, for half a float32 cache's bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "fast_exp.h"
#include "fp8.h"
#include "work_queue.h"

namespace {

// tokens ahead whose key and value rows are prefetched (measured: 8, 16 and 32 about equal, none 20% slower)
constexpr int64_t PF = 16;

// bfloat16 is the top half of a float32: widening is a shift, which the compiler vectorises.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Ask for a row a few tokens ahead: blocks sit anywhere in the cache, so the hardware prefetcher, which
// follows one 4 KiB page, loses the stream at every block boundary. The scores pass asks for values too,
// so the values pass finds them in L2.
inline float widen(inferd::E4M3 x) { return inferd::fp8_to_float(x); }
inline float widen(inferd::E5M2 x) { return inferd::fp8_to_float(x); }

// n cache values as float32 into dst (vectorised: a shift for bf16, fp8.h's conversions for fp8)
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  if constexpr (inferd::is_fp8<T>) {
    inferd::widen_fp8_row(src, dst, n);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
  }
}

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 1);
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * widen(b[i]);
  return s;
}

// Four cache rows as float32: float rows in place, bf16 rows widened into buf (4 * D floats).
template <typename T>
inline void as_float4(const T* const* rows, int64_t D, float* buf, const float** out) {
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      out[j] = rows[j];
    } else {
      float* dst = buf + j * D;
      widen_row(rows[j], dst, D);
      out[j] = dst;
    }
  }
}

// The largest of n scores: 16 running maxima (a > b ? a : b is vmaxps's own rule, so this vectorises where a
// reduction over std::max stays one vmaxss after another, 4 cycles each: 14% of the kernel at batch 32)
inline float row_max(const float* row, int64_t n) {
  float m[16];
  std::fill(m, m + 16, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) m[j] = m[j] > row[i + j] ? m[j] : row[i + j];
  for (; i < n; ++i) m[0] = m[0] > row[i] ? m[0] : row[i];
  return *std::max_element(m, m + 16);
}

// Scores of one query group against four keys: out[g * n + t..t+3] for every head g of the group.
// Generic path: the four keys are widened to float32 once (not once per head), then four independent
// accumulators per head keep the FMA units busy instead of waiting on one reduction chain.
template <typename T>
inline void scores4(const float* query, const T* const* keys, int64_t G, int64_t D, float* kbuf, float* out,
                    int64_t n) {
  const float* k[4];
  as_float4(keys, D, kbuf, k);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = query + g * D;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < D; ++i) {
      const float qi = q[i];
      s0 += qi * k[0][i];
      s1 += qi * k[1][i];
      s2 += qi * k[2][i];
      s3 += qi * k[3][i];
    }
    float* o = out + g * n;
    o[0] = s0;
    o[1] = s1;
    o[2] = s2;
    o[3] = s3;
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen float32 sums at once: lane i of the result is the sum of v[i]'s 16 lanes (a tree of shuffles and adds,
// ~2 instructions a sum, where one _mm512_reduce_add_ps each costs ~8).
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (v2i lanes 0+2, v2i+1 lanes 0+2, v2i 1+3, v2i+1 1+3)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v4i .. v4i+3
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[i]'s four 128-bit lanes added up, into 128-bit lane i of the result
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

// The scores of up to four heads (g0 ..) against four keys from their sums acc[g][j]: out[g * n + j].
inline void store_scores4(__m512 (*acc)[4], int64_t gn, float* out, int64_t n) {
  alignas(64) float s[16];
  if (gn == 4) {
    _mm512_store_ps(s, reduce16(&acc[0][0]));
  } else {
    for (int64_t g = 0; g < gn; ++g)
      for (int j = 0; j < 4; ++j) s[4 * g + j] = _mm512_reduce_add_ps(acc[g][j]);
  }
  for (int64_t g = 0; g < gn; ++g)
    for (int j = 0; j < 4; ++j) out[g * n + j] = s[4 * g + j];
}

// 32 of d of a key as bf16: a bf16 cache's own bits, or an fp8 cache's widened exactly in registers (fp8.h)
inline __m512i key32(const uint16_t* p) { return _mm512_loadu_si512(p); }
template <typename F>
inline __m512i key32(const F* p) {
  return inferd::widen32_bf16(p);
}

// A bf16 or fp8 cache on a CPU with AVX512_BF16: `vdpbf16ps` multiplies 32 bf16 pairs and accumulates in float32,
// straight from the cache's bits (fp8: widened to bf16 once per 32 of d of a key); the query is bf16 already (the
// model computed it so). Heads four at a time, d outer: each 32 of d of the four keys is loaded once for the four
// heads, and their 16 sums are reduced together (reduce16). For fp8, widening the rows to float32 in memory and
// four FMAs per 16 of d had taken a step's attention from 12.3 ms (bf16 cache) to 14.6. The heads' count is a
// template argument: as a variable, GCC kept mask registers saying which sums were set (kmovb in the product loop).
template <int GN, typename T>
inline void scores4_bf16_heads(const uint16_t* qbits, const T* const* keys, int64_t D, float* out, int64_t n) {
  __m512 acc[4][4];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 32) {
    const __m512bh k0 = (__m512bh)key32(keys[0] + i), k1 = (__m512bh)key32(keys[1] + i),
                   k2 = (__m512bh)key32(keys[2] + i), k3 = (__m512bh)key32(keys[3] + i);
    for (int g = 0; g < GN; ++g) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qbits + g * D + i);
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], qv, k0);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], qv, k1);
      acc[g][2] = _mm512_dpbf16_ps(acc[g][2], qv, k2);
      acc[g][3] = _mm512_dpbf16_ps(acc[g][3], qv, k3);
    }
  }
  store_scores4(acc, GN, out, n);
}

template <typename T>
inline void scores4_bf16(const uint16_t* qbits, const T* const* keys, int64_t G, int64_t D, float* out, int64_t n) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const uint16_t* q = qbits + g0 * D;
    float* o = out + g0 * n;
    switch (std::min<int64_t>(4, G - g0)) {
      case 4: scores4_bf16_heads<4>(q, keys, D, o, n); break;
      case 3: scores4_bf16_heads<3>(q, keys, D, o, n); break;
      case 2: scores4_bf16_heads<2>(q, keys, D, o, n); break;
      default: scores4_bf16_heads<1>(q, keys, D, o, n); break;
    }
  }
}
#endif

// acc[g * D + i] += p[g * n] * v[i] for every head g: the value row is widened once for the whole group.
template <typename T>
inline void accumulate(const float* p, int64_t n, const T* v, int64_t G, int64_t D, float* vbuf, float* acc) {
  const float* row;
  if constexpr (std::is_same_v<T, float>) {
    row = v;
  } else {
    widen_row(v, vbuf, D);
    row = vbuf;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float alpha = p[g * n];
    float* a = acc + g * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) a[i] += alpha * row[i];
  }
}

// Four value rows at once: the same sums in the same order as four calls of `accumulate`, but each
// accumulator is loaded and stored once per four tokens rather than once per token.
template <typename T>
inline void accumulate4(const float* p, int64_t n, const T* const* v, int64_t G, int64_t D, float* vbuf,
                        float* acc) {
  const float* r[4];
  as_float4(v, D, vbuf, r);
  const float *r0 = r[0], *r1 = r[1], *r2 = r[2], *r3 = r[3];
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * n;
    const float p0 = pg[0], p1 = pg[1], p2 = pg[2], p3 = pg[3];
    float* a = acc + g * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) {
      float s = a[i];
      s += p0 * r0[i];
      s += p1 * r1[i];
      s += p2 * r2[i];
      s += p3 * r3[i];
      a[i] = s;
    }
  }
}

// acc [G, D] = sum over tokens of p[g, t] * v_t, token after token (the sums of `accumulate4`, in the same
// order: the same bits). Tokens go in runs of 16, whose value rows stay in L1 while D's chunks pass, heads four at
// a time; L's `add<GN>` adds one chunk of L::kWidth values for GN heads in registers (16 lanes: Lanes16, 8:
// Lanes8). D % L::kWidth == 0.
template <typename L, typename T>
void values_runs(const float* p, int64_t n, const T* const* vrows, int64_t G, int64_t D, float* acc) {
  constexpr int64_t kRun = 16;
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kRun) {
    const int64_t t1 = std::min(n, t0 + kRun);
    for (int64_t t = t1; t < std::min(n, t1 + kRun); ++t) prefetch_row(vrows[t], D);
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* pg = p + g0 * n;
      float* ag = acc + g0 * D;
      for (int64_t d0 = 0; d0 < D; d0 += L::kWidth) {
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: L::template add<4>(pg, n, vrows, t0, t1, d0, D, ag); break;
          case 3: L::template add<3>(pg, n, vrows, t0, t1, d0, D, ag); break;
          case 2: L::template add<2>(pg, n, vrows, t0, t1, d0, D, ag); break;
          default: L::template add<1>(pg, n, vrows, t0, t1, d0, D, ag); break;
        }
      }
    }
  }
}

#if defined(__AVX512F__)
#define INFERD_VALUES_AVX512 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const inferd::E4M3* p) { return inferd::widen16(p); }
inline __m512 load16(const inferd::E5M2* p) { return inferd::widen16(p); }

// 16 float32 lanes: Lanes16 (below) holds 4 x GN of them for a chunk of 64 of D
struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16, kVecs = 4;
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 (Zen 3 and other CPUs without AVX-512): float32 or bf16 caches in registers, 8 lanes. The generic loops
// widen each row into memory and load it back once per head; these widen in registers as they read.
#define INFERD_ATTEND_AVX2 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scores of one query group (float32, [G, D]) against four keys, two heads at a time: 8 sums in registers, each
// key chunk loaded and widened once per two heads. D % 8 == 0.
template <typename T>
inline void scores4_avx2(const float* query, const T* const* keys, int64_t G, int64_t D, float* out, int64_t n) {
  for (int64_t g0 = 0; g0 < G; g0 += 2) {
    const bool two = g0 + 1 < G;
    const float* qa = query + g0 * D;
    const float* qb = two ? qa + D : qa;
    __m256 a[2][4];
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j) a[h][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 k0 = load8(keys[0] + i), k1 = load8(keys[1] + i), k2 = load8(keys[2] + i),
                   k3 = load8(keys[3] + i);
      const __m256 x = _mm256_loadu_ps(qa + i), y = _mm256_loadu_ps(qb + i);
      a[0][0] = _mm256_fmadd_ps(x, k0, a[0][0]);
      a[0][1] = _mm256_fmadd_ps(x, k1, a[0][1]);
      a[0][2] = _mm256_fmadd_ps(x, k2, a[0][2]);
      a[0][3] = _mm256_fmadd_ps(x, k3, a[0][3]);
      a[1][0] = _mm256_fmadd_ps(y, k0, a[1][0]);
      a[1][1] = _mm256_fmadd_ps(y, k1, a[1][1]);
      a[1][2] = _mm256_fmadd_ps(y, k2, a[1][2]);
      a[1][3] = _mm256_fmadd_ps(y, k3, a[1][3]);
    }
    for (int h = 0; h < (two ? 2 : 1); ++h)
      for (int j = 0; j < 4; ++j) out[(g0 + h) * n + j] = hsum8(a[h][j]);
  }
}

// 8 float32 lanes: Lanes8 (below) holds 2 x GN of them for a chunk of 16 of D
struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8, kVecs = 2;
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <typename T>
  static V load(const T* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

#if defined(__AVX512F__) || defined(INFERD_ATTEND_AVX2)
// acc[g, d0 .. d0 + kWidth) += p[g, t] * v_t[d0 .. d0 + kWidth) for GN heads and the tokens [t0, t1), in the
// registers of R (Avx512: 16 lanes, Avx2: 8): kVecs x GN sums held across the tokens, each value chunk loaded (and
// widened) once for all the heads; token after token, one FMA each, so 16 and 8 lanes give the same bits.
template <typename R>
struct LanesOf {
  static constexpr int64_t kWidth = R::kLanes * R::kVecs;
  template <int GN, typename T>
  static void add(const float* p, int64_t n, const T* const* vrows, int64_t t0, int64_t t1, int64_t d0, int64_t D,
                  float* acc) {
    typename R::V a[GN][R::kVecs];
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < R::kVecs; ++j) a[g][j] = R::loadf(acc + g * D + d0 + R::kLanes * j);
    for (int64_t t = t0; t < t1; ++t) {
      const T* v = vrows[t] + d0;
      typename R::V vv[R::kVecs];
      for (int j = 0; j < R::kVecs; ++j) vv[j] = R::load(v + R::kLanes * j);
      for (int g = 0; g < GN; ++g) {
        const typename R::V pg = R::set1(p[g * n + t]);
        for (int j = 0; j < R::kVecs; ++j) a[g][j] = R::fmadd(pg, vv[j], a[g][j]);
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < R::kVecs; ++j) R::storef(acc + g * D + d0 + R::kLanes * j, a[g][j]);
  }
};
#endif
#if defined(__AVX512F__)
using Lanes16 = LanesOf<Avx512>;
#endif
#if defined(INFERD_ATTEND_AVX2)
using Lanes8 = LanesOf<Avx2>;
#endif

// A thread's buffers, reused across the pairs (or parts of a pair) it attends.
template <typename T>
struct Workspace {
  std::vector<float> scores, query, buf;
  std::vector<const T*> krows, vrows;
};

// One (request, kv head) pair's query group against the tokens [t0, t1) of its window: acc [G, D] gets the
// probability-weighted values. normalize: the softmax over these tokens is the whole softmax (the pair is
// not split), and acc is the output; else each head's largest score and sum of exp(score - largest) go to
// mx and sum, acc holds the unnormalized sums, and the parts are merged by `merge_parts`.
template <typename TQ, typename T>
void attend(const TQ* q_in, const T* kp, const T* vp, const int64_t* table, int64_t start, int64_t t0, int64_t t1,
            int64_t kvh, int64_t G, int64_t D, int64_t BS, int64_t KVH, float fscale, float fcap, bool normalize,
            Workspace<T>& w, float* acc, float* mx, float* sum) {
  const int64_t n = t1 - t0;
  w.scores.assign(G * n, 0.f);
  w.query.resize(G * D);
  w.buf.resize(4 * D);
  for (int64_t i = 0; i < G * D; ++i) w.query[i] = widen(q_in[i]);
  // each token's key and value rows, found once: walking the block table costs no division per token
  w.krows.resize(n);
  w.vrows.resize(n);
  for (int64_t t = 0, pos = start + t0; t < n;) {
    const int64_t block = table[pos / BS];
    for (int64_t slot = pos % BS; slot < BS && t < n; ++slot, ++t, ++pos) {
      const int64_t offset = ((block * BS + slot) * KVH + kvh) * D;
      w.krows[t] = kp + offset;
      w.vrows[t] = vp + offset;
    }
  }
  float* scores = w.scores.data();
  // tokens outer, heads inner: four keys stay in L1 while every head of the group uses them
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    if (t + PF + 4 <= n)
      for (int j = 0; j < 4; ++j) {
        prefetch_row(w.krows[t + PF + j], D);
        prefetch_row(w.vrows[t + PF + j], D);
      }
    const T* keys[4] = {w.krows[t], w.krows[t + 1], w.krows[t + 2], w.krows[t + 3]};
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
    if constexpr ((std::is_same_v<T, uint16_t> || inferd::is_fp8<T>) && std::is_same_v<TQ, uint16_t>) {
      if (D % 32 == 0) {  // bf16 queries against a bf16 or fp8 cache
        scores4_bf16(q_in, keys, G, D, scores + t, n);
        continue;
      }
    }
#endif
#if defined(INFERD_ATTEND_AVX2)
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
      if (D % 8 == 0) {
        scores4_avx2(w.query.data(), keys, G, D, scores + t, n);
        continue;
      }
    }
#endif
    scores4(w.query.data(), keys, G, D, w.buf.data(), scores + t, n);
  }
  for (; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) scores[g * n + t] = dot(w.query.data() + g * D, w.krows[t], D);
  if (fcap > 0.f) {
    for (int64_t i = 0; i < G * n; ++i) scores[i] = std::tanh(scores[i] * fscale / fcap) * fcap;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < G * n; ++i) scores[i] *= fscale;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * n;
    const float top = row_max(row, n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      row[i] = inferd::exp_approx(row[i] - top);
      total += row[i];
    }
    if (normalize) {
      const float inv = 1.f / total;
      for (int64_t i = 0; i < n; ++i) row[i] *= inv;
    } else {
      mx[g] = top;
      sum[g] = total;
    }
  }
#if defined(INFERD_VALUES_AVX512)
  if (D % Lanes16::kWidth == 0) {
    values_runs<Lanes16>(scores, n, w.vrows.data(), G, D, acc);
    return;
  }
#endif
#if defined(INFERD_ATTEND_AVX2)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
    if (D % Lanes8::kWidth == 0) {
      values_runs<Lanes8>(scores, n, w.vrows.data(), G, D, acc);
      return;
    }
  }
#endif
  std::fill(acc, acc + G * D, 0.f);
  int64_t tv = 0;
  for (; tv + 4 <= n; tv += 4) {
    if (tv + PF + 4 <= n)
      for (int j = 0; j < 4; ++j) prefetch_row(w.vrows[tv + PF + j], D);
    const T* values[4] = {w.vrows[tv], w.vrows[tv + 1], w.vrows[tv + 2], w.vrows[tv + 3]};
    accumulate4(scores + tv, n, values, G, D, w.buf.data(), acc);
  }
  for (; tv < n; ++tv) accumulate(scores + tv, n, w.vrows[tv], G, D, w.buf.data(), acc);
}

// float32 -> the output's type (bfloat16: round to nearest even, as torch does; no NaNs reach here).
template <typename T>
inline void store(const float* acc, int64_t count, T* o) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(acc, acc + count, o);
  } else {
    for (int64_t i = 0; i < count; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &acc[i], sizeof bits);
      o[i] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
  }
}

// The parts of one pair, each a softmax over its own tokens, as one softmax over all of them (flash
// decoding's merge): every part's sums are rescaled by exp(its largest score - the overall largest).
inline void merge_parts(const float* acc, const float* mx, const float* sum, int64_t parts, int64_t G, int64_t D,
                        float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, mx[p * G + g]);
    float total = 0.f;
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float f = std::exp(mx[p * G + g] - top);
      total += f * sum[p * G + g];
      const float* a = acc + (p * G + g) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[i] += f * a[i];
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}

// tokens below which a pair is not split: a part must be long enough to pay for its merge
constexpr int64_t kMinPartTokens = 128;

// TQ: the storage type of q and the output (float, or uint16_t holding bfloat16 bits); T: the cache's (TQ, or
// an fp8 format). Work is split over (request, kv head) pairs. Fewer pairs than threads (decoding one or two
// requests) would leave threads idle, so then each pair's tokens are split into parts, one per thread, merged
// after.
template <typename TQ, typename T>
void decode(const TQ* qp, const T* kp, const T* vp, const int64_t* btp, const int64_t* lp, TQ* op, int64_t B,
            int64_t H, int64_t D, int64_t BS, int64_t KVH, int64_t MB, float fscale, int64_t window, float fcap,
            int64_t threads) {
  const int64_t G = H / KVH, pairs = B * KVH;
  auto window_of = [&](int64_t b) {
    const int64_t len = lp[b];
    return std::pair<int64_t, int64_t>{window > 0 ? std::max<int64_t>(0, len - window) : 0, len};
  };
  // parts of every pair: part p of a pair of n tokens covers [p * n / used, (p + 1) * n / used), where
  // used = min(parts, n / kMinPartTokens) (at least 1); the parts past `used` are empty
  const int64_t parts = pairs >= threads ? 1 : (threads + pairs - 1) / pairs;
  std::vector<int64_t> used(pairs, 1);
  for (int64_t item = 0; parts > 1 && item < pairs; ++item) {
    const auto [start, len] = window_of(item / KVH);
    used[item] = std::clamp<int64_t>((len - start) / kMinPartTokens, 1, parts);
  }
  if (*std::max_element(used.begin(), used.end()) == 1) {
    inferd::parallel_claim(pairs, 1, [&](auto each) {
      Workspace<T> w;
      std::vector<float> acc(G * D);
      each([&](int64_t item) {
        const int64_t b = item / KVH, kvh = item % KVH;
        const auto [start, len] = window_of(b);
        const TQ* q_in = qp + (b * H + kvh * G) * D;
        attend(q_in, kp, vp, btp + b * MB, start, 0, len - start, kvh, G, D, BS, KVH, fscale, fcap, true, w,
               acc.data(), nullptr, nullptr);
        store(acc.data(), G * D, op + (b * H + kvh * G) * D);
      });
    });
    return;
  }
  std::vector<float> acc(pairs * parts * G * D), mx(pairs * parts * G), sum(pairs * parts * G);
  inferd::parallel_claim(pairs * parts, 1, [&](auto each) {
    Workspace<T> w;
    each([&](int64_t job) {
      const int64_t item = job / parts, p = job % parts;
      if (p >= used[item]) return;
      const int64_t b = item / KVH, kvh = item % KVH;
      const auto [start, len] = window_of(b);
      const int64_t n = len - start, t0 = p * n / used[item], t1 = (p + 1) * n / used[item];
      attend(qp + (b * H + kvh * G) * D, kp, vp, btp + b * MB, start, t0, t1, kvh, G, D, BS, KVH, fscale, fcap,
             false, w, acc.data() + job * G * D, mx.data() + job * G, sum.data() + job * G);
    });
  });
  std::vector<float> out(G * D);
  for (int64_t item = 0; item < pairs; ++item) {
    const int64_t b = item / KVH, kvh = item % KVH, first = item * parts;
    merge_parts(acc.data() + first * G * D, mx.data() + first * G, sum.data() + first * G, used[item], G, D,
                out.data());
    store(out.data(), G * D, op + (b * H + kvh * G) * D);
  }
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D] in q's dtype or fp8; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64 (including the token being decoded); window <= 0 means none; threads <= 0: torch's
// thread count (what decides whether a pair's tokens are split). Returns [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           int64_t window, double softcap, int64_t threads) {
  const auto dtype = q.scalar_type(), kv = k_cache.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "paged_decode runs on float32 or bfloat16");
  const bool fp8 = inferd::is_fp8_type(kv);
  TORCH_CHECK(v_cache.scalar_type() == kv && (kv == dtype || kv == torch::kBFloat16 || fp8),
              "paged_decode: the KV cache is q's dtype, bfloat16 or fp8 (e4m3fn, e5m2), the same for K and V");
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
  if (threads <= 0) threads = at::get_num_threads();
  auto with_cache = [&](auto* qp, auto* op, auto own) {
    inferd::with_cache_type(kv, own, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const C* kp = reinterpret_cast<const C*>(k_cache.data_ptr());
      const C* vp = reinterpret_cast<const C*>(v_cache.data_ptr());
      decode(qp, kp, vp, btp, lp, op, B, H, D, BS, KVH, MB, fscale, window, fcap, threads);
    });
  };
  if (dtype == torch::kFloat32) {
    with_cache(q.data_ptr<float>(), out.data_ptr<float>(), 0.f);
  } else {
    auto bits = [](torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    with_cache(bits(q), bits(out), uint16_t{0});
  }
  return out;
}

// The number of distinct threads at::parallel_for hands work to: torch's thread count when this file was
// built with OpenMP, 1 when it was not (the inline parallel region is then ignored).
int64_t parallel_threads() {
  std::vector<char> seen(at::get_num_threads() + 1, 0);
  at::parallel_for(0, 4096, 1, [&](int64_t begin, int64_t end) {
    volatile double sink = 0;
    for (int64_t i = begin; i < end; ++i) sink = sink + std::sqrt(static_cast<double>(i));
    seen[std::min<int64_t>(at::get_thread_num(), seen.size() - 1)] = 1;
  });
  return std::count(seen.begin(), seen.end(), 1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &parallel_threads, "threads the work split reaches");
  m.def("paged_decode", &paged_decode, "paged attention for decode tokens (CPU, float32 or bfloat16; the cache in that, bfloat16 or fp8)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window"), py::arg("softcap"), py::arg("threads") = 0);
}
