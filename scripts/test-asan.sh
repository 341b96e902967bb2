#!/usr/bin/env bash
# Every suite again under AddressSanitizer and UndefinedBehaviorSanitizer (the asan
# preset: -O1 -g1, the AVX2 and AVX-512 kernels only, so it needs an AVX2 CPU). Part of
# CI (.ci/run), after the README's test command; on 2 cores it takes 17–20 minutes, most
# of it the build.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/install-deps.sh
jobs="$(nproc)"
cmake --preset asan >/dev/null
cmake --build build/asan -j "$jobs"
echo "test-asan.sh: asan build took $((SECONDS - start)) s"
start=$SECONDS
ctest --test-dir build/asan -j "$jobs" --output-on-failure
echo "test-asan.sh: asan tests took $((SECONDS - start)) s"
