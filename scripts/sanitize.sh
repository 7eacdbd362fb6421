#!/usr/bin/env bash
# The sanitizer and fuzzing jobs of CI (called by scripts/test.sh), clang from Debian, CUDA off:
#   build-asan  core + reference + cpu backends with AddressSanitizer + UndefinedBehaviorSanitizer
#               (and libFuzzer coverage): the C++ tests named in ASAN_TESTS, then each libFuzzer
#               target for FUZZ_SECONDS from its seed corpus (tests/fuzz/corpus).
#   build-tsan  the same with ThreadSanitizer: the concurrency tests (and the registry stress test).
# FUZZ_SECONDS=0 skips the fuzzing; a long run over many cores: scripts/fuzz_long.sh.
# The builds: scripts/sanitizer_build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-30}
# build-asan runs the cpu backend's portable kernels only (tests/fuzz/portable_kernels_only.h).
# The C++ tests whose code paths the sanitizers check: validation and every bad-input class, the
# registry and plug-ins, workspaces, saved chunk states, hard-reset gates, the command line, and the
# cpu backend on one grid slice. The whole grid under ASan is ~10x its plain time.
ASAN_TESTS=${ASAN_TESTS:-'Validation*:InputCheck*:Overflow*:OptionsSize*:Overlap*:CallbackMessages*:Cli*:Registry*:Plugins*:Fastest*:Capabilit*:Workspace*:ChunkStates*:HardReset*:Concurrency*:Oracle*:Reference*:CpuBackend.StridedInputsAndStates:CpuBackend.StagesMixWithReferenceStages:CpuBackend.PartialGradientRequests:ExtremeInputs*:-ExtremeInputs.MillionTokenSequenceOnCpu'}
TSAN_TESTS=${TSAN_TESTS:-'Concurrency*:Registry.ConcurrentCallsWhileRegistering:FastestStress*:Fastest.ConcurrentFirstCallsMeasureOnce'}

status=0
start=$(date +%s)
scripts/sanitizer_build.sh asan
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
build-asan/tests/cpp/gla_tests --gtest_brief=1 "--gtest_filter=$ASAN_TESTS" || status=1
echo "sanitize: asan+ubsan tests done after $(( $(date +%s) - start )) s"
if [ "$FUZZ_SECONDS" -gt 0 ]; then
  for target in c_abi cli_args; do
    work=$(mktemp -d)
    # New inputs go to the scratch directory; the committed seeds are only read.
    if ! build-asan/tests/fuzz/fuzz_$target -max_total_time="$FUZZ_SECONDS" -timeout=20 -rss_limit_mb=4096 \
        -print_final_stats=1 "$work" "tests/fuzz/corpus/$target" >"$work.log" 2>&1; then
      status=1
      tail -60 "$work.log"
    fi
    echo "sanitize: fuzz_$target: $(grep -h 'stat::number_of_executed_units' "$work.log" || echo 'no stats')"
    rm -rf "$work" "$work.log"
  done
  echo "sanitize: fuzzing done after $(( $(date +%s) - start )) s"
fi

scripts/sanitizer_build.sh tsan gla_tests
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 build-tsan/tests/cpp/gla_tests --gtest_brief=1 \
  "--gtest_filter=$TSAN_TESTS" || status=1
echo "sanitize: tsan done after $(( $(date +%s) - start )) s"
exit $status
