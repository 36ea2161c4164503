// The AVX-512 kernels, included by gguf_linear_avx512.cpp (AVX-512BW: maddubs + madd) and (with TRTSPEC_VNNI)
// gguf_linear_avx512vnni.cpp (vpdpbusd), each after its own #pragma GCC target. Everything here has internal
// linkage, so the two compilations never share a function.
//
// One zmm register is a panel's 16 columns: int32 lanes for the integer dot products, float32 lanes for the
// sums. A call's rows go through a panel R at a time, so the panel's bytes come from memory once and from L1 for the
// next R rows: R <= 12 with VNNI (2R accumulators within the 32 registers), R <= 8 without (plus R int16 partial
// sums).
#include <immintrin.h>

#include "gguf_linear.h"

namespace trtspec_gguf {
namespace {

#ifdef TRTSPEC_VNNI
constexpr int kMaxRows = 12;
#else
constexpr int kMaxRows = 8;
#endif
constexpr int kMaxFloatRows = 5;  // four sums d_t a row: 20 of the 32 registers, and R accumulators

template <int BITS> constexpr int kGroup = BITS == 6 ? 16 : 32;
template <int BITS> constexpr int kSteps = kGroup<BITS> / 4;
// Without VNNI, maddubs' int16 pair sums of one step are at most 2 * qmax * 127; this many steps add up in int16
// before they are widened to int32 without overflow (4 bits: 8 * 3810 = 30480; 5: 4 * 7874; 6: 2 * 16002; 8: one
// step of 2 * 128 * 127 after the sign trick).
template <int BITS> constexpr int kInt16Steps = BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1;

// Step s of a group: 64 codes, byte c*4 + t for column c at k = 4s + t. Unsigned for 4, 5 and 6 bits, signed for 8.
template <int BITS>
inline __m512i codes_of(const uint8_t* group, int s) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(group + 64 * s);
  } else {
    constexpr int half = kSteps<BITS> / 2;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i b = _mm512_loadu_si512(group + 64 * (s % half));
    __m512i q = s < half ? _mm512_and_si512(b, low4) : _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    if constexpr (BITS == 5 || BITS == 6) {
      const __m512i plane = _mm512_loadu_si512(group + 64 * half);
      const __m128i shift = _mm_cvtsi32_si128(BITS == 5 ? s : 2 * s);
      const __m512i high = _mm512_and_si512(_mm512_srl_epi16(plane, shift), _mm512_set1_epi8(BITS == 5 ? 1 : 3));
      q = _mm512_or_si512(q, _mm512_slli_epi16(high, 4));  // a byte's high bits stay in that byte: values <= 3
    }
    return q;
  }
}

template <bool HALF>
inline __m512 floats_as(const uint8_t* p) {
  if constexpr (HALF) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

// maddubs and vpdpbusd need an unsigned left operand. Without VNNI a signed code's sign moves onto the activation
// (per row and step; maddubs' int16 sums would overflow on codes up to 255). With VNNI, whose sums are int32, the
// code is offset by 128 instead (q ^ 0x80, once per step for all rows), and the call rounds its activations with a
// zero point 128 higher (Path::code_offset in ops.cpp), so idot = sum (q + 128) a - (zero + 128) sum a is unchanged.
inline __m512i abs_codes(__m512i q) { return _mm512_abs_epi8(q); }
inline __m512i signed_like(__m512i a, __m512i q) {
  return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(q), _mm512_setzero_si512(), a);
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
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = panel + g * F::group_bytes;
    prefetch_form<F>(group);
    const int32_t* a0 = xq + g * m * S;  // step s, row r: a0[r * S + s]
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#ifndef TRTSPEC_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
    __m512i part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_si512();
#endif
#ifdef TRTSPEC_VNNI
    // under 5 rows, a second chain of vpdpbusd for odd steps keeps more sums in flight (integer sums: the order
    // changes nothing); 5 rows and more are enough chains, and need the registers
    constexpr bool kOdd = R < 5;
    __m512i odd[kOdd ? R : 1];
    for (int r = 0; r < (kOdd ? R : 1); ++r) odd[r] = _mm512_setzero_si512();
#endif
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      __m512i q = codes_of<BITS>(group, s);
#ifdef TRTSPEC_VNNI
      const __m512i uq = BITS == 8 ? _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80))) : q;
#else
      const __m512i uq = BITS == 8 ? abs_codes(q) : q;
#endif
      for (int r = 0; r < R; ++r) {
        __m512i a = _mm512_set1_epi32(a0[r * S + s]);
#ifdef TRTSPEC_VNNI
        if (kOdd && s % 2) odd[r] = _mm512_dpbusd_epi32(odd[r], uq, a);
        else dot[r] = _mm512_dpbusd_epi32(dot[r], uq, a);
#else
        if constexpr (BITS == 8) a = signed_like(a, q);
        part[r] = _mm512_add_epi16(part[r], _mm512_maddubs_epi16(uq, a));
        __asm__("" : "+v"(part[r]));  // in its register step by step (gguf_linear_avx2.h)
        if ((s + 1) % kInt16Steps<BITS> == 0) {
          dot[r] = _mm512_add_epi32(dot[r], _mm512_madd_epi16(part[r], ones));
          part[r] = _mm512_setzero_si512();
        }
#endif
      }
    }
#ifdef TRTSPEC_VNNI
    if constexpr (kOdd)
      for (int r = 0; r < R; ++r) dot[r] = _mm512_add_epi32(dot[r], odd[r]);
