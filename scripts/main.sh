#!/usr/bin/env bash
# The README's first command: install what attn needs, build it, and run the main
# job — `attn demo`, which trains an attention model to translate human-written dates
# into ISO 8601 (11–28 s on 2 cores), reports its accuracy on 1,000 unseen dates,
# and draws what it attends to (attn-demo/attention.png and .svg).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/configure-release.sh
# The command-line tool alone (and the libraries it links): the demo needs nothing
# else, and the test command builds the rest of the same tree.
cmake --build build/release -j "$(nproc)" --target attn_cli
./build/release/tools/attn/attn demo --out attn-demo "$@"
