#!/usr/bin/env bash
# Here, before a device call: builds the GPU test suite and the GPU benchmark in
# build/release (this machine's compilers; nvcc compiles and links here even though nothing
# runs CUDA) and packs them, with the shared libraries a bare GPU image lacks (Highway,
# libgomp), into .gpu-bundle/NAME.tar.xz (ignored by git, carried by the device call).
# scripts/gpu-check.sh then tests and times every bundle it finds, instead of building on
# the GPU machine, whose device minutes are scarce. The binaries need only glibc >= Debian
# 12's there.
#
#   bash scripts/gpu-bundle.sh [NAME=main]
#
# A/B in one device call: bundle the current tree as `main`, check out a variant, bundle it
# under another name, check main out again, and carry .gpu-bundle. A bundle is ~22 MB (the
# 28 MB fat binary, sm_80 + sm_90a, is in each binary): two fit a call's 64 MiB without
# .gpu-deps (ATTN_GPU_SKIP_PYTHON=1 there). `main` also carries the argument-error suite,
# and every bundle of an sm_90a build the wgmma probe (bench/cuda/wgmma_probe.cu).
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-main}
# The bundles are timed on a Hopper GPU: they need its own code (a tree that
# scripts/configure-release.sh set up on a machine without a GPU has sm_80 alone).
if ! grep -q "^ATTN_CUDA_ARCHITECTURES:STRING=.*90a" build/release/CMakeCache.txt; then
  cmake --preset release -DATTN_CUDA_ARCHITECTURES="80;90a" > /dev/null
fi
targets=(cuda_attention_test cuda_attention_bench)
[ "$name" = main ] && targets+=(device_errors_test)
# The wgmma probe, where the build has it (an sm_90a build).
cmake --build build/release --target help | grep -q "wgmma_probe" && targets+=(wgmma_probe)
cmake --build build/release --target "${targets[@]}"
stage=$(mktemp -d)
mkdir -p "$stage/bin" "$stage/lib" .gpu-bundle
for t in "${targets[@]}"; do cp "$(find build/release/tests build/release/bench -maxdepth 1 -name "$t" -type f)" "$stage/bin/"; done
strip "$stage"/bin/*
for lib in libhwy.so.1 libgomp.so.1; do
  cp -L "$(ldd "$stage/bin/cuda_attention_test" | awk -v l="$lib" '$1 == l {print $3}')" "$stage/lib/"
done
{ git rev-parse HEAD; git diff --quiet HEAD -- src include tests bench CMakeLists.txt || echo "+uncommitted changes"; } \
  > "$stage/commit"
tar -C "$stage" -cJf ".gpu-bundle/$name.tar.xz" bin lib commit
rm -rf "$stage"
du -sh .gpu-bundle/*.tar.xz
