// AVX2 + FMA + F16C without VNNI (e.g. AMD Zen 2 and 3): maddubs pair sums in int16, widened by madd
// (gguf_linear_avx2.h).
#pragma GCC target("avx2,fma,f16c")
#define TRTSPEC_VEC_YMM 1  // vec16.h's fma16
#include "gguf_linear_avx2.h"
#include "attention_rows.h"
#include "quantize_rows.h"

namespace trtspec_gguf {
void int8_avx2(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  int8_any(w, x, y, ldy, p0, p1);
}
void float_avx2(const Weights& w, const FloatRows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  float_any(w, x, y, ldy, p0, p1);
}
void attention_avx2(const AttentionArgs& a, int64_t r0, int64_t r1, float* scratch) {
  attention_rows_impl(a, r0, r1, scratch);
}
void quantize_avx2(const float* x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0, int64_t b1, int32_t* q,
                   int32_t* zsum, float* fsum, float* scale) {
  quantize_rows_impl(x, m, k, group, zero, b0, b1, q, zsum, fsum, scale);
}
}  // namespace trtspec_gguf
