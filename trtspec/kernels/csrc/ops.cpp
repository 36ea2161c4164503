// torch.ops.trtspec.gguf_linear: y = x @ W^T for W in a GGUF file's own blocks (packed by trtspec/kernels/
// layout.py), on the fastest path this CPU runs, chosen once at load and changeable for tests and benchmarks
// (torch.ops.trtspec.gguf_kernel_path). Threads come from torch's intra-op pool: output panels are split
// between them, never the K axis, so the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gguf_linear.h"

namespace trtspec_gguf {
namespace {

struct Path {
  const char* name;
  bool (*supported)();
  Int8Kernel int8;
  FloatKernel floats;
  Quantizer quantize;
};

bool always() { return true; }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("fma"); }
bool has_avx512vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }

// Fastest first.
const Path kPaths[] = {
    {"avx512vnni", has_avx512vnni, int8_avx512vnni, float_avx512, quantize_avx512},
    {"avx512", has_avx512, int8_avx512, float_avx512, quantize_avx512},
    {"avx2", has_avx2, int8_avx2, float_avx2, quantize_avx2},
    {"reference", always, int8_reference, float_reference, quantize_reference},
};

const Path* best_path() {
  for (const Path& p : kPaths)
    if (p.supported()) return &p;
  return &kPaths[3];
}

const Path* g_path = best_path();

int64_t codes_bytes_of(int64_t bits, int64_t group) {
  const int64_t steps = group / 4;
  switch (bits) {
    case 4: return steps / 2 * 64;
    case 5:
    case 6: return steps / 2 * 64 + 64;
    default: return steps * 64;
  }
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k, int64_t bits,
                       int64_t group, int64_t zero, bool has_min, bool int8_activations) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "gguf_linear: x's last dimension must be ", k, ", got ", x.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "gguf_linear: packed must be contiguous uint8");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "gguf_linear: bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(group == (bits == 6 ? 16 : 32), "gguf_linear: ", bits, "-bit codes come in groups of ",
              bits == 6 ? 16 : 32, ", got ", group);
  TORCH_CHECK(k % 32 == 0 && k > 0, "gguf_linear: k must be a positive multiple of 32, got ", k);
  Weights w;
  w.data = packed.data_ptr<uint8_t>();
  w.k = k;
  w.group = static_cast<int>(group);
  w.groups = k / group;
  w.bits = static_cast<int>(bits);
  w.zero = static_cast<int>(zero);
  w.has_min = has_min;
  w.codes_bytes = codes_bytes_of(bits, group);
  w.group_bytes = w.codes_bytes + (has_min ? 128 : 64);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.numel() == panels * w.groups * w.group_bytes, "gguf_linear: packed holds ", packed.numel(),
              " bytes, a [", n, ", ", k, "] layer of ", bits, "-bit codes takes ", panels * w.groups * w.group_bytes);

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor y = at::empty({m, panels * kPanel}, x.options());
  if (m == 0) return y.narrow(1, 0, n).reshape(out_shape);
  float* yp = y.data_ptr<float>();
  const int64_t ldy = panels * kPanel;
  const Path* path = g_path;
  if (int8_activations) {
    // one buffer: codes [k/4, m] int32, then zsum [groups, m] int32, fsum and scale [groups, m] float32
    at::Tensor rows_buffer = at::empty({(k / 4 + 3 * w.groups) * m}, x.options().dtype(at::kInt));
    int32_t* qp = rows_buffer.data_ptr<int32_t>();
    int32_t* zp = qp + (k / 4) * m;
    float* fp = reinterpret_cast<float*>(zp + w.groups * m);
    float* sp = fp + w.groups * m;
    const float* xp = x2.data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      path->quantize(xp, m, k, group, w.zero, r0, r1, qp, zp, fp, sp);
    });
    const Int8Rows rows{qp, zp, fp, sp, m};
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { path->int8(w, rows, yp, ldy, p0, p1); });
  } else {
    const at::Tensor xt = m == 1 ? x2 : x2.t().contiguous();  // [k, m]
    const FloatRows rows{xt.data_ptr<float>(), m};
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { path->floats(w, rows, yp, ldy, p0, p1); });
  }
  if (ldy != n) y = y.narrow(1, 0, n).contiguous();
  return y.view(out_shape);
}

// "" -> the path in use; a name -> use that path from now on (it must run on this CPU), returning it.
std::string gguf_kernel_path(const std::string& name) {
  if (!name.empty()) {
    for (const Path& p : kPaths) {
      if (name == p.name) {
        TORCH_CHECK(p.supported(), "gguf_kernel_path: this CPU cannot run the ", name, " path");
        g_path = &p;
        return p.name;
      }
    }
    TORCH_CHECK(false, "gguf_kernel_path: no path named '", name, "'; choose avx512vnni, avx512, avx2 or reference");
  }
  return g_path->name;
}

// The paths this CPU runs, fastest first.
std::vector<std::string> gguf_kernel_paths() {
  std::vector<std::string> out;
  for (const Path& p : kPaths)
    if (p.supported()) out.emplace_back(p.name);
  return out;
}

}  // namespace
}  // namespace trtspec_gguf

TORCH_LIBRARY_FRAGMENT(trtspec, m) {  // a fragment: exporter/ defines other trtspec ops from Python
  m.def("gguf_linear(Tensor x, Tensor packed, int n, int k, int bits, int group, int zero, bool has_min, "
        "bool int8_activations) -> Tensor");
  m.def("gguf_kernel_path(str name='') -> str", &trtspec_gguf::gguf_kernel_path);
  m.def("gguf_kernel_paths() -> str[]", &trtspec_gguf::gguf_kernel_paths);
}

TORCH_LIBRARY_IMPL(trtspec, CPU, m) { m.impl("gguf_linear", &trtspec_gguf::gguf_linear); }
