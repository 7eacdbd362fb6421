#!/bin/bash
# Builds libgla.so and libgla_torch.so from a git ref into build-cuda/variants/<name>, for the
# `variants` step of device_run.sh (A/B of whole libraries through gla.chunk_gla, and the
# backward's gtests against each). The ref's tree is exported to build-cuda/variant-trees/<name>
# with the extraction time as every file's mtime (`tar -m`: git archive's mtimes are the commit's,
# which can predate the objects of an earlier build in the same folder, and ninja would then keep
# them) and built in build-cuda/variant-builds/<name>; the working tree and build-cuda/ itself
# are not touched:
#   bash bench/cuda/build_library_at.sh dc2ee3c tma
#   AB_VARIANTS=tma bash bench/cuda/device_run.sh variants   # on the device; carry build-cuda/variants/tma
set -euo pipefail
ref=${1:?git ref}
name=${2:?variant name}
root=$(git rev-parse --show-toplevel)
tree="$root/build-cuda/variant-trees/$name"
build="$root/build-cuda/variant-builds/$name"
rm -rf "$tree"
mkdir -p "$tree" "$build" "$root/build-cuda/variants/$name"
git -C "$root" archive "$ref" | tar -x -m -C "$tree"
export PATH=/usr/local/cuda/bin:$PATH
cmake -S "$tree" -B "$build" -G Ninja -DGLA_CUDA=ON -DCMAKE_BUILD_TYPE=Release > "$build/configure.log" 2>&1 ||
  { tail -20 "$build/configure.log"; exit 1; }
ninja -C "$build" gla gla_torch > "$build/build.log" 2>&1 || { grep -E "error" "$build/build.log" | head -20; exit 1; }
cp "$build/libgla.so" "$build/libgla_torch.so" "$root/build-cuda/variants/$name/"
echo "built build-cuda/variants/$name from $ref ($(git -C "$root" rev-parse --short "$ref"))"
