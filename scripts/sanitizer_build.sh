#!/usr/bin/env bash
# Configures and builds a sanitizer build of libgla with Debian's clang, CUDA off (used by
# scripts/sanitize.sh and scripts/fuzz_long.sh):
#   scripts/sanitizer_build.sh asan [targets...]   build-asan: AddressSanitizer + UndefinedBehaviorSanitizer
#                                                  and libFuzzer coverage, with the fuzz targets
#   scripts/sanitizer_build.sh tsan [targets...]   build-tsan: ThreadSanitizer
# Both run the cpu backend's portable kernels only (tests/fuzz/portable_kernels_only.h says why).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=$1
shift

configure() {  # dir, sanitizer flags, extra CMake arguments
  local flags="-O1 -g -fno-omit-frame-pointer $2 -include $PWD/tests/fuzz/portable_kernels_only.h"
  CC=clang CXX=clang++ cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=None -DGLA_CUDA=OFF -DGLA_BUILD_BENCH=OFF \
    "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags" "${@:3}" >/dev/null
}

case $kind in
  asan)
    configure build-asan "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fsanitize=fuzzer-no-link" \
      -DGLA_BUILD_FUZZ=ON "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" \
      "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" "-DCMAKE_MODULE_LINKER_FLAGS=-fsanitize=address,undefined"
    ninja -C build-asan "$@"
    ;;
  tsan)
    configure build-tsan "-fsanitize=thread" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" \
      "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread" "-DCMAKE_MODULE_LINKER_FLAGS=-fsanitize=thread"
    ninja -C build-tsan "$@"
    ;;
  *)
    echo "usage: scripts/sanitizer_build.sh asan|tsan [ninja targets...]" >&2
    exit 2
    ;;
esac
