#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: runs the GPU test suite (tests/cuda/), the argument-error
# suite and the Python GPU tests, then the GPU forward and backward benchmark and PyTorch's
# SDPA on the same shapes, and writes every result to $OUT (or build/gpu-check):
#   gpu.txt                      the device, driver and clocks (before and after)
#   cuda_attention_test.txt      the GPU tests (each compares with the float64 reference),
#                                one process per test, so that a crash names its test;
#                                a test that crashes is rerun under compute-sanitizer
#   python_test_cuda.txt         CUDA torch tensors through the Python package
#   attn_attention.txt, torch_sdpa.txt   the two benchmark tables, from one run
#
#   bash scripts/gpu-check.sh [repeats=20]
#
# The C++ binaries come prebuilt from .gpu-bundle/ when it exists (scripts/gpu-bundle.sh
# makes it on a machine with nvcc, to spare device minutes); otherwise they are built here.
# Libraries the machine lacks for a build (Highway, OpenBLAS, GoogleTest, ...) come from
# .gpu-deps/ (scripts/gpu-deps.sh, where Debian's mirrors are reachable): each package is
# unpacked and its files added without overwriting any file the machine already has. The
# Python extension is always built here (for this machine's python3), in the background
# while the C++ tests run.
set -uo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-20}
out=${OUT:-build/gpu-check}
mkdir -p "$out"
jobs=$(nproc)

clocks() { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv; }
{ echo "before:"; clocks; nvcc --version | tail -2; grep PRETTY /etc/os-release; } 2>&1 | tee "$out/gpu.txt"

