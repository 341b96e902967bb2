// read_order: how fast one core reads a KV cache in the order the decode kernel
// walks it, with no arithmetic — the ceiling that order puts on issue 12's decode
// rows, apart from the math. Keys and values are two arrays far larger than the
// caches, laid out as the cache is, [tokens, 8 kv heads, 128 dims]; every byte is
// read once and summed. The decode kernel (src/cpu/attention_decode.cc) on AVX-512
// takes blocks of 64 tokens; within one it reads keys 4 tokens × one head at a
// time, head by head, then values 16 tokens × one head at a time: consecutive reads
// jump by a token's stride (8 heads' rows), so a 4 KiB page is touched in several
// separated runs. The orders timed:
//   sequential        both arrays front to back (what the read bandwidth measures)
//   kernel order      as above, no software requests
//   + row requests    the kernel's rule: each row asked for `ahead` tokens early,
//                     into L2 (prefetcht1), beside the same head's work
//   + block requests  the same rows asked for, but each 4- or 16-token block's
//                     bytes in ascending address order
//   + L1 requests     row requests into L1 (prefetcht0) rather than L2
//   head-major        a [8 kv heads, tokens, 128] layout read in the kernel's order
//                     (8 key and 8 value streams), without and with row requests
//   pages of n        pages of n tokens laid out [heads, n, 128] within (vLLM's
//                     CPU layout), without and with row requests
// Each time is the median of 5 passes after a warm-up.
//
// usage: read_order [element bytes 2|4] [ahead tokens] [MiB per array]
//        (defaults 2 (bf16), 16, 512)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include "timing.hpp"
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using attn::bench::now_s;

constexpr int kHeads = 8;
constexpr int kDims = 128;
constexpr int kBlock = 64;      // tokens per decode block (kBk on AVX-512)
constexpr int kKeyStep = 4;     // tokens per head in the score pass
constexpr int kValueStep = 16;  // tokens per head in the P·V pass

typedef float V4 __attribute__((vector_size(16)));

/// 8 independent running sums, so that the loop waits on memory, not on an
/// add's latency (bench/read_sum.hpp explains why that matters).
struct Sums {
  V4 a[8] = {};
  void add_row(const char* p, int bytes) {
    const V4* v = reinterpret_cast<const V4*>(p);
    for (int i = 0; i < bytes / 16; i += 8)
      for (int k = 0; k < 8; ++k) a[k] += v[i + k];
  }
  float total() const {
    V4 s = {};
    for (const V4& x : a) s += x;
    return s[0] + s[1] + s[2] + s[3];
  }
};

/// Bytes on 2 MiB boundaries, advised onto transparent huge pages as the
/// library's tensors are (src/tensor/storage.cpp), so that the orders are timed
/// with the TLB reach the kernel has.
struct Bytes {
  std::unique_ptr<char, decltype(&std::free)> p{nullptr, &std::free};
  size_t n = 0;
  explicit Bytes(size_t bytes) : n(bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    p.reset(static_cast<char*>(std::aligned_alloc(kHuge, (bytes + kHuge - 1) / kHuge * kHuge)));
    if (p == nullptr) {
      std::fprintf(stderr, "read_order: out of memory for %zu bytes\n", bytes);
      std::exit(1);
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p.get(), (bytes + kHuge - 1) / kHuge * kHuge,
            MADV_HUGEPAGE);  // advice: a refusal changes nothing
#endif
  }
  const char* data() const { return p.get(); }
  char* data() { return p.get(); }
  size_t size() const { return n; }
};

enum class Request { none, row_l2, block_l2, row_l1 };

struct Cache {
  Cache(int row_bytes, int64_t n_tokens)
      : row(row_bytes), tokens(n_tokens), k(static_cast<size_t>(n_tokens) * kHeads * row_bytes), v(k.size()) {}
  int row;  // bytes of one head's row
  int64_t tokens;
  bool head_major = false;
  int page = 0;  // > 0: pages of `page` tokens laid out [pages, heads, page, dims]
  Bytes k, v;
  const char* at(const Bytes& a, int64_t t, int h) const {
    const int64_t i = page > 0     ? ((t / page) * kHeads + h) * page + t % page
                      : head_major ? int64_t{h} * tokens + t
                                   : t * kHeads + h;
    return a.data() + i * row;
  }
};

/// One line's request. On x86 an asm statement: GCC 12 deletes a loop whose
/// only work is `__builtin_prefetch` (the requests of `request_row` vanished at
/// -O1 and above), which would time the orders without their requests.
template <int kLocality>
inline void request_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  if (kLocality == 3)
    asm volatile("prefetcht0 %0" ::"m"(*p));
  else
    asm volatile("prefetcht1 %0" ::"m"(*p));
#else
  __builtin_prefetch(p, 0, kLocality);
#endif
}

void request_row(const char* p, int bytes, Request r) {
  if (r == Request::row_l1) {
    for (int i = 0; i < bytes; i += 64) request_line<3>(p + i);
  } else {
    for (int i = 0; i < bytes; i += 64) request_line<2>(p + i);
  }
}

