#!/usr/bin/env bash
# Downloads (here, where Debian's mirrors are reachable) the Debian packages attn's build
# needs into .gpu-deps/, for a GPU machine that has CUDA, CMake and a compiler but not
# these libraries and cannot fetch them (see scripts/gpu-check.sh, which adds them
# there). About 20 MB; .gpu-deps/ is ignored by git and travels as a carried path.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
cd .gpu-deps
apt-get download -q \
  libhwy-dev libhwy1 \
  libopenblas-dev libopenblas0 libopenblas0-pthread libopenblas-pthread-dev libblas-dev liblapack-dev \
  libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian \
  nlohmann-json3-dev libpng-dev libpng16-16 zlib1g-dev 2>&1 | grep -v "unsandboxed" || true
du -sh .
