// AVX2 + FMA + F16C (e.g. AMD Zen 3). A panel's 16 columns are two ymm halves, done one after the other (a half reads
// 32 of each 64-byte block; the panel stays in L1 between them), R <= 4 rows at a time: 16 ymm registers hold R
// int32 sums, R int16 partial sums and R float sums. maddubs' int16 pair sums add up over kInt16Steps steps of a
// group before madd widens them (the bounds of gguf_linear_avx512.h), so a 4-bit group costs one madd per row.
#pragma GCC target("avx2,fma,f16c")
#define TRTSPEC_VEC_YMM 1  // vec16.h's fma16
#include <immintrin.h>

#include "gguf_linear.h"
#include "attention_rows.h"
#include "quantize_rows.h"

namespace trtspec_gguf {
namespace {

constexpr int kMaxRows = 4;
constexpr int kHalf = 8;  // columns of a ymm register

template <int BITS> constexpr int kGroup = BITS == 6 ? 16 : 32;
template <int BITS> constexpr int kSteps = kGroup<BITS> / 4;
template <int BITS> constexpr int kInt16Steps = BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1;

// Step s of a group, columns 8h .. 8h + 7: 32 codes, byte c*4 + t for column 8h + c at k = 4s + t.
template <int BITS>
inline __m256i codes_of(const uint8_t* group, int s, int h) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 64 * s + 32 * h));
  } else {
    constexpr int half = kSteps<BITS> / 2;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 64 * (s % half) + 32 * h));
    __m256i q = s < half ? _mm256_and_si256(b, low4) : _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    if constexpr (BITS == 5 || BITS == 6) {
      const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 64 * half + 32 * h));
      const __m128i shift = _mm_cvtsi32_si128(BITS == 5 ? s : 2 * s);
      const __m256i high = _mm256_and_si256(_mm256_srl_epi16(plane, shift), _mm256_set1_epi8(BITS == 5 ? 1 : 3));
      q = _mm256_or_si256(q, _mm256_slli_epi16(high, 4));
    }
    return q;
  }
}

// The lines kPrefetchBytes past this group's (gguf_linear.h).
inline void prefetch_group(const Weights& w, const uint8_t* group) {
  const char* ahead = reinterpret_cast<const char*>(group) + kPrefetchBytes;
  for (int64_t j = 0; j < w.group_bytes; j += 64) _mm_prefetch(ahead + j, _MM_HINT_T0);
}

template <bool HALF>
inline __m256 floats_as(const uint8_t* p, int h) {
  if constexpr (HALF) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h));
  else return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + kHalf * h);
}

// Scales (or minimums) of columns 8h .. 8h + 7 from the 16 at p, as float32 (float16 converted exactly).
inline __m256 floats_at(const Weights& w, const uint8_t* p, int h) {
  return w.half_scales ? floats_as<true>(p, h) : floats_as<false>(p, h);
}

template <typename F, int R>
void int8_rows(const Weights& w, const uint8_t* panel, const Int8Rows& x, int64_t r0, float* y, int64_t ldy,
               int64_t col0) {
  constexpr int BITS = F::bits;
  constexpr int S = kSteps<BITS>;
  const int64_t groups = w.groups, m = x.m;
  const int32_t* const xq = x.q + r0 * S;
  const int32_t* const xz = x.zsum + r0;
  const float* const xf = x.fsum + r0;
  const float* const xs = x.scale + r0;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = panel + g * F::group_bytes;
      prefetch_form<F>(group);
      const int32_t* a0 = xq + g * m * S;  // step s, row r: a0[r * S + s]
      __m256i dot[R], part[R];
      for (int r = 0; r < R; ++r) dot[r] = part[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        const __m256i q = codes_of<BITS>(group, s, h);
        const __m256i uq = BITS == 8 ? _mm256_abs_epi8(q) : q;
        for (int r = 0; r < R; ++r) {
          __m256i a = _mm256_set1_epi32(a0[r * S + s]);
          if constexpr (BITS == 8) a = _mm256_sign_epi8(a, q);
          part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(uq, a));
          if ((s + 1) % kInt16Steps<BITS> == 0) {
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(part[r], ones));
            part[r] = _mm256_setzero_si256();
          }
        }
      }
      const __m256 scale = floats_as<F::half>(group + F::codes_bytes, h);
      const __m256 minimum = F::has_min ? floats_as<F::half>(group + F::codes_bytes + F::floats_bytes, h)
                                        : _mm256_setzero_ps();
      const int64_t i = g * m;
      for (int r = 0; r < R; ++r) {
        // zero * sum a is 0 for a type with minimums (zero point 0, checked by the op)
        const __m256i idot = F::has_min ? dot[r] : _mm256_sub_epi32(dot[r], _mm256_set1_epi32(xz[i + r]));
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(idot), scale);
        if constexpr (F::has_min) t = _mm256_add_ps(t, _mm256_mul_ps(minimum, _mm256_set1_ps(xf[i + r])));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(t, _mm256_set1_ps(xs[i + r])));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + col0 + kHalf * h, acc[r]);
  }
}

