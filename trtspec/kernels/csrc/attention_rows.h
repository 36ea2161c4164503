// Attention in an order fixed per query row: a row's result is the same bits whatever the call's number of rows and
// threads, and on every instruction set. The arithmetic is written on GCC's vectors of
// 16 floats (vec16.h), lane by lane, every multiply-add fused (fma16: vfmadd, or fmaf where the CPU has none);
// each ISA file includes this after its own #pragma GCC target, and the compiler makes one zmm, two ymm or scalar
// code of it with the same IEEE steps per lane (on AVX2 the 16-key blocks' scores, mask and maximum, the exps and the
// value sums are written on ymm halves instead, the same steps: GCC's own code for them went through memory lane by
// lane, or in xmm pieces). The int8-activation builds need that: their verify call's logits must equal the decode
// call's. It replaces a graph of products and sums whose compiled loops divided once per key and head-dim chunk, and
// recomputed the rotary embedding per key.
//
// Per row (b, h, t), kh = h / (H / Hkv) its key head, over the keys s with mask[b, t, s]:
//   score_s = dot(q, k_s) * scale      dot: 16 lanes, lane l fma-ing d = l, l + 16, ... in order, then the lanes
//                                      pairwise (l + 8, then l + 4, l + 2, l + 1)
//   [score_s = tanh(score_s / softcap) * softcap]
//   e_s = exp(score_s - max_s score_s) exp_nonpositive below, 16 keys at a time
//   out = (sum_s e_s * v_s) * (1 / sum_s e_s)   the first in four fma sums of every fourth key, added as (0 + 1) +
//                                               (2 + 3); the second 16 lanes at a time, then lanes_sum (D a
//                                               multiple of 16; any other D: both in key order)
// A row that sees no key gets NaN, as softmax over nothing does.
//
// A row's mask may show only a span of the keys it is given (a sliding window, a batch row shorter than the call's
// longest, a cache passed whole), so a row first finds that span (visible_span) and the loops run over its 16-key
// blocks only. Outside it every weight is 0: skipping those keys leaves every sum with the same bits (x + 0 = x),
// and the blocks start at a multiple of 16, so a key keeps its lane and its sum s % 4.
//
// Rows that share a key head (a group's H / Hkv heads, at every t) go in tiles of up to kAttentionTileRows: a run of
// keys (kTileKeys), then the same run of values, is read from memory once for the tile's rows, and from L1 for the
// others (one row at a time read its head's whole cache once per row). Tiles only interleave rows; each row's steps
// are its own, in its own order. A 17-token call over 1500 keys (SmolLM2's heads, 2 threads) took about a fifth less
// time on AVX2 and on AVX-512.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gguf_linear.h"
#include "vec16.h"

