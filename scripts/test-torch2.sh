#!/usr/bin/env bash
# The Python suite under PyTorch 2.x (issue 15): the same tests as the README's test
# command runs with Debian's torch 1.13, plus the torch.library / torch.compile tests
# that need PyTorch >= 2.4, in bench/peers/.venv (made by bench/peers/setup.sh from PyPI,
# ~5 GB on first use). Needs the release build (scripts/test.sh or the README's first
# command) for build/release/python.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/bench/peers/setup.sh"
cmake --build "$root/build/release" --target attn_python
PYTHONPATH="$root/build/release/python" OMP_NUM_THREADS=2 \
  "$root/bench/peers/.venv/bin/python" -m pytest -q -p no:cacheprovider "$root/python/tests"
