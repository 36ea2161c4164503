// torch.ops.trtspec.gguf_linear: y = x @ W^T for W in a GGUF file's own blocks (packed by trtspec/kernels/
// layout.py), on the fastest path this CPU runs, chosen once at load and changeable for tests and benchmarks
// (torch.ops.trtspec.gguf_kernel_path). Threads come from torch's intra-op pool: output panels are split
// between them, never the K axis, so the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gguf_linear.h"

namespace trtspec_gguf {
namespace {

struct Path {
  const char* name;
  bool (*supported)();
  int code_offset;  // added to an 8-bit code by the int8 kernel, so the rounding's zero point is this much higher
  Int8Kernel int8;
  FloatKernel floats;
  Quantizer quantize;
  AttentionKernel attention;
};

bool always() { return true; }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }
bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("fma"); }
bool has_avxvnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }
bool has_avx512vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }

// Fastest first.
const Path kPaths[] = {
    {"avx512vnni", has_avx512vnni, 128, int8_avx512vnni, float_avx512, quantize_avx512, attention_avx512},
    {"avx512", has_avx512, 0, int8_avx512, float_avx512, quantize_avx512, attention_avx512},
    {"avxvnni", has_avxvnni, 128, int8_avxvnni, float_avx2, quantize_avx2, attention_avx2},
    {"avx2", has_avx2, 0, int8_avx2, float_avx2, quantize_avx2, attention_avx2},
    {"reference", always, 0, int8_reference, float_reference, quantize_reference, attention_reference},
};

const Path* best_path() {
  for (const Path& p : kPaths)
    if (p.supported()) return &p;
  return &kPaths[sizeof(kPaths) / sizeof(kPaths[0]) - 1];
}

const Path* g_path = best_path();