namespace trtspec_gguf {
namespace {

// The sum of a vector's lanes: lane l adds lane l + 8, then l + 4, l + 2, l + 1; lane 0 holds the total.
inline float lanes_sum(f16x v) {
  v = v + lanes_xor<8>(v);
  v = v + lanes_xor<4>(v);
  v = v + lanes_xor<2>(v);
  v = v + lanes_xor<1>(v);
  return v[0];
}

// lanes_sum of 16 keys' lane vectors at once, lane j of the result key j's: the same additions of the same pairs
// (lane l with l + 8, then l + 4, l + 2, l + 1), done on two keys' halves per vector, so 16 keys take 30 shuffles
// instead of 64. `dot(j)` gives key j's lanes; keys are taken in an order that keeps few vectors alive.
template <typename Dot>
inline f16x lanes_sums16(const Dot& dot) {
  // two vectors' lanes: a's from ia, b's from ib (indices 16 .. 31 name b's lanes)
  auto pair_sum = [](f16x a, f16x b, i16x ia, i16x ib) {
    return __builtin_shuffle(a, b, ia) + __builtin_shuffle(a, b, ib);
  };
  // step 1, keys j and j + 8: lanes 0-7 key j's l + (l + 8), lanes 8-15 key j + 8's
  const i16x s1a{0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31};
  const i16x s1b{8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23};
  // step 2, halves of (j, j + 8) and (j + 4, j + 12): quarters of keys j, j + 4, j + 8, j + 12: l + (l + 4)
  const i16x s2a{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const i16x s2b{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  // step 3, quarters of j.. and j + 2..: lane pairs of keys j, j + 2, j + 4, ... j + 14: l + (l + 2)
  const i16x s3a{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const i16x s3b{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  // step 4, the even keys' pairs and the odd keys': l + (l + 1), lane j key j
  const i16x s4a{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const i16x s4b{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  f16x quarters[4];
  for (int j = 0; j < 4; ++j) {
    const f16x low = pair_sum(dot(j), dot(j + 8), s1a, s1b);
    const f16x high = pair_sum(dot(j + 4), dot(j + 12), s1a, s1b);
    quarters[j] = pair_sum(low, high, s2a, s2b);
  }
  const f16x even = pair_sum(quarters[0], quarters[2], s3a, s3b);
  const f16x odd = pair_sum(quarters[1], quarters[3], s3a, s3b);
  return pair_sum(even, odd, s4a, s4b);
}

#if defined(TRTSPEC_VEC_YMM)
// lanes_sums16 on ymm halves: the same additions of the same lanes, in AVX's shuffles (GCC makes the generic
// two-vector shuffles lane by lane through memory). `dot(j, h)` gives key j's lanes as halves h; out: keys 0-7, 8-15.
template <typename Dot>
inline void lanes_sums16_ymm(const Dot& dot, __m256 (&out)[2]) {
  __m256 quarters[4][2];
  for (int j = 0; j < 4; ++j) {
    __m256 a[2], b[2], c[2], d[2];
    dot(j, a);
    dot(j + 8, b);
    dot(j + 4, c);
    dot(j + 12, d);
    // step 1: lanes 0-7 key j's l + (l + 8), lanes 8-15 key j + 8's (low); keys j + 4 and j + 12 (high)
    const __m256 low[2] = {_mm256_add_ps(a[0], a[1]), _mm256_add_ps(b[1], b[0])};
    const __m256 high[2] = {_mm256_add_ps(c[0], c[1]), _mm256_add_ps(d[1], d[0])};
    // step 2: l + (l + 4), low's and high's quarters side by side
    for (int i = 0; i < 2; ++i)
      quarters[j][i] = _mm256_add_ps(_mm256_permute2f128_ps(low[i], high[i], 0x20),
                                     _mm256_permute2f128_ps(low[i], high[i], 0x31));
  }
  for (int i = 0; i < 2; ++i) {
    // step 3: l + (l + 2), pairs of lanes of keys j and j + 2 in each 4-lane group
    const __m256 even = _mm256_add_ps(_mm256_shuffle_ps(quarters[0][i], quarters[2][i], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm256_shuffle_ps(quarters[0][i], quarters[2][i], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 odd = _mm256_add_ps(_mm256_shuffle_ps(quarters[1][i], quarters[3][i], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(quarters[1][i], quarters[3][i], _MM_SHUFFLE(3, 2, 3, 2)));
    // step 4: l + (l + 1) as [e0 + e1, e2 + e3, o0 + o1, o2 + o3], then put in key order [e, o, e, o]
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(even, odd, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(even, odd, _MM_SHUFFLE(3, 1, 3, 1)));
    out[i] = _mm256_permute_ps(sums, _MM_SHUFFLE(3, 1, 2, 0));
  }
}
#endif

// exp's Taylor polynomial of degree 7, Horner's order: p = c_0, then p = p * r + c_i for i = 1 .. 7
constexpr float kExpTaylor[8] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f,
                                 1.0f};

// exp(x) for x <= 0 (scores minus their maximum), 16 at a time: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p exp's
// Taylor polynomial of degree 7 (error under 1e-8 there); below -87 (2^-126; a masked key's -inf) it is 0.
inline f16x exp_nonpositive(f16x x) {
  const i16x tiny = x < -87.0f;
  x = tiny ? splat(-87.0f) : x;
  const f16x n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rint(x / ln2)
  const f16x r = (x - n * 0.693359375f) - n * -2.12194440e-4f;              // ln2 in two parts
  f16x p = splat(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = fma16(p, r, splat(kExpTaylor[i]));
  const i16x bits = (__builtin_convertvector(n, i16x) + 127) << 23;
  f16x scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? splat(0.0f) : p * scale;
}

#if defined(TRTSPEC_VEC_YMM)
// exp_nonpositive on a ymm half: the same steps per lane (GCC lowers the generic version's selects and conversion to
// xmm pieces through memory). `x < -87` is an ordered compare, false for NaN, as the generic one.
inline __m256 exp_nonpositive_ymm(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_blendv_ps(x, lowest, tiny);
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), _mm256_setzero_ps(), tiny);
}
#endif

// The keys [lo, hi) from a row's first visible key to its last (lo = hi: none), its mask's bytes read 64 at a time
// from each end (a decode early in a long cache sees a short prefix of it).
inline void visible_span(const bool* m, int64_t S, int64_t ms, int64_t& lo, int64_t& hi) {
  auto any64 = [&](int64_t s) {
    uint64_t words[8];
    std::memcpy(words, m + s, sizeof(words));
    return (words[0] | words[1] | words[2] | words[3] | words[4] | words[5] | words[6] | words[7]) != 0;
  };
  lo = 0;
  hi = S;
  if (ms == 1) {
    while (lo + 64 <= hi && !any64(lo)) lo += 64;
    while (hi - 64 >= lo && !any64(hi - 64)) hi -= 64;
  }
  while (lo < hi && !m[lo * ms]) ++lo;
  while (hi > lo && !m[(hi - 1) * ms]) --hi;
}

// One query row of a tile: where its q, keys, values, mask row and output are, its span's 16-key blocks, and its
// scores (e, indexed by key, -inf outside the span's blocks) and value sums (4 * D floats) in the tile's scratch.
struct QueryRow {
  const float* q;
  const float* keys;    // the row's key head: key s at keys + s * D
  const float* values;  // value s at values + s * D
  const bool* m;        // visible key s: m[s * ms]
  float* o;
  float* __restrict e;
  float* __restrict sums;
  int64_t first, last, end, blocks_end;  // blocks_end: the end of the whole 16-key blocks from first
  float inv;                             // 1 / the sum of the exps (C > 0)
};

// Row `row`'s QueryRow, or false when it sees no key (its output then NaN, as softmax over nothing).
inline bool query_row(const AttentionArgs& a, int64_t row, float* e, float* sums, QueryRow& r) {
  const int64_t t = row % a.T, h = (row / a.T) % a.H, b = row / (a.T * a.H), kh = h / (a.H / a.Hkv);
  r.q = a.q + row * a.D;
  r.keys = a.k + b * a.kb + kh * a.kt;
  r.values = a.v + b * a.vb + kh * a.vt;
  r.m = a.mask + b * a.mb + t * a.mt;
  r.o = a.out + (a.tokens_major ? (b * a.T + t) * a.H + h : row) * a.D;
  r.e = e;
  r.sums = sums;
  int64_t lo, hi;
  visible_span(r.m, a.S, a.ms, lo, hi);
  if (lo == hi) {
    for (int64_t d = 0; d < a.D; ++d) r.o[d] = std::numeric_limits<float>::quiet_NaN();
    return false;
  }
  // the span's 16-key blocks: [first, last), last past S where S is not a multiple of 16; keys [first, end) are
  // scored, -inf where masked
  r.first = lo / kLanes * kLanes;
  r.last = (hi + kLanes - 1) / kLanes * kLanes;
  r.end = r.last < a.S ? r.last : a.S;
  r.blocks_end = r.first + (r.end - r.first) / kLanes * kLanes;
  return true;
}

#if defined(TRTSPEC_VEC_YMM)
// The largest visible score lane by lane (a maximum: exact in any order), on ymm halves.
struct Tops {
  __m256 h[2];
};
inline Tops no_tops() {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  return {{minus_inf, minus_inf}};
}
inline float top_of(const Tops& t) { return lanes_max(from_halves<f16x>(t.h)); }

// Row r's scores of keys [s, s + 16) into e (-inf where masked), on ymm halves throughout: the same steps as the
// generic score_block below.
template <int C>
inline void score_block(const AttentionArgs& a, const QueryRow& r, int64_t s, Tops& tops) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 visible[2];  // all ones where the key is visible
  bool any;
  if (a.ms == 1) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.m + s));
    any = !_mm_testz_si128(bytes, bytes);
    visible[0] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256()));
    visible[1] = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), _mm256_setzero_si256()));
  } else {
    i16x flags;
    for (int j = 0; j < kLanes; ++j) flags[j] = r.m[(s + j) * a.ms] ? -1 : 0;
    any = lanes_any(flags);
    to_halves(flags, visible);
  }
  if (!any) {  // no visible key in the block: its scores are -inf, its keys never read
    _mm256_storeu_ps(r.e + s, minus_inf);
    _mm256_storeu_ps(r.e + s + 8, minus_inf);
    return;
  }
  const float* keys = r.keys + s * a.D;
  __m256 scores[2];
  lanes_sums16_ymm([&](int j, __m256 (&h)[2]) {
    h[0] = h[1] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < 2; ++i)
        h[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r.q + c * kLanes + 8 * i),
                               _mm256_loadu_ps(keys + j * a.D + c * kLanes + 8 * i), h[i]);
  }, scores);
  for (int i = 0; i < 2; ++i) scores[i] = _mm256_mul_ps(scores[i], _mm256_set1_ps(a.scale));
  if (a.softcap != 0.0f) {
    f16x capped = from_halves<f16x>(scores);
    for (int j = 0; j < kLanes; ++j) capped[j] = std::tanh(capped[j] / a.softcap) * a.softcap;
    to_halves(capped, scores);
  }
  for (int i = 0; i < 2; ++i) {
    scores[i] = _mm256_blendv_ps(minus_inf, scores[i], visible[i]);
    _mm256_storeu_ps(r.e + s + 8 * i, scores[i]);
    tops.h[i] = _mm256_max_ps(tops.h[i], scores[i]);  // tops > scores ? tops : scores, as max16
  }
}
#else
struct Tops {
  f16x v;
};
inline Tops no_tops() { return {splat(-std::numeric_limits<float>::infinity())}; }
inline float top_of(const Tops& t) { return lanes_max(t.v); }

