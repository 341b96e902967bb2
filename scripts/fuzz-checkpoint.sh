#!/usr/bin/env bash
# Builds the checkpoint-reader libFuzzer target with clang and runs it for a while
# (default 20 s; first argument overrides). Used by ctest as fuzz.checkpoint.
#   bash scripts/fuzz-checkpoint.sh [seconds] [build-dir]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-20}"
out="${2:-$root/build/fuzz}"
mkdir -p "$out/checkpoint_corpus"
cxx="$(command -v clang++-14 || command -v clang++)"
srcs=("$root/tests/fuzz/checkpoint_fuzz.cc" "$root/src/train/checkpoint_files.cpp" "$root/src/train/model_config.cpp"
      "$root/src/train/tokenizer.cpp" "$root/src/train/tasks.cpp" "$root/src/io/files.cpp"
      "$root/src/io/safetensors.cpp" "$root/src/nn/module.cpp" "$root/src/tensor/tensor.cpp" "$root/src/tensor/storage.cpp"
      "$root/src/tensor/convert.cpp")
bin="$out/checkpoint_fuzz"
newest_src=$(ls -t "${srcs[@]}" "$0" | head -1)
if [ ! -x "$bin" ] || [ "$newest_src" -nt "$bin" ]; then
  "$cxx" -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root/include" -I"$root/src" "${srcs[@]}" -lz -o "$bin"
fi
[ -f "$out/checkpoint_corpus/seed" ] || python3 "$root/tests/fuzz/make_checkpoint_seed.py" "$out/checkpoint_corpus/seed"
# Flag variants of the seed: manifest rewritten (1), optimizer missing (2), not needed (4).
for flags in 1 3 5; do
  f="$out/checkpoint_corpus/seed-$flags"
  [ -f "$f" ] || { printf "\\x0$flags" > "$f"; tail -c +2 "$out/checkpoint_corpus/seed" >> "$f"; }
done
# -rss_limit_mb: a config that made us allocate without bound fails the run.
"$bin" "$out/checkpoint_corpus" -max_total_time="$seconds" -rss_limit_mb=1024 -max_len=8192 -print_final_stats=1 \
  2>&1 | tail -15
rm -rf /tmp/attn-fuzz-ckpt-*
