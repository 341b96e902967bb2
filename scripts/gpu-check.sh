#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: for every bundle of prebuilt binaries in .gpu-bundle/
# (scripts/gpu-bundle.sh makes them on a machine with nvcc, to spare device minutes), runs
# the GPU test suite (tests/cuda/, each test against the float64 reference) and the GPU
# forward and backward benchmark; then PyTorch's SDPA on the same shapes, one forward and
# one dQ launch under Nsight Compute, and the Python GPU tests. Writes to $OUT (or
# build/gpu-check), at most 8 files as a device call returns:
#   gpu.txt             the device, driver and clocks (before and after), the bundles' commits
#   summary.txt         every bundle's wgmma probe, test verdicts and times, and the benchmark tables
#   logs.tar.gz         every log: each test's output, compute-sanitizer reruns of crashed
#                       tests, the Python build and tests, a cuda-gdb backtrace of a crash
#   ncu.txt             the profiled launches (bundle `main`, or the first)
#   python_test_cuda.txt
#
#   bash scripts/gpu-check.sh [repeats=20]
#
# Environment: ATTN_GPU_PYTHON_ONLY=1 runs the Python GPU tests alone; ATTN_GPU_SKIP_PYTHON=1
# skips them (an A/B call that carries two bundles and no .gpu-deps); ATTN_GPU_NCU=0 skips
# the profile, ATTN_GPU_NCU_BUNDLE=NAME profiles that bundle instead of `main`;
# ATTN_GPU_SKIP_TORCH=1 skips PyTorch's SDPA (a short A/B call); ATTN_GPU_SANITIZE=0 skips the
# compute-sanitizer reruns of crashed tests (up to 2 × 90 s). Without bundles, the binaries are built here. Libraries the machine lacks for
# a build (Highway, OpenBLAS, GoogleTest, ...) come from .gpu-deps/ (scripts/gpu-deps.sh,
# where Debian's mirrors are reachable): each package is unpacked and its files added
# without overwriting any file the machine already has. The Python extension is always
# built here (for this machine's python3), in the background while the C++ tests run.
set -uo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-20}
out=${OUT:-build/gpu-check}
mkdir -p "$out"
logs=$(mktemp -d)/logs
mkdir -p "$logs"
jobs=$(nproc)
status=0

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
if [ "${ATTN_GPU_SKIP_PYTHON:-0}" != 1 ] && [ -n "$py" ] &&
   "$py" -c "import torch, numpy, pytest, pybind11; assert torch.cuda.is_available()" 2> /dev/null; then
  python_ok=1
  ( cmake -S . -B build/gpu-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_TESTS=OFF \
      -DATTN_BUILD_BENCH=OFF -DATTN_BUILD_DIST=OFF -DATTN_CUDA_ARCHITECTURES=90a \
      -DPython_EXECUTABLE="$py" -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" &&
    nice cmake --build build/gpu-py -j"$jobs" --target attn_python ) > "$logs/python_build.txt" 2>&1 &
  python_build=$!
fi

# One process per GPU test, six at a time: a kernel fault poisons its CUDA context, and
# would otherwise take every later test with it; the float64 references keep the CPU busy.
run_one() {  # binary, test name, log folder → <folder>/<name>.log and .sum (one summary line)
  local f=$3/${2//\//_} start rc verdict
  start=$(date +%s%N)
  timeout 150 "$1" --gtest_filter="$2" > "$f.log" 2>&1
  rc=$?
  case $rc in
    0) verdict=ok; grep -q "\[  SKIPPED \] $2" "$f.log" && verdict=SKIPPED ;;
    1) verdict=FAILED ;;
    *) verdict="CRASHED(rc=$rc)" ;;
  esac
  printf '%-75s %-14s %7d ms\n' "$2" "$verdict" "$((($(date +%s%N) - start) / 1000000))" > "$f.sum"
}
export -f run_one

