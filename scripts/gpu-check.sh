#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds attn with the CUDA backend, runs the GPU test
# suite (tests/cuda/), the argument-error suite and the Python GPU tests, then the GPU
# forward and backward benchmark and PyTorch's SDPA on the same shapes, and writes every
# result to $OUT (or build/gpu-check):
#   gpu.txt                      the device, driver and clocks (before and after)
#   cuda_attention_test.txt      the GPU tests (each compares with the float64 reference)
#   python_test_cuda.txt         CUDA torch tensors through the Python package
#   attn_attention.txt, torch_sdpa.txt   the two benchmark tables, from one run
#
#   bash scripts/gpu-check.sh [repeats=20]
#
# Libraries the machine lacks (Highway, OpenBLAS, GoogleTest, ...) come from .gpu-deps/
# (made by scripts/gpu-deps.sh where Debian's mirrors are reachable): each package is
# unpacked and its files added without overwriting any file the machine already has.
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-20}
out=${OUT:-build/gpu-check}
mkdir -p "$out"

if [ ! -f /usr/include/hwy/highway.h ]; then
  if ! ls .gpu-deps/*.deb > /dev/null 2>&1; then
    echo "gpu-check: Highway is missing and .gpu-deps/ holds no packages (run scripts/gpu-deps.sh first)" >&2
    exit 1
  fi
  rm -rf /tmp/gpu-deps-root
  for f in .gpu-deps/*.deb; do dpkg -x "$f" /tmp/gpu-deps-root; done
  cp -rn /tmp/gpu-deps-root/. /
  ldconfig 2> /dev/null || true
fi

clocks() { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv; }
{ echo "before:"; clocks; nvcc --version | tail -2; } | tee "$out/gpu.txt"

cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_PYTHON=OFF \
  -DATTN_BUILD_DIST=OFF -DATTN_CUDA_ARCHITECTURES="80;90a" > "$out/configure.txt" 2>&1 || { tail -30 "$out/configure.txt"; exit 1; }
cmake --build build/gpu -j"$(nproc)" --target cuda_attention_test device_errors_test cuda_attention_bench \
  > "$out/build.txt" 2>&1 || { grep -E "error|FAILED" "$out/build.txt" | head -30; exit 1; }

status=0
build/gpu/tests/device_errors_test > "$out/device_errors_test.txt" 2>&1 || status=1
build/gpu/tests/cuda_attention_test > "$out/cuda_attention_test.txt" 2>&1 || status=1
tail -3 "$out/device_errors_test.txt"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|message" "$out/cuda_attention_test.txt" | head -60 || true

# The Python GPU tests (python/tests/test_cuda.py: CUDA torch tensors, autograd), where this
# machine's python3 has torch with CUDA, numpy, pytest and pybind11; skipped, saying why, otherwise.
py=$(command -v python3 || true)
if [ -n "$py" ] && "$py" -c "import torch, numpy, pytest, pybind11; assert torch.cuda.is_available()" 2> /dev/null; then
  { cmake -S . -B build/gpu-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_TESTS=OFF \
      -DATTN_BUILD_BENCH=OFF -DATTN_BUILD_DIST=OFF -DATTN_CUDA_ARCHITECTURES="80;90a" -DPython_EXECUTABLE="$py" \
      -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" && cmake --build build/gpu-py -j"$(nproc)" --target _attn; } \
    > "$out/python_build.txt" 2>&1 || { grep -E "error|FAILED" "$out/python_build.txt" | head -20; status=1; }
  PYTHONPATH=build/gpu-py/python "$py" -m pytest -q -rs -p no:cacheprovider python/tests/test_cuda.py \
    > "$out/python_test_cuda.txt" 2>&1 || status=1
  tail -5 "$out/python_test_cuda.txt"
else
  echo "python GPU tests skipped: python3 lacks torch with CUDA, numpy, pytest or pybind11" | tee "$out/python_test_cuda.txt"
fi

build/gpu/bench/cuda_attention_bench "$repeats" 2>&1 | tee "$out/attn_attention.txt" || status=1
python3 bench/peers/cuda_sdpa.py "$repeats" 2>&1 | tee "$out/torch_sdpa.txt" || true
{ echo "after:"; clocks; } | tee -a "$out/gpu.txt"
exit $status