// Row r's scores of keys [s, s + 16) into e (-inf where masked): 16 keys at a time, the same sums as one at a time
// (finish_scores), fewer shuffles.
template <int C>
inline void score_block(const AttentionArgs& a, const QueryRow& r, int64_t s, Tops& tops) {
  const float inf = std::numeric_limits<float>::infinity();
  i16x visible;
  if (a.ms == 1) {
    i8x16 bytes;
    std::memcpy(&bytes, r.m + s, kLanes);
    visible = __builtin_convertvector(bytes, i16x) != 0;
  } else {
    for (int j = 0; j < kLanes; ++j) visible[j] = r.m[(s + j) * a.ms] ? -1 : 0;
  }
  if (!lanes_any(visible)) {
    store16(r.e + s, splat(-inf));
    return;
  }
  const float* keys = r.keys + s * a.D;
  f16x qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load16(r.q + c * kLanes);
  f16x scores = lanes_sums16([&](int j) {
    f16x lanes{};
    for (int c = 0; c < C; ++c) lanes = fma16(qv[c], load16(keys + j * a.D + c * kLanes), lanes);
    return lanes;
  }) * a.scale;
  if (a.softcap != 0.0f)
    for (int j = 0; j < kLanes; ++j) scores[j] = std::tanh(scores[j] / a.softcap) * a.softcap;
  scores = visible ? scores : splat(-inf);
  store16(r.e + s, scores);
  tops.v = max16(tops.v, scores);
}
#endif

