// Weight-only int8 linear on CPU: y[M,N] = x[M,K] @ (q[N,K] * scale[N])^T + bias, x float32 or bfloat16, for
// decode batches (1 to a few dozen rows), and for prefill's many rows where float32 or AMX makes the integer
// products the faster way (quant.py picks).
//
// As llama.cpp's Q8_0 x Q8_0: each activation row is quantized per group of 32 to int8 with one float step
// (x ~= xq * xd, xd = max|x| / 127), and a group's products are summed exactly in int32 before the float
// steps apply: y = scale[n] * sum over groups of xd[g] * sum(q[k] * xq[k]).
//
// The weights are packed once (int8_pack) in tiles of 16 output rows: tile t, k-quad j holds 64 bytes,
// q[16t + i, 4j .. 4j+3] + 128 for i = 0..15, so one 64-byte load holds four k of 16 output rows. A vector
// of 16 int32 lanes is then 16 outputs: VNNI's vpdpbusd multiplies those bytes (unsigned) by one activation
// row's four k broadcast to every lane (signed) and adds the four products to each lane. The +128 is taken
// off exactly by starting each group's sum at -128 * sum(xq of the group). A block of MB activation rows x
// NT tiles keeps its int32 sums in registers, so each weight byte is loaded once per MB rows (not once per row, as
// a dot product along k is), and nothing but a group's float multiply-add follows its eight vpdpbusd: the
// kernel stays bound by the int8 bytes it streams up to batches of dozens (it replaced a dot product along
// k that was compute-bound above 2 rows).
//
// AVX2 without VNNI takes the same layout 8 lanes at a time with vpmaddubsw + vpmaddwd, whose int16 pair
// sums would overflow with +128 weights: it turns a weight back to signed and moves its sign onto the
// activation (|q| * (sign(q) * xq), 2 * 127 * 127 <= 32767). A portable loop serves CPUs without AVX2.
// On a CPU with AMX, 8 rows and more take AMX tiles for the same integer sums (the same bits), prefill's hundreds
// of rows too. On AVX-512 (AMX or not), bf16 rows from 8 rows go in groups of 128 where K allows: see kWide.
// Work is claimed by the threads a few tiles at a time as each becomes free (work_queue.h; OpenMP threads);
// -march=native picks the instruction set (quantized_common.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "amx.h"
#include "quantized_common.h"
#include "work_queue.h"

using namespace inferd;

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;                     // output rows per tile
constexpr int64_t kQuadsPerGroup = kGroup / 4;    // 64-byte loads per group

// Wider activation groups, for bf16 rows from kWideMinRows rows where K is a multiple of kWide, on AVX-512 (AMX
// or vpdpbusd): each group's int32 sums take a float step per row and output (a convert and a multiply-add, and
// on AMX a tile store first), which at groups of 32 cost ~3x the TDPBSUD itself and a quarter of the vpdpbusd
// blocks' instructions. Quantized in groups of 128 instead (as llama.cpp's k-quant dot products quantize
// activations in blocks of 256), the values change (a wider group's step is set by its largest value):
// benchmarks/quality.py measures it. Both paths take the same groups for the same rows, so they agree bitwise.
constexpr int64_t kWide = 128;
constexpr int64_t kWideMinRows = 8;  // decode batches from 8 rows; fewer are bound by the weights' bytes

// What int8_pack adds to each weight: 128 where the integer products take unsigned weights (vpdpbusd, AMX), none on
// AVX2 without VNNI, whose vpmaddubsw takes a weight's absolute value and moves its sign onto the activation:
// stored signed, a load needs no xor to undo the offset (one of the six vector ops per 32 weight bytes at batch 1).
#if defined(INFERD_AVX2) && !defined(__AVXVNNI__)
constexpr int kWeightOffset = 0;
#else
constexpr int kWeightOffset = 128;
#endif

// The quantized activation rows, K padded with zeros to whole groups.
struct QuantizedRows {
  int64_t M, Kp, groups;
  std::vector<int8_t> q;      // [M, Kp]
  std::vector<float> d;       // [M, groups]: each group's step
  std::vector<int32_t> init;  // [M, groups]: -128 * sum of the group's q, what the +128 of the weights adds
  const int8_t* qrow(int64_t m) const { return q.data() + m * Kp; }
  int32_t quad(int64_t m, int64_t j) const {
    int32_t v;
    std::memcpy(&v, qrow(m) + 4 * j, 4);
    return v;
  }
};

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

#if defined(INFERD_AVX2)
// AVX2: 32 values in 4 vectors of 8, the same steps and rounding as the loop below (the products rounded to
// nearest even by cvtps). Returns the sum of q, sets amax.
template <typename T>
int32_t quantize_whole_group(const T* x, int8_t* q, float& amax) {
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int c = 0; c < 4; ++c) {
    if constexpr (std::is_same_v<T, float>) v[c] = _mm256_loadu_ps(x + 8 * c);
    else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * c));
      v[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    }
    mx = _mm256_max_ps(mx, _mm256_and_ps(v[c], abs_mask));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i i[4];
  for (int c = 0; c < 4; ++c) i[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv));
  // int32 -> int8 through int16 (|q| <= 127: no saturation), then the 128-bit lanes' order undone
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  const __m128i s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s1, _mm_shuffle_epi32(s1, 0xB1)));
}
#endif

// Group g of row m: 127 / max|x| in float32, each value rounded to nearest (ties to even, as nearbyint).
template <typename T>
void quantize_group(const T* x, int64_t n, QuantizedRows& r, int64_t m, int64_t g) {
  int8_t* q = r.q.data() + m * r.Kp + g * kGroup;
  float amax = 0.f;
#if defined(INFERD_AVX512_VNNI)
  const __mmask16 lo = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 hi = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
  auto load = [&](int64_t off, __mmask16 mask) {
    if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(mask, x + off);
    else {
      const __m256i b = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(x) + off);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    }
  };
  const __m512 a0 = load(0, lo), a1 = load(16, hi);
  amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
  int32_t sum = 0;
