#!/usr/bin/env bash
# Builds llama.cpp's ggml (CPU backend, -march=native, OpenMP) from the llama-cpp-python
# source distribution on PyPI, installs it under bench/peers/.ggml/install and builds
# build/release/bench/ggml_peer (attn against ggml_flash_attn_ext in one process).
# Benchmarks only: no test needs it. llama.cpp is not in Debian 12; PyPI's sdist carries
# its whole source (vendor/llama.cpp). The version is pinned so figures can be redone.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
work="$here/.ggml"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
mkdir -p "$work"
if [ ! -d "$src" ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
  tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
fi
if [ ! -f "$work/install/lib/cmake/ggml/ggml-config.cmake" ]; then
  # Configured from llama.cpp's top level: the sdist leaves out ggml's own pkg-config
  # template, which a standalone ggml configure needs. Only the ggml libraries are built.
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF >/dev/null
  cmake --build "$work/build" -j"$(nproc)" --target ggml ggml-base ggml-cpu
  cmake --install "$work/build/ggml" --prefix "$work/install" >/dev/null
fi
cd "$root"
cmake --preset release -Dggml_DIR="$work/install/lib/cmake/ggml" >/dev/null
cmake --build build/release -j"$(nproc)" --target ggml_peer
echo "built build/release/bench/ggml_peer against ggml from llama-cpp-python $version"