// Row r's scores after its 16-key blocks, one key at a time; then every score minus the top one (top: the blocks'
// largest so far), its exps, and for C > 0 the inverse of their sum, 16 lanes at a time (the padding's exps are 0).
template <int C>
inline void finish_scores(const AttentionArgs& a, QueryRow& r, float top) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t chunks = C ? C : a.D / kLanes;
  for (int64_t s = r.blocks_end; s < r.end; ++s) {
    if (!r.m[s * a.ms]) {
      r.e[s] = -inf;
      continue;
    }
    const float* key = r.keys + s * a.D;
    f16x lanes{};
    for (int64_t c = 0; c < chunks; ++c) lanes = fma16(load16(r.q + c * kLanes), load16(key + c * kLanes), lanes);
    if constexpr (C == 0)
      for (int64_t d = chunks * kLanes; d < a.D; ++d)
        lanes[d % kLanes] = __builtin_fmaf(r.q[d], key[d], lanes[d % kLanes]);
    float score = lanes_sum(lanes) * a.scale;
    if (a.softcap != 0.0f) score = std::tanh(score / a.softcap) * a.softcap;
    r.e[s] = score;
    top = score > top ? score : top;
  }
  for (int64_t s = r.end; s < r.last; ++s) r.e[s] = -inf;
