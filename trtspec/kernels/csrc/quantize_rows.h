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
  v += __builtin_shuffle(v, i16x{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, i16x{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, i16x{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, i16x{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

inline void quantize_rows_impl(const float* __restrict x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0,
                               int64_t b1, int32_t* __restrict q, int32_t* __restrict zsum, float* __restrict fsum,
                               float* __restrict scale) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t r = 0; r < m; ++r) {
      const float* v = x + r * k + b * 32;
      const f16x lo = load16(v), hi = load16(v + 16);
      const float d = lanes_max(max16(abs16(lo), abs16(hi))) / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const i16x clo = __builtin_convertvector((lo * id + 12582912.0f) - 12582912.0f, i16x);
      const i16x chi = __builtin_convertvector((hi * id + 12582912.0f) - 12582912.0f, i16x);
      int8_t codes[32];
      const i8x16 blo = __builtin_convertvector(clo, i8x16), bhi = __builtin_convertvector(chi, i8x16);
      std::memcpy(codes, &blo, 16);
      std::memcpy(codes + 16, &bhi, 16);
      // a group of 32 is the block; a group of 16 (Q6_K) is each half
      const int64_t g0 = b * 32 / group;
      if (group == 32) {
        std::memcpy(q + (g0 * m + r) * 8, codes, 32);
      } else {
        std::memcpy(q + (g0 * m + r) * 4, codes, 16);
        std::memcpy(q + ((g0 + 1) * m + r) * 4, codes + 16, 16);
      }
      if (group == 32) {
        const int32_t sum = lanes_total(clo + chi);
        zsum[g0 * m + r] = zero * sum;
        fsum[g0 * m + r] = static_cast<float>(sum);
        scale[g0 * m + r] = d;
      } else {
        const int32_t sums[2] = {lanes_total(clo), lanes_total(chi)};
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
