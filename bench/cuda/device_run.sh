#!/bin/bash
# Runs on the device machine from the repo root: the standalone harness (built here, carried in
# build-cuda/), then optional extra steps. Logs go to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
for step in "$@"; do
  case "$step" in
    check) ./build-cuda/harness check 2>&1 | tee "$OUT/check.log" ;;
    bench) ./build-cuda/harness bench 8x4096x16x128 4x8192x32x64 1x32768x16x128 32x1024x16x128 varlen 2>&1 | tee "$OUT/bench.log" ;;
    first) ./build-cuda/harness first 2>&1 | tee "$OUT/first.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
