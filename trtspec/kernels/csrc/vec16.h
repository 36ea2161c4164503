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

inline f16x splat(float x) { return f16x{} + x; }

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
  v = max16(v, __builtin_shuffle(v, i16x{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = max16(v, __builtin_shuffle(v, i16x{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = max16(v, __builtin_shuffle(v, i16x{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = max16(v, __builtin_shuffle(v, i16x{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
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
