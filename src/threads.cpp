// Thread count for the kernels: set_num_threads(), else ATTN_NUM_THREADS, else all
// cores (as OpenMP reports them).
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "attn/attention.hpp"

namespace attn {
namespace {

int default_threads() {
  if (const char* env = std::getenv("ATTN_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= kMaxThreads) return static_cast<int>(n);
  }
  return omp_get_num_procs();
}

std::atomic<int> g_threads{0};  // 0 = not decided yet

}  // namespace

void set_num_threads(int n) {
  if (n < 1 || n > kMaxThreads) {
    throw Error("set_num_threads: n must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                std::to_string(n));
  }
  g_threads.store(n);
}

int num_threads() {
  int n = g_threads.load();
  if (n == 0) {
    n = default_threads();
    g_threads.store(n);
  }
  return n;
}

}  // namespace attn
