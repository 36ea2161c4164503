// The step's small ops around the GGUF kernels, one op each where the traced step had ten (an RMSNorm: casts, a
// power, a mean, an add, a reciprocal square root, two products) or thirty (a layer's q/k/v split, RoPE on q and k,
// their transposes): torch.export, AOTInductor's second trace, its lowering and its C++ wrapper all cost per traced
// op, so an engine built with these compiles in about half the time (docs/kernels.md, "What it costs to build").
//
// Each row is computed alone, in an order fixed per row, so a row's result does not depend on the call's number of
// rows or threads (what the int8 activations' rounding needs of every op before it). Float32, in the operations'
// order of HF's modules (no fused multiply-adds: build.py compiles with -ffp-contract=off).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_linear.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <tuple>

namespace trtspec_step {
namespace {

// rows per task: a decode call's one row, or a verify call's few, stays on the calling thread
constexpr int64_t kRowsGrain = 16;

// torch.ops.trtspec.rms_norm: x [..., N] -> weight * (x * rsqrt(mean(x^2) + eps)), HF's LlamaRMSNorm in float32.
// The mean's sum: 8 partial sums s_j = x[j]^2 + x[8 + j]^2 + ..., added pairwise, then the tail in order.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: x and weight must be float32, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x [..., N] and weight [N] must agree, got ", x.sizes(), " and ", weight.sizes());
  const int64_t n = weight.size(0), rows = n ? x.numel() / n : 0;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * n;
      float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const int64_t body = n / 8 * 8;
      for (int64_t i = 0; i < body; i += 8)
        for (int j = 0; j < 8; ++j) s[j] += xr[i + j] * xr[i + j];
      float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
      for (int64_t i = body; i < n; ++i) sum += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + e);
      float* o = op + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

// torch.ops.trtspec.rope_qkv: a layer's fused projection qkv [B, T, (H + 2 Hkv) D] (q, then k, then v) and the
// rows' RoPE tables cos, sin [B, T, D] -> q [B, H, T, D] (attention_rows' layout) and k, v [B, T, Hkv, D] (the
// cache writes' values), q and k rotated: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_qkv: qkv, cos and sin must be float32");
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes(),
              "rope_qkv: qkv must be [B, T, (H + 2 Hkv) D] and cos, sin [B, T, D]; got ", qkv.sizes(), ", ",
              cos.sizes(), ", ", sin.sizes());
  const int64_t B = qkv.size(0), T = qkv.size(1), D = cos.size(2);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && D % 2 == 0 && cos.size(0) == B && cos.size(1) == T &&
              qkv.size(2) == (heads + 2 * kv_heads) * D,
              "rope_qkv: qkv's last dimension must be (heads + 2 kv_heads) * D with D even; got qkv ", qkv.sizes(),
              ", cos ", cos.sizes(), ", heads ", heads, ", kv_heads ", kv_heads);
  const at::Tensor xc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor q = at::empty({B, heads, T, D}, qkv.options());
  at::Tensor k = at::empty({B, T, kv_heads, D}, qkv.options());
  at::Tensor v = at::empty({B, T, kv_heads, D}, qkv.options());
  const float* xp = xc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t width = (heads + 2 * kv_heads) * D, half = D / 2;
  auto rotate = [&](const float* x, const float* c, const float* s, float* o) {
    for (int64_t d = 0; d < half; ++d) o[d] = x[d] * c[d] + -x[d + half] * s[d];
    for (int64_t d = half; d < D; ++d) o[d] = x[d] * c[d] + x[d - half] * s[d];
  };
  at::parallel_for(0, B * T, kRowsGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      const float* x = xp + r * width;
      const float* c = cp + r * D;
      const float* s = sp + r * D;
      for (int64_t h = 0; h < heads; ++h) rotate(x + h * D, c, s, qp + ((b * heads + h) * T + t) * D);
      for (int64_t h = 0; h < kv_heads; ++h) rotate(x + (heads + h) * D, c, s, kp + (r * kv_heads + h) * D);
      const float* xv = x + (heads + kv_heads) * D;
      std::copy(xv, xv + kv_heads * D, vp + r * kv_heads * D);
    }
  });
  return {q, k, v};
}

