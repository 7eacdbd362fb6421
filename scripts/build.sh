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
# The system g++ where there is one: a toolchain that links libstdc++ statically into libgla.so
# crashed inside iostreams once loaded next to PyTorch's libstdc++ (seen on the GPU machines' image,
# whose CXX points at /opt/gcc). GLA_CXX overrides.
if [ -n "${GLA_CXX:-}" ]; then
  export CXX=$GLA_CXX CUDAHOSTCXX=$GLA_CXX
elif [ -x /usr/bin/g++ ]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGLA_WERROR=ON "$@" >/dev/null
ninja -C "$BUILD_DIR"