/// Asks for tokens [t, t + n) of head h: row by row, or (block_l2, token-major
/// layout) the whole n-token span of all heads, an eighth per head, in address
/// order.
void request(const Cache& c, const Bytes& a, int64_t t, int n, int h, Request r) {
  if (r == Request::none || t + n > c.tokens) return;
  if (r == Request::block_l2 && !c.head_major && c.page == 0) {
    const int64_t span = int64_t{n} * kHeads * c.row;
    const char* base = c.at(a, t, 0) + span / kHeads * h;
    for (int64_t i = 0; i < span / kHeads; i += 64) request_line<2>(base + i);
    return;
  }
  for (int k = 0; k < n; ++k) request_row(c.at(a, t + k, h), c.row, r);
}

/// One pass over keys then values of each block, in the decode kernel's order.
void kernel_order(const Cache& c, int ahead, Request r, Sums& s) {
  for (int64_t j0 = 0; j0 + kBlock <= c.tokens; j0 += kBlock) {
    for (int t = 0; t < kBlock; t += kKeyStep)
      for (int h = 0; h < kHeads; ++h) {
        request(c, c.k, j0 + t + ahead, kKeyStep, h, r);
        for (int k = 0; k < kKeyStep; ++k) s.add_row(c.at(c.k, j0 + t + k, h), c.row);
      }
    for (int t = 0; t < kBlock; t += kValueStep)
      for (int h = 0; h < kHeads; ++h) {
        // The kernel asks for half the rows before the pass and half after it.
        request(c, c.v, j0 + t + ahead, kValueStep / 2, h, r);
        for (int k = 0; k < kValueStep; ++k) s.add_row(c.at(c.v, j0 + t + k, h), c.row);
        request(c, c.v, j0 + t + ahead + kValueStep / 2, kValueStep / 2, h, r);
      }
  }
}

void sequential(const Cache& c, Sums& s) {
  for (size_t i = 0; i < c.k.size(); i += c.row) s.add_row(c.k.data() + i, c.row);
  for (size_t i = 0; i < c.v.size(); i += c.row) s.add_row(c.v.data() + i, c.row);
}

template <typename Pass>
double median_gbs(const Cache& c, Pass pass, float* sink) {
  std::vector<double> t;
  for (int rep = 0; rep < 6; ++rep) {
    Sums s;
    const double t0 = now_s();
    pass(s);
    if (rep > 0) t.push_back(now_s() - t0);
    *sink += s.total();
  }
  std::sort(t.begin(), t.end());
  return static_cast<double>(c.k.size() + c.v.size()) / t[t.size() / 2] / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int elem = argc > 1 ? std::atoi(argv[1]) : 2;
  const int ahead = argc > 2 ? std::atoi(argv[2]) : 16;
  const long mib = argc > 3 ? std::strtol(argv[3], nullptr, 10) : 512;
  if ((elem != 2 && elem != 4) || ahead < 0 || ahead > 4096 || mib < 64 || mib > 16384) {
    std::fprintf(stderr,
                 "usage: read_order [element bytes: 2 or 4] [ahead "
                 "tokens: 0 to 4096] [MiB per array: 64 to "
                 "16384]\n");
    return 2;
  }
  const int row_bytes = kDims * elem;
  Cache c(row_bytes, (int64_t{mib} << 20) / (int64_t{kHeads} * row_bytes) / kBlock * kBlock);
  const size_t bytes = c.k.size();
  for (size_t i = 0; i < bytes; i += 4) {  // touch every page; values that sum to finite floats
    const float x = static_cast<float>(i % 1000) * 1e-3f;
    std::memcpy(c.k.data() + i, &x, 4);
    std::memcpy(c.v.data() + i, &x, 4);
  }
  float sink = 0;
  std::printf("keys and values %ld MiB each, rows of %d bytes (%d heads x %d dims x %d bytes), ahead %d tokens\n\n",
              mib, c.row, kHeads, kDims, elem, ahead);
  std::printf("| order | GB/s | of sequential |\n|---|---|---|\n");
  const double seq = median_gbs(c, [&](Sums& s) { sequential(c, s); }, &sink);
  const auto row = [&](const char* name, double gbs) {
    std::printf("| %s | %.1f | %.0f%% |\n", name, gbs, 100 * gbs / seq);
  };
  const auto kernel = [&](Request r) { return median_gbs(c, [&](Sums& s) { kernel_order(c, ahead, r, s); }, &sink); };
  row("sequential", seq);
  row("kernel order", kernel(Request::none));
  row("+ row requests (L2)", kernel(Request::row_l2));
  row("+ block requests in address order (L2)", kernel(Request::block_l2));
  row("+ row requests (L1)", kernel(Request::row_l1));
  c.head_major = true;
  row("head-major", kernel(Request::none));
  row("head-major + row requests (L2)", kernel(Request::row_l2));
  c.head_major = false;
  for (int page : {16, 32}) {
    c.page = page;
    char name[96];
    std::snprintf(name, sizeof name, "pages of %d, head-major within", page);
    row(name, kernel(Request::none));
    std::snprintf(name, sizeof name, "pages of %d, head-major within + row requests (L2)", page);
    row(name, kernel(Request::row_l2));
  }
  if (sink == 12345.678f) std::printf(" ");  // keep the sums alive
}