// exp(x) in float32 for any x (0 from e^-104 down, inf from e^89 up, subnormals between), by Cody and Waite's
// reduction and a degree-6 polynomial, times 2^n as two powers of two (each a normal float): only additions,
// multiplications and conversions, so every vector width gives the same bits.
inline __attribute__((always_inline)) float exp_any(float x) {
  x = x < -104.0f ? -104.0f : x;
  x = x > 89.0f ? 89.0f : x;
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln 2), to nearest
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const int32_t n1 = static_cast<int32_t>(n) >> 1, n2 = static_cast<int32_t>(n) - n1;  // 2^n = 2^n1 2^n2
  const int32_t bits1 = (n1 + 127) << 23, bits2 = (n2 + 127) << 23;
  float scale1, scale2;
  std::memcpy(&scale1, &bits1, sizeof scale1);
  std::memcpy(&scale2, &bits2, sizeof scale2);
  return (e * scale1) * scale2;
}

inline __attribute__((always_inline)) void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + exp_any(-g[i])) * u[i];
}

// the same loop compiled for each vector width (the same bits on each: no fused multiply-adds, -ffp-contract=off)
__attribute__((target("avx512f"))) void silu_mul_avx512(const float* g, const float* u, float* y, int64_t n) {
  silu_mul_row(g, u, y, n);
}
// AVX2 by hand: GCC left silu_mul_row scalar for AVX2 (a compare and a branch per clamp, a scalar division), about 6%
// of a 5-token call of the int8 SmolLM2 engine on the avx2 path against under 1% for the AVX-512 loop it vectorises.
// The same operations on 8 lanes in exp_any's order: max(c, x) and min(c, x) return x for a NaN x, as its clamps do.
__attribute__((target("avx2"))) void silu_mul_avx2(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), round = _mm256_set1_ps(12582912.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    __m256 x = _mm256_xor_ps(gi, _mm256_set1_ps(-0.0f));  // -g: a sign flip, as the scalar negation
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
    const __m256 nf = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), round), round);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(nf, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(nf, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    const __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), one);
    const __m256i ni = _mm256_cvttps_epi32(nf);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    const __m256 ex = _mm256_mul_ps(_mm256_mul_ps(e, s1), s2);
    const __m256 silu = _mm256_div_ps(gi, _mm256_add_ps(one, ex));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  silu_mul_row(g + i, u + i, y + i, n - i);
}
void silu_mul_sse(const float* g, const float* u, float* y, int64_t n) { silu_mul_row(g, u, y, n); }

using SiluRow = void (*)(const float*, const float*, float*, int64_t);

// The widths this CPU runs, widest first.
std::vector<SiluRow> silu_mul_widths() {
  std::vector<SiluRow> out;
  if (__builtin_cpu_supports("avx512f")) out.push_back(silu_mul_avx512);
  if (__builtin_cpu_supports("avx2")) out.push_back(silu_mul_avx2);
  out.push_back(silu_mul_sse);
  return out;
}

at::Tensor silu_mul_with(const at::Tensor& x, SiluRow row) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_mul: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_mul: x [..., 2N] has an even last dimension, got ",
              x.sizes());
  const int64_t n = x.size(-1) / 2, rows = n ? x.numel() / (2 * n) : 0;
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowsGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(xp + r * 2 * n, xp + r * 2 * n + n, op + r * n, n);
  });
  return out;
}

