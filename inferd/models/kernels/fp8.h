// fp8 KV cache values (--kv-cache-dtype fp8 / fp8_e5m2) widened to float32 or bfloat16, exactly.
//
// Both formats are a float16 with fewer bits, so the vector paths build float16 bits and let the F16C /
// AVX-512 conversion widen them: e5m2 is the top byte of a float16 (a shift); e4m3's 4 exponent and 3
// mantissa bits, placed in a float16's, give the value / 2^8 (float16's exponent bias is 8 more), subnormals
// included, and one multiply by 2^8 restores it. The scalar forms build float32 bits and need no F16C.
// Neither format's NaN or infinity reaches here: the cache is written clamped to the finite range.
#pragma once

#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace inferd {

struct E4M3 {  // torch.float8_e4m3fn: bias 7, max 448
  uint8_t bits;
};
struct E5M2 {  // torch.float8_e5m2: bias 15, max 57344
  uint8_t bits;
};

inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float fp8_to_float(E4M3 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x80) << 24, e = (x.bits >> 3) & 0xF, m = x.bits & 0x7;
  if (e == 0) return (sign ? -1.f : 1.f) * static_cast<float>(m) * 0x1p-9f;
  return from_bits(sign | (e + 120) << 23 | m << 20);
}

inline float fp8_to_float(E5M2 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x80) << 24, e = (x.bits >> 2) & 0x1F, m = x.bits & 0x3;
  if (e == 0) return (sign ? -1.f : 1.f) * static_cast<float>(m) * 0x1p-16f;
  return from_bits(sign | (e + 112) << 23 | m << 21);
}

template <typename F>
constexpr bool is_fp8 = std::is_same_v<F, E4M3> || std::is_same_v<F, E5M2>;

inline bool is_fp8_type(c10::ScalarType t) {
  return t == c10::ScalarType::Float8_e4m3fn || t == c10::ScalarType::Float8_e5m2;
}

// f(a value of the cache's element type): E4M3 or E5M2 for an fp8 cache, else `own` (the kernel's own type).
template <typename Own, typename F>
inline void with_cache_type(c10::ScalarType kv, Own own, F&& f) {
  if (kv == c10::ScalarType::Float8_e4m3fn) {
    f(E4M3{});
  } else if (kv == c10::ScalarType::Float8_e5m2) {
    f(E5M2{});
  } else if (kv == c10::ScalarType::BFloat16) {  // bf16 bits, whatever q's dtype (float32 q: widened as read)
    f(uint16_t{0});
  } else {
    f(own);
  }
}

#if defined(__AVX512F__)
// 16 values -> 16 float32 lanes
inline __m512 widen16(const E4M3* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
inline __m512 widen16(const E5M2* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// 32 values -> 32 bfloat16 lanes (exact: the values fit in bf16)
inline __m512i widen32_bf16(const E5M2* p) { return (__m512i)_mm512_cvtne2ps_pbh(widen16(p + 16), widen16(p)); }

// e4m3 straight to bf16 in 16-bit lanes, no float conversion: a normal value's exponent and mantissa shifted
// into bf16's and rebiased (+120); the seven subnormals (m x 2^-9) from a table; the sign moved to bit 15.
// Half the instructions of the float16 route (17 for 32 values), which made an e4m3 cache's decode step 8%
// slower than a bf16 cache's.
inline __m512i widen32_bf16(const E4M3* p) {
  alignas(64) static constexpr uint16_t kSubnormals[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i bits = _mm512_mask_permutexvar_epi16(normal, sub, mag, _mm512_load_si512(kSubnormals));
  return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// 8 values -> 8 float32 lanes
inline __m256 widen8(const E4M3* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
inline __m256 widen8(const E5M2* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
}
#endif

// n values -> dst[0 .. n) as float32
template <typename F>
inline void widen_fp8_row(const F* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, widen16(src + i));
#elif defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
#endif
  for (; i < n; ++i) dst[i] = fp8_to_float(src[i]);
}

// the bfloat16 bits of an fp8 value: exact, both formats fit in bf16's 8 exponent and 7 mantissa bits
template <typename F>
inline uint16_t fp8_to_bf16(F x) {
  uint32_t bits;
  const float f = fp8_to_float(x);
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// all 256 values' bfloat16 bits, for loops that convert one value at a time (a lookup, not the branches)
template <typename F>
inline const uint16_t* fp8_bf16_table() {
  static const auto table = [] {
    std::array<uint16_t, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8_to_bf16(F{static_cast<uint8_t>(i)});
    return t;
  }();
  return table.data();
}

}  // namespace inferd