#if defined(INFERD_AVX2)
  if (n == kGroup) {  // whole groups (all but a row's last where K is not a multiple of 32)
    sum = quantize_whole_group(x, q, amax);
  } else
#endif
  {
    for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t k = 0; k < kGroup; ++k) {
      q[k] = k < n ? static_cast<int8_t>(std::nearbyint(to_float(x[k]) * inv)) : 0;
      sum += q[k];
    }
  }
#endif
  r.d[m * r.groups + g] = amax / 127.f;
  r.init[m * r.groups + g] = -128 * sum;
}

#if defined(INFERD_AVX512_VNNI)
// Group g of row m, n <= kWide values: as quantize_group, 16 lanes at a time.
template <typename T>
void quantize_wide_group(const T* x, int64_t n, QuantizedRows& r, int64_t m, int64_t g) {
  __m512 v[kWide / 16];
  __m512 mx = _mm512_setzero_ps();
  for (int64_t c = 0; c < kWide / 16; ++c) {
    const int64_t left = n - 16 * c;
    const __mmask16 mask = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    if constexpr (std::is_same_v<T, float>) v[c] = _mm512_maskz_loadu_ps(mask, x + 16 * c);
    else {
      const __m256i b = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(x) + 16 * c);
      v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    }
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v[c]));
  }
  const float amax = _mm512_reduce_max_ps(mx);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  int8_t* q = r.q.data() + m * r.Kp + g * kWide;
  __m512i sum = _mm512_setzero_si512();
  for (int64_t c = 0; c < kWide / 16; ++c) {
    const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * c), _mm512_cvtepi32_epi8(i));
    sum = _mm512_add_epi32(sum, i);
  }
  r.d[m * r.groups + g] = amax / 127.f;
  r.init[m * r.groups + g] = -128 * _mm512_reduce_add_epi32(sum);
}
#endif

// Rows beyond M (up to Mp, for whole AMX row tiles) stay zero. Groups of Width: 32, or kWide
// (quantize_wide_group, above).
template <typename T, int64_t Width = kGroup>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K, int64_t Kp, int64_t Mp) {
  const int64_t G = Kp / Width;
  QuantizedRows r{M, Kp, G, std::vector<int8_t>(Mp * Kp), std::vector<float>(Mp * G), std::vector<int32_t>(Mp * G)};
  // rows claimed by the threads, at least 16 at a time: a prefill's many on both, a decode batch's few on one
  parallel_claim(M, 16, [&](auto each) {
    each([&](int64_t m) {
      for (int64_t g = 0; g < G; ++g) {
        const T* group = x + m * K + g * Width;
        const int64_t n = std::min(Width, K - g * Width);
        if constexpr (Width == kGroup) quantize_group(group, n, r, m, g);
        else quantize_wide_group(group, n, r, m, g);
      }
    });
  });
  return r;
}

// The next stripe's weights, which the blocks after a stripe's first ask for into L2, so the next stripe's first
// block finds them there: its own prefetching, a few KB ahead of its loads, left the memory idle while the
// stripe's other blocks computed. Per thread (set in compute()). Without AMX: a 32-row step of Gemma 3 270M
// 1.067x, the LM head alone at 32 rows 1.33x (Xeon capped at avx512-bf16); 1 and 4 rows, which take one block a
// stripe or run on memory's speed, unchanged. Each quad of the later blocks asks for per_quad lines, so that
// they cover the whole next stripe: one a quad covered a quarter of it where one block follows the first (7-12
// rows) and half where two do; whole, the LM head at 12 and 16 rows took 0.83x and 0.87x the time (Zen 4).
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;  // 64-byte lines not yet asked for
  int64_t per_quad = 1;
  // the next stripe's `lines` from p, spread over the quads of the `later` blocks that follow the first
  Ahead(const char* p, int64_t lines, int64_t later, int64_t quads)
      : p(p), lines(lines), per_quad(later > 0 ? std::max<int64_t>(1, (lines + later * quads - 1) / (later * quads)) : 1) {}
  Ahead() = default;
};
thread_local Ahead ahead;

// Where a block's tile streams prefetch, kPrefetchBytes ahead of quad j (an offset from the tile's start). Past
// the tile's end the stream ran on into tile t + 1, which the block reads already; where the stripe is this block
// alone (a.M <= MB: up to kMaxRows rows) it goes on into the next stripe's tile t instead, so the next stripe's
// first 4 KiB of each tile are asked for too. Where more blocks follow, the next stripe is theirs to fetch
// (Ahead), and the first block's L1 is left to the stripe's weights.
struct TileAhead {
  int64_t tile_bytes, jump;
  TileAhead(int64_t M, int MB, int NT, int64_t tile_bytes)
      : tile_bytes(tile_bytes), jump(M <= MB ? (NT - 1) * tile_bytes : 0) {}
  int64_t at(int64_t j) const {
    const int64_t off = j * 64 + kPrefetchBytes;
    return off >= tile_bytes ? off + jump : off;
  }
};

// Where a block writes: rows m0.., tiles t0.. of y [M, N], with the per-row scale and bias.
struct Output {
  int64_t N;
  const float* scale;
  const float* bias;  // or nullptr
};

template <typename Out>
inline void put_row(const float* v, int64_t n, const Output& o, Out y) {
  const int64_t count = std::min(kTile, o.N - n);
  for (int64_t i = 0; i < count; ++i) put(v[i] * o.scale[n + i] + (o.bias ? o.bias[n + i] : 0.f), y + n + i);
}

