#!/usr/bin/env bash
# Configures and builds libgla into build/ (CUDA backend when nvcc is found). Extra arguments go to
# CMake. Warnings are errors here, as in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# nvcc lives outside PATH on some machines.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGLA_WERROR=ON "$@" >/dev/null
ninja -C "$BUILD_DIR"
