// The portable path: one column at a time, the arithmetic of gguf_linear.h written out. The tests compare every
// ISA path with it bit for bit; it also runs where the CPU has no AVX2.
#include <cmath>
#include <cstring>

#include "gguf_linear.h"
#include "attention_rows.h"
#include "quantize_rows.h"

namespace trtspec_gguf {
namespace {

// The code of column c at position kk (0 .. G-1) of a group, as stored by the layout above.
int code_at(const Weights& w, const uint8_t* group, int c, int kk) {
  const int steps = w.group / 4, s = kk / 4, idx = c * 4 + kk % 4;
  if (w.bits == 8) return static_cast<int8_t>(group[64 * s + idx]);
  const int half = steps / 2;
  const uint8_t b = group[64 * (s % half) + idx];
  int code = s < half ? (b & 0x0F) : (b >> 4);
  const uint8_t* plane = group + 64 * half;
  if (w.bits == 5) code |= ((plane[idx] >> s) & 1) << 4;
  if (w.bits == 6) code |= ((plane[idx] >> (2 * s)) & 3) << 4;
  return code;
}

// An IEEE float16's value as float32 (exact: every float16 is a float32).
float from_half(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float v;
  if (exponent == 0) v = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
  else if (exponent == 31) v = mantissa ? NAN : INFINITY;
  else v = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  return sign ? -v : v;
}

// Float i (0 .. 15) of the 16 at p: a column's scale or minimum.
float float_at(const Weights& w, const uint8_t* p, int i) {
  if (w.half_scales) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return from_half(h);
  }
  float v;
  std::memcpy(&v, p + 4 * i, 4);
  return v;
}

float scale_at(const Weights& w, const uint8_t* group, int c) { return float_at(w, group + w.codes_bytes, c); }

float minimum_at(const Weights& w, const uint8_t* group, int c) {
  return float_at(w, group + w.codes_bytes + w.floats_bytes, c);
}

}  // namespace

void int8_reference(const Weights& w, const Int8Rows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = w.groups * w.group_bytes;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w.data + p * panel_bytes;
    for (int64_t r = 0; r < x.m; ++r) {
      for (int c = 0; c < kPanel; ++c) {
        float acc = 0.0f;
        for (int64_t g = 0; g < w.groups; ++g) {
          const uint8_t* group = panel + g * w.group_bytes;
          int32_t dot = 0;
          for (int kk = 0; kk < w.group; ++kk) {
            const int64_t at = g * w.group + kk;
            const int64_t steps = w.group / 4, chunk = at / 4 % steps;  // x.q [groups, m, steps]
            const int8_t a = reinterpret_cast<const int8_t*>(x.q + (g * x.m + r) * steps + chunk)[at % 4];
            dot += code_at(w, group, c, kk) * a;
          }
          const int64_t i = g * x.m + r;
          float t = static_cast<float>(dot - x.zsum[i]) * scale_at(w, group, c);
          if (w.has_min) t = t + minimum_at(w, group, c) * x.fsum[i];
          acc = acc + t * x.scale[i];
        }
        y[r * ldy + p * kPanel + c] = acc;
      }
    }
  }
}

void float_reference(const Weights& w, const FloatRows& x, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = w.groups * w.group_bytes;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w.data + p * panel_bytes;
    for (int64_t r = 0; r < x.m; ++r) {
      for (int c = 0; c < kPanel; ++c) {
        float acc = 0.0f;
        for (int64_t g = 0; g < w.groups; ++g) {
          const uint8_t* group = panel + g * w.group_bytes;
          float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int kk = 0; kk < w.group; ++kk)
            d[kk % 4] = std::fma(static_cast<float>(code_at(w, group, c, kk) - w.zero),
                                 x.xt[(g * w.group + kk) * x.m + r], d[kk % 4]);
          acc = std::fma((d[0] + d[1]) + (d[2] + d[3]), scale_at(w, group, c), acc);
          if (w.has_min) acc = std::fma(minimum_at(w, group, c), x.xsum[g * x.m + r], acc);
        }
        y[r * ldy + p * kPanel + c] = acc;
      }
    }
  }
}

void attention_reference(const AttentionArgs& a, int64_t r0, int64_t r1, float* scratch) {
  attention_rows_impl(a, r0, r1, scratch);
}

void quantize_reference(const float* x, int64_t m, int64_t k, int64_t group, int zero, int64_t b0, int64_t b1, int32_t* q,
                    int32_t* zsum, float* fsum, float* scale) {
  quantize_rows_impl(x, m, k, group, zero, b0, b1, q, zsum, fsum, scale);
}

}  // namespace trtspec_gguf