// torch.ops.trtspec.silu_mul: a gated MLP's fused gate/up output x [..., 2N] -> silu(gate) * up [..., N], silu(g) =
// g / (1 + exp(-g)) (HF's SiLU, within float32 rounding), as one traced op where split, silu and mul were five.
// The width is the kernel path's (trtspec_gguf::path_vector_bits): the widest on its own; all give the same bits.
at::Tensor silu_mul(const at::Tensor& x) {
  const int bits = trtspec_gguf::path_vector_bits();
  if (bits >= 512 && __builtin_cpu_supports("avx512f")) return silu_mul_with(x, silu_mul_avx512);
  if (bits >= 256 && __builtin_cpu_supports("avx2")) return silu_mul_with(x, silu_mul_avx2);
  return silu_mul_with(x, silu_mul_sse);
}

// torch.ops.trtspec.silu_mul_widths: silu_mul on each vector width this CPU runs, widest first (the tests' check
// that they give the same bits).
std::vector<at::Tensor> silu_mul_all_widths(const at::Tensor& x) {
  std::vector<at::Tensor> out;
  for (SiluRow row : silu_mul_widths()) out.push_back(silu_mul_with(x, row));
  return out;
}

// Coupled sampling's noise (runtime/picks.py): h_i, the top 52 bits of SplitMix64's output from z = start + (i + 1)
// golden, and G_i = -log(-log(u_i)) with u_i = (h_i + 0.5) / 2^52 (picks.gumbel_noise_host's bits, std::log's
// logarithms).
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
uint64_t noise_bits(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (z ^ (z >> 31)) >> 12;
}
double gumbel(uint64_t h) { return -std::log(-std::log((static_cast<double>(h) + 0.5) * 0x1p-52)); }

typedef uint64_t u64x4 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));

// The largest x_i, or NaN where x holds a NaN or +inf.
__attribute__((target_clones("avx2", "default"))) float largest(const float* x, int64_t n) {
  f32x8 top = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  i64x4 odd = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x8 v;
    std::memcpy(&v, x + i, sizeof v);
    odd |= (i64x4)((v != v) | (v == INFINITY));
    top = v > top ? v : top;
  }
  float best = -INFINITY;
  bool bad = odd[0] | odd[1] | odd[2] | odd[3];
  for (int j = 0; j < 8; ++j) best = std::max(best, top[j]);
  for (; i < n; ++i) {
    bad |= std::isnan(x[i]) || x[i] == INFINITY;
    best = std::max(best, x[i]);
  }
  return bad ? NAN : best;
}

