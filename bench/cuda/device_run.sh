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
    skips) for m in 0 1 2 4 8 16 3 31; do echo "skip $m"; GLA_CUDA_SKIP=$m ./build-cuda/harness bench 8x4096x16x128; done 2>&1 | tee "$OUT/skips.log" ;;
    ncu) ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis -k regex:chunk_forward -c 1 ./build-cuda/harness bench 8x4096x16x128 2>&1 | tee "$OUT/ncu.log" | grep -v "^==PROF" | tail -120 ;;
    first) ./build-cuda/harness first 2>&1 | tee "$OUT/first.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
