// e^x in plain float arithmetic, so `omp simd` loops vectorise it (std::exp is a library call per element).
// Its clamp (std::min/max) vectorises on AVX2 only under -fno-trapping-math (cpu_kernels.py); AVX-512 masks it.
// Included by norm_rope_cpu.cpp (the gated activations), paged_decode_cpu.cpp and prefill_attention_cpu.cpp (the
// softmax).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace inferd {

// x = k ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes' expf), 2^k built in the exponent bits.
// Within 2 ulp of std::exp over the float range; inputs below -87 give e^-87 rather than 0.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float k = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  return e * std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23);
}

#if defined(__AVX512F__)
// The same steps on 16 lanes, for loops the compiler does not vectorise (a softmax's reductions).
inline __m512 exp_approx(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i two_k = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(two_k));
}
#endif

}  // namespace inferd
