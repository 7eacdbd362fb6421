#!/usr/bin/env bash
# Sets everything up, builds, and runs every test: the C++ suite through CTest, then the Python
# suite through pytest. GPU tests skip with a message where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
status=0
( cd build && ctest --output-on-failure -j "$(nproc)" ) || status=1
# Say out loud which C++ tests skipped and why (GPU tests on a machine without an NVIDIA GPU).
log=build/Testing/Temporary/LastTest.log
if [ -f "$log" ] && grep -q ": Skipped" "$log"; then
  echo "C++ tests skipped: $(grep -c '^\[  SKIPPED \] .* ms)' "$log") — reasons:"
  grep -A1 ": Skipped$" "$log" | grep -v -e ": Skipped$" -e '^--$' | sort | uniq -c | sed 's/^/  /' || true
fi
# Sanitizers (ASan + UBSan over the C++ tests that matter, TSan over the concurrency tests) and a
# short libFuzzer run; scripts/sanitize.sh says what each runs.
scripts/sanitize.sh || status=1
if [ -d tests/python ] && ls tests/python/test_*.py >/dev/null 2>&1; then
  GLA_LIBRARY="$PWD/build/libgla.so" python3 -m pytest -q -rs tests/python || status=1
fi
exit $status
