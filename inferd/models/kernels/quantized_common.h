// What the int8 and int4 kernels share: the instruction set they are built for (chosen by -march=native),
// the prefetch distance, the u8 x s8 dot product of AVX2, and float32 -> bfloat16 rounding. Included by
// int8_linear_cpu.cpp and int4_linear_cpu.cpp (cpu_kernels.py puts this folder on the include path and
// hashes the headers into each build's name).
#pragma once

#include <bit>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace inferd {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INFERD_AVX512_VNNI 1
constexpr const char* kIsa = "avx512-vnni";
#elif defined(__AVX2__)
#define INFERD_AVX2 1
#if defined(__AVXVNNI__)
constexpr const char* kIsa = "avx2-vnni";
#else
constexpr const char* kIsa = "avx2";
#endif
#else
constexpr const char* kIsa = "portable";
#endif

// Weight bytes are prefetched this far ahead of the loads (measured: a decode step's weight stream went from
// 12 to 17 GB/s here at 4 KiB; 2 and 8 KiB were slower). Rows are contiguous, so it runs on into the next.
constexpr int64_t kPrefetchBytes = 4096;

// The hint of those prefetches. On AMD (cpu.py's compiler_flags defines INFERD_AMD) prefetcht2, which the Zen 4
// measured far ahead of prefetcht0: the LM head's int8 pass at 1, 4 and 12 rows 0.87x, 0.83x and 0.93x the time
// with T0, whose lines gained nothing over the hardware prefetcher's (the same held for decode attention: T0
// and NTA as slow as none at all, T2 1.45x faster). Elsewhere T0, as measured on the Xeon.
#if defined(INFERD_AMD)
#define INFERD_STREAM_HINT _MM_HINT_T2
#else
#define INFERD_STREAM_HINT _MM_HINT_T0
#endif

// float32 -> bfloat16 bits, round to nearest even as torch does (no NaNs reach here): vectorisable, unlike
// at::BFloat16's constructor in a loop.
inline uint16_t bf16_bits(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// One output value: float32 as is, bfloat16 as its bits.
inline void put(float v, float* out) { *out = v; }
inline void put(float v, uint16_t* out) { *out = bf16_bits(v); }

#if defined(INFERD_AVX2)
// 32 unsigned bytes times 32 signed bytes, summed in fours into 8 int32 lanes and added to acc. Without
// AVX-VNNI, pairs are summed in int16 first: callers keep |u * s| * 2 <= 32767 (int4: 15 * 127; int8 with
// signs moved: 127 * 127).
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

}  // namespace inferd
