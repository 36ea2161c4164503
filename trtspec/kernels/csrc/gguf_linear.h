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
//   scales   16 floats, the group's scale of each column: float16 where the whole tensor's scales and minimums
//            are float16 exactly (the legacy types: their d and m are the file's; half_scales), else float32
//   minimums 16 floats of the same width (only where the type has them)
//
// A column of a padded last panel has zero codes and zero scales.
//
// ---- What every path computes, in this order, per row r and column c ---------------------------------------
// float activations:  per group, with c = q - zero (an integer, |c| <= 128) and its G inputs x[4s + t]:
//                       d_t = fma((float)c[4s + t], x[4s + t], d_t) for s = 0 .. G/4 - 1, four sums t = 0 .. 3 from 0
//                       acc = fma((d_0 + d_1) + (d_2 + d_3), scale, acc)
//                       acc = fma(minimum, xsum, acc)   (types with minimums; xsum = (u_0 + u_1) + (u_2 + u_3),
//                                                       u_t = x[t] + x[4 + t] + ..., summed by ops.cpp for every path)
//                     Four independent sums a group keep a one-row call off the fused multiply-add's latency, and the
//                     codes meet x as integers: no per-weight multiply by the scale, no per-weight minimum.
// int8 activations:   x is rounded per 32 along K (scale s = amax / 127, a = rint(x / s)); per group g
//                       dot = sum_k q * a  (exact, int32);  idot = dot - zero * sum_k a
//                       t = (float)idot * scale [+ minimum * (float)sum_k a]
//                       acc = acc + t * s
//                     with no fused multiply-add (the build passes -ffp-contract=off), so numpy can model it.
// Integer sums are exact, and the float steps are the same in every path: the portable path, AVX2, AVX-VNNI,
// AVX-512 and AVX-512 VNNI give bit-identical results, for any number of rows and threads.
#pragma once
#include <cstdint>

