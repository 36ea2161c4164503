// AVX-VNNI (vpdpbusd on ymm, VEX-encoded: Intel client CPUs from Alder Lake on, which have no AVX-512): one
// vpdpbusd a step and row, exact in int32 (gguf_linear_avx2.h). Float activations, attention and the rounding of
// activations use no integer dot product: those are gguf_linear_avx2.cpp's.
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define TRTSPEC_AVXVNNI 1
#include "gguf_linear_avx2.h"

namespace trtspec_gguf {
void int8_avxvnni(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  int8_any(w, x, y, ldy, p0, p1);
}
}  // namespace trtspec_gguf