template <int BITS, int R>
void float_rows(const Weights& w, const uint8_t* panel, const FloatRows& x, int64_t r0, float* y, int64_t ldy,
                int64_t col0) {
  constexpr int G = kGroup<BITS>, S = kSteps<BITS>;
  const __m256i zero = _mm256_set1_epi32(w.zero), byte = _mm256_set1_epi32(0xFF);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* group = panel + g * w.group_bytes;
      prefetch_group(w, group);
      const float* xg = x.xt + g * G * x.m + r0;  // k = g * G + i, row r: xg[i * m + r]
      const __m256 scale = floats_at(w, group + w.codes_bytes, h);
      const __m256 minimum = w.has_min
          ? floats_at(w, group + w.codes_bytes + w.floats_bytes, h)
          : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        const __m256i q = codes_of<BITS>(group, s, h);
        for (int t = 0; t < 4; ++t) {
          __m256i qt;
          if constexpr (BITS == 8) {
            qt = _mm256_sra_epi32(_mm256_sll_epi32(q, _mm_cvtsi32_si128(24 - 8 * t)), _mm_cvtsi32_si128(24));
          } else {
            qt = _mm256_and_si256(_mm256_srl_epi32(q, _mm_cvtsi32_si128(8 * t)), byte);
          }
          __m256 wt = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qt, zero)), scale);
          if (w.has_min) wt = _mm256_add_ps(wt, minimum);
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wt, _mm256_set1_ps(xg[(4 * s + t) * x.m + r]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + col0 + kHalf * h, acc[r]);
  }
}

template <typename F, bool INT8, typename X>
void panels(const Weights& w, const X& x, int64_t m, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = w.groups * w.group_bytes;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w.data + p * panel_bytes;
    const int64_t col0 = p * kPanel;
    for (int64_t r = 0, n; r < m; r += n) {
      n = tile_rows(m - r, kMaxRows);
      if constexpr (INT8) {
        switch (n) {
          case 4: int8_rows<F, 4>(w, panel, x, r, y, ldy, col0); break;
          case 3: int8_rows<F, 3>(w, panel, x, r, y, ldy, col0); break;
          case 2: int8_rows<F, 2>(w, panel, x, r, y, ldy, col0); break;
          default: int8_rows<F, 1>(w, panel, x, r, y, ldy, col0); break;
        }
      } else {
        switch (n) {
          case 4: float_rows<F::bits, 4>(w, panel, x, r, y, ldy, col0); break;
          case 3: float_rows<F::bits, 3>(w, panel, x, r, y, ldy, col0); break;
          case 2: float_rows<F::bits, 2>(w, panel, x, r, y, ldy, col0); break;
          default: float_rows<F::bits, 1>(w, panel, x, r, y, ldy, col0); break;
        }
      }
    }
  }
}

template <int BITS>
void int8_bits(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  with_form<BITS>(w.has_min, w.half_scales, [&](auto form) { panels<decltype(form), true>(w, x, x.m, y, ldy, p0, p1); });
}

}  // namespace

void int8_avx2(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  switch (w.bits) {
    case 4: int8_bits<4>(w, x, y, ldy, p0, p1); break;
    case 5: int8_bits<5>(w, x, y, ldy, p0, p1); break;
    case 6: int8_bits<6>(w, x, y, ldy, p0, p1); break;
    default: int8_bits<8>(w, x, y, ldy, p0, p1); break;
  }
}

void float_avx2(const Weights& w, const FloatRows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  switch (w.bits) {
    case 4: panels<Form<4, false, false>, false>(w, x, x.m, y, ldy, p0, p1); break;
    case 5: panels<Form<5, false, false>, false>(w, x, x.m, y, ldy, p0, p1); break;
    case 6: panels<Form<6, false, false>, false>(w, x, x.m, y, ldy, p0, p1); break;
    default: panels<Form<8, false, false>, false>(w, x, x.m, y, ldy, p0, p1); break;
  }
}

void attention_avx2(const AttentionArgs& a, int64_t r0, int64_t r1, float* scratch) {
  attention_rows_impl(a, r0, r1, scratch);
}

void quantize_avx2(const float* x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0, int64_t b1, int32_t* q,
                    int32_t* zsum, float* fsum, float* scale) {
  quantize_rows_impl(x, m, k, group, zero, b0, b1, q, zsum, fsum, scale);
}

}  // namespace trtspec_gguf