// f(i0, i1) over [0, n) on the pool's threads, balanced as they run: each thread takes its own contiguous share in
// chunks from the front (a one-row call streams the weights in order, as the prefetch expects), and a thread done
// with its share takes chunks from the back of the share with the most left. On a machine whose cores also run other
// work, at::parallel_for's fixed equal shares left the faster thread waiting at the end of every call. Each index is
// computed the same way whichever thread takes it, so the result never depends on the split.
template <typename F>
void parallel_chunks(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, n / (4 * threads));
  // share t's [front, back) packed in one word (n < 2^31), so an owner and a thief never take the same index; a cache
  // line each, so an owner taking from its share does not evict the others'
  struct alignas(64) Share : std::atomic<uint64_t> {};
  std::vector<Share> shares(threads);
  auto pack = [](int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(hi); };
  for (int64_t t = 0; t < threads; ++t) shares[t].store(pack(n * t / threads, n * (t + 1) / threads));
  // take up to `chunk` indices from share t's front (or back); false when it is empty
  auto take = [&](int64_t t, bool front, int64_t& i0, int64_t& i1) {
    uint64_t cur = shares[t].load();
    for (;;) {
      const int64_t lo = static_cast<int64_t>(cur >> 32), hi = static_cast<int64_t>(cur & 0xFFFFFFFFu);
      if (lo >= hi) return false;
      i0 = front ? lo : std::max(lo, hi - chunk);
      i1 = front ? std::min(hi, lo + chunk) : hi;
      if (shares[t].compare_exchange_weak(cur, front ? pack(i1, hi) : pack(lo, i0))) return true;
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t i0, i1;
      while (take(t, true, i0, i1)) f(i0, i1);
      for (;;) {  // steal from the share with the most left
        int64_t victim = -1, most = 0;
        for (int64_t v = 0; v < threads; ++v) {
          const uint64_t cur = shares[v].load();
          const int64_t left = static_cast<int64_t>(cur & 0xFFFFFFFFu) - static_cast<int64_t>(cur >> 32);
          if (left > most) most = left, victim = v;
        }
        if (victim < 0) break;
        if (take(victim, false, i0, i1)) f(i0, i1);
      }
    }
  });
}

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
                       int64_t group, int64_t zero, bool has_min, bool half_scales, bool int8_activations) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "gguf_linear: x's last dimension must be ", k, ", got ", x.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "gguf_linear: packed must be contiguous uint8");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "gguf_linear: bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(group == (bits == 6 ? 16 : 32), "gguf_linear: ", bits, "-bit codes come in groups of ",
              bits == 6 ? 16 : 32, ", got ", group);
  TORCH_CHECK(k % 32 == 0 && k > 0, "gguf_linear: k must be a positive multiple of 32, got ", k);
  // every GGUF type with minimums has unsigned codes and zero point 0, and the int8 kernels rely on it (gguf_linear.h)
  TORCH_CHECK(!has_min || zero == 0, "gguf_linear: a type with minimums has zero point 0, got ", zero);
  Weights w;
  w.data = packed.data_ptr<uint8_t>();
  w.k = k;
  w.group = static_cast<int>(group);
  w.groups = k / group;
  w.bits = static_cast<int>(bits);
  w.zero = static_cast<int>(zero);
  w.has_min = has_min;
  w.half_scales = half_scales;
  w.codes_bytes = codes_bytes_of(bits, group);
  w.floats_bytes = kPanel * (half_scales ? 2 : 4);
  w.group_bytes = w.codes_bytes + w.floats_bytes * (has_min ? 2 : 1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.numel() == panels * w.groups * w.group_bytes, "gguf_linear: packed holds ", packed.numel(),
              " bytes, a [", n, ", ", k, "] layer of ", bits, "-bit codes takes ", panels * w.groups * w.group_bytes);

  // a one-row call's fixed cost is a good part of it (a decode of SmolLM2 makes ~150 of our calls): no reshaped views, the output
  // allocated in its final shape, and the rounded activations in a buffer kept by the calling thread
  at::DimVector out_shape(x.sizes());
  out_shape.back() = n;
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const int64_t m = x.numel() / k;
  const int64_t ldy = panels * kPanel;
  at::Tensor y = ldy == n ? at::empty(out_shape, x.options()) : at::empty({m, ldy}, x.options());
  if (m == 0) return ldy == n ? y : y.narrow(1, 0, n).reshape(out_shape);
  float* yp = y.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  const Path* path = g_path;
  if (int8_activations) {
    // one buffer: codes [groups, m, group / 4] int32, then zsum [groups, m] int32, fsum and scale [groups, m] float32
    thread_local std::vector<int32_t> rows_buffer;
    rows_buffer.resize(std::max<size_t>(rows_buffer.size(), (k / 4 + 3 * w.groups) * m));
    int32_t* qp = rows_buffer.data();
    int32_t* zp = qp + (k / 4) * m;
    float* fp = reinterpret_cast<float*>(zp + w.groups * m);
    float* sp = fp + w.groups * m;
    // split along K, never between rows: the rows of a chunk share cache lines (Int8Rows), and threads writing
    // one line each made a 17-row call's rounding cost more than its matmul; under 16K values it is one thread's
    const int zero = w.zero + (bits == 8 ? path->code_offset : 0);
    at::parallel_for(0, k / 32, std::max<int64_t>(1, 512 / m), [&](int64_t b0, int64_t b1) {
      path->quantize(xp, m, k, group, zero, b0, b1, qp, zp, fp, sp);
    });
    const Int8Rows rows{qp, zp, fp, sp, m};
    parallel_chunks(panels, [&](int64_t p0, int64_t p1) { path->int8(w, rows, yp, ldy, p0, p1); });
  } else {
    const at::Tensor xt = m == 1 ? xc : xc.view({m, k}).t().contiguous();  // [k, m]
    // each row's sum over each group (the minimums' term, gguf_linear.h), the same bits for every path: four sums
    // s_t = x[t] + x[4 + t] + ... (one 4-float vector add a step), then (s_0 + s_1) + (s_2 + s_3)
    thread_local std::vector<float> sums;
    if (has_min) {
      typedef float f4 __attribute__((vector_size(16)));
      sums.resize(std::max<size_t>(sums.size(), w.groups * m));
      for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < w.groups; ++g) {
          const float* xg = xp + r * k + g * group;
          f4 s = {0.0f, 0.0f, 0.0f, 0.0f}, v;
          for (int64_t i = 0; i < group; i += 4) {
            std::memcpy(&v, xg + i, sizeof(v));
            s = s + v;
          }
          sums[g * m + r] = (s[0] + s[1]) + (s[2] + s[3]);
        }
    }
    const FloatRows rows{xt.data_ptr<float>(), has_min ? sums.data() : nullptr, m};
    parallel_chunks(panels, [&](int64_t p0, int64_t p1) { path->floats(w, rows, yp, ldy, p0, p1); });
  }
  return ldy == n ? y : y.narrow(1, 0, n).contiguous().view(out_shape);
}

