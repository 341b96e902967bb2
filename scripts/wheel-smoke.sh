#!/usr/bin/env bash
# Builds attn's wheel with `pip install .` (PEP 517, scikit-build-core, build isolation)
# into a fresh virtual environment and imports it from there, outside the checkout, so
# that a missing file in the wheel or a wrong install rule fails here. Part of CI
# (.ci/run), after the README's test command; about 4–5 minutes on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
venv="$root/build/wheel-venv"
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "$root"
want="$(sed -n 's/^project(attn VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")"
cd "$(mktemp -d)"
"$venv/bin/python" - "$venv" "$want" <<'PY'
import os, sys
import numpy as np
import attn

venv, want = sys.argv[1], sys.argv[2]
assert os.path.realpath(attn.__file__).startswith(os.path.realpath(venv)), attn.__file__
assert attn.__version__ == want, (attn.__version__, want)
rng = np.random.default_rng(0)
q, k, v = (rng.uniform(-1, 1, (2, 3, 17, 16)).astype(np.float32) for _ in range(3))
out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
s = q @ np.swapaxes(k, -1, -2) / 4.0 + np.triu(np.full((17, 17), -np.inf, np.float32), 1)
p = np.exp(s - s.max(-1, keepdims=True))
ref = (p / p.sum(-1, keepdims=True)) @ v
assert np.abs(out - ref).max() < 1e-5, np.abs(out - ref).max()
print("wheel smoke: attn %s from %s, bf16 path %s: 1 passed, 0 failed"
      % (attn.__version__, os.path.dirname(attn.__file__), attn.cpu_info()["bf16_path"]))
PY