// Where int8_argmax sends the outputs instead of y: one thread's running best per row in 16 lanes, lane i
// holding the greatest of the outputs n with n % 16 == i it has seen (the first such n on ties: a thread claims
// tiles in increasing order), each output rounded first to the dtype the logits would have had. No logits are
// written or read back: at 32 rows of Gemma 3 270M's 262,144-token head they are 16 MiB a step.
struct LaneBest {
  int64_t N;
  std::vector<float> val;    // [M, 16]
  std::vector<int64_t> idx;  // [M, 16]
  LaneBest(int64_t M, int64_t N)
      : N(N), val(M * kTile, -std::numeric_limits<float>::infinity()), idx(M * kTile, 0) {}
  void offer(int64_t row, int64_t n, float v) {  // one output; NaN never wins
    float& best = val[row * kTile + n % kTile];
    if (v > best) best = v, idx[row * kTile + n % kTile] = n;
  }
  // Into the running (best_val, best_idx) of the earlier vocabulary (indices below offset): a greater value
  // replaces it, and of equal values the first index stays.
  void fold_into(float* best_val, int64_t* best_idx, int64_t rows, int64_t offset) const {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t i = 0; i < kTile; ++i) {
        const float v = val[m * kTile + i];
        const int64_t n = offset + idx[m * kTile + i];
        if (v > best_val[m] || (v == best_val[m] && n < best_idx[m])) best_val[m] = v, best_idx[m] = n;
      }
  }
};

// A "pointer" into y's [M, N] outputs that offers each to a LaneBest instead; Out (float or uint16_t: bf16 bits)
// is the dtype the outputs are rounded to first, as y's would be.
template <typename Out>
struct ArgmaxOut {
  LaneBest* best;
  int64_t at;  // row * N + n
  ArgmaxOut operator+(int64_t d) const { return {best, at + d}; }
};

template <typename Out>
inline void put(float v, ArgmaxOut<Out> y) {
  if constexpr (std::is_same_v<Out, uint16_t>) v = std::bit_cast<float>(static_cast<uint32_t>(bf16_bits(v)) << 16);
  y.best->offer(y.at / y.best->N, y.at % y.best->N, v);
}

#if defined(INFERD_AVX512_VNNI)
// Rows per block and the tiles a block spans for that many rows. Up to 3 rows (bound by the weights' bytes),
// MB * NT sums in int32 and in float plus NT weight vectors stay within the 32 vector registers; from 4 rows
// the float sums live in memory (touched once a group), so the registers hold 6 rows x 4 tiles of int32 sums:
// 24 vpdpbusd for 4 weight loads and 6 broadcasts. Against 4 rows x 3 tiles with the float sums in registers,
// that took 1.15-1.25x off the body's layers and 1.11x off the LM head at 8-32 rows (Xeon, AMX off).
constexpr int kMaxRows = 6;
constexpr int tiles_for(int rows) { return rows == 1 ? 8 : rows == 2 ? 5 : 4; }

inline void store(__m512 v, __mmask16 mask, float* y) { _mm512_mask_storeu_ps(y, mask, v); }
// bf16 bits of v in each int32 lane, rounded to nearest even as bf16_bits does
inline __m512i bf16_lanes(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}
inline void store(__m512 v, __mmask16 mask, uint16_t* y) { _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(bf16_lanes(v))); }
// 16 outputs n .. n + 15 of a row (at: row * N + n, n a multiple of 16) into its lanes' running best
template <typename Out>
inline void store(__m512 v, __mmask16 mask, ArgmaxOut<Out> y) {
  if constexpr (std::is_same_v<Out, uint16_t>) v = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_lanes(v), 16));
  const int64_t row = y.at / y.best->N, n = y.at % y.best->N;
  float* val = y.best->val.data() + row * kTile;
  int64_t* idx = y.best->idx.data() + row * kTile;
  const __mmask16 better = _mm512_mask_cmp_ps_mask(mask, v, _mm512_loadu_ps(val), _CMP_GT_OQ);
  if (!better) return;
  _mm512_mask_storeu_ps(val, better, v);
  const __m512i lanes = _mm512_add_epi64(_mm512_set1_epi64(n), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  _mm512_mask_storeu_epi64(idx, static_cast<__mmask8>(better), lanes);
  _mm512_mask_storeu_epi64(idx + 8, static_cast<__mmask8>(better >> 8), _mm512_add_epi64(lanes, _mm512_set1_epi64(8)));
}

// The outputs of tile t: a row's 16 float sums times the tile's scales plus its bias, stored to that row's
// columns 16t.. (masked where the last tile is partly filled).
struct TileOutput {
  int64_t n;
  __mmask16 mask;
  __m512 scale, add;
  TileOutput(const Output& o, int64_t t)
      : n(t * kTile), mask(o.N - n >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << (o.N - n)) - 1)),
        scale(_mm512_maskz_loadu_ps(mask, o.scale + n)),
        add(o.bias ? _mm512_maskz_loadu_ps(mask, o.bias + n) : _mm512_setzero_ps()) {}
  template <typename Out>
  void put(__m512 sums, Out row) const { store(_mm512_fmadd_ps(sums, scale, add), mask, row + n); }
};

// acc += the four products of each of w's unsigned bytes with x's signed bytes, in place. Not the intrinsic: with
// it, GCC 12 copied every sum of the block to another register and back each pass (two moves per vpdpbusd,
// which bound the loop at about one vpdpbusd a cycle against the core's two).
inline void dpbusd_into(__m512i& acc, __m512i w, __m512i x) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }

