#!/usr/bin/env bash
# The README's second command: install what attn needs, build it, and run every
# test — the release build, then the same suites under AddressSanitizer and
# UndefinedBehaviorSanitizer, with the pip-built wheel smoke-tested in between. Set
# ATTN_SKIP_ASAN=1 to run the release suites only, ATTN_SKIP_WHEEL=1 to skip the wheel.
# Each stage prints how long it took: CI allows 90 minutes, and on 2 cores the builds
# are most of it (see the asan preset in CMakePresets.json for what keeps it short).
set -euo pipefail
cd "$(dirname "$0")/.."
stage_start=$SECONDS
stage() {
  echo "test.sh: $1 took $((SECONDS - stage_start)) s (total $SECONDS s)"
  stage_start=$SECONDS
}
bash scripts/install-deps.sh
stage "install-deps"
jobs="$(nproc)"
cmake --preset release >/dev/null
cmake --build build/release -j "$jobs"
stage "release build"
ctest --test-dir build/release -j "$jobs" --output-on-failure
stage "release tests"
# The Python wheel, built by pip (scikit-build-core) and imported from a fresh venv.
if [ "${ATTN_SKIP_WHEEL:-0}" != "1" ]; then
  bash scripts/wheel-smoke.sh
  stage "wheel build and smoke test"
fi
if [ "${ATTN_SKIP_ASAN:-0}" != "1" ]; then
  cmake --preset asan >/dev/null
  cmake --build build/asan -j "$jobs"
  stage "asan build"
  ctest --test-dir build/asan -j "$jobs" --output-on-failure
  stage "asan tests"
fi