#if defined(TRTSPEC_VEC_YMM)
  for (int64_t s = r.first; s < r.last; s += 8)
    _mm256_storeu_ps(r.e + s, exp_nonpositive_ymm(_mm256_sub_ps(_mm256_loadu_ps(r.e + s), _mm256_set1_ps(top))));
#else
  for (int64_t s = r.first; s < r.last; s += kLanes) store16(r.e + s, exp_nonpositive(load16(r.e + s) - top));
#endif
  if constexpr (C > 0) {
    f16x weights{};
    for (int64_t s = r.first; s < r.last; s += kLanes) weights = weights + load16(r.e + s);
    r.inv = 1.0f / lanes_sum(weights);
  }
}

// Keys [b0, b1) (b0 a multiple of 4) into row r's value sums: four sums, key s into sum s % 4 in key order (one chain
// of additions over every key kept a row waiting on its latency); sums [C][4][16] as floats.
#if defined(TRTSPEC_VEC_YMM)
template <int C>
inline void value_block(const AttentionArgs& a, const QueryRow& r, int64_t b0, int64_t b1) {
  const int64_t D = a.D;
  const float* const e = r.e;
  for (int c = 0; c < C; ++c) {  // 16 lanes of the head at a time, 8 ymm sums live
    float* const kept = r.sums + c * 4 * kLanes;
    __m256 sum[4][2];
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 2; ++i) sum[j][i] = _mm256_loadu_ps(kept + (2 * j + i) * 8);
    auto add = [&](__m256 (&acc)[2], const float* value, float w) {
      const __m256 wv = _mm256_set1_ps(w);
      acc[0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(value), acc[0]);
      acc[1] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(value + 8), acc[1]);
    };
    const float* value = r.values + b0 * D + c * kLanes;
    int64_t s = b0;
    for (; s + 4 <= b1; s += 4, value += 4 * D) {
      // a masked key's weight is 0 and its value never read: four keys tested at once, one branch
      if (_mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(e + s), _mm_setzero_ps())) == 0) {
        for (int j = 0; j < 4; ++j) add(sum[j], value + j * D, e[s + j]);
      } else {
        for (int j = 0; j < 4; ++j)
          if (e[s + j] != 0.0f) add(sum[j], value + j * D, e[s + j]);
      }
    }
    for (int j = 0; s < b1; ++s, ++j, value += D)  // the row's last keys
      if (e[s] != 0.0f) add(sum[j], value, e[s]);
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 2; ++i) _mm256_storeu_ps(kept + (2 * j + i) * 8, sum[j][i]);
  }
}