#endif
    const __m512 scale = floats_as<F::half>(group + F::codes_bytes);
    const __m512 minimum = F::has_min ? floats_as<F::half>(group + F::codes_bytes + F::floats_bytes) : _mm512_setzero_ps();
    const int64_t i = g * m;
    for (int r = 0; r < R; ++r) {
      // zero * sum a is 0 for a type with minimums (zero point 0, checked by the op): one subtraction less a row
      const __m512i idot = F::has_min ? dot[r] : _mm512_sub_epi32(dot[r], _mm512_set1_epi32(xz[i + r]));
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(idot), scale);
      if constexpr (F::has_min) t = _mm512_add_ps(t, _mm512_mul_ps(minimum, _mm512_set1_ps(xf[i + r])));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(t, _mm512_set1_ps(xs[i + r])));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy + col0, acc[r]);
}

// pshufb's mask moving byte t of each int32 lane to the lane's top byte, the other three bytes zero (per 128-bit lane):
// converted to float, a code c in the top byte is c * 2^24 exactly.
inline __m512i byte_to_top(int t) {
  auto lane = [t](int j) { return static_cast<int>(0x808080u | static_cast<unsigned>(4 * j + t) << 24); };
  return _mm512_broadcast_i32x4(_mm_setr_epi32(lane(0), lane(1), lane(2), lane(3)));
}

// Float activations (gguf_linear.h): codes minus the zero point as int8 in a lane's top byte, so the sums d_t carry a
// factor 2^24, taken off the scale instead (a power of two changes no rounding: the portable path's bits).
template <typename F, int R>
void float_rows(const Weights& w, const uint8_t* panel, const FloatRows& x, int64_t r0, float* y, int64_t ldy,
                int64_t col0) {
  constexpr int BITS = F::bits, G = kGroup<BITS>, S = kSteps<BITS>;
  const int64_t m = x.m;
  const __m512i zero = _mm512_set1_epi8(static_cast<char>(w.zero));
  const __m512 unscale = _mm512_set1_ps(1.0f / 16777216.0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* group = panel + g * F::group_bytes;
    prefetch_form<F>(group);
    const float* xg = x.xt + g * G * m + r0;  // k = g * G + i, row r: xg[i * m + r]
    __m512 d[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) d[r][t] = _mm512_setzero_ps();
    const float* xk = xg;  // k's rows at xk[r], stepped by m (as in gguf_linear_avx2.h's float_rows)
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const __m512i c = _mm512_sub_epi8(codes_of<BITS>(group, s), zero);
      for (int t = 0; t < 4; ++t, xk += m) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(c, byte_to_top(t)));
        for (int r = 0; r < R; ++r) d[r][t] = _mm512_fmadd_ps(f, _mm512_set1_ps(xk[r]), d[r][t]);
      }
    }
    const __m512 scale = _mm512_mul_ps(floats_as<F::half>(group + F::codes_bytes), unscale);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(d[r][0], d[r][1]), _mm512_add_ps(d[r][2], d[r][3])), scale,
                               acc[r]);
    if constexpr (F::has_min) {
      const __m512 minimum = floats_as<F::half>(group + F::codes_bytes + F::floats_bytes);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x.xsum[g * m + r0 + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy + col0, acc[r]);
}

// A tile of R rows, with a kernel of exactly its rows (tile_rows picks R): a row's sums go through the same steps
// whichever tile it lands in.
template <typename F, bool INT8, int R, typename X>
inline void rows(const Weights& w, const uint8_t* panel, const X& x, int64_t r0, float* y, int64_t ldy, int64_t col0) {
  if constexpr (INT8) int8_rows<F, R>(w, panel, x, r0, y, ldy, col0);
  else if constexpr (R <= kMaxFloatRows) float_rows<F, R>(w, panel, x, r0, y, ldy, col0);
}

template <typename F, bool INT8, typename X>
void panels(const Weights& w, const X& x, int64_t m, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = w.groups * w.group_bytes;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w.data + p * panel_bytes;
    const int64_t col0 = p * kPanel;
    for (int64_t r = 0, n; r < m; r += n) {
      n = tile_rows(m - r, INT8 ? kMaxRows : kMaxFloatRows);
      switch (n) {
#ifdef TRTSPEC_VNNI
        case 12: rows<F, INT8, 12>(w, panel, x, r, y, ldy, col0); break;
        case 11: rows<F, INT8, 11>(w, panel, x, r, y, ldy, col0); break;
        case 10: rows<F, INT8, 10>(w, panel, x, r, y, ldy, col0); break;
        case 9: rows<F, INT8, 9>(w, panel, x, r, y, ldy, col0); break;
#endif
        case 8: rows<F, INT8, 8>(w, panel, x, r, y, ldy, col0); break;
        case 7: rows<F, INT8, 7>(w, panel, x, r, y, ldy, col0); break;
        case 6: rows<F, INT8, 6>(w, panel, x, r, y, ldy, col0); break;
        case 5: rows<F, INT8, 5>(w, panel, x, r, y, ldy, col0); break;
        case 4: rows<F, INT8, 4>(w, panel, x, r, y, ldy, col0); break;
        case 3: rows<F, INT8, 3>(w, panel, x, r, y, ldy, col0); break;
        case 2: rows<F, INT8, 2>(w, panel, x, r, y, ldy, col0); break;
        default: rows<F, INT8, 1>(w, panel, x, r, y, ldy, col0); break;
      }
    }
  }
}

void int8_any(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  with_layer_form(w, [&](auto form) { panels<decltype(form), true>(w, x, x.m, y, ldy, p0, p1); });
}

#ifndef TRTSPEC_VNNI  // that file runs no float kernel: none compiled for it
void float_any(const Weights& w, const FloatRows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  with_layer_form(w, [&](auto form) { panels<decltype(form), false>(w, x, x.m, y, ldy, p0, p1); });
}
#endif

}  // namespace
}  // namespace trtspec_gguf
