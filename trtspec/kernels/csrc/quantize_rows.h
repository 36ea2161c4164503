// Activations to int8 per block of 32 along K (blocks [b0, b1) of every row: a thread's share is a range of K, so two
// threads never write the same cache line of the interleaved rows), as the int8 kernels read them: scale d = amax / 127, code
// rint(x / d) computed as x * (1 / d) rounded half to even (adding and subtracting 1.5 * 2^23 rounds any
// |v| < 2^22 in the default rounding mode, as numpy's rint does), and each group's sum of codes. Plain loops,
// included by each ISA file so that its compiler target vectorizes them; the IEEE operations are the same
// whatever the vector width, so every path rounds identically.
#pragma once
#include <cstdint>

namespace trtspec_gguf {
namespace {

inline void quantize_rows_impl(const float* __restrict x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0,
                               int64_t b1, int32_t* __restrict q, int32_t* __restrict zsum, float* __restrict fsum,
                               float* __restrict scale) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t r = 0; r < m; ++r) {
      const float* v = x + r * k + b * 32;
      float half[16];  // |x| of the block folded in two, then reduced: written so the compiler vectorizes it
      for (int i = 0; i < 16; ++i) {
        const float lo = __builtin_fabsf(v[i]), hi = __builtin_fabsf(v[i + 16]);
        half[i] = lo > hi ? lo : hi;
      }
      float amax = 0.0f;
      for (int i = 0; i < 16; ++i) amax = amax > half[i] ? amax : half[i];
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t codes[32];
      for (int i = 0; i < 32; ++i) codes[i] = static_cast<int8_t>((v[i] * id + 12582912.0f) - 12582912.0f);
      for (int j = 0; j < 8; ++j) __builtin_memcpy(q + (b * 8 + j) * m + r, codes + 4 * j, 4);
      for (int64_t g = b * 32 / group; g < (b + 1) * 32 / group; ++g) {
        int32_t s = 0;
        for (int64_t i = g * group - b * 32; i < (g + 1) * group - b * 32; ++i) s += codes[i];
        zsum[g * m + r] = zero * s;
        fsum[g * m + r] = static_cast<float>(s);
        scale[g * m + r] = d;
      }
    }
  }
}

}  // namespace
}  // namespace trtspec_gguf
