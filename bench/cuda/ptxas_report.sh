#!/bin/bash
# ptxas's report on the cuda backend's kernels, from this machine (no GPU needed): per kernel and
# architecture the registers and spill bytes, and every C7520 ("wgmma.mma_async instructions are
# serialized"), which ptxas prints as info, not as a warning. Run it after changing a kernel that
# uses wgmma: in 4de3526 one branch on a barrier's result made ptxas serialise every wgmma of the
# dq/dk/dg kernel, its value loop's included (dqk 947 -> 970 us at B8 T4096 H16 D128, H100).
# Usage: bench/cuda/ptxas_report.sh [build dir, default build-cuda]; exits 1 on any C7520.
# Recompiles each object with its own command (ninja -t commands) plus -Xptxas -v, into a
# temporary file: the build itself is untouched.
set -o pipefail
build=${1:-build-cuda}
out=$(mktemp --suffix .o)
trap 'rm -f "$out"' EXIT
serialised=0
objects=$(ninja -C "$build" -t targets all | grep -o "src/backends/cuda/CMakeFiles/[A-Za-z_]*\.dir/[A-Za-z_0-9]*\.cu\.o" | sort -u)
[ -n "$objects" ] || { echo "no CUDA objects in $build (configured with -DGLA_CUDA=ON?)"; exit 2; }
printf "%-7s %5s %7s %7s  %s\n" arch regs spill_st spill_ld kernel
for object in $objects; do
  command=$(ninja -C "$build" -t commands "$object" | tail -1)
  report=$(cd "$build" && eval "${command/-o $object/-o $out} -Xptxas -v" 2>&1) || { echo "$object: compile failed"; echo "$report" | tail -5; exit 2; }
  echo "$report" | awk '
    /Compiling entry function/ { split($0, a, "'"'"'"); name = a[2]; arch = a[4] }
    /spill stores/ { st = $5; ld = $9 }
    /Used [0-9]+ registers/ && name != "" { for (i = 1; i <= NF; ++i) if ($i == "Used") regs = $(i + 1); print arch, regs, st, ld, name; name = ""; st = ld = 0 }
  ' | while read -r arch regs st ld name; do
    printf "%-7s %5s %7s %7s  %s\n" "$arch" "$regs" "$st" "$ld" "$(echo "$name" | c++filt | cut -c1-110)"
  done
  if echo "$report" | grep -q "C7520"; then
    serialised=1
    echo "$report" | grep "C7520" | sed "s/^/$(basename "$object"): /"
  fi
done
exit $serialised