# Tests and times the binaries in $2 under the name $1.
check_bundle() {
  local name=$1 bin=$2 dir=$logs/$1 t f sanitized=0
  mkdir -p "$dir/tests"
  if [ -x "$bin/device_errors_test" ]; then
    timeout 60 "$bin/device_errors_test" > "$dir/device_errors_test.txt" 2>&1 || status=1
    echo "[$name] device_errors_test: $(tail -1 "$dir/device_errors_test.txt")" | tee -a "$out/summary.txt"
  fi
  if [ -x "$bin/wgmma_probe" ]; then  # which wgmma layouts and descriptors are right (seconds)
    timeout 60 "$bin/wgmma_probe" 2>&1 | sed "s/^/[$name] wgmma_probe: /" | tee -a "$out/summary.txt"
  fi
  "$bin/cuda_attention_test" --gtest_list_tests | awk '/^[^ ]/ {s = $1} /^  / {print s $1}' > "$dir/tests/list"
  xargs -P 6 -I{} bash -c 'run_one "$1" "$2" "$3"' _ "$bin/cuda_attention_test" {} "$dir/tests" < "$dir/tests/list"
  echo "[$name] GPU tests:" >> "$out/summary.txt"
  while read -r t; do cat "$dir/tests/${t//\//_}.sum"; done < "$dir/tests/list" >> "$out/summary.txt"
  echo "[$name] GPU tests: $(cat "$dir"/tests/*.sum | grep -c " ok ") ok, $(cat "$dir"/tests/*.sum | grep -c SKIPPED) skipped"
  cat "$dir"/tests/*.sum | grep -E "FAILED|CRASHED" | sed "s/^/[$name] /" && status=1
  for t in $(grep -h -E "CRASHED" "$dir"/tests/*.sum | awk '{print $1}' | head -2); do
    [ "${ATTN_GPU_SANITIZE:-1}" = 1 ] || break
    sanitized=$((sanitized + 1))
    command -v compute-sanitizer > /dev/null &&
      timeout 90 compute-sanitizer --tool memcheck --print-limit 20 "$bin/cuda_attention_test" --gtest_filter="$t" \
        > "$dir/sanitizer_$sanitized.txt" 2>&1
  done
  cat "$dir"/tests/*.log | grep -E "Failure|Expected|Which is|Value of|actual" | head -20
  timeout 240 "$bin/cuda_attention_bench" "$repeats" > "$dir/bench.txt" 2>&1 || status=1
  { echo "[$name] cuda_attention_bench $repeats:"; cat "$dir/bench.txt"; } >> "$out/summary.txt"
}

bundles=()
if [ "${ATTN_GPU_PYTHON_ONLY:-0}" != 1 ]; then
  for tarball in .gpu-bundle/*.tar.xz; do
    [ -f "$tarball" ] || continue
    name=$(basename "$tarball" .tar.xz)
    rm -rf "build/gpu/$name" && mkdir -p "build/gpu/$name"
    tar -C "build/gpu/$name" -xJf "$tarball"
    echo "bundle $name: $(tr '\n' ' ' < "build/gpu/$name/commit")" | tee -a "$out/gpu.txt"
    bundles+=("$name")
  done
  if [ ${#bundles[@]} = 0 ]; then
    cmake -S . -B build/gpu-src -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_PYTHON=OFF \
      -DATTN_BUILD_DIST=OFF -DATTN_CUDA_ARCHITECTURES="80;90a" > "$logs/configure.txt" 2>&1 || { tail -30 "$logs/configure.txt"; exit 1; }
    cmake --build build/gpu-src -j"$jobs" --target cuda_attention_test device_errors_test cuda_attention_bench \
      > "$logs/build.txt" 2>&1 || { grep -E "error|FAILED" "$logs/build.txt" | head -30; exit 1; }
    mkdir -p build/gpu/source/bin
    cp build/gpu-src/tests/cuda_attention_test build/gpu-src/tests/device_errors_test \
      build/gpu-src/bench/cuda_attention_bench build/gpu/source/bin/
    bundles=(source)
  fi
  for name in "${bundles[@]}"; do
    (export LD_LIBRARY_PATH="$PWD/build/gpu/$name/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
     check_bundle "$name" "build/gpu/$name/bin"; exit $status) || status=1
  done
  if [ "${ATTN_GPU_SKIP_TORCH:-0}" != 1 ]; then
    timeout 240 python3 bench/peers/cuda_sdpa.py "$repeats" > "$logs/torch_sdpa.txt" 2>&1 || true
    { echo "PyTorch SDPA (bench/peers/cuda_sdpa.py $repeats):"; cat "$logs/torch_sdpa.txt"; } >> "$out/summary.txt"
  fi
  # One launch of each attention kernel (d = 128, N = 4096, not causal: the 19th shape;
  # the bench makes 4 launches of each per shape) through Nsight Compute, where it reads the
  # counters: where the kernels' time goes; then the forward's stall reasons per issued
  # instruction.
  profiled=${ATTN_GPU_NCU_BUNDLE:-main}
  [ -d "build/gpu/$profiled" ] || profiled=${bundles[0]}
  if [ "${ATTN_GPU_NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
    export LD_LIBRARY_PATH="$PWD/build/gpu/$profiled/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    timeout 150 ncu --clock-control none -k regex:"flash_forward_(wgmma_)?kernel|backward_dq_kernel|backward_dkdv_kernel" \
      --launch-skip 219 --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section SourceCounters \
      "build/gpu/$profiled/bin/cuda_attention_bench" 1 > "$out/ncu.txt" 2>&1 || true
    timeout 100 ncu --clock-control none -k regex:"flash_forward_(wgmma_)?kernel|backward_dkdv_kernel" --launch-skip 147 --launch-count 2 \
      --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
      "build/gpu/$profiled/bin/cuda_attention_bench" 1 >> "$out/ncu.txt" 2>&1 || true
  fi
fi

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
        --args "$py" -m pytest -q -p no:cacheprovider python/tests/test_cuda.py -k "$crashed" > "$logs/python_crash_bt.txt" 2>&1
      grep -E "^#[0-9]+ " "$logs/python_crash_bt.txt" | head -25
      pytest_cuda -k "not $crashed" >> "$out/python_test_cuda.txt" 2>&1 || status=1
      tail -8 "$out/python_test_cuda.txt"
    fi
  else
    status=1
    grep -E "error|Error|FAILED" "$logs/python_build.txt" | head -20
  fi
elif [ "${ATTN_GPU_SKIP_PYTHON:-0}" != 1 ]; then
  echo "python GPU tests skipped: python3 lacks torch with CUDA, numpy, pytest or pybind11" | tee "$out/python_test_cuda.txt"
fi
{ echo "after:"; clocks; } 2>&1 | tee -a "$out/gpu.txt"
tar -C "$(dirname "$logs")" -czf "$out/logs.tar.gz" logs
# The end of the output is what a device call returns: the benchmark tables last.
grep -A200 -E "cuda_attention_bench|PyTorch SDPA" "$out/summary.txt" | grep -E "^\[|^\| (forward|backward)|^PyTorch|^device|^torch" | tail -120
exit $status