template <int64_t Width, int MB, int NT, bool prefetch, typename Out>
void block_body(const uint8_t* P, int64_t tile_bytes, const QuantizedRows& a, int64_t m0, int64_t t0,
                const Output& o, Out Y) {
  // the float sums: in registers for up to 3 rows (batch 1-3, bound by the weights' bytes); from 4 rows in
  // memory, once a group, so the registers hold more int32 sums a pass (6 rows x 4 tiles)
  constexpr bool in_registers = MB <= 3;
  __m512 fr[MB][NT];
  alignas(64) float f[MB][NT][kTile];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) {
      fr[m][t] = _mm512_setzero_ps();
      if constexpr (!in_registers) _mm512_store_ps(f[m][t], fr[m][t]);
    }
  const uint8_t* base = P + t0 * tile_bytes;
  const TileAhead tile_ahead(a.M, MB, NT, tile_bytes);
  for (int64_t g = 0; g < a.groups; ++g) {
    // the next stripe's lines, one a quad (a burst of them at the group's start stalled the core once the
    // line fill buffers were full); where fewer than a group's lines remain, those go at once and each quad asks
    // again for a line of this block's own, already in cache (no branch in the loop: see dpbusd_into)
    const char* pf = reinterpret_cast<const char*>(base);
    int64_t pf_step = 0;
    if constexpr (!prefetch) {
      if (ahead.lines >= Width / 4 * ahead.per_quad) {
        pf = ahead.p;
        pf_step = 64;
        ahead.lines -= Width / 4 * ahead.per_quad;
        ahead.p += Width / 4 * ahead.per_quad * 64;
      } else {
        for (; ahead.lines > 0; --ahead.lines, ahead.p += 64) _mm_prefetch(ahead.p, _MM_HINT_T1);
      }
    }
    __m512i acc[MB][NT];
    for (int m = 0; m < MB; ++m) {
      const __m512i start = _mm512_set1_epi32(a.init[(m0 + m) * a.groups + g]);
      for (int t = 0; t < NT; ++t) acc[m][t] = start;
    }
    for (int64_t j = g * Width / 4; j < (g + 1) * Width / 4; ++j) {
      if constexpr (!prefetch) {
        for (int64_t i = 0; i < ahead.per_quad; ++i, pf += pf_step) _mm_prefetch(pf, _MM_HINT_T1);
      }
      __m512i w[NT];
      const int64_t pf_at = tile_ahead.at(j);
      for (int t = 0; t < NT; ++t) {
        const uint8_t* p = base + t * tile_bytes + j * 64;
        if constexpr (prefetch) _mm_prefetch(reinterpret_cast<const char*>(base + t * tile_bytes + pf_at), INFERD_STREAM_HINT);
        w[t] = _mm512_loadu_si512(p);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i xb = _mm512_set1_epi32(a.quad(m0 + m, j));
        for (int t = 0; t < NT; ++t) dpbusd_into(acc[m][t], w[t], xb);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 d = _mm512_set1_ps(a.d[(m0 + m) * a.groups + g]);
      for (int t = 0; t < NT; ++t) {
        const __m512 sums = _mm512_cvtepi32_ps(acc[m][t]);
        if constexpr (in_registers) fr[m][t] = _mm512_fmadd_ps(sums, d, fr[m][t]);
        else _mm512_store_ps(f[m][t], _mm512_fmadd_ps(sums, d, _mm512_load_ps(f[m][t])));
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const TileOutput out(o, t0 + t);
    for (int m = 0; m < MB; ++m) out.put(in_registers ? fr[m][t] : _mm512_load_ps(f[m][t]), Y + (m0 + m) * o.N);
  }
}
// prefetch: the first block of a stripe, which reads its weights from memory; a template parameter, since a
// branch in the loop also made GCC copy the sums each pass
template <int64_t Width, int MB, int NT, typename Out>
void block(const uint8_t* P, int64_t tile_bytes, const QuantizedRows& a, int64_t m0, int64_t t0, bool prefetch,
           const Output& o, Out Y) {
  if (prefetch) block_body<Width, MB, NT, true>(P, tile_bytes, a, m0, t0, o, Y);
  else block_body<Width, MB, NT, false>(P, tile_bytes, a, m0, t0, o, Y);
}
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define INFERD_AMX 1
// AMX (Intel Sapphire Rapids and later): one TDPBSUD multiplies 16 activation rows x 32 k (signed) by 32 k x
// 16 outputs (unsigned, +128: the packed tile's quads are exactly the B tile's rows) into 16 x 16 int32,
// 8,192 products in one instruction against 128 vpdpbusd. Each group's sums go through memory (a tile store)
// to take their float step per row, as the vpdpbusd path does, in the same order: the two give the same bits.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxMinRows = 8;  // below, the vpdpbusd blocks are as fast (a row tile would be mostly padding)
constexpr int64_t kClaimTiles = 4;  // tiles a run (taken row tile by row tile), the fewest a thread claims at once

// Per thread (tile configuration is thread state): A tiles 0-1 (16 rows x 32 int8), B tiles 2-3 (8 quads x 64
// bytes), C tiles 4-5 (16 x 16 int32); two of each, so one group's product runs while the other's is scaled.
void configure_tiles() {
  TileConfig c;
  for (int i : {0, 1}) c.rows[i] = kAmxRows, c.colsb[i] = kGroup;
  for (int i : {2, 3}) c.rows[i] = kQuadsPerGroup, c.colsb[i] = 64;
  for (int i : {4, 5}) c.rows[i] = kAmxRows, c.colsb[i] = 64;
  load_tile_config(c);
}

// Group g's int32 sums of 16 rows (c, a stored C tile) into their float sums f: (sum + init) * step.
inline void scale_group(const int32_t (*c)[kTile], const QuantizedRows& a, int64_t m0, int64_t g, __m512* f) {
  for (int r = 0; r < kAmxRows; ++r) {
    const int64_t i = (m0 + r) * a.groups + g;
    const __m512i sum = _mm512_add_epi32(_mm512_load_si512(c[r]), _mm512_set1_epi32(a.init[i]));
    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(a.d[i]), f[r]);
  }
}


// A tiles 0-1 (16 rows x 64 int8), B tiles 2-3 (16 quads x 64 bytes), C tiles 4-5 (16 x 16 int32).
void configure_wide_tiles() {
  TileConfig c;
  for (int i = 0; i < 6; ++i) c.rows[i] = kAmxRows, c.colsb[i] = 64;
  load_tile_config(c);
}

// One TDPBSUD into C tile c from A tile a and B tile b. A macro: GCC's tile intrinsics paste the tile numbers
// into their assembly text, so they must be literals, not template parameters.
#define INFERD_TILE_PRODUCT(c, a, b, A, lda, B) \
  do {                                          \
    _tile_loadd(a, A, lda);                     \
    _tile_loadd(b, B, 64);                      \
    _tile_dpbsud(c, a, b);                      \
  } while (0)

// One group's int32 sums of 16 rows into C tile 4 (first) or 5: one TDPBSUD of 32 k (Width 32: configure_tiles)
// or two of 64 k (Width 128: configure_wide_tiles), alternating the A/B tile pairs so a load need not wait.
template <int64_t Width, bool first>
inline void group_sums(const int8_t* A, int64_t lda, const uint8_t* B) {
  static_assert(Width == kGroup || Width == 128, "groups of 32 or 128");
  constexpr bool wide = Width == 128;
  if constexpr (first) {
    _tile_zero(4);
    INFERD_TILE_PRODUCT(4, 0, 2, A, lda, B);
    if constexpr (wide) INFERD_TILE_PRODUCT(4, 1, 3, A + 64, lda, B + 16 * 64);
  } else {
    _tile_zero(5);
    INFERD_TILE_PRODUCT(5, 1, 3, A, lda, B);
    if constexpr (wide) INFERD_TILE_PRODUCT(5, 0, 2, A + 64, lda, B + 16 * 64);
  }
}

// Rows m0 .. m0 + 15 (zero past M) x tile t, in activation groups of Width (a from quantize_rows<T, Width>): the
// next group's products are issued before this group's sums are stored and scaled, so the tiles work while the
// vector units scale (5-10% at 16-32 rows on a Xeon with AMX, where those steps cost as much as the products).
template <int64_t Width, typename Out>
void amx_block(const uint8_t* P, int64_t tile_bytes, const QuantizedRows& a, int64_t m0, int64_t t, bool prefetch,
               const Output& o, Out Y) {
  __m512 f[kAmxRows];
  for (auto& v : f) v = _mm512_setzero_ps();
  alignas(64) int32_t c[2][kAmxRows][kTile];
  const int8_t* A = a.q.data() + m0 * a.Kp;
  const uint8_t* B = P + t * tile_bytes;
  constexpr int64_t group_bytes = Width / 4 * 64;
  group_sums<Width, true>(A, a.Kp, B);
  for (int64_t g = 0; g < a.groups; ++g) {
    if (prefetch && g % 2 == 0)
      for (int64_t off = 0; off < 2 * group_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(B + g * group_bytes + kPrefetchBytes + off), _MM_HINT_T0);
    const bool next = g + 1 < a.groups;
    if (g % 2 == 0) {
      if (next) group_sums<Width, false>(A + (g + 1) * Width, a.Kp, B + (g + 1) * group_bytes);
      _tile_stored(4, c[0], 64);
      scale_group(c[0], a, m0, g, f);
    } else {
      if (next) group_sums<Width, true>(A + (g + 1) * Width, a.Kp, B + (g + 1) * group_bytes);
      _tile_stored(5, c[1], 64);
      scale_group(c[1], a, m0, g, f);
    }
  }
  const TileOutput out(o, t);
  for (int64_t r = 0; r < kAmxRows && m0 + r < a.M; ++r) out.put(f[r], Y + (m0 + r) * o.N);
}
#endif
#elif defined(INFERD_AVX2)
// 16 vector registers: a block's int32 sums (MB rows x NT tiles x 2 vectors) stay in registers with the
// weights, their absolute values and the broadcast row; its float sums live in a small array (L1), updated
// once per group. Four rows of one tile share each weight load and its sign work.
constexpr int kMaxRows = 4;
constexpr int tiles_for(int rows) { return rows == 1 ? 2 : 1; }

// Four k of 8 output rows (32 weight bytes, +128) times one row's four k broadcast, added to acc: with VNNI
// directly (acc starts at -128 * sum(xq), taking the +128 off); without, on the signed weight's absolute
// value (aw) and the activation with the weight's sign (sw: the signed weight) moved onto it.
#if defined(__AVXVNNI__)
struct Weights {
  __m256i w;
  explicit Weights(__m256i v) : w(v) {}
  __m256i dot(__m256i acc, __m256i xb) const { return _mm256_dpbusd_avx_epi32(acc, w, xb); }
};
#else
struct Weights {
  __m256i sw, aw;
  explicit Weights(__m256i v) : sw(v), aw(_mm256_abs_epi8(v)) {}  // stored signed (kWeightOffset 0)
  __m256i dot(__m256i acc, __m256i xb) const { return dot_u8s8(acc, aw, _mm256_sign_epi8(xb, sw)); }
};
#endif

template <int64_t Width, int MB, int NT, typename Out>
void block(const uint8_t* P, int64_t tile_bytes, const QuantizedRows& a, int64_t m0, int64_t t0, bool prefetch,
           const Output& o, Out Y) {
  alignas(32) float f[MB][NT * kTile] = {};
  const uint8_t* base = P + t0 * tile_bytes;
  const TileAhead tile_ahead(a.M, MB, NT, tile_bytes);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i acc[MB][2 * NT];
    for (int m = 0; m < MB; ++m) {
#if defined(__AVXVNNI__)
      const __m256i start = _mm256_set1_epi32(a.init[(m0 + m) * a.groups + g]);
#else
      const __m256i start = _mm256_setzero_si256();  // the weights are signed: no +128 to take off
#endif
      for (int h = 0; h < 2 * NT; ++h) acc[m][h] = start;
    }
    for (int64_t j = g * Width / 4; j < (g + 1) * Width / 4; ++j) {
      const int64_t pf_at = tile_ahead.at(j);
      for (int h = 0; h < 2 * NT; ++h) {
        const uint8_t* p = base + (h / 2) * tile_bytes + j * 64 + (h % 2) * 32;
        if (prefetch && h % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(base + (h / 2) * tile_bytes + pf_at), _MM_HINT_T0);
        const Weights w(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        for (int m = 0; m < MB; ++m) acc[m][h] = w.dot(acc[m][h], _mm256_set1_epi32(a.quad(m0 + m, j)));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * a.groups + g]);
      for (int h = 0; h < 2 * NT; ++h)
        _mm256_store_ps(f[m] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), d, _mm256_load_ps(f[m] + 8 * h)));
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) put_row(f[m] + t * kTile, (t0 + t) * kTile, o, Y + (m0 + m) * o.N);
}
#else
constexpr int kMaxRows = 1;
constexpr int tiles_for(int) { return 1; }

