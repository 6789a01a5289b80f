// exp(x) for x <= 0 in float32, one value, 8 lanes (AVX2) or 16 (AVX-512), for the CPU kernels that include it
// (kernels/cpu_attention.cpp's online softmax, kernels/cpu_sampler.cpp's temperature draw);
// kernels/cpu_attention_build.py keys a library by its source and the headers of this folder it
// includes.
//
// Why not libm's expf: it is not vectorised without -ffast-math, which would also break the inf
// semantics these kernels rely on. Range reduction x = n ln2 + f, |f| <= ln2/2 (ln2 split in two
// for precision), then a degree-6 Taylor polynomial: relative error ~1e-7. Underflows to 0 below
// -87, -inf included.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ce_exp {

inline float exp_nonpositive(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float f = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t e = static_cast<int32_t>(std::max(n, -126.0f)) + 127;
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive for 16 lanes at once, the same steps.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_max_ps(n, _mm512_set1_ps(-126.0f))), _mm512_set1_epi32(127));
  const __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ), r);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive for 8 lanes at once (AVX2 + FMA), the same steps.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 f = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.0f))), _mm256_set1_epi32(127));
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
  // Lanes below -87 (-inf included) give 0; a NaN lane keeps r's NaN.
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ), r);
}
#endif

}  // namespace ce_exp