// out = ((sum 0 + sum 1) + (sum 2 + sum 3)) * inv
template <int C>
inline void write_out(const QueryRow& r) {
  for (int c = 0; c < C; ++c) {
    const float* kept = r.sums + c * 4 * kLanes;
    for (int i = 0; i < 2; ++i) {
      auto sum = [&](int j) { return _mm256_loadu_ps(kept + (2 * j + i) * 8); };
      _mm256_storeu_ps(r.o + c * kLanes + 8 * i, _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(sum(0), sum(1)),
                                                                             _mm256_add_ps(sum(2), sum(3))),
                                                               _mm256_set1_ps(r.inv)));
    }
  }
}
#else
template <int C>
inline void value_block(const AttentionArgs& a, const QueryRow& r, int64_t b0, int64_t b1) {
  f16x sum[4][C];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 4; ++j) sum[j][c] = load16(r.sums + (c * 4 + j) * kLanes);
  const float* const e = r.e;  // locals: GCC reloaded r's fields and a.D for every key
  const float* const values = r.values;
  const int64_t D = a.D;
  auto add = [&](int j, int64_t s) {
    const float w = e[s];
    if (w == 0.0f) return;  // a masked key's value is never read
    const float* value = values + s * D;
    for (int c = 0; c < C; ++c) sum[j][c] = fma16(splat(w), load16(value + c * kLanes), sum[j][c]);
  };
  int64_t s = b0;
  for (; s + 4 <= b1; s += 4)
    for (int j = 0; j < 4; ++j) add(j, s + j);
  for (int j = 0; s < b1; ++s, ++j) add(j, s);
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < 4; ++j) store16(r.sums + (c * 4 + j) * kLanes, sum[j][c]);
}

template <int C>
inline void write_out(const QueryRow& r) {
  for (int c = 0; c < C; ++c) {
    auto sum = [&](int j) { return load16(r.sums + (c * 4 + j) * kLanes); };
    store16(r.o + c * kLanes, ((sum(0) + sum(1)) + (sum(2) + sum(3))) * r.inv);
  }
}
#endif

// Keys a tile's rows take one after the other: 16 KiB of keys, then of values (D = 64: 64 keys), kept in L1 for the
// tile's other rows.
template <int C> constexpr int64_t kTileKeys = 256 / C >= 32 ? 256 / C / 16 * 16 : 16;

// Row r's 16-key blocks [s0, s1), its running maxima in registers throughout.
template <int C>
inline void score_blocks(const AttentionArgs& a, const QueryRow& r, int64_t s0, int64_t s1, Tops& tops) {
  Tops t = tops;
  for (int64_t s = s0; s < s1; s += kLanes) score_block<C>(a, r, s, t);
  tops = t;
}

