// Activations to int8 per block of 32 along K, as the int8 kernels read them: scale d = amax / 127, code
// rint(x / d) computed as x * (1 / d) rounded half to even (adding and subtracting 1.5 * 2^23 rounds any
// |v| < 2^22 in the default rounding mode, as numpy's rint does), and each group's sum of codes. Plain loops,
// included by each ISA file so that its compiler target vectorizes them; the IEEE operations are the same
// whatever the vector width, so every path rounds identically.
#pragma once
#include <cstdint>

namespace trtspec_gguf {
namespace {

inline void quantize_rows_impl(const float* __restrict x, int64_t m, int64_t k, int64_t group, int8_t* __restrict q,
                               float* __restrict scale, int32_t* __restrict sum) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < k / 32; ++b) {
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
      int8_t* out = q + r * k + b * 32;
      for (int i = 0; i < 32; ++i) out[i] = static_cast<int8_t>((v[i] * id + 12582912.0f) - 12582912.0f);
      scale[r * (k / 32) + b] = d;
    }
    for (int64_t g = 0; g < k / group; ++g) {
      int32_t s = 0;
      for (int64_t i = 0; i < group; ++i) s += q[r * k + g * group + i];
      sum[r * (k / group) + g] = s;
    }
  }
}

}  // namespace
}  // namespace trtspec_gguf
