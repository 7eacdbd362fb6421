#!/usr/bin/env bash
# Sets everything up, builds, and runs every test: the C++ suite through CTest, then the Python
# suite through pytest. GPU tests skip with a message where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
status=0
( cd build && ctest --output-on-failure -j "$(nproc)" ) || status=1
if [ -d tests/python ] && ls tests/python/test_*.py >/dev/null 2>&1; then
  GLA_LIBRARY="$PWD/build/libgla.so" python3 -m pytest -q tests/python || status=1
fi
exit $status
