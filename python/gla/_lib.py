"""ctypes binding of libgla's C ABI (include/gla/gla.h).

The registry calls (backends, explain, selection), the `torch` backend's callbacks and the fallback
kernels (_ctypes_kernels.py) reach libgla through ctypes; the operators' hot path is C++
(libgla_torch, gla/csrc/). The structs below mirror gla.h field for field; GLA_ABI_VERSION guards
the callback table.

Library search order: next to this package (where `pip install .` puts it), then $GLA_LIBRARY (a
file, or a folder holding libgla.so), then the build trees of a source checkout (build*/ at the
repository root, newest first).
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
import threading
from typing import List, Optional

ABI_VERSION = 1
MAX_RANK = 6

# gla_status
OK, INVALID_ARGUMENT, NOT_SUPPORTED, BACKEND_ERROR, OUT_OF_MEMORY, INTERNAL_ERROR = range(6)
# gla_dtype
F32, F16, BF16, F64, I32, I64 = range(6)
# gla_device_type (DLPack codes)
DEVICE_CPU, DEVICE_CUDA, DEVICE_CUDA_HOST, DEVICE_OPENCL = 1, 2, 3, 4
DEVICE_VULKAN, DEVICE_METAL, DEVICE_ROCM, DEVICE_EXT, DEVICE_ONEAPI = 7, 8, 10, 12, 14
# gla_policy
POLICY_DEFAULT, POLICY_PRIORITY, POLICY_FORCED, POLICY_FASTEST = range(4)
POLICY_NAMES = {"default": POLICY_DEFAULT, "priority": POLICY_PRIORITY, "forced": POLICY_FORCED,
                "fastest": POLICY_FASTEST}
# gla_unit
UNIT_CHUNK_FWD, UNIT_CHUNK_BWD = 0, 1


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("sizes", ctypes.c_int64 * MAX_RANK),
        ("strides", ctypes.c_int64 * MAX_RANK),
    ]


TensorP = ctypes.POINTER(Tensor)


class Options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("has_scale", ctypes.c_int32),
        ("scale", ctypes.c_double),
        ("state_v_first", ctypes.c_int32),
        ("backend", ctypes.c_char_p),
        ("policy", ctypes.c_int32),
        ("force_stage_pipeline", ctypes.c_int32),
        ("check_inputs", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]


class ForwardArgs(ctypes.Structure):
    _fields_ = [(name, TensorP) for name in
                ("q", "k", "v", "g", "initial_state", "cu_seqlens", "cu_seqlens_host", "o", "final_state")]


class BackwardArgs(ctypes.Structure):
    _fields_ = [(name, TensorP) for name in
                ("q", "k", "v", "g", "initial_state", "cu_seqlens", "cu_seqlens_host", "do_", "dht",
                 "dq", "dk", "dv", "dg", "dh0")]


class Problem(ctypes.Structure):
    _fields_ = [
        ("unit", ctypes.c_int32),
        ("backward", ctypes.c_int32),
        ("B", ctypes.c_int64), ("T", ctypes.c_int64), ("H", ctypes.c_int64),
        ("K", ctypes.c_int64), ("V", ctypes.c_int64), ("N", ctypes.c_int64),
        ("gate_per_head", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("gate_dtype", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("scale", ctypes.c_double),
        ("state_v_first", ctypes.c_int32),
        ("seq_offsets", ctypes.POINTER(ctypes.c_int64)),
        ("varlen", ctypes.c_int32),
    ] + [(name, Tensor) for name in ("q", "k", "v", "g", "initial_state", "cu_seqlens", "o", "final_state",
                                     "do_", "dht", "dq", "dk", "dv", "dg", "dh0")] + [
        ("chunk_size", ctypes.c_int64),
        ("num_chunks", ctypes.c_int64),
        ("chunk_offsets", ctypes.POINTER(ctypes.c_int64)),
    ] + [(name, Tensor) for name in ("gcum", "h", "A", "dh", "dA", "dq_intra", "dk_intra")] + [
        ("stream", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]


ProblemP = ctypes.POINTER(Problem)
AvailableFn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
VerifyFn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ProblemP, ctypes.c_void_p, ctypes.c_size_t)
RunFn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ProblemP, ctypes.c_void_p, ctypes.c_size_t)
WorkspaceFn = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ProblemP)


class BackendDesc(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("name", ctypes.c_char_p),
        ("priority", ctypes.c_int32),
        ("device_mask", ctypes.c_uint64),
        ("unit_mask", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("available", AvailableFn),
        ("verify", VerifyFn),
        ("run", RunFn),
        ("workspace_size", WorkspaceFn),
    ]


def _candidates() -> List[str]:
    names = {"linux": ["libgla.so"], "darwin": ["libgla.dylib", "libgla.so"], "win32": ["gla.dll", "libgla.dll"]}
    libnames = names.get(sys.platform, ["libgla.so"])
    here = os.path.dirname(os.path.abspath(__file__))
    found = [os.path.join(here, n) for n in libnames]
    env = os.environ.get("GLA_LIBRARY")
    if env:
        found += [os.path.join(env, n) for n in libnames] if os.path.isdir(env) else [env]
    root = os.path.dirname(os.path.dirname(here))  # python/gla -> repository root
    builds = []
    for n in libnames:
        builds += glob.glob(os.path.join(root, "build*", n))
    builds.sort(key=lambda p: os.path.getmtime(p), reverse=True)
    return found + builds


_lib = None
_lock = threading.Lock()


def _declare(lib):
    c = ctypes
    sigs = {
        "gla_last_error": (c.c_char_p, []),
        "gla_status_name": (c.c_char_p, [c.c_int]),
        "gla_version": (c.c_char_p, []),
        "gla_options_init": (None, [c.POINTER(Options)]),
        "gla_chunk_forward": (c.c_int, [c.POINTER(ForwardArgs), c.POINTER(Options)]),
        "gla_chunk_backward": (c.c_int, [c.POINTER(BackwardArgs), c.POINTER(Options)]),
        "gla_chunk_forward_workspace_size": (c.c_int, [c.POINTER(ForwardArgs), c.POINTER(Options), c.POINTER(c.c_size_t)]),
        "gla_chunk_backward_workspace_size": (c.c_int, [c.POINTER(BackwardArgs), c.POINTER(Options), c.POINTER(c.c_size_t)]),
        "gla_chunk_forward_saving_states": (c.c_int, [c.POINTER(ForwardArgs), c.POINTER(Tensor), c.POINTER(Options)]),
        "gla_chunk_backward_from_states": (c.c_int, [c.POINTER(BackwardArgs), c.POINTER(Tensor), c.POINTER(Options)]),
        "gla_unit_name": (c.c_char_p, [c.c_int32]),
        "gla_backend_count": (c.c_int32, []),
        "gla_backend_info": (c.c_int, [c.c_int32, c.POINTER(c.c_char_p), c.POINTER(c.c_int32), c.POINTER(c.c_int32),
                                       c.POINTER(c.c_char_p)]),
        "gla_backend_set_enabled": (c.c_int, [c.c_char_p, c.c_int32]),
        "gla_reload_environment": (c.c_int, []),
        "gla_explain": (c.c_int, [c.POINTER(ForwardArgs), c.POINTER(BackwardArgs), c.POINTER(Options),
                                  c.POINTER(c.c_char_p)]),
        "gla_register_backend": (c.c_int, [c.POINTER(BackendDesc)]),
        "gla_unregister_backend": (c.c_int, [c.c_char_p]),
        "gla_load_plugin": (c.c_int, [c.c_char_p]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def library():
    """The loaded libgla (ctypes.CDLL), loading it on first use."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if not os.path.isfile(path):
                tried.append(f"{path} (not found)")
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            _declare(lib)
            _lib = lib
            _lib.path = path
            return _lib
        raise ImportError("gla: cannot load the libgla shared library. Install the package with `pip install .` "
                          "or set GLA_LIBRARY to the built library (e.g. build/libgla.so). Tried:\n  "
                          + "\n  ".join(tried))


