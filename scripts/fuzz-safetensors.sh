#!/usr/bin/env bash
# Builds the safetensors libFuzzer target with clang and runs it for a while
# (default 20 s; first argument overrides). Used by ctest as fuzz.safetensors.
#   bash scripts/fuzz-safetensors.sh [seconds] [build-dir]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-20}"
out="${2:-$root/build/fuzz}"
mkdir -p "$out/corpus"
cxx="$(command -v clang++-14 || command -v clang++)"
srcs=("$root/tests/fuzz/safetensors_fuzz.cc" "$root/src/io/safetensors.cpp" "$root/src/nn/module.cpp"
      "$root/src/tensor/tensor.cpp" "$root/src/tensor/storage.cpp" "$root/src/tensor/convert.cpp" "$root/src/io/files.cpp")
bin="$out/safetensors_fuzz"
newest_src=$(ls -t "${srcs[@]}" "$0" | head -1)
if [ ! -x "$bin" ] || [ "$newest_src" -nt "$bin" ]; then
  "$cxx" -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root/include" -I"$root/src" "${srcs[@]}" -lz -o "$bin"
fi
cp -n "$root"/tests/fuzz/safetensors_corpus/* "$out/corpus/" 2>/dev/null || true
# -rss_limit_mb: a header that made us allocate without bound fails the run.
"$bin" "$out/corpus" -max_total_time="$seconds" -rss_limit_mb=1024 -max_len=4096 -print_final_stats=1 2>&1 | tail -15
