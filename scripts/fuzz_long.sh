#!/usr/bin/env bash
# A long libFuzzer run of every target in tests/fuzz, for the execution count in docs/reliability.md:
#   scripts/fuzz_long.sh [SECONDS] [JOBS]        (defaults: 3600 s per target, nproc jobs)
# Each target runs JOBS libFuzzer processes at once (-jobs=JOBS -workers=JOBS) for SECONDS each, in
# the ASan + UBSan build (build-asan, from scripts/sanitizer_build.sh),
# starting from a copy of its seed corpus. Everything lands in build-asan/fuzz-long/<target>/: the
# grown corpus, each job's log (fuzz-N.log) and any crash-, timeout-, oom- or leak- input. Prints
# each target's executions and crashes and the totals; exits 1 when anything crashed.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-3600}
JOBS=${2:-$(nproc)}
ROOT=$PWD
scripts/sanitizer_build.sh asan fuzz_c_abi fuzz_cli_args >/dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

total_runs=0
total_crashes=0
for target in c_abi cli_args; do
  dir=$ROOT/build-asan/fuzz-long/$target
  mkdir -p "$dir/corpus" "$dir/artifacts"
  rm -f "$dir"/fuzz-*.log
  cp -n "$ROOT/tests/fuzz/corpus/$target/"* "$dir/corpus/"
  start=$(date +%s)
  # -jobs writes each job's output to fuzz-<n>.log in the working directory.
  (cd "$dir" && "$ROOT/build-asan/tests/fuzz/fuzz_$target" -jobs="$JOBS" -workers="$JOBS" \
      -max_total_time="$SECONDS_PER_TARGET" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$dir/artifacts/" "$dir/corpus" >"$dir/run.log" 2>&1) || true
  runs=0
  for log in "$dir"/fuzz-*.log; do
    [ -f "$log" ] || continue
    # The final stats line; a job that died without it counts its last progress line (#N ...).
    n=$(grep -h 'stat::number_of_executed_units' "$log" | tail -1 | awk '{print $2}')
    [ -n "$n" ] || n=$(grep -ho '^#[0-9]*' "$log" | tail -1 | tr -d '#')
    runs=$((runs + ${n:-0}))
  done
  crashes=$(find "$dir/artifacts" -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | wc -l)
  echo "fuzz_long: fuzz_$target: $runs executions, $crashes crashes, $JOBS jobs x ${SECONDS_PER_TARGET} s" \
       "($(( $(date +%s) - start )) s wall), corpus $(ls "$dir/corpus" | wc -l) inputs"
  total_runs=$((total_runs + runs))
  total_crashes=$((total_crashes + crashes))
done
echo "fuzz_long: total $total_runs executions, $total_crashes crashes"
[ "$total_crashes" -eq 0 ]
