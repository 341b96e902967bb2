#!/usr/bin/env bash
# The README's second command: install what attn needs, build the release tree and run
# every test suite in it (C++, Python, command line, fuzzers). CI (.ci/run) then adds two
# slower passes over the same code: the pip-built wheel in a fresh venv
# (scripts/wheel-smoke.sh) and every suite again under AddressSanitizer and
# UndefinedBehaviorSanitizer (scripts/test-asan.sh). Each stage prints how long it took:
# the README promises about a quarter of an hour on 2 cores, and CI allows 90 minutes.
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
bash scripts/configure-release.sh
cmake --build build/release -j "$jobs"
stage "release build"
ctest --test-dir build/release -j "$jobs" --output-on-failure
stage "release tests"