// Rows [r0, r1) that share a key head (at most kAttentionTileRows), with C = D / 16: the tile reads each block of
// keys and values once from memory (then from L1 for the tile's other rows) where one row at a time read a head's
// whole cache once per row. Each row's own steps and their order are those of a row alone.
template <int C>
void attention_tile(const AttentionArgs& a, int64_t r0, int64_t r1, float* __restrict scratch) {
  const int64_t padded = (a.S + kLanes - 1) / kLanes * kLanes;
  QueryRow rows[kAttentionTileRows];
  Tops tops[kAttentionTileRows];
  int n = 0;
  int64_t first = a.S, blocks_end = 0, end = 0;
  for (int64_t row = r0; row < r1; ++row) {
    if (!query_row(a, row, scratch + n * padded, scratch + kAttentionTileRows * padded + n * 4 * a.D, rows[n]))
      continue;
    tops[n] = no_tops();
    first = std::min(first, rows[n].first);
    blocks_end = std::max(blocks_end, rows[n].blocks_end);
    end = std::max(end, rows[n].end);
    ++n;
  }
  // a few rows (a decode's group of heads) take longer runs: each run costs a row its setup (AVX-512, one row:
  // about 10% slower in 64-key runs, the same as one row at a time in 256-key runs)
  const int64_t keys = n > 4 ? kTileKeys<C> : 4 * kTileKeys<C>;
  for (int64_t k0 = first; k0 < blocks_end; k0 += keys)
    for (int i = 0; i < n; ++i) {
      const int64_t s0 = std::max(k0, rows[i].first), s1 = std::min(k0 + keys, rows[i].blocks_end);
      if (s0 < s1) score_blocks<C>(a, rows[i], s0, s1, tops[i]);
    }
  for (int i = 0; i < n; ++i) {
    finish_scores<C>(a, rows[i], top_of(tops[i]));
    std::fill(rows[i].sums, rows[i].sums + 4 * a.D, 0.0f);
  }
  for (int64_t b0 = first; b0 < end; b0 += keys)
    for (int i = 0; i < n; ++i) {
      const int64_t lo = std::max(b0, rows[i].first), hi = std::min(b0 + keys, rows[i].end);
      if (lo < hi) value_block<C>(a, rows[i], lo, hi);
    }
  for (int i = 0; i < n; ++i) write_out<C>(rows[i]);
}

// Any other D (no case in attention_rows_impl): one row at a time, keys one at a time, the value sum in scratch.
inline void attention_row_any(const AttentionArgs& a, int64_t row, float* __restrict scratch) {
  const int64_t padded = (a.S + kLanes - 1) / kLanes * kLanes;
  QueryRow r;
  if (!query_row(a, row, scratch, nullptr, r)) return;
  r.blocks_end = r.first;
  finish_scores<0>(a, r, -std::numeric_limits<float>::infinity());
  float* __restrict acc = scratch + padded;  // [D]
  const int64_t chunks = a.D / kLanes;
  float total = 0.0f;
  for (int64_t d = 0; d < a.D; ++d) acc[d] = 0.0f;
  for (int64_t s = r.first; s < r.end; ++s) {
    const float w = r.e[s];
    if (w == 0.0f) continue;
    total = total + w;
    const float* value = r.values + s * a.D;
    for (int64_t c = 0; c < chunks; ++c)
      store16(acc + c * kLanes, fma16(splat(w), load16(value + c * kLanes), load16(acc + c * kLanes)));
    for (int64_t d = chunks * kLanes; d < a.D; ++d) acc[d] = __builtin_fmaf(w, value[d], acc[d]);
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < a.D; ++d) r.o[d] = acc[d] * inv;
}

// Rows [r0, r1) of the B * H * T, in tiles of rows that share a key head: a run of the group's H / Hkv heads at every
// t (rows (b, h, t) are in that order). scratch: attention_scratch_floats(S, D).
template <int C>
void attention_tiles(const AttentionArgs& a, int64_t r0, int64_t r1, float* scratch) {
  const int64_t run = a.H / a.Hkv * a.T;
  for (int64_t t0 = r0, t1; t0 < r1; t0 = t1) {
    t1 = std::min({r1, (t0 / run + 1) * run, t0 + kAttentionTileRows});
    attention_tile<C>(a, t0, t1, scratch);
  }
}

inline void attention_rows_impl(const AttentionArgs& a, int64_t r0, int64_t r1, float* scratch) {
  switch (a.D) {  // the head sizes of common models, with their accumulators in registers
    case 64: attention_tiles<4>(a, r0, r1, scratch); break;
    case 80: attention_tiles<5>(a, r0, r1, scratch); break;
    case 96: attention_tiles<6>(a, r0, r1, scratch); break;
    case 128: attention_tiles<8>(a, r0, r1, scratch); break;
    case 256: attention_tiles<16>(a, r0, r1, scratch); break;
    default:
      for (int64_t row = r0; row < r1; ++row) attention_row_any(a, row, scratch);
      break;
  }
}

}  // namespace
}  // namespace trtspec_gguf
