// What `trtspec index` spends its time on, natively: a byte-level BPE tokenizer's encoding (GPT-2's pre-tokenizer
// and merges, the form of SmolLM2's, Llama-2-era and GPT-2 tokenizers alike) and the suffix array's sort
// (runtime/drafters/datastore.py). Both give exactly what the pure paths give: the tokenizer equals the HF fast
// tokenizer's ids (tests/test_datastore_native.py compares them on random and real text), the suffix array equals
// datastore.suffix_array's numpy prefix doubling.
//
// The tokenizer knows no Unicode tables: the caller gives each non-ASCII character's class (letter, number,
// whitespace, other), read from the HF tokenizer's own pre-tokenizer (kernels/text.py), before a text holding it
// is encoded.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace trtspec_text {
namespace {

enum Class : uint8_t { kUnknown = 0, kLetter = 1, kNumber = 2, kSpace = 3, kOther = 4 };

// UTF-8 (valid: the caller's str.encode) -> code point at p, its length in bytes.
inline uint32_t decode(const uint8_t* p, int* len) {
  const uint8_t b = p[0];
  if (b < 0x80) { *len = 1; return b; }
  if (b < 0xE0) { *len = 2; return ((b & 0x1Fu) << 6) | (p[1] & 0x3Fu); }
  if (b < 0xF0) { *len = 3; return ((b & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu); }
  *len = 4;
  return ((b & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
}

struct WordCache {  // pre-token bytes -> its ids (offset, count in pool): words repeat, their merges are done once
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>> index;
  std::vector<int32_t> pool;
  void clear() { index.clear(); pool.clear(); }
};

// torch.classes.trtspec.ByteLevelBPE(byte_ids [256] (-1: no token), merges [M, 3]: left id, right id, merged id,
// in rank order)
class ByteLevelBPE : public torch::CustomClassHolder {
 public:
  ByteLevelBPE(const at::Tensor& byte_ids, const at::Tensor& merges) : classes_(0x110000, kUnknown) {
    TORCH_CHECK(byte_ids.numel() == 256, "ByteLevelBPE: byte_ids must hold the 256 bytes' ids");
    const at::Tensor b = byte_ids.to(at::kLong).contiguous();
    for (int i = 0; i < 256; ++i) byte_ids_[i] = static_cast<int32_t>(b.data_ptr<int64_t>()[i]);
    TORCH_CHECK(merges.dim() == 2 && merges.size(1) == 3, "ByteLevelBPE: merges must be [M, 3]");
    const at::Tensor m = merges.to(at::kLong).contiguous();
    const int64_t* mp = m.data_ptr<int64_t>();
    merges_.reserve(static_cast<size_t>(m.size(0)) * 2);
    for (int64_t r = 0; r < m.size(0); ++r) {  // a pair listed twice keeps its last rank, as HF's map keeps it
      const uint64_t pair = (static_cast<uint64_t>(mp[3 * r]) << 32) | static_cast<uint32_t>(mp[3 * r + 1]);
      merges_[pair] = (static_cast<uint64_t>(r) << 32) | static_cast<uint32_t>(mp[3 * r + 2]);
    }
    for (uint32_t c = 0; c < 128; ++c)  // GPT-2's pattern on ASCII: \p{L} letters, \p{N} digits, \s 9-13 and 32
      classes_[c] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ? kLetter
                    : (c >= '0' && c <= '9')                         ? kNumber
                    : (c == ' ' || (c >= 9 && c <= 13))              ? kSpace
                                                                     : kOther;
  }

  // Classes of non-ASCII code points, as the HF pre-tokenizer sees them (1 letter, 2 number, 3 space, 4 other).
  void set_classes(const at::Tensor& code_points, const at::Tensor& classes) {
    const at::Tensor c = code_points.to(at::kLong).contiguous(), k = classes.to(at::kLong).contiguous();
    TORCH_CHECK(c.numel() == k.numel(), "set_classes: one class per code point");
    for (int64_t i = 0; i < c.numel(); ++i) {
      const int64_t cp = c.data_ptr<int64_t>()[i], cls = k.data_ptr<int64_t>()[i];
      TORCH_CHECK(cp >= 128 && cp < 0x110000 && cls >= 1 && cls <= 4, "set_classes: bad entry ", cp, " -> ", cls);
      classes_[cp] = static_cast<uint8_t>(cls);
    }
  }

  // Documents as UTF-8 bytes [B] with their starts [D + 1] -> (ids [T] int32, tokens per document [D] int64).
  std::vector<at::Tensor> encode(const at::Tensor& text, const at::Tensor& starts) {
    TORCH_CHECK(text.scalar_type() == at::kByte && text.dim() == 1, "encode: text must be uint8 [B]");
    const at::Tensor s = starts.to(at::kLong).contiguous();
    const int64_t docs = s.numel() - 1;
    TORCH_CHECK(docs >= 0, "encode: starts must hold D + 1 offsets");
    const int64_t* sp = s.data_ptr<int64_t>();
    TORCH_CHECK(sp[0] == 0 && sp[docs] == text.numel(), "encode: starts must run from 0 to the text's length");
    const at::Tensor t = text.contiguous();
    const uint8_t* tp = t.data_ptr<uint8_t>();
    // contiguous runs of documents, one a thread, balanced by bytes; each thread keeps its own word cache
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), docs)));
    if (static_cast<int>(caches_.size()) < threads) caches_.resize(threads);
    std::vector<int64_t> cut(threads + 1, docs);
    cut[0] = 0;
    for (int i = 1, d = 0; i < threads; ++i) {
      while (d < docs && sp[d] * threads < sp[docs] * i) ++d;
      cut[i] = d;
    }
    std::vector<std::vector<int32_t>> ids(threads);
    at::Tensor counts = at::zeros({docs}, at::kLong);
    int64_t* cp = counts.data_ptr<int64_t>();
    std::vector<std::string> errors(threads);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; ++i) {
      try {
        for (int64_t d = cut[i]; d < cut[i + 1]; ++d) {
          const size_t before = ids[i].size();
          encode_doc(tp + sp[d], sp[d + 1] - sp[d], caches_[i], ids[i]);
          cp[d] = static_cast<int64_t>(ids[i].size() - before);
        }
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
    for (const std::string& e : errors) TORCH_CHECK(e.empty(), e);
    size_t total = 0;
    for (const auto& v : ids) total += v.size();
    at::Tensor out = at::empty({static_cast<int64_t>(total)}, at::kInt);
    int32_t* op = out.data_ptr<int32_t>();
    for (const auto& v : ids) op = std::copy(v.begin(), v.end(), op);
    return {out, counts};
  }

 private:
  // GPT-2's pre-tokenizer, 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+, its
  // alternatives tried in order at each match's start, then each piece's merges.
  void encode_doc(const uint8_t* p, int64_t bytes, WordCache& cache, std::vector<int32_t>& out) {
    std::vector<uint32_t> at;  // each character's byte offset, and one past the end
    std::vector<uint8_t> cls;
    std::vector<uint32_t> ascii;  // the character where it is ASCII, else 0
    at.reserve(bytes + 1);
    cls.reserve(bytes);
    ascii.reserve(bytes);
    for (int64_t i = 0; i < bytes;) {
      int len;
      const uint32_t c = decode(p + i, &len);
      const uint8_t k = classes_[c];
      if (k == kUnknown) throw std::runtime_error("encode: code point " + std::to_string(c) + " has no class");
      at.push_back(static_cast<uint32_t>(i));
      cls.push_back(k);
      ascii.push_back(c < 128 ? c : 0);
      i += len;
    }
    const size_t n = cls.size();
    at.push_back(static_cast<uint32_t>(bytes));
    size_t i = 0;
    while (i < n) {
      size_t j = contraction(ascii, i, n);
      if (!j) {
        const bool lead = ascii[i] == ' ' && i + 1 < n && cls[i + 1] != kSpace;
        const size_t from = lead ? i + 1 : i;
        const uint8_t k = cls[from];
        if (k != kSpace) {  // ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`: a run of one class
          j = from + 1;
          while (j < n && cls[j] == k) ++j;
        } else {  // whitespace: all of the run, but its last character where something other than space follows
          j = i + 1;
          while (j < n && cls[j] == kSpace) ++j;
          if (j < n && j - i >= 2) --j;
        }
      }
      word(p + at[i], at[j] - at[i], cache, out);
      i = j;
    }
  }

  static size_t contraction(const std::vector<uint32_t>& c, size_t i, size_t n) {
    if (c[i] != '\'' || i + 1 >= n) return 0;
    const uint32_t a = c[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if (i + 2 < n) {
      const uint32_t b = c[i + 2];
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
    return 0;
  }

  // One pre-token's ids: its bytes' ids, then the lowest-ranked adjacent pair merged, the leftmost of equals,
  // until no pair has a merge (what HF's word merge does with its queue).
  void word(const uint8_t* p, size_t len, WordCache& cache, std::vector<int32_t>& out) {
    std::string key(reinterpret_cast<const char*>(p), len);
    auto hit = cache.index.find(key);
    if (hit != cache.index.end()) {
      out.insert(out.end(), cache.pool.begin() + hit->second.first,
                 cache.pool.begin() + hit->second.first + hit->second.second);
      return;
    }
    std::vector<int32_t> sym;  // (a byte without a token, -1, is dropped: HF's BPE without an unknown token)
    sym.reserve(len);
    for (size_t i = 0; i < len; ++i)
      if (byte_ids_[p[i]] >= 0) sym.push_back(byte_ids_[p[i]]);
    while (sym.size() > 1) {
      uint64_t best = UINT64_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        auto m = merges_.find((static_cast<uint64_t>(static_cast<uint32_t>(sym[i])) << 32) |
                              static_cast<uint32_t>(sym[i + 1]));
        if (m != merges_.end() && m->second < best) {
          best = m->second;
          at = i;
        }
      }
      if (best == UINT64_MAX) break;
      sym[at] = static_cast<int32_t>(best & 0xFFFFFFFFu);
      sym.erase(sym.begin() + at + 1);
    }
    if (cache.pool.size() > (1u << 26)) cache.clear();  // (a bound on memory for huge corpora)
    cache.index.emplace(std::move(key), std::make_pair(static_cast<uint32_t>(cache.pool.size()),
                                                       static_cast<uint32_t>(sym.size())));
    cache.pool.insert(cache.pool.end(), sym.begin(), sym.end());
    out.insert(out.end(), sym.begin(), sym.end());
  }

  int32_t byte_ids_[256];
  std::unordered_map<uint64_t, uint64_t> merges_;  // (left, right) -> (rank, merged id)
  std::vector<uint8_t> classes_;
  std::vector<WordCache> caches_;
};

// LSD radix sort of idx by key (stable), 16-bit digits, only the digits some key has set.
void radix_sort(std::vector<uint64_t>& key, std::vector<uint32_t>& idx) {
  const size_t n = key.size();
  uint64_t any = 0;
  for (uint64_t k : key) any |= k;
  std::vector<uint64_t> key2(n);
  std::vector<uint32_t> idx2(n);
  std::vector<size_t> count(65537);
  for (int shift = 0; shift < 64 && (any >> shift); shift += 16) {
    std::fill(count.begin(), count.end(), 0);
    for (uint64_t k : key) ++count[((k >> shift) & 0xFFFF) + 1];
    for (size_t d = 1; d <= 65536; ++d) count[d] += count[d - 1];
    for (size_t i = 0; i < n; ++i) {
      const size_t to = count[(key[i] >> shift) & 0xFFFF]++;
      key2[to] = key[i];
      idx2[to] = idx[i];
    }
    key.swap(key2);
    idx.swap(idx2);
  }
}

// torch.ops.trtspec.suffix_array(values [N] int32 >= 1, bits, depth) -> starts [N] int32 (uint32 bits): the
// suffixes sorted by their first tokens, as datastore.suffix_array sorts them (values: each id's rank among the
// ids present, bits wide; 0 past the end): packed keys of 64 / bits tokens, then prefix doubling within the groups
// of equal ranks, to at least depth tokens; ties beyond keep position order.
at::Tensor suffix_array(const at::Tensor& values, int64_t bits, int64_t depth) {
  TORCH_CHECK(values.dim() == 1 && values.scalar_type() == at::kInt, "suffix_array: values must be int32 [N]");
  TORCH_CHECK(bits >= 1 && bits <= 32 && depth >= 1, "suffix_array: bad bits or depth");
  const at::Tensor vc = values.contiguous();
  const uint32_t* v = reinterpret_cast<const uint32_t*>(vc.data_ptr<int32_t>());
  const size_t n = static_cast<size_t>(vc.numel());
  at::Tensor out = at::empty({static_cast<int64_t>(n)}, at::kInt);
  if (n == 0) return out;
  int64_t k = std::max<int64_t>(1, std::min<int64_t>(depth, 64 / bits));
  std::vector<uint64_t> key(n);
  std::vector<uint32_t> order(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t x = 0;
    for (int64_t j = 0; j < k; ++j) x = (x << bits) | (i + j < n ? v[i + j] : 0u);
    key[i] = x;
    order[i] = static_cast<uint32_t>(i);
  }
  radix_sort(key, order);
  // rank: the sorted position of the first suffix of one's group; groups: [start, end) of the groups of more than one
  std::vector<uint32_t> rank(n);
  std::vector<std::pair<uint32_t, uint32_t>> groups;
  for (size_t j = 0, g = 0; j < n; ++j) {
    if (j && key[j] != key[j - 1]) {
      if (j - g > 1) groups.emplace_back(g, j);
      g = j;
    }
    rank[order[j]] = static_cast<uint32_t>(g);
    if (j == n - 1 && n - g > 1) groups.emplace_back(g, n);
  }
  std::vector<uint64_t>().swap(key);
  std::vector<uint64_t> sub(n);  // within a group: (rank k tokens on + 1, or 0 past the end) << 32 | position
  std::vector<uint32_t> fresh(n);  // each sorted position's new rank
  while (k < depth && !groups.empty()) {
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 64, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const auto [a, b] = groups[g];
        for (uint32_t j = a; j < b; ++j) {
          const uint64_t i = order[j];
          const uint64_t next = i + k < n ? static_cast<uint64_t>(rank[i + k]) + 1 : 0;
          sub[j] = (next << 32) | i;
        }
        std::sort(sub.begin() + a, sub.begin() + b);
        uint32_t start = a;
        for (uint32_t j = a; j < b; ++j) {
          order[j] = static_cast<uint32_t>(sub[j] & 0xFFFFFFFFu);
          if (j > a && (sub[j] >> 32) != (sub[j - 1] >> 32)) start = j;
          fresh[j] = start;
        }
      }
    });
    std::vector<std::pair<uint32_t, uint32_t>> next;
    for (const auto& [a, b] : groups) {
      uint32_t start = a;
      for (uint32_t j = a; j < b; ++j) {
        rank[order[j]] = fresh[j];
        if (j > a && fresh[j] != fresh[j - 1]) {
          if (j - start > 1) next.emplace_back(start, j);
          start = j;
        }
      }
      if (b - start > 1) next.emplace_back(start, b);
    }
    groups.swap(next);
    k *= 2;
  }
  std::memcpy(out.data_ptr<int32_t>(), order.data(), n * sizeof(uint32_t));
  return out;
}

}  // namespace
}  // namespace trtspec_text

TORCH_LIBRARY_FRAGMENT(trtspec, m) {
  m.class_<trtspec_text::ByteLevelBPE>("ByteLevelBPE")
      .def(torch::init<at::Tensor, at::Tensor>())
      .def("set_classes", &trtspec_text::ByteLevelBPE::set_classes)
      .def("encode", &trtspec_text::ByteLevelBPE::encode);
  m.def("suffix_array(Tensor values, int bits, int depth) -> Tensor", &trtspec_text::suffix_array);
}
