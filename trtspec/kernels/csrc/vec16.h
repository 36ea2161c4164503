// GCC's vectors of 16 floats (and int32): each ISA file compiles them, after its own #pragma GCC target, to one zmm,
// two ymm or scalar code with the same IEEE steps per lane (attention_rows.h and quantize_rows.h are written on them).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(TRTSPEC_VEC_ZMM) || defined(TRTSPEC_VEC_YMM)
#include <immintrin.h>
#endif

namespace trtspec_gguf {
namespace {

constexpr int kLanes = 16;
typedef float f16x __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));

inline f16x load16(const float* p) {
  f16x v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f16x v) { std::memcpy(p, &v, sizeof(v)); }

#if defined(TRTSPEC_VEC_YMM)
// A vector as two ymm, lanes 0-7 and 8-15, and back. GCC lowers a 64-byte vector's lane-wise arithmetic to ymm
// halves itself on AVX2, but its shuffles and broadcasts lane by lane through memory: those are written on halves.
template <typename V>
inline void to_halves(const V& v, __m256 (&h)[2]) {
  std::memcpy(h, &v, sizeof(v));
}
template <typename V>
inline V from_halves(const __m256 (&h)[2]) {
  V v;
  std::memcpy(&v, h, sizeof(v));
  return v;
}
#endif

// x in every lane, as 0 + x per lane (so -0 gives +0)
inline f16x splat(float x) {
#if defined(TRTSPEC_VEC_YMM)
  const __m256 h[2] = {_mm256_set1_ps(x + 0.0f), _mm256_set1_ps(x + 0.0f)};
  return from_halves<f16x>(h);
#else
  return f16x{} + x;
#endif
}

// v's lane l ^ Bit in each lane l (Bit 8, 4, 2 or 1): the partner lanes of a fold in halves; moves bits only.
template <int Bit, typename V>
inline V lanes_xor(V v) {
  static_assert(Bit == 8 || Bit == 4 || Bit == 2 || Bit == 1, "a fold's partner is 8, 4, 2 or 1 lanes away");
#if defined(TRTSPEC_VEC_YMM)
  __m256 h[2], r[2];
  to_halves(v, h);
  for (int i = 0; i < 2; ++i) {
    if constexpr (Bit == 8) {
      r[i] = h[1 - i];
    } else if constexpr (Bit == 4) {
      r[i] = _mm256_permute2f128_ps(h[i], h[i], 0x01);
    } else if constexpr (Bit == 2) {
      r[i] = _mm256_permute_ps(h[i], _MM_SHUFFLE(1, 0, 3, 2));
    } else {
      r[i] = _mm256_permute_ps(h[i], _MM_SHUFFLE(2, 3, 0, 1));
    }
  }
  return from_halves<V>(r);
#else
  return __builtin_shuffle(v, i16x{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} ^ Bit);
#endif
}

// a * b + c rounded once, the same bits on every path: one vfmadd on a zmm, two on ymm halves (the ISA file defines
// TRTSPEC_VEC_ZMM or TRTSPEC_VEC_YMM after its #pragma GCC target), else fmaf lane by lane (exact in software where
// the CPU has no fused multiply-add). The build's -ffp-contract=off fuses nothing else.
inline f16x fma16(f16x a, f16x b, f16x c) {
#if defined(TRTSPEC_VEC_ZMM)
  return reinterpret_cast<f16x>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#elif defined(TRTSPEC_VEC_YMM)
  __m256 ah[2], bh[2], ch[2];
  std::memcpy(ah, &a, sizeof(a));
  std::memcpy(bh, &b, sizeof(b));
  std::memcpy(ch, &c, sizeof(c));
  ch[0] = _mm256_fmadd_ps(ah[0], bh[0], ch[0]);
  ch[1] = _mm256_fmadd_ps(ah[1], bh[1], ch[1]);
  std::memcpy(&c, ch, sizeof(c));
  return c;
#else
  for (int l = 0; l < kLanes; ++l) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return c;
#endif
}

typedef int8_t i8x16 __attribute__((vector_size(16)));

inline f16x max16(f16x a, f16x b) { return a > b ? a : b; }

// The largest lane, folding the vector in halves.
inline float lanes_max(f16x v) {
  v = max16(v, lanes_xor<8>(v));
  v = max16(v, lanes_xor<4>(v));
  v = max16(v, lanes_xor<2>(v));
  v = max16(v, lanes_xor<1>(v));
  return v[0];
}

// Whether any lane is nonzero.
inline bool lanes_any(i16x v) {
  uint64_t words[8];
  std::memcpy(words, &v, sizeof(v));
  return (words[0] | words[1] | words[2] | words[3] | words[4] | words[5] | words[6] | words[7]) != 0;
}

}  // namespace
}  // namespace trtspec_gguf
