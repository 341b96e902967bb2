// read_overlap: how much of a single core's DRAM read time hides computation done
// between the reads — the limit of issue 12's decode kernels, which read each
// cached byte once and compute with it. An array far larger than the caches is read
// in chunks of 32 KiB (one decode block of bf16 keys, 16 tokens × 8 kv heads ×
// 128 dims); after each chunk a dependent chain of scalar multiply-adds stands in
// for the softmax and products of that block. Per compute amount the table gives
// the time per KiB of the compute alone, of the reads alone and of both, and the
// share of the shorter one that overlapped: 100% means time = max(read, compute),
// 0% means time = read + compute.
//
// usage: read_overlap [MiB]   (array size, default 512)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include "read_sum.hpp"
#include "timing.hpp"

namespace {

using attn::bench::now_s;

constexpr size_t kChunk = 32 * 1024;  // bytes read between two compute steps

/// A dependent chain of n multiply-adds: its latency, not its throughput, is what
/// it costs, like the serial parts of a softmax. With `next` set, the chain also
/// asks for the chunk at next (into L2), one line at a time spread evenly over
/// its links: the software prefetching that a kernel can interleave with its math.
float chain(float x, int n, const char* next) {
  if (next == nullptr) {
    for (int i = 0; i < n; ++i) x = x * 0.999f + 0.001f;
    return x;
  }
  const int lines = static_cast<int>(kChunk / 64);
  int line = 0;
  for (int i = 0; i < n; ++i) {
    x = x * 0.999f + 0.001f;
    // Line k is requested at link ⌊k·n / lines⌋.
    while (line < lines && static_cast<int64_t>(line) * n <= static_cast<int64_t>(i) * lines) {
      __builtin_prefetch(next + 64 * line, 0, 2);
      ++line;
    }
  }
  for (; line < lines; ++line) __builtin_prefetch(next + 64 * line, 0, 2);
  return x;
}

/// Seconds to read all of a (in chunks) with `steps` chain links after each chunk;
/// read = false runs only the chains; prefetch: the chains request the next chunk.
/// Median of 5 repetitions after a warm-up.
double time_pass(const std::vector<float>& a, int steps, bool read, bool prefetch, float* sink) {
  const size_t per_chunk = kChunk / sizeof(float);
  std::vector<double> t;
  for (int rep = 0; rep < 6; ++rep) {
    const double t0 = now_s();
    float sum = 0, x = 0.5f;
    for (size_t c = 0; c < a.size(); c += per_chunk) {
      if (read) {
        const size_t end = std::min(a.size(), c + per_chunk);
        sum += attn::bench::sum_for_reading(a.data() + c, static_cast<int64_t>(end - c));
      }
      const bool more = read && prefetch && c + 2 * per_chunk <= a.size();
      x = chain(x, steps, more ? reinterpret_cast<const char*>(a.data() + c + per_chunk) : nullptr);
    }
    *sink += sum + x;
    if (rep > 0) t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const long mib = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 512;
  if (mib < 64 || mib > 65536) {
    std::fprintf(stderr, "usage: read_overlap [MiB]  (array size, 64 to 65536; default 512)\n");
    return 2;
  }
  std::vector<float> a(static_cast<size_t>(mib) << 18);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 1000) * 1e-3f;  // touch every page
  const double kib = static_cast<double>(a.size()) * sizeof(float) / 1024;
  float sink = 0;
  const double read_s = time_pass(a, 0, true, false, &sink);
  std::printf("array %ld MiB, chunks of %zu KiB; reads alone: %.1f GB/s\n\n", mib, kChunk / 1024,
              kib * 1024 / read_s / 1e9);
  std::printf(
      "| chain links per chunk | compute ns/KiB | read ns/KiB | both ns/KiB | GB/s | of reads alone | overlapped "
      "| both, next chunk prefetched during the chain | GB/s | of reads alone | overlapped |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int steps : {0, 250, 500, 1000, 2000, 4000, 8000}) {
    const double comp = steps == 0 ? 0 : time_pass(a, steps, false, false, &sink) / kib * 1e9;
    const double read = read_s / kib * 1e9;
    const double shorter = std::min(comp, read);
    const auto overlap = [&](double both) {
      return shorter > 0 ? std::clamp((comp + read - both) / shorter, 0.0, 1.0) : 1.0;
    };
    const double both = time_pass(a, steps, true, false, &sink) / kib * 1e9;
    const double both_pf = time_pass(a, steps, true, true, &sink) / kib * 1e9;
    std::printf("| %d | %.1f | %.1f | %.1f | %.1f | %.0f%% | %.0f%% | %.1f | %.1f | %.0f%% | %.0f%% |\n", steps, comp,
                read, both, 1024 / both, 100 * read / both, 100 * overlap(both), both_pf, 1024 / both_pf,
                100 * read / both_pf, 100 * overlap(both_pf));
  }
  if (sink == 12345.678f) std::printf(" ");  // keep the sums alive
}
