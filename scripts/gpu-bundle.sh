#!/usr/bin/env bash
# Here, before a device call: builds the GPU test suite, the argument-error suite and the
# GPU benchmark in build/release (this machine's compilers; nvcc compiles and links here
# even though nothing runs CUDA), and packs them with the shared libraries a bare GPU image
# lacks (Highway, libgomp) into .gpu-bundle/ (ignored by git, carried by the device call).
# scripts/gpu-check.sh then runs them instead of building on the GPU machine, whose device
# minutes are scarce. The binaries need only glibc >= Debian 12's on that machine.
#
#   bash scripts/gpu-bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(cuda_attention_test device_errors_test cuda_attention_bench)
cmake --build build/release --target "${targets[@]}"
rm -rf .gpu-bundle
mkdir -p .gpu-bundle/bin .gpu-bundle/lib
cp build/release/tests/cuda_attention_test build/release/tests/device_errors_test \
   build/release/bench/cuda_attention_bench .gpu-bundle/bin/
strip .gpu-bundle/bin/*
for lib in libhwy.so.1 libgomp.so.1; do
  cp -L "$(ldd .gpu-bundle/bin/cuda_attention_test | awk -v l="$lib" '$1 == l {print $3}')" .gpu-bundle/lib/
done
# The three binaries share one 28 MB fat binary (sm_80 + sm_90a); xz packs them to fit a
# device call's 64 MiB.
tar -C .gpu-bundle -cJf .gpu-bundle/bundle.tar.xz bin lib
rm -rf .gpu-bundle/bin .gpu-bundle/lib
git rev-parse HEAD > .gpu-bundle/commit
git diff --quiet HEAD -- src include tests bench CMakeLists.txt || echo "+uncommitted changes" >> .gpu-bundle/commit
du -sh .gpu-bundle
