#!/usr/bin/env bash
# Configures build/release (the `release` preset) for the README's two commands,
# scripts/main.sh and scripts/test.sh.
#
# The CUDA backend (built wherever nvcc is found) is compiled by default for sm_80 and
# sm_90a (CMakeLists.txt, ATTN_CUDA_ARCHITECTURES). Both compile the same kernels (no
# source in src/cuda/ differs by architecture), and on a machine with no NVIDIA GPU
# nothing can run them, so there a fresh tree compiles sm_80 alone: the same compile
# check at half the CUDA cost, ~2.5 of the test command's minutes on 2 cores
# (docs/TESTING.md). Its sm_80 code and PTX run on any GPU from sm_80 on (newer ones
# compile the PTX when it first loads). A tree already configured keeps its setting, and
# ATTN_CUDA_ARCHITECTURES in the environment chooses explicitly:
#
#   ATTN_CUDA_ARCHITECTURES="80;90a" bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
if [ -n "${ATTN_CUDA_ARCHITECTURES:-}" ]; then
  args+=("-DATTN_CUDA_ARCHITECTURES=$ATTN_CUDA_ARCHITECTURES")
elif [ ! -f build/release/CMakeCache.txt ] && ! nvidia-smi -L 2> /dev/null | grep -q "^GPU"; then
  echo "configure-release.sh: no NVIDIA GPU here: the CUDA backend is compiled for sm_80 only"
  args+=("-DATTN_CUDA_ARCHITECTURES=80")
fi
cmake --preset release "${args[@]}" > /dev/null
