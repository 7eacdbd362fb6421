#!/bin/bash
# Runs on the device machine from the repo root: the standalone harness (built here, carried in
# build-cuda/), then optional extra steps. Logs go to $OUT.
# Build first, on the development machine (the device call carries build-cuda/ and .whl/):
#   cmake -S . -B build-cuda -G Ninja -DGLA_CUDA=ON && ninja -C build-cuda gla gla_tests
#   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -o build-cuda/harness \
#     bench/cuda/harness.cu src/backends/cuda/forward.cu src/backends/cuda/plan.cpp src/backends/cuda/chunk_forward_d64.cu \
#     src/backends/cuda/chunk_forward_d128.cu src/backends/cuda/chunk_forward_intra.cu
#   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -o build-cuda/handoff bench/cuda/handoff_racecheck.cu
# A device call returns at most 8 files from $OUT: the logs go to $OUT/logs/ and come back as one
# $OUT/logs.tgz; fla's Triton cache comes back as $OUT/triton_cache.tgz.part* (keep them in .devtmp/
# and carry .devtmp to skip fla's ~80 s autotune per shape next time).
# Typical calls: `check bench` after a kernel change (carry build-cuda/harness); `check gtest
# pytest fla` before calling GPU work done (carry the library, tests, .whl, .devtmp). For the
# backward: `gtestall sanbwd pytest ab training` (carry build-cuda/libgla.so, libgla_torch.so,
# tests/cpp/gla_tests, .whl and AB_BASE's folder).
set -o pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/logs"
mkdir -p "$LOG"
trap 'tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOG"' EXIT
# fla's Triton autotune choices (bench/cuda/triton_autotune_cache.py): seeded from the committed
# bench/cuda/fla_autotune before fla runs, and the new ones copied into logs/fla_autotune after
# it, also when the step's timeout stopped it (commit them to skip fla's autotune next time).
autotune_seed() {
  export TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
  mkdir -p /tmp/tc && [ -d bench/cuda/fla_autotune ] && cp -rn bench/cuda/fla_autotune/. /tmp/tc/ 2>/dev/null || true
}
autotune_harvest() {
  (cd /tmp/tc 2>/dev/null && find . -name "*.autotune.json" -exec cp --parents -n {} "$LOG/fla_autotune/" \; 2>/dev/null)
  echo "autotune files in logs/fla_autotune: $(find "$LOG/fla_autotune" -name '*.autotune.json' | wc -l)"
}
mkdir -p "$LOG/fla_autotune"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOG/gpu.txt"
for step in "$@"; do
  case "$step" in
    check) ./build-cuda/harness check 2>&1 | tee "$LOG/check.log" || { echo "CHECK FAILED: stopping"; exit 1; } ;;
    bench) ./build-cuda/harness bench 8x4096x16x128 4x8192x32x64 1x32768x16x128 32x1024x16x128 varlen 2>&1 | tee "$LOG/bench.log" ;;
    ncu) ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters -k regex:chunk_forward -c 1 ./build-cuda/harness bench 8x4096x16x128 2>&1 | tee "$LOG/ncu.log" | grep -v "^==PROF" | tail -60
      ncu --clock-control none --set full --import-source no -k regex:chunk_forward_ws -c 1 -o "$LOG/ws_profile" ./build-cuda/harness bench 8x4096x16x128 > /dev/null 2>&1; ls -la "$LOG"/ws_profile* ;;
    ncusrc) # per-SASS-instruction stall samples of the ws kernel (the source page as CSV); NCU_SHAPE
      # picks the shape (default B8 T4096 H16 D128); analyse with bench/cuda/ncu_regions.py
      ncu --clock-control none --set full --import-source no -k regex:chunk_forward_ws -c 1 -o "$LOG/ws" ./build-cuda/harness bench ${NCU_SHAPE:-8x4096x16x128} > "$LOG/ncu_run.log" 2>&1
      ncu -i "$LOG/ws.ncu-rep" --page source --csv --print-source sass > "$LOG/ws_sass.csv" 2> "$LOG/ws_sass.err"; wc -l "$LOG/ws_sass.csv"; head -c 600 "$LOG/ws_sass.err"
      ncu -i "$LOG/ws.ncu-rep" --page details > "$LOG/ws_details.txt" 2>&1; grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Achieved Occupancy" "$LOG/ws_details.txt" | head -12
      rm -f "$LOG/ws.ncu-rep" ;;
    ncudqk) # the same for the backward's dqk_kernel, through the public call (one fwd+bwd of
      # NCU_CASE, a bench_training.py label, default B8 T4096 H16 D128; carry the library), summarised
      # by the regions between its barriers (ncu_regions.py); NCU_KERNEL (a regex, default dqk_kernel)
      # picks another kernel of the call, e.g. chunk_intra with NCU_CASE="B8 T2048 H4 K256 V512"; the
      # logs are named after it (logs/<kernel>_regions.txt, ...)
      kernel=${NCU_KERNEL:-dqk_kernel}; out="$LOG/${kernel//[^A-Za-z0-9_]/_}"
      PYTHONPATH=python GLA_LIBRARY=build-cuda/libgla.so LD_LIBRARY_PATH=build-cuda ncu --clock-control none --set full \
        --import-source no -k "regex:$kernel" -c 1 -o "$out" python3 bench/cuda/kernel_times.py --once \
        --cases "${NCU_CASE:-B8 T4096 H16 D128}" > "${out}_run.log" 2>&1
      ncu -i "$out.ncu-rep" --page source --csv --print-source sass > "${out}_sass.csv" 2> "${out}_sass.err"
      ncu -i "$out.ncu-rep" --page details > "${out}_details.txt" 2>&1
      grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Achieved Occupancy" "${out}_details.txt" | head -12
      python3 bench/cuda/ncu_regions.py "${out}_sass.csv" --top 15 2>&1 | tee "${out}_regions.txt" | head -60
      rm -f "$out.ncu-rep" ;;
    sanitize) export GLA_CHECK_SMALL=1
      timeout 240 compute-sanitizer --tool memcheck ./build-cuda/harness check 2>&1 | tail -25 | tee "$LOG/memcheck.log"
      # the shipped kernels as built (mbarrier hand-off); the whole report is kept for the warnings
      timeout 240 compute-sanitizer --tool racecheck --print-limit 400 ./build-cuda/harness check > "$LOG/racecheck_full.log" 2>&1; tail -3 "$LOG/racecheck_full.log" | tee "$LOG/racecheck.log"
      grep -E "^========= (Warning|Error)" "$LOG/racecheck_full.log" | sed -E 's/0x[0-9a-f]+//g' | sort | uniq -c | sort -rn | head -12
      timeout 240 compute-sanitizer --tool synccheck ./build-cuda/harness check 2>&1 | tail -3 | tee "$LOG/synccheck.log"
      unset GLA_CHECK_SMALL ;;
    gtest) LD_LIBRARY_PATH=build-cuda ./build-cuda/tests/cpp/gla_tests --gtest_filter='*Cuda*' 2>&1 | tee "$LOG/gtest.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |FAILED|Failure|error" | head -40 ;;
    fla) python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
      # fla caches its autotune choices (FLA_CACHE_RESULTS=1) and Triton its binaries in TRITON_CACHE_DIR;
      # the cache comes back as $OUT/triton_cache.tgz: keep it in .devtmp/ and carry it to skip ~80 s per shape.
      export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR
      ls .devtmp/triton_cache.tgz.part* >/dev/null 2>&1 && cat .devtmp/triton_cache.tgz.part* | tar -xzf - -C $TRITON_CACHE_DIR
      PYTHONUNBUFFERED=1 timeout ${FLA_TIMEOUT:-540} python3 bench/cuda/bench_vs_fla.py --lib build-cuda/libgla.so 2>&1 | tee "$LOG/fla.log" | grep -v Warning
      tar -czf - -C $TRITON_CACHE_DIR . | split -b 15m - "$OUT/triton_cache.tgz.part"; ls -la "$OUT"/triton_cache.tgz.part*
      for i in 1 2 3; do python3 bench/cuda/bench_vs_fla.py --lib build-cuda/libgla.so --first; done 2>&1 | tee "$LOG/first_py.log" ;;
    pytest) GLA_LIBRARY=build-cuda/libgla.so PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest tests/python -m cuda -rs -q -p no:cacheprovider 2>&1 | tee "$LOG/pytest_cuda.log" | tail -15 ;;
    final) python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/triton_cache
      python3 bench/cuda/bench_vs_fla.py --lib build-cuda/libgla.so --first 2>&1 | tee "$LOG/first_py.log"
      PYTHONUNBUFFERED=1 timeout 200 python3 bench/cuda/bench_vs_fla.py --lib build-cuda/libgla.so --fla-cases 8x4096x16x128 2>&1 | tee "$LOG/fla.log" | grep -v Warning ;;
    ours) PYTHONUNBUFFERED=1 python3 bench/cuda/bench_vs_fla.py --lib build-cuda/libgla.so --no-fla 2>&1 | tee "$LOG/ours.log" ;;
    first) ./build-cuda/harness first 2>&1 | tee "$LOG/first.log" ;;
    order) # the longest-first block order against the natural one (GLA_ORDER=0)
      for r in 1 2; do for o in 0 1; do echo "GLA_ORDER=$o"; GLA_ORDER=$o ./build-cuda/harness bench varlen 1x32768x16x128 32x1024x16x128 8x4096x16x128; done; done 2>&1 | tee "$LOG/bench_order.log" ;;
    abbin) # several harness builds in one call (bench/cuda/build_harness_at.sh REF NAME; carry each
      # build-cuda/NAME): AB_BINS="harness harness_regs ...", check each, then two interleaved rounds
      # (AB_SHAPES: the shapes, default the five of the issue; the host fills inputs, ~15 s per shape)
      for b in ${AB_BINS:-harness}; do timeout 120 ./build-cuda/$b check 2>&1 | tail -1 | sed "s/^/$b: /"; done 2>&1 | tee "$LOG/check_abbin.log"
      for r in 1 2; do for b in ${AB_BINS:-harness}; do echo "== $b"; ./build-cuda/$b bench ${AB_SHAPES:-8x4096x16x128 4x8192x32x64 1x32768x16x128 32x1024x16x128 varlen}; done; done 2>&1 | tee "$LOG/bench_abbin.log" ;;
    handoff) # racecheck on the hand-off protocol alone (bench/cuda/handoff_racecheck.cu, built as build-cuda/handoff)
      for m in 0 1 2 3 4; do timeout 60 compute-sanitizer --tool racecheck ./build-cuda/handoff $m 2>&1 | grep -E "^mode|SUMMARY"; done 2>&1 | tee "$LOG/handoff.log" ;;
    racebin) # racecheck on the small grid for each build in RC_BINS (e.g. A/B builds of the hand-off)
      for b in ${RC_BINS:-harness}; do echo "== $b"; GLA_CHECK_SMALL=1 timeout 200 compute-sanitizer --tool racecheck ./build-cuda/$b check 2>&1 | tail -3; done 2>&1 | tee "$LOG/racecheck_bins.log" ;;
    wide) # K = V = 256 (the key split): harness timing, memcheck of the GPU test, same-run against fla
      ./build-cuda/harness bench 8x4096x16x256 1x32768x16x256 2>&1 | tee "$LOG/bench_wide.log"
      LD_LIBRARY_PATH=build-cuda timeout 200 compute-sanitizer --tool memcheck ./build-cuda/tests/cpp/gla_tests --gtest_filter='*WideKeys*' 2>&1 | tail -4 | tee "$LOG/memcheck_wide.log"
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/triton_cache
      mkdir -p $TRITON_CACHE_DIR; ls .devtmp/triton_cache.tgz.part* >/dev/null 2>&1 && cat .devtmp/triton_cache.tgz.part* | tar -xzf - -C $TRITON_CACHE_DIR
      PYTHONUNBUFFERED=1 timeout ${FLA_TIMEOUT:-300} python3 bench/cuda/bench_vs_fla.py --lib build-cuda/libgla.so --cases ${WIDE_CASES:-8x4096x16x256} 2>&1 | tee "$LOG/fla_wide.log" | grep -v Warning ;;
    gtestall) LD_LIBRARY_PATH=build-cuda timeout 200 ./build-cuda/tests/cpp/gla_tests --gtest_filter='*Cuda*' 2>&1 | tee "$LOG/gtest_all.log" | grep -E "^\[  (FAILED|PASSED) " ;;
    sanbwd) # compute-sanitizer on the backward's kernels: one process per (tool, test)
      for spec in memcheck:HardResetGates racecheck:HardResetGates memcheck:VarlenEmptyAndSingleTokenSequences racecheck:GateVariantsAndLayouts; do
        tool=${spec%%:*}; t=${spec#*:}
        LD_LIBRARY_PATH=build-cuda timeout 100 compute-sanitizer --tool $tool ./build-cuda/tests/cpp/gla_tests --gtest_filter=CudaBackward.$t > "$LOG/san_${tool}_$t.log" 2>&1
        echo "$tool $t rc $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/san_${tool}_$t.log")"
      done ;;
    ab) # gla.chunk_gla fwd and fwd+bwd, libgla alone: build-cuda against AB_BASE (a folder with a
      # libgla.so and libgla_torch.so of the base commit, and its python/ when that differs), two
      # interleaved rounds
      for r in 1 2; do for d in "$PWD/build-cuda" "${AB_BASE:?set AB_BASE}"; do echo "== $d"
        pkg=python; [ "$d" != "$PWD/build-cuda" ] && [ -d "$d/python" ] && pkg=$d/python
        PYTHONPATH=$pkg GLA_LIBRARY=$d/libgla.so LD_LIBRARY_PATH=$d timeout 60 python3 bench/cuda/bench_training.py --no-fla
      done; done 2>&1 | tee "$LOG/ab.log" | grep -E "==|fwd\+bwd" ;;
    variants) # libgla builds in build-cuda/variants/<name> (AB_VARIANTS: from a commit by
      # bench/cuda/build_library_at.sh, or bench/cuda/experiments/state_store_variants.sh) against
      # build-cuda: ncu durations of the ws kernels and dqk (VARIANT_KERNELS, a regex) per case, two
      # interleaved rounds of bench_training.py --no-fla, then the GPU gtests (*Cuda*: forward and
      # backward, the SPEC grid included; ~100 s on an H200) against each variant
      libs="$PWD/build-cuda"; for v in ${AB_VARIANTS:-}; do libs="$libs $PWD/build-cuda/variants/$v"; done
      for c in "B8 T4096 H16 D128" "B8 T2048 H4 K256 V512"; do for d in $libs; do
        echo "== $d $c"; PYTHONPATH=python GLA_LIBRARY=$d/libgla.so LD_LIBRARY_PATH=$d timeout 60 ncu --csv --metrics gpu__time_duration.sum \
          -k "regex:${VARIANT_KERNELS:-chunk_forward_ws|dqk}" python3 bench/cuda/kernel_times.py --once --cases "$c" 2>/dev/null | python3 bench/cuda/experiments/ncu_durations.py
      done; done 2>&1 | tee "$LOG/variants_ncu.log"
      for r in 1 2; do for d in $libs; do echo "== $d"
        PYTHONPATH=python GLA_LIBRARY=$d/libgla.so LD_LIBRARY_PATH=$d timeout 60 python3 bench/cuda/bench_training.py --no-fla --reps 30 \
          --cases "B8 T2048 H4 K256 V512,B8 T4096 H16 D128,B4 T4096 H16 K128 V256"
      done; done 2>&1 | tee "$LOG/variants_ab.log" | grep -E "==|fwd\+bwd"
      # (carry build-cuda/tests/cpp/gla_tests: it loads libgla.so from LD_LIBRARY_PATH)
      [ -x build-cuda/tests/cpp/gla_tests ] && for v in ${AB_VARIANTS:-}; do
        LD_LIBRARY_PATH=build-cuda/variants/$v timeout 200 ./build-cuda/tests/cpp/gla_tests --gtest_filter='*Cuda*' \
          > "$LOG/gtest_variant_$v.log" 2>&1
        echo "$v: $(grep -E '^\[  (FAILED|PASSED) ' "$LOG/gtest_variant_$v.log" | tr '\n' ' ')"
      done | tee "$LOG/variants_gtest.log" ;;
    training) # the same-run table against fla (TRAINING_CASES: labels, default all), fla's autotune
      # choices seeded from bench/cuda/fla_autotune and the new ones collected in logs/fla_autotune
      # (commit them: triton_autotune_cache.py)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
      PYTHONPATH=/tmp/site:python GLA_LIBRARY=build-cuda/libgla.so LD_LIBRARY_PATH=build-cuda TRITON_CACHE_DIR=/tmp/tc \
        timeout ${TRAINING_TIMEOUT:-500} python3 bench/cuda/bench_training.py --fla-tune-ms 5,20 --cases "${TRAINING_CASES:-}" \
        --autotune-dir bench/cuda/fla_autotune --autotune-out "$LOG/fla_autotune" --json "$LOG/training.json" 2>&1 \
        | tee "$LOG/training.log" | grep -v Warn; autotune_harvest ;;
    dropin) # fla's GLAForCausalLM on fla's kernels and on libgla (bench/fla_model_dropin.py; carry
      # .whl-fla, the wheels of its docstring): DROPIN_CONFIGS (default 1024x8), DROPIN_ARGS extra flags
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_fla .whl-fla/*.whl
      autotune_seed
      PYTHONPATH=/tmp/site_fla:python LD_LIBRARY_PATH=build-cuda PYTHONUNBUFFERED=1 \
        timeout ${DROPIN_TIMEOUT:-500} python3 bench/fla_model_dropin.py --lib build-cuda/libgla.so --out "$LOG" \
        --fla-tune-ms 5,20 --configs ${DROPIN_CONFIGS:-1024x8} ${DROPIN_ARGS:-} 2>&1 | tee "$LOG/dropin.log" | grep -v Warn
      autotune_harvest ;;
    torchprof) # the torch backend's forward+backward on the GPU (bench/torch_backend_bench.py), one
      # call under torch.profiler: kernel time against wall time, launches, top kernels
      PYTHONPATH=python GLA_LIBRARY=build-cuda/libgla.so LD_LIBRARY_PATH=build-cuda PYTHONUNBUFFERED=1 \
        timeout ${TORCHPROF_TIMEOUT:-200} python3 bench/torch_backend_bench.py --cuda --repeat 5 --profile 2>&1 | tee "$LOG/torchprof.log" ;;
    torchblocks) # the torch backend's forward+backward against fla at several block budgets
      # (TORCH_BLOCK_GIB, GiB; bench/torch_backend_bench.py --block-gib): fewer, larger blocks launch
      # fewer ops (census at B8 T4096 H16 D128: 1797 ops at 1 GiB, 1277 at 2, 911 at 4)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
      autotune_seed
      PYTHONPATH=/tmp/site:python GLA_LIBRARY=build-cuda/libgla.so LD_LIBRARY_PATH=build-cuda PYTHONUNBUFFERED=1 \
        timeout ${TORCHBLOCKS_TIMEOUT:-400} python3 bench/torch_backend_bench.py --cuda --repeat 5 \
        --block-gib ${TORCH_BLOCK_GIB:-1,2,3} 2>&1 | tee "$LOG/torchblocks.log" | grep -v Warn ;;
    *) echo "unknown step $step" ;;
  esac
  # Packed after every step too: a call stopped at its time limit (SIGKILL skips the EXIT trap)
  # still returns the logs of the steps that finished.
  tar -czf "$OUT/logs.tgz" -C "$OUT" logs
done
