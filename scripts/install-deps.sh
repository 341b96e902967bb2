#!/usr/bin/env bash
# Installs every Debian package attn needs to build, test and benchmark.
# Idempotent: when everything is present it prints nothing and does not touch apt.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libhwy-dev            # Highway: SIMD with runtime dispatch
  libopenblas-dev       # CBLAS: the nn modules' dense products, and the baseline
  libgtest-dev libgmock-dev
  libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libpng-dev zlib1g-dev
  clang-14 libclang-rt-14-dev   # libFuzzer for the safetensors loader
  python3-torch python3-numpy   # the PyTorch parity oracle (tests/parity), for /usr/bin/python3
  pybind11-dev python3-dev python3-pytest   # the Python package and its tests
  python3-venv                  # `pip install .` into a fresh venv (scripts/wheel-smoke.sh)
  libopenmpi-dev openmpi-bin    # attn::dist: ring attention over MPI, tested under mpirun
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
