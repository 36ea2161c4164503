// The AVX2 kernels (e.g. AMD Zen 3), included by gguf_linear_avx2.cpp (AVX2 + FMA + F16C: maddubs + madd) and (with
// TRTSPEC_AVXVNNI) gguf_linear_avxvnni.cpp (AVX-VNNI's vpdpbusd on ymm, Intel client CPUs from Alder Lake on), each
// after its own #pragma GCC target; everything here has internal linkage, so the two never share a function.
//
// A panel's 16 columns are two ymm halves, done one after the other (a half reads 32 of each 64-byte block; the panel
// stays in L1 between them), R rows at a time: R int32 sums, R float sums (and without VNNI R int16 partial sums)
// within the 16 ymm registers; one or two int8 rows without VNNI take both halves in one pass (int8_rows_both).
// maddubs' int16 pair sums add up over kInt16Steps steps of a group before madd widens them (the bounds of
// gguf_linear_avx512.h), so a 4-bit group costs one madd per row.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "gguf_linear.h"

namespace trtspec_gguf {
namespace {

// R int32 sums (VNNI, and under 4 rows R more; without VNNI R int16 partial sums, or for 8-bit codes R int32 sums)
// and R float sums: with the codes, the broadcast and the constants, all 16 ymm registers at 6 rows. Without VNNI,
// 6-row tiles against the 5 before made a hot call of 6 rows 12-20% faster and one of 17 rows (6, 6, 5 against 5, 4,
// 4, 4) 3-10%, for Q4_1, Q5_0, Q6_K and Q8_0 alike (a scratch A/B, medians of 300 calls).
constexpr int kMaxRows = 6;
constexpr int kMaxFloatRows = 2;  // float_rows' tiles (more rows: float_wide)
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

template <bool HALF>
inline __m256 floats_as(const uint8_t* p, int h) {
  if constexpr (HALF) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h));
  else return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + kHalf * h);
}

// A group's half h into R rows' float sums (row r's activations at index i + r): the step after the integer dot
// products, for int8_rows and int8_rows_both.
template <typename F, int R>
inline void add_group_half(const uint8_t* group, int h, const __m256i (&dot)[R], const Int8Rows& x, int64_t i,
                           __m256 (&acc)[R]) {
  const __m256 scale = floats_as<F::half>(group + F::codes_bytes, h);
  const __m256 minimum = F::has_min ? floats_as<F::half>(group + F::codes_bytes + F::floats_bytes, h)
                                    : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) {
    // zero * sum a is 0 for a type with minimums (zero point 0, checked by the op)
    const __m256i idot = F::has_min ? dot[r] : _mm256_sub_epi32(dot[r], _mm256_set1_epi32(x.zsum[i + r]));
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(idot), scale);
    if constexpr (F::has_min) t = _mm256_add_ps(t, _mm256_mul_ps(minimum, _mm256_set1_ps(x.fsum[i + r])));
    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(t, _mm256_set1_ps(x.scale[i + r])));
  }
}

// The next panel's lines, half a group's bytes at each of the 2 * groups steps (pass h, group g) of a panel's two
// passes: a steady stream from memory under all of the arithmetic. Asked for kPrefetchBytes past the group being
// read, as the other kernels do, every request fell in the first pass (the second reads the panel again from L1), so
// a call of 3 to 6 rows waited on memory in the first pass and left it idle in the second.
template <typename F>
inline void prefetch_next_panel(const uint8_t* panel, int64_t groups, int h, int64_t g) {
  constexpr int64_t kStep = F::group_bytes / 2;
  const uint8_t* from = panel + groups * F::group_bytes + (h * groups + g) * kStep;
  const uintptr_t line = reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63};
#pragma GCC unroll 8
  for (uintptr_t l = line; l < reinterpret_cast<uintptr_t>(from) + kStep; l += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(l), 0, 3);
}

#ifndef TRTSPEC_AVXVNNI
// Step s's maddubs pair sums of one row into its int16 partial sum, widened into the int32 sums every kInt16Steps
// steps; an 8-bit code's pairs (up to 2 * 127 * 127) go straight to the int32 sums, with no partial sum. Each sum stays
// in its register step by step: left free, GCC computes a whole group's products first and spills them (integer adds
// reassociate), several loads and stores a row and step.
template <int BITS>
inline void add_products(int s, __m256i pairs, __m256i ones, __m256i& part, __m256i& dot) {
  if constexpr (kInt16Steps<BITS> == 1) {
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
    __asm__("" : "+x"(dot));
  } else {
    part = _mm256_add_epi16(part, pairs);
    __asm__("" : "+x"(part));
    if ((s + 1) % kInt16Steps<BITS> == 0) {
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(part, ones));
      part = _mm256_setzero_si256();
    }
  }
}
#endif

