// bench_decode [L ...]: the decode table (decode_table.hpp) with its defaults, or for
// the given cache lengths; the read bandwidth for 1 and 2 threads first. The same
// table as `attn bench --decode`, without the CLI.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "decode_table.hpp"

int main(int argc, char** argv) {
  attn::bench::DecodeOptions o;
  if (argc > 1) {
    o.lengths.clear();
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      char* end = nullptr;
      const long len = std::strtol(argv[i], &end, 10);
      const bool valid = end != argv[i] && *end == '\0' && len >= 1 && len <= (1L << 24);
      if (!valid) {
        if (arg != "--help" && arg != "-h") std::fprintf(stderr, "bench_decode: bad cache length '%s'\n", argv[i]);
        std::fprintf(stderr,
                     "usage: bench_decode [L ...]  (cache lengths, 1 to 16777216)\n"
                     "       `attn bench --decode --help` has every option\n");
        return arg == "--help" || arg == "-h" ? 0 : 2;
      }
      o.lengths.push_back(static_cast<int>(len));
    }
  }
  std::vector<double> bw(3, 0.0);
  for (int t : {1, 2}) {
    bw[t] = attn::bench::measure_read_bandwidth(t);
    std::printf("read bandwidth, %d thread(s): %.1f GB/s (huge pages)\n", t, bw[t]);
  }
  const auto rows = attn::bench::run_decode_table(o, std::cout);
  std::printf("\n%s", attn::bench::format_decode_table(rows, bw).c_str());
}
