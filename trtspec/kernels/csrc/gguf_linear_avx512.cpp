// AVX-512 (F, BW, VL, DQ) without VNNI: maddubs pair sums in int16, widened by madd (gguf_linear_avx512.h).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define TRTSPEC_VEC_ZMM 1  // vec16.h's fma16
#include "gguf_linear_avx512.h"
#include "attention_rows.h"
#include "quantize_rows.h"

namespace trtspec_gguf {
void int8_avx512(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  int8_any(w, x, y, ldy, p0, p1);
}
void float_avx512(const Weights& w, const FloatRows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  float_any(w, x, y, ldy, p0, p1);
}
void attention_avx512(const AttentionArgs& a, int64_t r0, int64_t r1, float* scratch) {
  attention_rows_impl(a, r0, r1, scratch);
}

void quantize_avx512(const float* x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0, int64_t b1, int32_t* q,
                    int32_t* zsum, float* fsum, float* scale) {
  quantize_rows_impl(x, m, k, group, zero, b0, b1, q, zsum, fsum, scale);
}

}  // namespace trtspec_gguf