template <typename F, int R>
void int8_rows(const Weights& w, const uint8_t* panel, const Int8Rows& x, int64_t r0, float* y, int64_t ldy,
               int64_t col0) {
  constexpr int BITS = F::bits;
  constexpr int S = kSteps<BITS>;
  const int64_t groups = w.groups, m = x.m;
  const int32_t* const xq = x.q + r0 * S;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = panel + g * F::group_bytes;
      prefetch_next_panel<F>(panel, groups, h, g);
      const int32_t* a0 = xq + g * m * S;  // step s, row r: a0[r * S + s]
      __m256i dot[R], part[R];
      for (int r = 0; r < R; ++r) dot[r] = part[r] = _mm256_setzero_si256();
#ifdef TRTSPEC_AVXVNNI
      // under 4 rows, a second chain of vpdpbusd for odd steps keeps more sums in flight (integer sums: the order
      // changes nothing)
      constexpr bool kOdd = R < 4;
#endif
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        const __m256i q = codes_of<BITS>(group, s, h);
#ifdef TRTSPEC_AVXVNNI
        // vpdpbusd's left operand is unsigned: an 8-bit code is offset by 128, and the call's rounding zero point
        // with it (Path::code_offset in ops.cpp), as on the AVX-512 VNNI path
        const __m256i uq = BITS == 8 ? _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))) : q;
        for (int r = 0; r < R; ++r) {
          const __m256i a = _mm256_set1_epi32(a0[r * S + s]);
          if (kOdd && s % 2) part[r] = _mm256_dpbusd_avx_epi32(part[r], uq, a);
          else dot[r] = _mm256_dpbusd_avx_epi32(dot[r], uq, a);
        }
#else
        const __m256i uq = BITS == 8 ? _mm256_abs_epi8(q) : q;
        for (int r = 0; r < R; ++r) {
          __m256i a = _mm256_set1_epi32(a0[r * S + s]);
          if constexpr (BITS == 8) a = _mm256_sign_epi8(a, q);
          add_products<BITS>(s, _mm256_maddubs_epi16(uq, a), ones, part[r], dot[r]);
        }
#endif
      }
#ifdef TRTSPEC_AVXVNNI
      if constexpr (kOdd)
        for (int r = 0; r < R; ++r) dot[r] = _mm256_add_epi32(dot[r], part[r]);
#endif
      add_group_half<F, R>(group, h, dot, x, g * m + r0, acc);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + col0 + kHalf * h, acc[r]);
  }
}

