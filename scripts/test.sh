#!/usr/bin/env bash
# The README's second command: install what attn needs, build it, and run every
# test — the release build, then the same suites under AddressSanitizer and
# UndefinedBehaviorSanitizer, with the pip-built wheel smoke-tested in between. Set
# ATTN_SKIP_ASAN=1 to run the release suites only, ATTN_SKIP_WHEEL=1 to skip the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs="$(nproc)"
cmake --preset release >/dev/null
cmake --build build/release -j "$jobs"
ctest --test-dir build/release -j "$jobs" --output-on-failure
# The Python wheel, built by pip (scikit-build-core) and imported from a fresh venv.
if [ "${ATTN_SKIP_WHEEL:-0}" != "1" ]; then
  bash scripts/wheel-smoke.sh
fi
if [ "${ATTN_SKIP_ASAN:-0}" != "1" ]; then
  cmake --preset asan >/dev/null
  cmake --build build/asan -j "$jobs"
  ctest --test-dir build/asan -j "$jobs" --output-on-failure
fi
