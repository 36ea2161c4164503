// GCC's vectors of 16 floats (and int32): each ISA file compiles them, after its own #pragma GCC target, to one zmm,
// two ymm or scalar code with the same IEEE steps per lane (attention_rows.h and quantize_rows.h are written on them).
#pragma once
#include <cstdint>
#include <cstring>

namespace trtspec_gguf {
namespace {

constexpr int kLanes = 16;
typedef float f16x __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));

inline f16x load16(const float* p) {
  f16x v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f16x v) { std::memcpy(p, &v, sizeof(v)); }

inline f16x splat(float x) { return f16x{} + x; }

}  // namespace
}  // namespace trtspec_gguf
