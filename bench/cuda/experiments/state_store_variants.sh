#!/bin/bash
# Timing-only variants of how the warp-specialised chunk kernel stores the chunk states (S in the
# training forward, dS in the backward's reversed forward), to tell what the ~69 us those stores
# add to each ws pass at B8 T4096 H16 D128 (ncu, H100) is made of. Results of the variants are
# wrong; they only time. Built into build-cuda/variants/<name>/ (libgla.so, libgla_torch.so) from
# the working tree, which is restored afterwards:
#   staging   the stmatrix staging and shared loads as shipped, no global store (the loaded words
#             go to a sink stored only under an impossible condition)
#   none      no chunk states stored at all
#   bulk      the rows leave the stage by 32-byte cp.async.bulk copies (commit 4169eab)
# If staging ~ none, the global stores are the cost (bytes or back-pressure), and bulk says whether
# taking them off the warps helps; if staging ~ shipped, the staging is. Time them with
# `AB_VARIANTS="staging none bulk" bash bench/cuda/device_run.sh variants` (carry build-cuda/libgla.so,
# build-cuda/libgla_torch.so and build-cuda/variants).
source "$(dirname "$0")/variant_lib.sh"
python3 - "$kernel" <<'PY'
import sys
path = sys.argv[1]
s = open(path).read()
store = """        *reinterpret_cast<uint4*>(block + key * st[3] + half * 8) =
            *reinterpret_cast<const uint4*>(stage + r * pitch + vrow + half * 8);"""
assert store in s, "store_chunk_state_staged's store not found"
s = s.replace(store, """        const uint4 x = *reinterpret_cast<const uint4*>(stage + r * pitch + vrow + half * 8);
        sink ^= x.x ^ x.y ^ x.z ^ x.w;""")
head = "  const bool values_lo = v0 + vrow < p.V, values_hi = v0 + vrow + 8 < p.V;\n"
assert head in s
s = s.replace(head, head + "  uint32_t sink = 0;\n", 1)
tail = "  __syncwarp();  // the rows are read before the caller writes the columns again\n}"
assert tail in s
s = s.replace(tail, "  if (sink == 0x9e3779b9u && p.K == 7) block[0] = static_cast<uint16_t>(sink);\n" + tail, 1)
open(path, "w").write(s)
PY
build_as staging
restore
sed -i 's/const bool store_state = full && p.chunk_states != nullptr;/const bool store_state = false \&\& full \&\& p.chunk_states != nullptr;/' "$kernel"
git diff --quiet -- "$kernel" && { echo "the store_state line was not found" >&2; exit 1; }
build_as none
restore
git show 4169eab -- "$kernel" | git apply
build_as bulk
restore
ninja -C build-cuda gla gla_torch > /dev/null  # the shipped library again in build-cuda/
