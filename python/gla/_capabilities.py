"""gla.capabilities: a backend's declaration (gla_capability records, gla.h) as dictionaries."""
from __future__ import annotations

import ctypes
from typing import Dict, List

from . import _lib, _ops

DTYPES = {_lib.F32: "float32", _lib.F16: "float16", _lib.BF16: "bfloat16"}
FEATURES = ("varlen", "initial_state", "final_state", "state_v_first", "per_key_gate", "per_head_gate",
            "chunk_states", "value_gate", "reverse", "state_pool", "token_states", "chunk_states_bf16")
UNITS = ("chunk_fwd", "chunk_bwd", "cumsum", "fwd_h", "fwd_intra", "fwd_o", "bwd_dh", "bwd_dv", "bwd_dA",
         "bwd_dqk_intra", "bwd_dqkg", "recurrent_fwd", "recurrent_bwd")
DEVICES = {_lib.DEVICE_CPU: "cpu", _lib.DEVICE_CUDA: "cuda", _lib.DEVICE_CUDA_HOST: "cuda_host",
           _lib.DEVICE_OPENCL: "opencl", _lib.DEVICE_VULKAN: "vulkan", _lib.DEVICE_METAL: "metal",
           _lib.DEVICE_ROCM: "rocm", _lib.DEVICE_EXT: "ext", _lib.DEVICE_ONEAPI: "oneapi"}


class Capability(ctypes.Structure):
    _fields_ = [("unit_mask", ctypes.c_uint64), ("device_mask", ctypes.c_uint64),
                ("min_compute_capability", ctypes.c_int32), ("dtype_mask", ctypes.c_uint32),
                ("gate_dtype_mask", ctypes.c_uint32), ("k_min", ctypes.c_int64), ("k_max", ctypes.c_int64),
                ("v_min", ctypes.c_int64), ("v_max", ctypes.c_int64), ("features", ctypes.c_uint32),
                ("layout", ctypes.c_uint32), ("alignment", ctypes.c_uint32), ("deterministic", ctypes.c_int32)]


def _bits(mask: int, names) -> List[str]:
    items = names.items() if isinstance(names, dict) else enumerate(names)
    return [name for bit, name in items if mask >> bit & 1]


def capabilities(name: str) -> List[Dict]:
    """The records backend `name` declares: units, devices, min_compute_capability (10 * major +
    minor, 0 = none), dtypes, gate_dtypes, k and v as (min, max) with max None for no limit,
    features, layout ("any", "last_dim_contiguous" or "contiguous"), alignment, deterministic."""
    lib = _ops.ensure_loaded()
    fn = lib.gla_backend_capabilities
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(Capability)), ctypes.POINTER(ctypes.c_int32)]
    records, count = ctypes.POINTER(Capability)(), ctypes.c_int32()
    _lib.raise_for(fn(name.encode(), ctypes.byref(records), ctypes.byref(count)))
    out = []
    for i in range(count.value):
        c = records[i]
        out.append({
            "units": _bits(c.unit_mask, UNITS), "devices": _bits(c.device_mask, DEVICES),
            "min_compute_capability": c.min_compute_capability,
            "dtypes": _bits(c.dtype_mask, DTYPES), "gate_dtypes": _bits(c.gate_dtype_mask, DTYPES),
            "k": (c.k_min, c.k_max or None), "v": (c.v_min, c.v_max or None),
            "features": _bits(c.features, FEATURES),
            "layout": "contiguous" if c.layout & 2 else "last_dim_contiguous" if c.layout & 1 else "any",
            "alignment": c.alignment, "deterministic": bool(c.deterministic)})
    return out
