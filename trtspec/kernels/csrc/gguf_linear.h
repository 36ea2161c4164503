// The GGUF linear layer's kernels, one function per instruction set, and the packed layout they all read.
// Plain C++ with no torch headers: the ISA files are compiled for their own instruction set (#pragma GCC target),
// and nothing they define may be shared with the portable code (a header's inline function compiled for AVX-512
// and picked by the linker for every caller would crash an AVX2 machine).
//
// ---- The packed layout (trtspec/kernels/layout.py writes it) ------------------------------------------------
// Output columns (the weight's rows n) in panels of 16. A panel holds every group of the K axis, in K order; a
// group is G weights along K (G = 32, or 16 for Q6_K) and takes group_bytes:
//
//   codes    S = G / 4 steps of 4 consecutive k. For one step the 16 columns' codes are 64 bytes, byte c*4 + t
//            holding column c at k = 4*step + t: an int32 lane per column, so every path keeps a column in one
//            lane from the first k to the last, and a column's sum never depends on the vector width.
//            4-bit: S/2 blocks of 64 bytes; block j holds step j in the low nibbles, step j + S/2 in the high.
//            5-bit: those nibble blocks, then one 64-byte plane whose bit s of byte c*4 + t is bit 4 of step s's
//                   code (S = 8).
//            6-bit: the nibble blocks, then one plane whose bits 2s, 2s + 1 are bits 4, 5 of step s's code (S = 4).
//            8-bit: S blocks of 64 signed bytes (Q8_0's codes as they are).
//   scales   16 float32, the group's scale of each column
//   minimums 16 float32 (only where the type has them)
//
// A column of a padded last panel has zero codes and zero scales.
//
// ---- What every path computes, in this order, per row r and column c ---------------------------------------
// float activations:  acc = fma((float)(q - zero) * scale [+ minimum], x[k], acc) for k = 0 .. K-1
// int8 activations:   x is rounded per 32 along K (scale s = amax / 127, a = rint(x / s)); per group g
//                       dot = sum_k q * a  (exact, int32);  idot = dot - zero * sum_k a
//                       t = (float)idot * scale [+ minimum * (float)sum_k a]
//                       acc = acc + t * s
//                     with no fused multiply-add (the build passes -ffp-contract=off), so numpy can model it.
// Integer sums are exact, and the float steps are the same in every path: the portable path, AVX2, AVX-512 and
// AVX-512 VNNI give bit-identical results, for any number of rows and threads.
#pragma once
#include <cstdint>

namespace trtspec_gguf {

constexpr int kPanel = 16;  // columns of a panel: one AVX-512 vector of float32, two AVX2 vectors

struct Weights {
  const uint8_t* data;   // [panels, panel_bytes]
  int64_t k;             // input size
  int64_t groups;        // k / group
  int group;             // 32, or 16 for Q6_K
  int bits;              // 4, 5, 6 or 8
  int zero;              // integer zero point
  bool has_min;
  int64_t codes_bytes;   // per group
  int64_t group_bytes;   // codes + scales (+ minimums)
};

struct Int8Rows {
  const int8_t* q;       // [m, k]
  const float* scale;    // [m, k / 32]
  const int32_t* sum;    // [m, groups], the sum of q over each group
  int64_t m;
};

// Each computes output panels [p0, p1) for all m rows: y [m, ldy] float32, columns 16 * p ...
using Int8Kernel = void (*)(const Weights&, const Int8Rows&, float* y, int64_t ldy, int64_t p0, int64_t p1);
using FloatKernel = void (*)(const Weights&, const float* x, int64_t m, float* y, int64_t ldy, int64_t p0, int64_t p1);
// x [m, k] -> q [m, k], scale [m, k / 32], sum [m, k / group] (quantize_rows.h)
using Quantizer = void (*)(const float* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sum);

void quantize_reference(const float*, int64_t, int64_t, int64_t, int8_t*, float*, int32_t*);
void quantize_avx2(const float*, int64_t, int64_t, int64_t, int8_t*, float*, int32_t*);
void quantize_avx512(const float*, int64_t, int64_t, int64_t, int8_t*, float*, int32_t*);
void int8_reference(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
void float_reference(const Weights&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void int8_avx2(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
void float_avx2(const Weights&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void int8_avx512(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
void float_avx512(const Weights&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void int8_avx512vnni(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);

}  // namespace trtspec_gguf