template <int64_t Width, int MB, int NT, typename Out>
void block(const uint8_t* P, int64_t tile_bytes, const QuantizedRows& a, int64_t m0, int64_t t0, bool,
           const Output& o, Out Y) {
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) {
      const uint8_t* tile = P + (t0 + t) * tile_bytes;
      float v[kTile] = {};
      for (int64_t g = 0; g < a.groups; ++g) {
        int32_t dot[kTile] = {};
        for (int64_t j = g * Width / 4; j < (g + 1) * Width / 4; ++j)
          for (int i = 0; i < kTile; ++i)
            for (int b = 0; b < 4; ++b)
              dot[i] += (static_cast<int32_t>(tile[j * 64 + i * 4 + b]) - kWeightOffset) * a.qrow(m0 + m)[4 * j + b];
        for (int i = 0; i < kTile; ++i) v[i] += a.d[(m0 + m) * a.groups + g] * static_cast<float>(dot[i]);
      }
      put_row(v, (t0 + t) * kTile, o, Y + (m0 + m) * o.N);
    }
}
#endif

// One block of mb rows (1..kMaxRows) x nt tiles (1..tiles_for(mb): a stripe's nt is tiles_for of its full
// blocks' rows, and tiles_for never grows with the rows, so its last, shorter block fits too).
template <int64_t Width, int MB, typename Out>
void block_tiles(int nt, const uint8_t* P, int64_t tile_bytes, const QuantizedRows& a, int64_t m0, int64_t t0,
                 bool prefetch, const Output& o, Out Y) {
  switch (nt) {
#define INFERD_TILES(n) \
  case n:               \
    if constexpr (n <= tiles_for(MB)) return block<Width, MB, n>(P, tile_bytes, a, m0, t0, prefetch, o, Y);
    INFERD_TILES(1)
    INFERD_TILES(2)
    INFERD_TILES(3)
    INFERD_TILES(4)
    INFERD_TILES(5)
    INFERD_TILES(6)
    INFERD_TILES(7)
    INFERD_TILES(8)
#undef INFERD_TILES
  }
  TORCH_CHECK(false, "int8_linear: no block of ", MB, " rows x ", nt, " tiles");
}

