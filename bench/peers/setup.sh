#!/usr/bin/env bash
# Makes bench/peers/.venv: PyTorch 2.x from PyPI (and NumPy) for the peer benchmarks.
# Benchmarks only: the tests keep Debian's python3-torch. The venv is made from
# Debian's /usr/bin/python3 so that attn's extension (built for it) imports there too.
# PyPI's Linux wheels of torch are CUDA builds: the first run downloads ~3 GB.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  if ! /usr/bin/python3 -m venv "$venv" 2>/dev/null; then
    apt-get install -y python3-venv >/dev/null
    /usr/bin/python3 -m venv "$venv"
  fi
fi
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "torch>=2.4,<3" numpy pytest
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'in', '$venv')"
