// Activations to int8 per block of 32 along K, as the int8 kernels read them: blocks [b0, b1) of every row (a
// thread's share is a range of K, so two threads never write the same cache line of the interleaved rows). Scale
// d = amax / 127, code rint(x / d) computed as x * (1 / d) rounded half to even (adding and subtracting 1.5 * 2^23
// rounds any |v| < 2^22 in the default rounding mode, as numpy's rint does), and each group's sum of codes.
// Written on GCC's vectors (vec16.h) and included by each ISA file, so that its compiler target makes one zmm, two
// ymm or scalar code of it; the maximum and the sums are exact in any order and the IEEE steps are the same per
// lane, so every path rounds identically.
#pragma once
#include <cstdint>
#include <cstring>

#include "vec16.h"

namespace trtspec_gguf {
namespace {

inline f16x abs16(f16x v) {
  i16x bits;
  std::memcpy(&bits, &v, sizeof(v));
  bits &= 0x7FFFFFFF;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline int32_t lanes_total(i16x v) {
  v += lanes_xor<8>(v);
  v += lanes_xor<4>(v);
  v += lanes_xor<2>(v);
  v += lanes_xor<1>(v);
  return v[0];
}

// One block of 32: its scale d, its codes, and the sums of its two halves' codes.
inline float block_codes(const float* v, int8_t* codes, int32_t* sums) {
#if defined(TRTSPEC_VEC_YMM)
  // on ymm, the same IEEE steps per lane (GCC makes the generic narrowing and folds lane by lane through memory)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(v + 8 * i);
  __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x[0], magnitude), _mm256_and_ps(x[1], magnitude)),
                             _mm256_max_ps(_mm256_and_ps(x[2], magnitude), _mm256_and_ps(x[3], magnitude)));
  top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 0x01));
  top = _mm256_max_ps(top, _mm256_permute_ps(top, _MM_SHUFFLE(1, 0, 3, 2)));
  top = _mm256_max_ps(top, _mm256_permute_ps(top, _MM_SHUFFLE(2, 3, 0, 1)));
  const float d = _mm256_cvtss_f32(top) / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f), shift = _mm256_set1_ps(12582912.0f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)
    c[i] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x[i], id), shift), shift));
  // |code| <= 127: the saturating packs narrow exactly; they interleave 4-code runs, which the permute puts back
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  for (int h = 0; h < 2; ++h) {
    const __m256i both = _mm256_add_epi32(c[2 * h], c[2 * h + 1]);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    sums[h] = _mm_cvtsi128_si32(t);
  }
  return d;
#else
  const f16x lo = load16(v), hi = load16(v + 16);
  const float d = lanes_max(max16(abs16(lo), abs16(hi))) / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const i16x clo = __builtin_convertvector((lo * id + 12582912.0f) - 12582912.0f, i16x);
  const i16x chi = __builtin_convertvector((hi * id + 12582912.0f) - 12582912.0f, i16x);
  const i8x16 blo = __builtin_convertvector(clo, i8x16), bhi = __builtin_convertvector(chi, i8x16);
  std::memcpy(codes, &blo, 16);
  std::memcpy(codes + 16, &bhi, 16);
  sums[0] = lanes_total(clo);
  sums[1] = lanes_total(chi);
  return d;
#endif
}

inline void quantize_rows_impl(const float* __restrict x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0,
                               int64_t b1, int32_t* __restrict q, int32_t* __restrict zsum, float* __restrict fsum,
                               float* __restrict scale) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t r = 0; r < m; ++r) {
      int8_t codes[32];
      int32_t sums[2];
      const float d = block_codes(x + r * k + b * 32, codes, sums);
      // a group of 32 is the block; a group of 16 (Q6_K) is each half
      const int64_t g0 = b * 32 / group;
      if (group == 32) {
        std::memcpy(q + (g0 * m + r) * 8, codes, 32);
        const int32_t sum = sums[0] + sums[1];
        zsum[g0 * m + r] = zero * sum;
        fsum[g0 * m + r] = static_cast<float>(sum);
        scale[g0 * m + r] = d;
      } else {
        std::memcpy(q + (g0 * m + r) * 4, codes, 16);
        std::memcpy(q + ((g0 + 1) * m + r) * 4, codes + 16, 16);
        for (int h = 0; h < 2; ++h) {
          zsum[(g0 + h) * m + r] = zero * sums[h];
          fsum[(g0 + h) * m + r] = static_cast<float>(sums[h]);
          scale[(g0 + h) * m + r] = d;
        }
      }
    }
  }
}

}  // namespace
}  // namespace trtspec_gguf
