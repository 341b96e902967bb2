// The decode benchmark of issue 12: attention_with_kvcache with Lq = 1 (one new token
// appended per call, as a decoding step does) against a long KV cache, reported as GB/s
// of cache read and as a fraction of the machine's measured read bandwidth
// (measure_read_bandwidth, a STREAM-like sum). Used by `attn bench --decode` and
// bench_decode.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/tensor.hpp"

namespace attn::bench {

/// GB/s of reading `bytes` of f32 with `threads` threads (a sum of an array far larger
/// than the caches, in independent running sums so that memory, not the adds, bounds
/// it: sum_for_reading), median of repetitions. The array lies on transparent
/// huge pages (an attn::Tensor's storage) or, with huge_pages = false, on 4 KiB pages;
/// on the Intel Xeon with AMX the first reads ~20% faster.
double measure_read_bandwidth(int threads, size_t bytes = size_t{1} << 30, bool huge_pages = true);

struct DecodeConfig {
  int B = 1, Hq = 32, Hkv = 8, d = 128, L = 8192;
  int page = 16;  // 0 = contiguous
  DType cache = DType::bf16;
  int threads = 1;
  int splits = 0;  // 0 = automatic
  /// Pages of a sequence in a random order (what a serving engine's allocator leaves),
  /// or in order, which lays the cache out as a contiguous one: the two differ only in
  /// where the pages lie, so their gap is the memory system's, not the kernel's.
  bool pages_in_order = false;
  /// AttentionOptions::precision of the calls (bf16: i8 caches on integer products).
  Precision precision = Precision::f32;
};

struct DecodeRow {
  DecodeConfig config;
  double bytes = 0;  // cache bytes one call reads (keys, values, i8 scales)
  double ms = 0;     // median per call
  double gbps() const { return bytes / (ms * 1e6); }
};

struct DecodeOptions {
  std::vector<int> batches = {1, 8};
  std::vector<int> lengths = {1024, 8192, 32768, 131072};
  std::vector<int> pages = {16, 256};
  std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::i8};
  std::vector<int> threads = {1, 2};
  double max_cache_gb = 6.0;  // rows whose cache is larger are skipped (and said so)
  bool pages_in_order = false;  // DecodeConfig::pages_in_order of every row
  Precision precision = Precision::f32;  // DecodeConfig::precision of every row
  int splits = 0;                        // DecodeConfig::splits of every row (0 = automatic)
  int min_reps = 5;
  double min_seconds = 0.5;
};

/// Times one configuration (the cache filled with random values first).
DecodeRow time_decode(const DecodeConfig& c, const DecodeOptions& o);

/// Runs the table, printing progress to `log`.
std::vector<DecodeRow> run_decode_table(const DecodeOptions& o, std::ostream& log);

/// Markdown table: GB/s and the fraction of the read bandwidth for the row's threads
/// (bandwidth[t] for t threads).
std::string format_decode_table(const std::vector<DecodeRow>& rows, const std::vector<double>& bandwidth);

}  // namespace attn::bench
