#!/bin/bash
# On the device: library variants in build-cuda/variants/<name> (AB, space-separated names, the
# base first) through gla.chunk_gla: a hash of o for bench_training.py's inputs per variant (a
# change meant to be bitwise neutral must print the same hashes), then three interleaved rounds of
# forward timings (bench_training.py --no-fla --forward-only; AB_CASES overrides the cases). Logs to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
for v in $AB; do
  d=build-cuda/variants/$v
  echo "== $v"
  PYTHONPATH=python GLA_LIBRARY=$d/libgla.so LD_LIBRARY_PATH=$d python3 - <<'PY'
import hashlib, sys
sys.path.insert(0, "bench/cuda")
import gla
from bench_training import make_inputs
for (B, T, H, K, V) in [(8, 4096, 16, 128, 128), (4, 4096, 16, 128, 256), (2, 300, 3, 128, 128), (1, 1000, 2, 100, 72)]:
    (q, k, v, gate), _, _, _ = make_inputs(B, T, H, K, V, None, False)
    o, _ = gla.chunk_gla(q, k, v, gate)
    print(f"B{B} T{T} H{H} K{K} V{V}: o {hashlib.sha256(o.float().cpu().numpy().tobytes()).hexdigest()[:16]}, "
          f"{int(o.isnan().sum())} NaN")
PY
done 2>&1 | tee "$OUT/variant_hashes.txt"
for r in 1 2 3; do
  for v in $AB; do
    d=build-cuda/variants/$v
    echo "== $v round $r"
    PYTHONPATH=python GLA_LIBRARY=$d/libgla.so LD_LIBRARY_PATH=$d timeout 100 python3 bench/cuda/bench_training.py --no-fla \
      --forward-only --reps 50 --cases "${AB_CASES:-B8 T4096 H16 D128,B32 T1024 H16 D128,B4 T4096 H16 K128 V256}" 2>&1 |
      grep -E "^(B|varlen)"
  done
done 2>&1 | tee "$OUT/variant_forward_ab.txt"
