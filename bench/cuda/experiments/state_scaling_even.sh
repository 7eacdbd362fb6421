#!/bin/bash
# A timing candidate for the bf16 D128 forward's STATE_SCALES instance (not adopted until measured):
# the state group's scaling of qloc/kloc spread evenly, 24 rows per thread (its own sub-chunk's 16
# rows of kw or qw, and 8 rows of kw's sub-chunk 1 or qw's sub-chunk 2) instead of 16 rows for the
# threads of sub-chunks 0 and 3 and 32 for those of 1 and 2, whose barrier after the scaling took
# 7.1% of the state group's stall samples (bench/results/cuda_backward.md). The factors are the
# shipped ones (the same sums), so o must be bitwise the same. ptxas (sm_90a): 20 B spill stores /
# 44 B loads against 28 / 32; per chunk one local load in the state loop (six shipped) and five
# loads and a store in the prep loop (none shipped).
# Builds build-cuda/variants/even24/ from the working tree plus state_scaling_even.patch (and
# build-cuda/variants/base/ from the working tree as is), restoring the tree afterwards:
#   bash bench/cuda/experiments/state_scaling_even.sh
#   AB="base even24" bash bench/cuda/experiments/forward_variant_ab.sh   # on the device; carry build-cuda/variants
source "$(dirname "$0")/variant_lib.sh"
build_as base
git apply bench/cuda/experiments/state_scaling_even.patch
build_as even24
restore
ninja -C build-cuda gla gla_torch > /dev/null  # the working tree's library again in build-cuda/
