# Sourced by the variant builders in this folder (state_store_variants.sh, state_scaling_even.sh):
# moves to the repository root, requires the ws kernel's file to be as committed and restores it on
# exit, and defines build_as NAME, which builds the working tree's libgla.so and libgla_torch.so in
# build-cuda/ (configured already) and copies them into build-cuda/variants/NAME/.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
kernel=src/backends/cuda/chunk_forward_ws_kernel.cuh
git diff --quiet -- "$kernel" || { echo "$kernel has uncommitted changes" >&2; exit 1; }
restore() { git checkout -q -- "$kernel"; }
trap restore EXIT
build_as() {
  ninja -C build-cuda gla gla_torch > /dev/null
  mkdir -p "build-cuda/variants/$1"
  cp build-cuda/libgla.so build-cuda/libgla_torch.so "build-cuda/variants/$1/"
  echo "built build-cuda/variants/$1"
}
