#!/usr/bin/env bash
# Installs what libgla needs to build and test, from Debian's packages and PyPI (pinned in
# requirements-test.txt). Idempotent: a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

# clang and libclang-rt-14-dev (its sanitizer runtimes and libFuzzer): the sanitizer and fuzzing builds
# of scripts/test.sh.
debian_packages=(cmake ninja-build g++ libgtest-dev libbenchmark-dev python3 clang libclang-rt-14-dev)
missing=()
for p in "${debian_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
if [ -f requirements-test.txt ]; then
  # pip is quiet and fast when everything pinned is already there.
  if ! "$PYTHON" -m pip install -q --disable-pip-version-check -r requirements-test.txt; then
    echo "setup: pip install -r requirements-test.txt failed" >&2
    exit 1
  fi
fi