template <int64_t Width, typename Out>
void run_block(int mb, int nt, const uint8_t* P, int64_t tile_bytes, const QuantizedRows& a, int64_t m0,
               int64_t t0, bool prefetch, const Output& o, Out Y) {
  switch (mb) {
    case 1: return block_tiles<Width, 1>(nt, P, tile_bytes, a, m0, t0, prefetch, o, Y);
#if defined(INFERD_AVX512_VNNI) || defined(INFERD_AVX2)
    case 2: return block_tiles<Width, 2>(nt, P, tile_bytes, a, m0, t0, prefetch, o, Y);
    case 3: return block_tiles<Width, 3>(nt, P, tile_bytes, a, m0, t0, prefetch, o, Y);
    case 4: return block_tiles<Width, 4>(nt, P, tile_bytes, a, m0, t0, prefetch, o, Y);
#endif
#if defined(INFERD_AVX512_VNNI)
    case 5: return block_tiles<Width, 5>(nt, P, tile_bytes, a, m0, t0, prefetch, o, Y);
    case 6: return block_tiles<Width, 6>(nt, P, tile_bytes, a, m0, t0, prefetch, o, Y);
#endif
  }
  TORCH_CHECK(false, "int8_linear: no block of ", mb, " rows");
}

}  // namespace

#if defined(INFERD_AMX)
constexpr int64_t kAmxRowsOr1 = kAmxRows;
bool amx_enabled = true;  // tests switch it off to compare the two paths
bool amx_available() { return amx_enabled && amx_permitted(); }
bool use_amx(int64_t M) { return M >= kAmxMinRows && amx_available(); }
#else
constexpr int64_t kAmxRowsOr1 = 1;
bool amx_available() { return false; }
bool use_amx(int64_t) { return false; }
#endif
#if defined(INFERD_AVX512_VNNI)
// Wide groups for bf16 rows (1), off (0), or for float32 rows too (2, tests). float32 rows keep groups of 32, so
// their outputs stay the same bits whatever the batch's row count; a bf16 row's outputs depend on how many rows
// share its call (groups of 32 below kWideMinRows, of kWide from there).
int wide_mode = 1;
bool wide_groups(int64_t M, int64_t Kp, bool bf16) {
  return M >= kWideMinRows && (wide_mode == 2 || (wide_mode == 1 && bf16)) && Kp % kWide == 0;
}
template <typename T>
QuantizedRows quantize_wide(const T* x, int64_t M, int64_t K, int64_t Kp, int64_t Mp) {
  return quantize_rows<T, kWide>(x, M, K, Kp, Mp);
}
#else
bool wide_groups(int64_t, int64_t, bool) { return false; }
template <typename T>
QuantizedRows quantize_wide(const T* x, int64_t M, int64_t K, int64_t Kp, int64_t Mp) {
  return quantize_rows(x, M, K, Kp, Mp);  // never called: wide groups are AVX-512's
}
#endif

// q [N, K] int8 in -127..127 (as quantize_int8 makes it) -> [ceil(N / 16), Kp / 4, 16, 4] uint8, q + kWeightOffset
// (its bits, where that is 0), with Kp = K rounded up to whole groups of 32; padding holds a zero weight.
torch::Tensor int8_pack(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8, "int8_pack: q must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), Kp = (K + kGroup - 1) / kGroup * kGroup;
  const int64_t tiles = (N + kTile - 1) / kTile;
  auto padded = torch::zeros({tiles * kTile, Kp}, q.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  // [tiles, 16, Kp / 4, 4] -> [tiles, Kp / 4, 16, 4]
  auto packed = padded.view({tiles, kTile, Kp / 4, 4}).permute({0, 2, 1, 3}).contiguous();
  return kWeightOffset ? (packed.to(torch::kInt16) + kWeightOffset).to(torch::kUInt8) : packed.view(torch::kUInt8);
}

// One output row's weights from its tile (src: its first quad; quads 64 bytes apart) as K values q * s, rounded
// to Out once (bf16: to nearest even).
template <typename Out>
void unpack_row(const uint8_t* src, int64_t K, float s, Out* row) {
  int64_t k = 0;
#if defined(INFERD_AVX512_VNNI)
  const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(64));
  for (; k + 64 <= K; k += 64) {  // 16 quads: 64 consecutive k
    const __m512i v = _mm512_i32gather_epi32(index, src + (k / 4) * 64, 1);
    for (int c = 0; c < 4; ++c) {
      const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, c)), _mm512_set1_epi32(128));
      store(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s)), 0xFFFF, row + k + 16 * c);
    }
  }