// torch.ops.trtspec.attention_rows: softmax(q k^T * scale [soft-capped], masked) v per query row, in an order
// fixed per row (attention_rows.h). q [B, H, T, D]; k, v [B, Hkv, S', D] with unit stride along D and D along S'
// (a KV cache: any batch and head strides), of which the first S = mask.size(3) slots are read (the live ones: no
// cut view of the cache to trace); mask bool [B, 1, T, S] (broadcast strides allowed) -> [B, H, T, D]. Rows are split
// between threads, never a row's keys.
at::Tensor attention_rows_as(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                             double scale, double softcap, bool tokens_major) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention_rows: q, k and v must be float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4,
              "attention_rows: q, k, v and mask must be 4-d ([B, H, T, D], [B, Hkv, S, D], [B, 1, T, S])");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = mask.size(3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hkv > 0 && H % Hkv == 0 &&
              k.size(2) >= S, "attention_rows: k and v must be [B, Hkv, S, D] with H a multiple of Hkv and S at least "
              "the mask's; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", mask ", mask.sizes());
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && v.stride(3) == 1 && v.stride(2) == D,
              "attention_rows: k and v must be contiguous along S and D");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == B && mask.size(1) == 1 && mask.size(2) == T,
              "attention_rows: mask must be bool [B, 1, T, S], got ", mask.sizes());
  const at::Tensor qc = q.contiguous();
  at::Tensor out = tokens_major ? at::empty({B, T, H * D}, q.options()) : at::empty({B, H, T, D}, q.options());
  if (out.numel() == 0) return out;
  AttentionArgs a{qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mask.data_ptr<bool>(),
                  out.data_ptr<float>(), B, H, Hkv, T, S, D, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  mask.stride(0), mask.stride(2), mask.stride(3), static_cast<float>(scale),
                  static_cast<float>(softcap), tokens_major};
  const Path* path = g_path;
  parallel_chunks(B * H * T, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> scratch;  // kept between calls: no allocation (nor page faults) per call
    scratch.resize(std::max<size_t>(scratch.size(), attention_scratch_floats(S, D) + 16));
    // 64-byte aligned: a row's value sums are stored and loaded back a block of keys at a time, and vectors split
    // across cache lines made that cost more than the blocks saved (AVX-512, one row)
    const uintptr_t at = (reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63};
    path->attention(a, r0, r1, reinterpret_cast<float*>(at));
  });
  return out;
}

at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale, double softcap) {
  return attention_rows_as(q, k, v, mask, scale, softcap, false);
}

// torch.ops.trtspec.attention_rows_tokens: the same rows, the same bits, written as [B, T, H * D], the output
// projection's input (one traced op where attention_rows was followed by a transpose and a flatten).
at::Tensor attention_rows_tokens(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                                 double scale, double softcap) {
  return attention_rows_as(q, k, v, mask, scale, softcap, true);
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
    TORCH_CHECK(false, "gguf_kernel_path: no path named '", name, "'; choose avx512vnni, avx512, avxvnni, avx2 or reference");
  }
  return g_path->name;
}

}  // namespace

int path_vector_bits() {
  const std::string name = g_path->name;
  return name.rfind("avx512", 0) == 0 ? 512 : name == "reference" ? 128 : 256;
}

namespace {

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
        "bool half_scales, bool int8_activations) -> Tensor");
  m.def("attention_rows(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, float softcap) -> Tensor");
  m.def("attention_rows_tokens(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, float softcap) -> Tensor");
  m.def("gguf_kernel_path(str name='') -> str", &trtspec_gguf::gguf_kernel_path);
  m.def("gguf_kernel_paths() -> str[]", &trtspec_gguf::gguf_kernel_paths);
}

TORCH_LIBRARY_IMPL(trtspec, CPU, m) {
  m.impl("gguf_linear", &trtspec_gguf::gguf_linear);
  m.impl("attention_rows", &trtspec_gguf::attention_rows);
  m.impl("attention_rows_tokens", &trtspec_gguf::attention_rows_tokens);
}

// ---- C shims: AOTInductor's generated code calls these directly (torch._inductor.config.aot_inductor.
// custom_ops_to_c_shims, set by trtspec/torch_backend/aot.py), not through the dispatcher's boxed call, whose
// argument stack cost a one-row call a few microseconds. Same arguments as the schemas above, bools as int32_t.
#include <torch/csrc/inductor/aoti_torch/utils.h>

extern "C" {

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_gguf_linear(
    AtenTensorHandle x, AtenTensorHandle packed, int64_t n, int64_t k, int64_t bits, int64_t group, int64_t zero,
    int32_t has_min, int32_t half_scales, int32_t int8_activations, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(trtspec_gguf::gguf_linear(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(packed), n, k, bits, group, zero,
        has_min, half_scales, int8_activations));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_attention_rows(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle mask, double scale, double softcap,
    AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(trtspec_gguf::attention_rows(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
        *tensor_handle_to_tensor_pointer(mask), scale, softcap));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_attention_rows_tokens(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle mask, double scale, double softcap,
    AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(trtspec_gguf::attention_rows_tokens(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k), *tensor_handle_to_tensor_pointer(v),
        *tensor_handle_to_tensor_pointer(mask), scale, softcap));
  });
}

}  // extern "C"