#ifndef TRTSPEC_AVXVNNI
// int8_rows for one or two rows without VNNI, both halves of each group in one pass: the panel's stream from memory
// then overlaps all of the arithmetic (a half at a time, the second half's pass runs from L1 with memory idle, about
// a sixth of a one-row call). The same sums per column as int8_rows; more rows fill the registers a half at a time.
template <typename F, int R>
void int8_rows_both(const Weights& w, const uint8_t* panel, const Int8Rows& x, int64_t r0, float* y, int64_t ldy,
                    int64_t col0) {
  constexpr int BITS = F::bits;
  constexpr int S = kSteps<BITS>;
  const int64_t m = x.m;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* group = panel + g * F::group_bytes;
    prefetch_form<F>(group);
    const int32_t* a0 = x.q + r0 * S + g * m * S;  // step s, row r: a0[r * S + s]
    __m256i dot[2][R], part[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) dot[h][r] = part[h][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const __m256i q[2] = {codes_of<BITS>(group, s, 0), codes_of<BITS>(group, s, 1)};
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_set1_epi32(a0[r * S + s]);
        for (int h = 0; h < 2; ++h) {
          const __m256i uq = BITS == 8 ? _mm256_abs_epi8(q[h]) : q[h];
          const __m256i signed_a = BITS == 8 ? _mm256_sign_epi8(a, q[h]) : a;
          add_products<BITS>(s, _mm256_maddubs_epi16(uq, signed_a), ones, part[h][r], dot[h][r]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) add_group_half<F, R>(group, h, dot[h], x, g * m + r0, acc[h]);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (r0 + r) * ldy + col0 + kHalf * h, acc[h][r]);
}
#endif

// pshufb's mask moving byte t of each int32 lane to the lane's top byte, the other three bytes zero: converted to
// float, a code c in the top byte is c * 2^24 exactly, one shuffle and one conversion for 8 weights.
inline __m256i byte_to_top(int t) {
  auto lane = [t](int j) { return static_cast<int>(0x808080u | static_cast<unsigned>(4 * j + t) << 24); };
  return _mm256_setr_epi32(lane(0), lane(1), lane(2), lane(3), lane(0), lane(1), lane(2), lane(3));
}

// Float activations (gguf_linear.h) for one or two rows (float_wide below takes more): R rows, H halves a pass (both
// for one row, to keep 8 sums in flight). Codes
// minus the zero point are int8 in a lane's top byte, so the sums d_t carry a factor 2^24, taken off the scale
// instead (powers of two change no rounding: the same bits as the portable path, short of an overflow or a
// subnormal no activation comes near).
template <typename F, int R, int H>
void float_rows(const Weights& w, const uint8_t* panel, const FloatRows& x, int64_t r0, float* y, int64_t ldy,
                int64_t col0) {
  constexpr int BITS = F::bits, G = kGroup<BITS>, S = kSteps<BITS>;
  const int64_t m = x.m;
  const __m256i zero = _mm256_set1_epi8(static_cast<char>(w.zero));
  const __m256 unscale = _mm256_set1_ps(1.0f / 16777216.0f);
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 acc[R][H];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < H; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* group = panel + g * F::group_bytes;
      if constexpr (H == 1) prefetch_next_panel<F>(panel, w.groups, h0, g);  // two passes, as int8_rows
      else prefetch_form<F>(group);
      const float* xg = x.xt + g * G * m + r0;  // k = g * G + i, row r: xg[i * m + r]
      __m256 d[R][H][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < H; ++j)
          for (int t = 0; t < 4; ++t) d[r][j][t] = _mm256_setzero_ps();
      // k's rows at xk[r], one pointer stepped by m: the broadcasts' addresses take one add a k, not a multiply and
      // an add a row (GCC's unrolled loop spent more instructions on them than on the arithmetic)
      const float* xk = xg;
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        __m256i c[H];
        for (int j = 0; j < H; ++j) c[j] = _mm256_sub_epi8(codes_of<BITS>(group, s, h0 + j), zero);
        for (int t = 0; t < 4; ++t, xk += m) {
          __m256 f[H];
          for (int j = 0; j < H; ++j) f[j] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(c[j], byte_to_top(t)));
          for (int r = 0; r < R; ++r) {
            const __m256 xb = _mm256_broadcast_ss(xk + r);
            for (int j = 0; j < H; ++j) d[r][j][t] = _mm256_fmadd_ps(f[j], xb, d[r][j][t]);
          }
        }
      }
      for (int j = 0; j < H; ++j) {
        const __m256 scale = _mm256_mul_ps(floats_as<F::half>(group + F::codes_bytes, h0 + j), unscale);
        for (int r = 0; r < R; ++r) {
          const __m256 sum = _mm256_add_ps(_mm256_add_ps(d[r][j][0], d[r][j][1]), _mm256_add_ps(d[r][j][2], d[r][j][3]));
          acc[r][j] = _mm256_fmadd_ps(sum, scale, acc[r][j]);
        }
        if constexpr (F::has_min) {
          const __m256 minimum = floats_as<F::half>(group + F::codes_bytes + F::floats_bytes, h0 + j);
          for (int r = 0; r < R; ++r)
            acc[r][j] = _mm256_fmadd_ps(minimum, _mm256_broadcast_ss(x.xsum + g * m + r0 + r), acc[r][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < H; ++j) _mm256_storeu_ps(y + (r0 + r) * ldy + col0 + kHalf * (h0 + j), acc[r][j]);
  }
}

// Float activations for kWideFrom rows and more. In float_rows a row's codes cost a shuffle and a conversion per 8
// weights, as much as its multiply-adds, again in every tile. Here a tile of up to 6 rows takes both halves (12 sums,
// R broadcasts a k), and the panel's codes are converted once a chunk of K: the chunk's first tile keeps its floats
// (c * 2^24, the values float_rows makes; [group][t][s][16 columns], 64 bytes a k) for the others. The sums d_t go
// one after another (t outer), each over s in order, then (d_0 + d_1) + (d_2 + d_3): float_rows' steps, the same bits.
constexpr int kWideFrom = 3;
constexpr int kMaxWideRows = 6;
constexpr int64_t kWideChunk = 256;  // k a pass of the tiles: its floats (16 KiB) and the tiles' x stay in L1

// Where a tile's floats come from: the codes (converted in registers), the codes with the floats kept for the
// chunk's next tiles, or the floats a first tile kept.
enum class Source { codes, codes_kept, kept };

// One sum d_t of a group for R rows over both halves (xk: row 0's x at k = g * G + t; kept: the group's floats).
template <int BITS, int T, Source SRC, int R>
__attribute__((always_inline)) inline void group_sums_t(const uint8_t* group, __m256i zero, float* kept,
                                                         const float* xk, int64_t m, __m256 (&d)[R][2]) {
  constexpr int S = kSteps<BITS>;
  for (int r = 0; r < R; ++r) d[r][0] = d[r][1] = _mm256_setzero_ps();
  float* u = kept + T * S * kPanel;  // [t][s][16 columns]
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s, xk += 4 * m, u += kPanel) {
    __m256 f[2];
    for (int j = 0; j < 2; ++j) {
      if constexpr (SRC == Source::kept) {
        f[j] = _mm256_load_ps(u + kHalf * j);
      } else {
        const __m256i c = _mm256_sub_epi8(codes_of<BITS>(group, s, j), zero);
        f[j] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(c, byte_to_top(T)));
        if constexpr (SRC == Source::codes_kept) _mm256_store_ps(u + kHalf * j, f[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xk + r);
      d[r][0] = _mm256_fmadd_ps(f[0], xb, d[r][0]);
      d[r][1] = _mm256_fmadd_ps(f[1], xb, d[r][1]);
    }
  }
}

// A group's (d_0 + d_1) + (d_2 + d_3) for R rows, both halves: one function per code width, not per form (the
// scales' width and the minimum only change the step after it), which keeps the build's compile time down.
template <int BITS, Source SRC, int R>
__attribute__((noinline)) void group_sums(const uint8_t* group, __m256i zero, float* kept, const float* xg, int64_t m,
                                          __m256 (&sum)[R][2]) {
  __m256 d[R][2], third[R][2];
  group_sums_t<BITS, 0, SRC>(group, zero, kept, xg, m, d);
  for (int r = 0; r < R; ++r) sum[r][0] = d[r][0], sum[r][1] = d[r][1];
  group_sums_t<BITS, 1, SRC>(group, zero, kept, xg + m, m, d);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) sum[r][j] = _mm256_add_ps(sum[r][j], d[r][j]);
  group_sums_t<BITS, 2, SRC>(group, zero, kept, xg + 2 * m, m, d);
  for (int r = 0; r < R; ++r) third[r][0] = d[r][0], third[r][1] = d[r][1];
  group_sums_t<BITS, 3, SRC>(group, zero, kept, xg + 3 * m, m, d);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) sum[r][j] = _mm256_add_ps(sum[r][j], _mm256_add_ps(third[r][j], d[r][j]));
}

