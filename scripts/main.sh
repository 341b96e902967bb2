#!/usr/bin/env bash
# The README's first command: install what attn needs, build it, and run the
# main job — a quick benchmark against this machine's peak and a cblas baseline,
# then a worked example that prints the attention matrix of a sentence.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build build/release -j "$(nproc)"
./build/release/tools/attn/attn bench --quick
./build/release/tools/attn/attn explain "the cat sat on the mat because the mat was warm"