if [ ! -f /usr/include/hwy/highway.h ] && ls .gpu-deps/*.deb > /dev/null 2>&1; then
  rm -rf /tmp/gpu-deps-root
  for f in .gpu-deps/*.deb; do dpkg -x "$f" /tmp/gpu-deps-root; done
  cp -rn /tmp/gpu-deps-root/. / 2> /dev/null
  ldconfig 2> /dev/null || true
fi

# The Python extension, in the background (one GPU architecture: it is only tested here).
py=$(command -v python3 || true)
python_ok=0
if [ -n "$py" ] && "$py" -c "import torch, numpy, pytest, pybind11; assert torch.cuda.is_available()" 2> /dev/null; then
  python_ok=1
  ( cmake -S . -B build/gpu-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_TESTS=OFF \
      -DATTN_BUILD_BENCH=OFF -DATTN_BUILD_DIST=OFF -DATTN_CUDA_ARCHITECTURES=90a \
      -DPython_EXECUTABLE="$py" -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" &&
    nice cmake --build build/gpu-py -j"$jobs" --target attn_python ) > "$out/python_build.txt" 2>&1 &
  python_build=$!
fi

status=0
# ATTN_GPU_PYTHON_ONLY=1: only the Python GPU tests (the C++ suites and benchmarks are skipped).
if [ "${ATTN_GPU_PYTHON_ONLY:-0}" != 1 ]; then
bin=build/gpu/bin
if [ -f .gpu-bundle/bundle.tar.xz ]; then
  rm -rf "$bin" && mkdir -p "$bin"
  tar -C "$bin" -xJf .gpu-bundle/bundle.tar.xz
  export LD_LIBRARY_PATH="$PWD/$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  bin=$bin/bin
  echo "prebuilt binaries of $(cat .gpu-bundle/commit | tr '\n' ' ')" | tee -a "$out/gpu.txt"
else
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_PYTHON=OFF \
    -DATTN_BUILD_DIST=OFF -DATTN_CUDA_ARCHITECTURES="80;90a" > "$out/configure.txt" 2>&1 || { tail -30 "$out/configure.txt"; exit 1; }
  cmake --build build/gpu -j"$jobs" --target cuda_attention_test device_errors_test cuda_attention_bench \
    > "$out/build.txt" 2>&1 || { grep -E "error|FAILED" "$out/build.txt" | head -30; exit 1; }
  mkdir -p "$bin"
  cp build/gpu/tests/cuda_attention_test build/gpu/tests/device_errors_test build/gpu/bench/cuda_attention_bench "$bin"/
fi

timeout 60 "$bin/device_errors_test" > "$out/device_errors_test.txt" 2>&1 || status=1
tail -1 "$out/device_errors_test.txt"

# One process per GPU test, six at a time: a kernel fault poisons its CUDA context, and
# would otherwise take every later test with it; the float64 references keep the CPU busy.
log=$out/cuda_attention_test.txt
rm -rf /tmp/gtests && mkdir -p /tmp/gtests
run_one() {  # test name → /tmp/gtests/<name>.log and one summary line
  local t=$1 f=/tmp/gtests/${1//\//_} start rc verdict
  start=$(date +%s%N)
  timeout 150 "$bin/cuda_attention_test" --gtest_filter="$t" > "$f.log" 2>&1
  rc=$?
  case $rc in
    0) verdict=ok; grep -q "\[  SKIPPED \] $t" "$f.log" && verdict=SKIPPED ;;
    1) verdict=FAILED ;;
    *) verdict="CRASHED(rc=$rc)" ;;
  esac
  printf '%-75s %-14s %7d ms\n' "$t" "$verdict" "$((($(date +%s%N) - start) / 1000000))" > "$f.sum"
}
export -f run_one
export bin
"$bin/cuda_attention_test" --gtest_list_tests | awk '/^[^ ]/ {s = $1} /^  / {print s $1}' > /tmp/gtests/list
xargs -P 6 -I{} bash -c 'run_one "$1"' _ {} < /tmp/gtests/list
: > "$log"
while read -r t; do
  f=/tmp/gtests/${t//\//_}
  cat "$f.log" >> "$log"
  cat "$f.sum" | tee -a "$out/summary.txt"
done < /tmp/gtests/list
grep -q -E "FAILED|CRASHED" "$out/summary.txt" && status=1
sanitized=0
for t in $(awk '/CRASHED/ {print $1}' "$out/summary.txt" | head -2); do
  sanitized=$((sanitized + 1))
  command -v compute-sanitizer > /dev/null &&
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$bin/cuda_attention_test" --gtest_filter="$t" \
      > "$out/sanitizer_$sanitized.txt" 2>&1
done
grep -E "Failure|Expected|Which is|Value of|actual|error" "$log" | head -40

timeout 240 "$bin/cuda_attention_bench" "$repeats" > "$out/attn_attention.txt" 2>&1 || status=1
timeout 240 python3 bench/peers/cuda_sdpa.py "$repeats" > "$out/torch_sdpa.txt" 2>&1 || true
# One forward and one dQ launch (d = 128, N = 4096, not causal: the 19th shape) through Nsight Compute,
# where it reads the counters: where the kernels' time goes.
if [ "${ATTN_GPU_NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  timeout 150 ncu --clock-control none -k regex:"flash_forward_kernel|backward_dq_kernel" --launch-skip 147 \
    --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis "$bin/cuda_attention_bench" 1 > "$out/ncu.txt" 2>&1 || true
fi
fi  # C++ suites and benchmarks

if [ $python_ok = 1 ]; then
  if wait "$python_build"; then
    "$py" -c "import pybind11, numpy, torch; print('pybind11', pybind11.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
    pytest_cuda() { PYTHONPATH=build/gpu-py/python timeout 180 "$py" -X faulthandler -m pytest -q -rs -p no:cacheprovider \
      python/tests/test_cuda.py "$@"; }
    pytest_cuda > "$out/python_test_cuda.txt" 2>&1 || status=1
    tail -8 "$out/python_test_cuda.txt"
    # A crash: the native stack of the crashing test (cuda-gdb is gdb for host code too), then
    # the other tests without it.
    crashed=$(grep -oE "line [0-9]+ in test_[A-Za-z0-9_]+" "$out/python_test_cuda.txt" | head -1 | awk '{print $4}')
    if [ -n "$crashed" ]; then
      command -v cuda-gdb > /dev/null && PYTHONPATH=build/gpu-py/python timeout 150 cuda-gdb -batch -ex run -ex bt \
        --args "$py" -m pytest -q -p no:cacheprovider python/tests/test_cuda.py -k "$crashed" > "$out/python_crash_bt.txt" 2>&1
      grep -E "^#[0-9]+ " "$out/python_crash_bt.txt" | head -25
      pytest_cuda -k "not $crashed" > "$out/python_test_cuda_rest.txt" 2>&1 || status=1
      tail -8 "$out/python_test_cuda_rest.txt"
    fi
  else
    status=1
    grep -E "error|Error|FAILED" "$out/python_build.txt" | head -20
  fi
else
  echo "python GPU tests skipped: python3 lacks torch with CUDA, numpy, pytest or pybind11" | tee "$out/python_test_cuda.txt"
fi
{ echo "after:"; clocks; } | tee -a "$out/gpu.txt"
cat "$out/attn_attention.txt" "$out/torch_sdpa.txt" 2> /dev/null
exit $status