// torch.ops.trtspec.gumbel_candidates(x, temperature, start): the ids i (ascending) that can hold the first maximum
// of x_i / T + G_i, coupled sampling's Gumbel-max pick (picks.coupled_pick scores them exactly in numpy); empty where
// x holds a NaN or +inf (the full pick handles those). Most ids are ruled out without a logarithm, 64 at a time in
// vectors: -log(u) >= 1 - u = w / 2^53 with w = 2^53 - 2h - 1, so G_i <= (53 - floor(log2 w)) ln 2, from w's
// exponent as a double (exact: w < 2^53). The others are scored with std::log, and one is kept unless its score,
// within a margin far wider than two logarithms' difference (or x_i * (1 / T)'s from x_i / T), is below another's.
// The AVX2 clone ran faster than an AVX-512 one on an AMD EPYC (benchmarks/bench_picks.py times the whole pick).
__attribute__((target_clones("avx2", "default")))
at::Tensor gumbel_candidates(const at::Tensor& x, double temperature, int64_t start) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1 && temperature > 0,
              "gumbel_candidates: x must be float32 [V] and temperature > 0, got ", x.scalar_type(), " ", x.sizes(),
              " and ", temperature);
  const at::Tensor xc = x.contiguous();
  const float* px = xc.data_ptr<float>();
  const int64_t n = xc.numel();
  const float top_x = n ? largest(px, n) : NAN;
  if (std::isnan(top_x)) return at::empty({0}, at::kLong);
  const uint64_t s0 = static_cast<uint64_t>(start);
  const int64_t m = std::find(px, px + n, top_x) - px;
  const double inv_t = 1.0 / temperature, top = static_cast<double>(top_x) / temperature;
  double low = top + gumbel(noise_bits(s0 + (m + 1) * kGolden));  // the best score is at least this
  const double margin = 1e-9 * (128.0 + 2 * std::fabs(top) + std::fabs(low));
  low -= margin;
  std::vector<std::pair<int64_t, double>> kept;  // (id, its score + margin)
  auto score = [&](int64_t i) {
    const double s = static_cast<double>(px[i]) * inv_t + gumbel(noise_bits(s0 + (i + 1) * kGolden));
    low = std::max(low, s - margin);
    kept.emplace_back(i, s + margin);
  };
  const u64x4 magic = {0x4330000000000000ull, 0x4330000000000000ull, 0x4330000000000000ull, 0x4330000000000000ull};
  u64x4 z = {s0 + kGolden, s0 + 2 * kGolden, s0 + 3 * kGolden, s0 + 4 * kGolden};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const double cut = low - margin;
    i64x4 pass[16], any = {};
    for (int b = 0; b < 16; ++b, z += 4 * kGolden) {
      u64x4 h = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
      h = (h ^ (h >> 31)) >> 12;
      const f64x4 w = (0x1p53 - 1) - 2 * ((f64x4)(h | magic) - 0x1p52);  // (h | magic) - 2^52: h as a double
      const f64x4 e = (f64x4)(((u64x4)w >> 52) | magic) - 0x1p52;        // w's biased exponent, 1023 + floor(log2 w)
      f32x4 v;
      std::memcpy(&v, px + i + 4 * b, sizeof v);
      pass[b] = __builtin_convertvector(v, f64x4) * inv_t + (1076 - e) * 0.6931471805599453 >= cut;
      any |= pass[b];
    }
    if (any[0] | any[1] | any[2] | any[3])
      for (int b = 0; b < 16; ++b)
        for (int j = 0; j < 4; ++j)
          if (pass[b][j]) score(i + 4 * b + j);
  }
  for (; i < n; ++i) score(i);
  std::vector<int64_t> ids;
  for (const auto& [id, high] : kept)
    if (high >= low) ids.push_back(id);
  at::Tensor out = at::empty({static_cast<int64_t>(ids.size())}, at::kLong);
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace
}  // namespace trtspec_step

TORCH_LIBRARY_FRAGMENT(trtspec, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("silu_mul_widths(Tensor x) -> Tensor[]", &trtspec_step::silu_mul_all_widths);
  m.def("gumbel_candidates(Tensor x, float temperature, int start) -> Tensor", &trtspec_step::gumbel_candidates);
}

TORCH_LIBRARY_IMPL(trtspec, CPU, m) {
  m.impl("rms_norm", &trtspec_step::rms_norm);
  m.impl("rope_qkv", &trtspec_step::rope_qkv);
  m.impl("silu_mul", &trtspec_step::silu_mul);
}

// C shims for AOTInductor (as ops.cpp's): the schemas' arguments, then a handle for each output.
#include <torch/csrc/inductor/aoti_torch/utils.h>

extern "C" {

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x,
                                                                              AtenTensorHandle weight, double eps,
                                                                              AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(
        trtspec_step::rms_norm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(weight), eps));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_rope_qkv(
    AtenTensorHandle qkv, AtenTensorHandle cos, AtenTensorHandle sin, int64_t heads, int64_t kv_heads,
    AtenTensorHandle* ret0, AtenTensorHandle* ret1, AtenTensorHandle* ret2) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    auto [q, k, v] = trtspec_step::rope_qkv(*tensor_handle_to_tensor_pointer(qkv),
                                            *tensor_handle_to_tensor_pointer(cos),
                                            *tensor_handle_to_tensor_pointer(sin), heads, kv_heads);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(q));
    *ret1 = torch::aot_inductor::new_tensor_handle(std::move(k));
    *ret2 = torch::aot_inductor::new_tensor_handle(std::move(v));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_silu_mul(AtenTensorHandle x,
                                                                              AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(trtspec_step::silu_mul(*tensor_handle_to_tensor_pointer(x)));
  });
}

}  // extern "C"