#endif
  for (; k < K; ++k) {
    const uint8_t b = src[(k / 4) * 64 + k % 4];
    const int q = kWeightOffset ? static_cast<int>(b) - kWeightOffset : static_cast<int8_t>(b);
    put(static_cast<float>(q) * s, row + k);
  }
}

// The int8 weights back out of int8_pack's layout as [N, K] float32 or bfloat16, for the dense matmul that many
// rows (prefill) take: q * scale[n] (rounded once to the dtype) with a scale, q itself (exact) without.
torch::Tensor int8_unpack(torch::Tensor packed, int64_t N, int64_t K, torch::ScalarType dtype,
                          c10::optional<torch::Tensor> scale) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == kTile,
              "int8_unpack: packed must come from int8_pack");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "int8_unpack: float32 or bfloat16");
  packed = packed.contiguous();
  const int64_t tiles = packed.size(0), quads = packed.size(1);
  TORCH_CHECK(tiles == (N + kTile - 1) / kTile && quads * 4 == (K + kGroup - 1) / kGroup * kGroup,
              "int8_unpack: shapes do not match");
  torch::Tensor sc;
  if (scale.has_value() && scale->defined()) {
    sc = scale->to(torch::kFloat32).contiguous();
    TORCH_CHECK(sc.numel() == N, "int8_unpack: scale has the wrong size");
  }
  const float* S = sc.defined() ? sc.data_ptr<float>() : nullptr;
  auto w = torch::empty({N, K}, packed.options().dtype(dtype));
  const uint8_t* P = packed.data_ptr<uint8_t>();
  auto run = [&](auto* W) {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t n = t * kTile; n < std::min(N, (t + 1) * kTile); ++n)
          unpack_row(P + t * quads * 64 + (n - t * kTile) * 4, K, S ? S[n] : 1.f, W + n * K);
    });
  };
  if (dtype == torch::kFloat32) run(w.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>()));
  return w;
}

// What int8_linear checks: x [M, K] and packed weights of matching shapes, the scales (float32) and the bias
// (float32, or undefined), made contiguous.
struct Call {
  torch::Tensor x, packed, scale, bias;
  int64_t M, K, N, tiles, Kp;
};

Call check_call(const char* what, torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, what, ": x must be [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == kTile &&
                  packed.size(3) == 4,
              what, ": packed must come from int8_pack");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32, what, ": scale must be float32");
  Call c{x.contiguous(), packed.contiguous(), scale.contiguous(), torch::Tensor(), 0, 0, 0, 0, 0};
  c.M = x.size(0), c.K = x.size(1), c.N = scale.numel(), c.tiles = packed.size(0), c.Kp = packed.size(1) * 4;
  TORCH_CHECK(c.Kp == (c.K + kGroup - 1) / kGroup * kGroup && c.tiles == (c.N + kTile - 1) / kTile, what,
              ": shapes do not match");
  if (bias.has_value() && bias->defined()) {
    c.bias = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(c.bias.numel() == c.N, what, ": bias has the wrong size");
  }
  return c;
}

// A call's products ready to run: the call checked, x quantized, the path chosen (AMX from 8 rows).
struct Products {
  Call c;
  bool amx, wide;
  QuantizedRows a;
};

Products prepare(const char* what, torch::Tensor x_in, torch::Tensor packed_in, torch::Tensor scale_in,
                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 || x_in.scalar_type() == torch::kBFloat16, what,
              ": x must be float32 or bfloat16");
  Call c = check_call(what, x_in, packed_in, scale_in, bias);
  const int64_t M = c.M, K = c.K, Kp = c.Kp;
  const bool amx = use_amx(M);
  const int64_t Mp = amx ? (M + kAmxRowsOr1 - 1) / kAmxRowsOr1 * kAmxRowsOr1 : M;
  const bool wide = wide_groups(M, Kp, c.x.scalar_type() == torch::kBFloat16);
  auto quantize = [&](const auto* xp) { return wide ? quantize_wide(xp, M, K, Kp, Mp) : quantize_rows(xp, M, K, Kp, Mp); };
  QuantizedRows a = c.x.scalar_type() == torch::kFloat32 ? quantize(c.x.data_ptr<float>())
                                                         : quantize(c.x.data_ptr<at::BFloat16>());
  return {std::move(c), amx, wide, std::move(a)};
}

