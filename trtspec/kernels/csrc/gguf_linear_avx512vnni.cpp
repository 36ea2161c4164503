// AVX-512 with VNNI: one vpdpbusd a step and row, exact in int32 (gguf_linear_avx512.h). Float activations use
// no integer dot product: that path is gguf_linear_avx512.cpp's.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
// #pragma GCC target does not define __AVX512VNNI__ for the preprocessor: the header asks for this instead
#define TRTSPEC_VNNI 1
#include "gguf_linear_avx512.h"

namespace trtspec_gguf {
void int8_avx512vnni(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  int8_any(w, x, y, ldy, p0, p1);
}
}  // namespace trtspec_gguf