template <typename F, Source SRC, int R>
void float_rows_wide(const Weights& w, const uint8_t* panel, int64_t g0, int64_t g1, float* kept, const FloatRows& x,
                     int64_t r0, float* y, int64_t ldy, int64_t col0) {
  constexpr int G = kGroup<F::bits>;
  const int64_t m = x.m;
  const __m256i zero = _mm256_set1_epi8(static_cast<char>(w.zero));
  const __m256 unscale = _mm256_set1_ps(1.0f / 16777216.0f);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = g0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (r0 + r) * ldy + col0 + kHalf * j);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = panel + g * F::group_bytes;
    if constexpr (SRC != Source::kept) prefetch_form<F>(group);
    __m256 sum[R][2];
    // the group's x from row r0 on: row r0 + r's x at k = g * G + 4s + t is [(4s + t) * m + r] from there
    group_sums<F::bits, SRC, R>(group, zero, kept + (g - g0) * G * kPanel, x.xt + g * G * m + r0, m, sum);
    for (int j = 0; j < 2; ++j) {
      const __m256 scale = _mm256_mul_ps(floats_as<F::half>(group + F::codes_bytes, j), unscale);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(sum[r][j], scale, acc[r][j]);
      if constexpr (F::has_min) {
        const __m256 minimum = floats_as<F::half>(group + F::codes_bytes + F::floats_bytes, j);
        for (int r = 0; r < R; ++r)
          acc[r][j] = _mm256_fmadd_ps(minimum, _mm256_broadcast_ss(x.xsum + g * m + r0 + r), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(y + (r0 + r) * ldy + col0 + kHalf * j, acc[r][j]);
}

template <typename F, Source SRC>
void float_tile_wide(int64_t n, const Weights& w, const uint8_t* panel, int64_t g0, int64_t g1, float* kept,
                     const FloatRows& x, int64_t r0, float* y, int64_t ldy, int64_t col0) {
  switch (n) {
    case 6: float_rows_wide<F, SRC, 6>(w, panel, g0, g1, kept, x, r0, y, ldy, col0); break;
    case 5: float_rows_wide<F, SRC, 5>(w, panel, g0, g1, kept, x, r0, y, ldy, col0); break;
    case 4: float_rows_wide<F, SRC, 4>(w, panel, g0, g1, kept, x, r0, y, ldy, col0); break;
    default: float_rows_wide<F, SRC, 3>(w, panel, g0, g1, kept, x, r0, y, ldy, col0); break;
  }
}

template <typename F>
void float_wide(const Weights& w, const FloatRows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  constexpr int64_t chunk = kWideChunk / kGroup<F::bits>;  // groups
  struct alignas(32) Eight {
    float f[kHalf];
  };
  thread_local std::vector<Eight> kept;  // a chunk's floats, per thread, aligned for the ymm loads and stores
  kept.resize(kWideChunk * 2);
  float* const u = kept.data()->f;
  const int64_t panel_bytes = w.groups * w.group_bytes;
  const int64_t first = tile_rows(x.m, kMaxWideRows);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w.data + p * panel_bytes;
    for (int64_t g0 = 0; g0 < w.groups; g0 += chunk) {
      const int64_t g1 = std::min(w.groups, g0 + chunk);
      if (first == x.m) {
        float_tile_wide<F, Source::codes>(first, w, panel, g0, g1, u, x, 0, y, ldy, p * kPanel);
        continue;
      }
      float_tile_wide<F, Source::codes_kept>(first, w, panel, g0, g1, u, x, 0, y, ldy, p * kPanel);
      for (int64_t r = first, n; r < x.m; r += n) {
        n = tile_rows(x.m - r, kMaxWideRows);
        float_tile_wide<F, Source::kept>(n, w, panel, g0, g1, u, x, r, y, ldy, p * kPanel);
      }
    }
  }
}

template <typename F, bool INT8, typename X>
void panels(const Weights& w, const X& x, int64_t m, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = w.groups * w.group_bytes;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w.data + p * panel_bytes;
    const int64_t col0 = p * kPanel;
    for (int64_t r = 0, n; r < m; r += n) {
      n = tile_rows(m - r, INT8 ? kMaxRows : kMaxFloatRows);
      if constexpr (INT8) {
        switch (n) {
          case 6: int8_rows<F, 6>(w, panel, x, r, y, ldy, col0); break;
          case 5: int8_rows<F, 5>(w, panel, x, r, y, ldy, col0); break;
          case 4: int8_rows<F, 4>(w, panel, x, r, y, ldy, col0); break;
          case 3: int8_rows<F, 3>(w, panel, x, r, y, ldy, col0); break;
#ifdef TRTSPEC_AVXVNNI
          case 2: int8_rows<F, 2>(w, panel, x, r, y, ldy, col0); break;
          default: int8_rows<F, 1>(w, panel, x, r, y, ldy, col0); break;
#else
          case 2: int8_rows_both<F, 2>(w, panel, x, r, y, ldy, col0); break;
          default: int8_rows_both<F, 1>(w, panel, x, r, y, ldy, col0); break;
#endif
        }
      } else {
        switch (n) {
          case 2: float_rows<F, 2, 1>(w, panel, x, r, y, ldy, col0); break;
          default: float_rows<F, 1, 2>(w, panel, x, r, y, ldy, col0); break;
        }
      }
    }
  }
}

void int8_any(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  with_layer_form(w, [&](auto form) { panels<decltype(form), true>(w, x, x.m, y, ldy, p0, p1); });
}

#ifndef TRTSPEC_AVXVNNI  // that file runs no float kernel: none compiled for it
void float_any(const Weights& w, const FloatRows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  with_layer_form(w, [&](auto form) {
    if (x.m >= kWideFrom) float_wide<decltype(form)>(w, x, y, ldy, p0, p1);
    else panels<decltype(form), false>(w, x, x.m, y, ldy, p0, p1);
  });
}
#endif

}  // namespace
}  // namespace trtspec_gguf
