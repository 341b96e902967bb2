#!/usr/bin/env bash
# On the GPU machine, with bundle NAME unpacked in build/gpu/NAME (as scripts/gpu-check.sh
# does, or `tar -C build/gpu/NAME -xJf .gpu-bundle/NAME.tar.xz`): an A/B of the
# values of one environment variable that chooses between kernels (e.g.
# ATTN_CUDA_WGMMA), in one device call. For each value: the forward GPU tests (one
# process per test, eight at a time) and the benchmark's forward rows. Writes
# $OUT/ab.txt (or build/gpu-check/ab.txt) and the table of TFLOP/s per value, which it
# prints last, to ab_table_VARIABLE.txt beside it.
#
#   bash scripts/gpu-ab-env.sh NAME VARIABLE VALUE... [-- repeats=10]
#
# ATTN_AB_TESTS: another gtest filter (e.g. '*CudaBackward*'); ATTN_AB_PASS=backward: the
# table of the backward rows (the benchmark then times both passes).
set -uo pipefail
cd "$(dirname "$0")/.."
name=$1 var=$2
shift 2
values=()
repeats=10
while [ $# -gt 0 ]; do
  if [ "$1" = -- ]; then repeats=${2:-10}; break; fi
  values+=("$1")
  shift
done
bin=build/gpu/$name/bin
export LD_LIBRARY_PATH="$PWD/build/gpu/$name/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-build/gpu-check}
mkdir -p "$out"
logs=$(mktemp -d)
pass=${ATTN_AB_PASS:-forward}
"$bin/cuda_attention_test" --gtest_list_tests --gtest_filter="${ATTN_AB_TESTS:-*CudaForward*}" |
  awk '/^[^ ]/ {s = $1} /^  / {print s $1}' > "$logs/list"
status=0
for value in "${values[@]}"; do
  export "$var=$value"
  xargs -P 8 -I{} sh -c 'timeout 150 "$1" --gtest_filter="$2" > "$3/$(echo "$2" | tr / _).log" 2>&1 || echo "FAILED $2"' \
    _ "$bin/cuda_attention_test" {} "$logs" < "$logs/list" > "$logs/failed"
  echo "$var=$value: $(wc -l < "$logs/list") tests, $(wc -l < "$logs/failed") failed $(tr '\n' ' ' < "$logs/failed")" |
    tee -a "$out/ab.txt"
  [ -s "$logs/failed" ] && status=1
  # What each failure said (its assertions, a crash's last lines), into ab.txt.
  while read -r _ t; do
    echo "--- $var=$value $t:"
    grep -E "Failure|Expected|Which is|Value of|actual|error|trap|CUDA" "$logs/$(echo "$t" | tr / _).log" | head -12
    tail -3 "$logs/$(echo "$t" | tr / _).log"
  done < "$logs/failed" >> "$out/ab.txt"
  only=forward
  [ "$pass" = forward ] || only=all
  timeout 300 "$bin/cuda_attention_bench" "$repeats" "$only" > "$logs/bench_$value.txt" 2>&1 || status=1
  { echo "$var=$value:"; cat "$logs/bench_$value.txt"; } >> "$out/ab.txt"
done
# One row per shape, one TFLOP/s column per value.
header="| d | N | causal |"
for v in "${values[@]}"; do header="$header $v |"; done
{
  echo "$pass TFLOP/s by $var:"
  echo "$header"
  paste -d'|' $(for v in "${values[@]}"; do echo "$logs/bench_$v.txt"; done) |
    awk -F'|' -v pass="$pass" 'NF > 9 && $2 ~ pass {line = "| " $3 "|" $4 "|" $7; for (i = 9; i <= NF; i += 10) line = line "| " $i; print line " |"}'
} | tee "$out/ab_table_$var.txt"
exit $status
