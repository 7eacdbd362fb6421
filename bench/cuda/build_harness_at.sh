#!/bin/bash
# Builds the standalone harness from a git ref into build-cuda/<name> (sm_90a), for A/B timing of
# several kernel versions in one device call (device_run.sh step `abbin`):
#   bash bench/cuda/build_harness_at.sh next/prep-registers harness_regs
# The ref's tree is exported to a temporary folder; the working tree is not touched.
set -euo pipefail
ref=${1:?git ref}
name=${2:?output name under build-cuda/}
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$root" archive "$ref" | tar -x -C "$tmp"
mkdir -p "$root/build-cuda"
(cd "$tmp" && nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -o "$root/build-cuda/$name" \
  bench/cuda/harness.cu src/backends/cuda/forward.cu src/backends/cuda/plan.cpp \
  src/backends/cuda/chunk_forward_d64.cu src/backends/cuda/chunk_forward_d128.cu src/backends/cuda/chunk_forward_intra.cu)
echo "built build-cuda/$name from $ref ($(git -C "$root" rev-parse --short "$ref"))"