namespace trtspec_gguf {

constexpr int kPanel = 16;  // columns of a panel: one AVX-512 vector of float32, two AVX2 vectors
// How far ahead of the group being read the vector paths ask for the panel's bytes (a software prefetch of the
// next group's lines, kPrefetchBytes on): a thread streams its panels in order, and the hardware prefetcher alone
// left a one-row call at half the machine's read bandwidth. 3 to 8 KiB measured alike on SmolLM2's layers (a decode
// call 9.6 -> 8.2 ms); past the end of the weights a prefetch is a no-op, never a fault.
constexpr int64_t kPrefetchBytes = 4096;

// Rows of the next tile when `left` rows remain, at most `most` a tile: the call's rows in as few tiles as the
// registers allow, of equal size (17 rows at 8 a tile: 6, 6, 5, not 8, 8, 1: a one-row tile has too few independent
// sums to keep the multiply units busy). A row's sums take the same steps in any tile, so this changes no result.
// Internal linkage: each ISA file gets its own copy (see above).
static inline int64_t tile_rows(int64_t left, int64_t most) {
  const int64_t tiles = (left + most - 1) / most;
  return (left + tiles - 1) / tiles;
}

// A group's form known at compile time, for the int8 kernels: a one-row call's loop is short, and a branch on the
// minimum or on the scales' width (reloaded from memory every group) and a prefetch loop of unknown length cost it
// about a tenth of its time. Data only, so safe to share between the ISA files.
template <int BITS, bool MIN, bool HALF>
struct Form {
  static constexpr int bits = BITS;
  static constexpr bool has_min = MIN, half = HALF;
  static constexpr int64_t codes_bytes = BITS == 8 ? 8 * 64 : BITS == 4 ? 4 * 64 : BITS == 5 ? 5 * 64 : 3 * 64;
  static constexpr int64_t floats_bytes = kPanel * (HALF ? 2 : 4);
  static constexpr int64_t group_bytes = codes_bytes + floats_bytes * (MIN ? 2 : 1);
};

// The lines kPrefetchBytes past a group of this form (__builtin_prefetch: a read, kept in every cache level, the
// ISA files' _mm_prefetch(..., _MM_HINT_T0)). Internal linkage, as tile_rows.
template <typename F>
static inline void prefetch_form(const uint8_t* group) {
  const uint8_t* ahead = group + kPrefetchBytes;
#pragma GCC unroll 16
  for (int64_t j = 0; j < F::group_bytes; j += 64) __builtin_prefetch(ahead + j, 0, 3);
}

// panels(Form<BITS, w.has_min, w.half_scales>{}): a layer's form as a compile-time type. Internal linkage, as tile_rows.
template <int BITS, typename Panels>
static inline void with_form(bool has_min, bool half_scales, const Panels& panels) {
  if (has_min) {
    if (half_scales) panels(Form<BITS, true, true>{});
    else panels(Form<BITS, true, false>{});
  } else {
    if (half_scales) panels(Form<BITS, false, true>{});
    else panels(Form<BITS, false, false>{});
  }
}

struct Weights {
  const uint8_t* data;   // [panels, panel_bytes]
  int64_t k;             // input size
  int64_t groups;        // k / group
  int group;             // 32, or 16 for Q6_K
  int bits;              // 4, 5, 6 or 8
  int zero;              // integer zero point
  bool has_min;
  bool half_scales;      // scales and minimums as float16 (converted exactly to float32 as they are read)
  int64_t codes_bytes;   // per group
  int64_t floats_bytes;  // a group's 16 scales (or minimums): 32 or 64
  int64_t group_bytes;   // codes + scales (+ minimums)
};

// panels(Form<w.bits, w.has_min, w.half_scales>{}): the layer's whole form as a compile-time type, for each ISA file's
// entry points. Internal linkage, as tile_rows.
template <typename Panels>
static inline void with_layer_form(const Weights& w, const Panels& panels) {
  switch (w.bits) {
    case 4: with_form<4>(w.has_min, w.half_scales, panels); break;
    case 5: with_form<5>(w.has_min, w.half_scales, panels); break;
    case 6: with_form<6>(w.has_min, w.half_scales, panels); break;
    default: with_form<8>(w.has_min, w.half_scales, panels); break;
  }
}

// A call's activations rounded to int8, laid out so that a tile's rows sit side by side: per group of the layer, the
// m rows' codes one after the other, a row's as S = group / 4 int32 (4 consecutive k, the 4 bytes one int32 lane of
// the weights meets); and per group, the m rows' values of what the group's float steps need. One pointer per group
// and constant offsets then reach every row and step of a tile (with [k / 4, m], a step's offset was a multiple of m,
// and the compiler ran out of registers for the tile's addresses).
struct Int8Rows {
  const int32_t* q;      // [groups, m, S]: row r's codes at k = g * group + 4s .. + 3 in q[(g * m + r) * S + s]
  const int32_t* zsum;   // [groups, m]: zero point * the sum of the row's codes over the group
  const float* fsum;     // [groups, m]: that sum (not times the zero point) as float32, for the minimum's term
  const float* scale;    // [groups, m]: the row's scale of the block of 32 the group lies in
  int64_t m;
};

// A call's float activations transposed, a tile's rows side by side for each k.
struct FloatRows {
  const float* xt;       // [k, m]: row r's x[k] in xt[k * m + r]
  const float* xsum;     // [groups, m]: row r's xsum of group g (above) in xsum[g * m + r]; types with minimums
  int64_t m;
};

// A call of attention over a KV cache, one query row at a time (attention_rows.h).
struct AttentionArgs {
  const float* q;          // [B, H, T, D] contiguous
  const float* k;          // key cache: element (b, kh, s, d) at k[b * kb + kh * kt + s * D + d]
  const float* v;          // value cache: v[b * vb + kh * vt + s * D + d]
  const bool* mask;        // mask (b, t, s) at mask[b * mb + t * mt + s * ms]
  float* out;              // [B, H, T, D] contiguous, or [B, T, H, D] (tokens_major: the output projection's input)
  int64_t B, H, Hkv, T, S, D;
  int64_t kb, kt, vb, vt;
  int64_t mb, mt, ms;
  float scale, softcap;    // softcap 0: none
  bool tokens_major = false;
};

// Each computes output panels [p0, p1) for all m rows: y [m, ldy] float32, columns 16 * p ...
using Int8Kernel = void (*)(const Weights&, const Int8Rows&, float* y, int64_t ldy, int64_t p0, int64_t p1);
using FloatKernel = void (*)(const Weights&, const FloatRows&, float* y, int64_t ldy, int64_t p0, int64_t p1);
// blocks of 32 [b0, b1) along K of every row of x [m, k] -> their part of an Int8Rows' arrays (quantize_rows.h)
using Quantizer = void (*)(const float* x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0, int64_t b1,
                           int32_t* q, int32_t* zsum, float* fsum, float* scale);

void quantize_reference(const float*, int64_t, int64_t, int64_t, int, int64_t, int64_t, int32_t*, int32_t*, float*, float*);
void quantize_avx2(const float*, int64_t, int64_t, int64_t, int, int64_t, int64_t, int32_t*, int32_t*, float*, float*);
void quantize_avx512(const float*, int64_t, int64_t, int64_t, int, int64_t, int64_t, int32_t*, int32_t*, float*, float*);
void int8_reference(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
void float_reference(const Weights&, const FloatRows&, float*, int64_t, int64_t, int64_t);
void int8_avx2(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
void float_avx2(const Weights&, const FloatRows&, float*, int64_t, int64_t, int64_t);
void int8_avx512(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
void float_avx512(const Weights&, const FloatRows&, float*, int64_t, int64_t, int64_t);
void int8_avx512vnni(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
void int8_avxvnni(const Weights&, const Int8Rows&, float*, int64_t, int64_t, int64_t);
// rows [r0, r1) of the B * H * T, tiles of up to kAttentionTileRows rows sharing a key head (attention_rows.h);
// scratch: attention_scratch_floats(S, D) floats
constexpr int64_t kAttentionTileRows = 8;
inline int64_t attention_scratch_floats(int64_t S, int64_t D) {
  return kAttentionTileRows * ((S + 15) / 16 * 16 + 4 * D) + D;  // a row's scores and value sums; any D's sum
}
using AttentionKernel = void (*)(const AttentionArgs&, int64_t r0, int64_t r1, float* scratch);
void attention_reference(const AttentionArgs&, int64_t, int64_t, float*);
// The vector width in bits the kernel path in use is written for: 512 (the AVX-512 paths), 256 (avx2, avxvnni) or
// 128 (reference). silu_mul's loop follows it (step_ops.cpp; the other step ops have one loop for every CPU), so a
// path forced by TRTSPEC_KERNEL_PATH runs the ops as a CPU with only that path would.
int path_vector_bits();
void attention_avx2(const AttentionArgs&, int64_t, int64_t, float*);
void attention_avx512(const AttentionArgs&, int64_t, int64_t, float*);

}  // namespace trtspec_gguf