class GlaError(RuntimeError):
    """A libgla failure that is neither an invalid argument nor a dtype problem."""


def raise_for(status: int, context: str = "") -> None:
    """Turns a failing gla_status into ValueError (invalid argument), TypeError (dtype problems) or
    RuntimeError (anything else), carrying the core's message."""
    if status == OK:
        return
    lib = library()
    message = (lib.gla_last_error() or b"").decode("utf-8", "replace")
    if not message:
        message = (lib.gla_status_name(status) or b"unknown status").decode()
    if context:
        message = f"{context}: {message}"
    if status == INVALID_ARGUMENT:
        if "dtype" in message.split("\n", 1)[0]:
            raise TypeError(message)
        raise ValueError(message)
    if status == OUT_OF_MEMORY:
        raise MemoryError(message)
    raise GlaError(message)


_TAGGED = re.compile(r"\[gla:(\w+)\] ", re.S)
_CLASSES = {"ValueError": ValueError, "TypeError": TypeError, "MemoryError": MemoryError, "GlaError": GlaError}


def python_error(error: BaseException) -> BaseException:
    """The exception libgla_torch meant: its C++ kernels can only raise RuntimeError through PyTorch's
    stable ABI, so their message starts with the Python class, "[gla:ValueError] q: expected ...".
    Anything else is returned unchanged."""
    match = _TAGGED.search(str(error))
    if match is None or match.group(1) not in _CLASSES:
        return error
    return _CLASSES[match.group(1)](str(error)[match.end():])


def make_options(scale: Optional[float], state_v_first: bool, backend: str, policy: int,
                 stream: Optional[int] = None, workspace: Optional[int] = None, workspace_bytes: int = 0,
                 check_inputs: bool = False, force_stage_pipeline: bool = False) -> Options:
    opts = Options()
    library().gla_options_init(ctypes.byref(opts))
    if scale is not None:
        opts.has_scale = 1
        opts.scale = float(scale)
    opts.state_v_first = int(bool(state_v_first))
    opts.backend = backend.encode() if backend else None
    opts.policy = int(policy)
    opts.check_inputs = int(bool(check_inputs))
    opts.force_stage_pipeline = int(bool(force_stage_pipeline))
    opts.stream = stream or None
    opts.workspace = workspace or None
    opts.workspace_bytes = int(workspace_bytes)
    return opts
