"""fla's Triton autotune choices, kept from one device session to the next.

With TRITON_CACHE_AUTOTUNING=1, Triton (3.6, runtime/autotuner.py) writes each autotuned kernel's
timings of all its candidate configurations to TRITON_CACHE_DIR/<key>/<kernel>.autotune.json, where
<key> is a SHA-256 over the Triton install, the GPU target, the kernel's source, its tuning key
(shapes, dtypes) and the candidates. A later run that finds the file takes the best configuration
from it without timing any, and compiles only that one. The files are about a kilobyte each, where
the compiled candidates are ~100 MB (too large to bring back from the GPU machine), so the files are
what a device call keeps: seed() copies a folder of them into the cache before fla is imported,
harvest() copies the new ones out after the run. A file matches only the same Triton, fla, GPU
and shape; the rest are ignored and those kernels autotune as usual.

Used by bench_training.py (--autotune-dir / --autotune-out). On the GPU machine:
    python3 bench/cuda/bench_training.py --autotune-dir bench/cuda/fla_autotune --autotune-out $OUT/fla_autotune ...
    tar -czf $OUT/fla_autotune.tgz -C $OUT fla_autotune     # one file back (a call returns at most 8)
and here: unpack it over bench/cuda/fla_autotune/ and commit the new files.
"""
from __future__ import annotations

import glob
import os
import shutil

SUFFIX = ".autotune.json"


def cache_dir() -> str:
    """Triton's cache folder (TRITON_CACHE_DIR, else Triton's default, ~/.triton/cache)."""
    folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    os.environ["TRITON_CACHE_DIR"] = folder
    return folder


def _copy_new(src_root: str, dst_root: str) -> int:
    copied = 0
    for path in glob.glob(os.path.join(src_root, "*", "*" + SUFFIX)):
        key = os.path.basename(os.path.dirname(path))
        target = os.path.join(dst_root, key, os.path.basename(path))
        if os.path.exists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(path, target)
        copied += 1
    return copied


def seed(folder: str) -> int:
    """Turns Triton's autotune cache on (call before triton or fla is imported: the autotuners read
    the setting when fla defines its kernels) and copies folder's autotune files that the cache
    lacks into it. Returns how many were copied."""
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    return _copy_new(folder, cache_dir()) if os.path.isdir(folder) else 0


def harvest(folder: str) -> int:
    """Copies the cache's autotune files that folder lacks into folder. Returns how many."""
    return _copy_new(cache_dir(), folder)


def shorten_autotune(tune_ms: str) -> None:
    """Triton's autotune times each candidate configuration with triton.testing.do_bench (handed to
    the autotuner by Triton's NVIDIA driver when it first tunes): WARMUP,REP ms instead of 25,100."""
    import functools

    import triton.testing
    warmup, rep = (float(x) for x in tune_ms.split(","))
    triton.testing.do_bench = functools.partial(triton.testing.do_bench, warmup=warmup, rep=rep)