// Every output of the call handed to the sink that make_y() gives each thread: a pointer into y [M, N] (float,
// or uint16_t for bf16 bits), or an ArgmaxOut.
template <typename MakeY>
void compute(const Products& p, MakeY&& make_y) {
  const Call& c = p.c;
  const QuantizedRows& a = p.a;
  const int64_t M = c.M, tiles = c.tiles;
  const uint8_t* P = c.packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = c.Kp * kTile;
  const Output o{c.N, c.scale.data_ptr<float>(), c.bias.defined() ? c.bias.data_ptr<float>() : nullptr};
#if defined(INFERD_AMX)
  if (p.amx) {
    // runs of kClaimTiles tiles, each taken row tile by row tile: a row's outputs are then written in runs of
    // whole cache lines, where tile by tile (all rows each) wrote 32-byte pieces a row (N outputs) apart, half
    // lines that two threads could share. At prefill's hundreds of rows the outputs' writes cost more than the
    // products (a timing experiment without them: 384 rows x 4096 outputs 2.8 -> 0.85 ms on one thread); this
    // order took 1.14-1.17x off 384 rows x 4096 or 16384 outputs (1.03x at 640; decode's 16-32 rows even).
    const int64_t runs = (tiles + kClaimTiles - 1) / kClaimTiles;
    const bool wide = p.wide;
    parallel_claim(runs, 1, [&](auto each) {
      wide ? configure_wide_tiles() : configure_tiles();
      const auto Y = make_y();
      each([&](int64_t r) {
        const int64_t t0 = r * kClaimTiles, t1 = std::min(tiles, t0 + kClaimTiles);
        for (int64_t m0 = 0; m0 < M; m0 += kAmxRows)
          for (int64_t t = t0; t < t1; ++t)
            wide ? amx_block<kWide>(P, tile_bytes, a, m0, t, m0 == 0, o, Y)
                 : amx_block<kGroup>(P, tile_bytes, a, m0, t, m0 == 0, o, Y);
      });
      _tile_release();
    });
    return;
  }
#endif
  // rows a block: with AVX-512 the rows split evenly over the fewest blocks of up to kMaxRows (8 rows as 4 + 4,
  // not 6 + 2: a short block left too little time to fetch the next stripe in; 7, 8 and 13 rows 0.87x, 0.92x and
  // 0.93x the time, Zen 4); AVX2's blocks stay kMaxRows and the rest (5 and 6 rows even: 1.07x, 1.03x, capped)
#if defined(INFERD_AVX512_VNNI)
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  const int rows = static_cast<int>((M + blocks - 1) / blocks);
#else
  const int rows = static_cast<int>(std::min<int64_t>(M, kMaxRows));
#endif
  const int nt = tiles_for(rows);  // tiles per stripe: each stripe's weights are read from memory once
  const int64_t later = (M + rows - 1) / rows - 1;  // blocks after a stripe's first
  const int64_t stripes = (tiles + nt - 1) / nt;
  parallel_claim(stripes, 1, [&](auto each) {
    const auto Y = make_y();
    each([&](int64_t s) {
      const int64_t t0 = s * nt;
      const int n = static_cast<int>(std::min<int64_t>(nt, tiles - t0));
      const int64_t next = std::clamp<int64_t>(tiles - t0 - nt, 0, nt);  // tiles of the next stripe
      ahead = next ? Ahead(reinterpret_cast<const char*>(P + (t0 + nt) * tile_bytes), next * tile_bytes / 64, later,
                           c.Kp / 4)
                   : Ahead();
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int mb = static_cast<int>(std::min<int64_t>(rows, M - m0));
        p.wide ? run_block<kWide>(mb, n, P, tile_bytes, a, m0, t0, m0 == 0, o, Y)
               : run_block<kGroup>(mb, n, P, tile_bytes, a, m0, t0, m0 == 0, o, Y);
      }
    });
  });
}

// x [M, K] float32 or bfloat16, packed from int8_pack, scale [N] float32, bias [N] or None -> [M, N] in x's dtype.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  const Products p = prepare("int8_linear", x, packed, scale, bias);
  auto y = torch::empty({p.c.M, p.c.N}, p.c.x.options());
  if (y.scalar_type() == torch::kFloat32) compute(p, [&] { return y.data_ptr<float>(); });
  else compute(p, [&] { return reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()); });
  return y;
}

// int8_linear's outputs folded into a running argmax per row instead of returned: best_val [M] float32 and
// best_idx [M] int64 take output n as index offset + n where it is strictly greater than the best so far (the
// first maximal index, as argmax_update over int8_linear's y gives: each output rounded to x's dtype first).
void int8_argmax(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                 torch::Tensor best_val, torch::Tensor best_idx, int64_t offset) {
  const Products p = prepare("int8_argmax", x, packed, scale, bias);
  const int64_t M = p.c.M;
  TORCH_CHECK(best_val.scalar_type() == torch::kFloat32 && best_idx.scalar_type() == torch::kInt64 &&
                  best_val.is_contiguous() && best_idx.is_contiguous() && best_val.numel() == M && best_idx.numel() == M,
              "int8_argmax: best_val [M] float32, best_idx [M] int64");
  std::vector<LaneBest> bests(at::get_num_threads(), LaneBest(M, p.c.N));
  auto into = [&](auto dtype) {
    return [&, dtype] { return ArgmaxOut<decltype(dtype)>{&bests[at::get_thread_num()], 0}; };
  };
  if (p.c.x.scalar_type() == torch::kFloat32) compute(p, into(float{}));
  else compute(p, into(uint16_t{}));
  for (const LaneBest& b : bests) b.fold_into(best_val.data_ptr<float>(), best_idx.data_ptr<int64_t>(), M, offset);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_pack", &int8_pack, "int8 weights [N, K] -> the tiled layout int8_linear reads");
  m.def("int8_unpack", &int8_unpack, "the packed int8 weights as [N, K] float32 or bfloat16 (times scale, if given)",
        py::arg("packed"), py::arg("N"), py::arg("K"), py::arg("dtype"), py::arg("scale") = py::none());
  m.def("int8_linear", &int8_linear,
        "int8 weights x int8-quantized activations (groups of 32; 128 for bf16 rows on AMX), on CPU");
  m.def("int8_argmax", &int8_argmax,
        "int8_linear's outputs folded into a running argmax per row (best_val, best_idx; indices from offset)");
  m.def("isa", [] { return std::string(kIsa) + (amx_available() ? "+amx" : ""); },
        "the instruction set int8_linear was built for (+amx: AMX tiles serve 8 rows and more)");
#if defined(INFERD_AMX)
  m.def("set_amx", [](bool on) { amx_enabled = on; }, "tests: switch the AMX path off or on");
#endif
#if defined(INFERD_AVX512_VNNI)
  m.def("set_wide_groups", [](int mode) { wide_mode = mode; },
        "tests: rows from 8 quantized in groups of 128 for bf16 rows (1, the default), never (0), or always (2)");
  m.def("wide_group", [] { return kWide; }, "the activation group of 8 rows and more where K is a multiple of it");
#endif
}
