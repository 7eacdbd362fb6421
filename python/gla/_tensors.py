"""torch.Tensor <-> gla_tensor descriptors.

Outbound (Python calling libgla): a descriptor is the tensor's data pointer, dtype, device, sizes
and element strides; nothing is copied. While a call is in flight, the tensors handed over are kept
in a thread-local table so that the `torch` backend's callback, running inside that call on the
same thread, turns each descriptor back into the very torch.Tensor it came from. This works on every
device PyTorch has (CPU, CUDA, NPU, MPS, XPU): no pointer arithmetic, no device-specific import.

Inbound descriptors that were not handed over by Python (a C caller using the `torch` backend) are
wrapped through a DLPack capsule built here with ctypes, which PyTorch reads for CPU and CUDA memory.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Dict, Optional

import torch

from . import _lib

_TO_GLA_DTYPE = {torch.float32: _lib.F32, torch.float16: _lib.F16, torch.bfloat16: _lib.BF16,
                 torch.float64: _lib.F64, torch.int32: _lib.I32, torch.int64: _lib.I64}
_FROM_GLA_DTYPE = {v: k for k, v in _TO_GLA_DTYPE.items()}


def device_code(device: torch.device) -> int:
    """DLPack device code of a torch device (what gla_tensor.device_type holds)."""
    t = device.type
    if t == "cpu":
        return _lib.DEVICE_CPU
    if t == "cuda":
        return _lib.DEVICE_ROCM if getattr(torch.version, "hip", None) else _lib.DEVICE_CUDA
    if t == "mps":
        return _lib.DEVICE_METAL
    if t == "xpu":
        return _lib.DEVICE_ONEAPI
    return _lib.DEVICE_EXT  # Ascend NPU (torch_npu), privateuse1 devices, ...


def describe(name: str, t: Optional[torch.Tensor]) -> Optional[_lib.Tensor]:
    """A descriptor over t's memory (None for None)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    dtype = _TO_GLA_DTYPE.get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name}: expected dtype float32, float16, bfloat16, int32 or int64, got {t.dtype}")
    if t.dim() > _lib.MAX_RANK:
        raise ValueError(f"{name}: expected at most {_lib.MAX_RANK} dimensions, got shape {list(t.shape)}")
    d = _lib.Tensor()
    d.data = t.data_ptr() if t.numel() > 0 else None
    d.dtype = dtype
    d.device_type = device_code(t.device)
    d.device_index = t.device.index if t.device.index is not None else 0
    d.rank = t.dim()
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        d.sizes[i] = size
        d.strides[i] = stride
    return d


# ---- the thread-local table of tensors handed to libgla in the call in flight ----
_inflight = threading.local()


@contextlib.contextmanager
def handed_over(*tensors: Optional[torch.Tensor]):
    """Registers tensors for the duration of one libgla call on this thread (re-entrant)."""
    table: Dict[int, list] = getattr(_inflight, "table", None)
    outer = table
    table = dict(outer) if outer else {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            table.setdefault(t.data_ptr(), []).append(t)
    _inflight.table = table
    try:
        yield
    finally:
        _inflight.table = outer


def _sizes_strides(d: _lib.Tensor):
    return [d.sizes[i] for i in range(d.rank)], [d.strides[i] for i in range(d.rank)]


def to_torch(d: _lib.Tensor) -> Optional[torch.Tensor]:
    """The torch.Tensor a descriptor from libgla refers to (None for an absent one)."""
    if d.rank == 0 and not d.data:
        return None
    sizes, strides = _sizes_strides(d)
    dtype = _FROM_GLA_DTYPE.get(d.dtype)
    if dtype is None:
        raise TypeError(f"descriptor has unknown dtype code {d.dtype}")
    if not d.data:
        return torch.empty(sizes, dtype=dtype, device=_device_of(d))
    table = getattr(_inflight, "table", None) or {}
    for t in table.get(d.data, ()):
        if t.dtype == dtype and device_code(t.device) == d.device_type:
            if list(t.shape) == sizes and list(t.stride()) == strides:
                return t
            return torch.as_strided(t, sizes, strides, t.storage_offset())
    inside = _view_inside(table, d, dtype, sizes, strides)
    if inside is not None:
        return inside
    return _from_dlpack(d, dtype, sizes, strides)


def _view_inside(table, d: _lib.Tensor, dtype, sizes, strides) -> Optional[torch.Tensor]:
    """A view of the handed-over tensor whose storage holds d's memory (a stage buffer inside the
    workspace), or None. This is what reaches memory of devices DLPack cannot wrap."""
    esize = torch.empty(0, dtype=dtype).element_size()
    for tensors in table.values():
        for t in tensors:
            if device_code(t.device) != d.device_type:
                continue
            storage = t.untyped_storage()
            offset = d.data - storage.data_ptr()
            if not 0 <= offset < storage.nbytes() or offset % esize:
                continue
            usable = storage.nbytes() - storage.nbytes() % esize
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (usable,), (1,))
            return raw.view(dtype).as_strided(sizes, strides, offset // esize)
    return None


def _device_of(d: _lib.Tensor) -> torch.device:
    if d.device_type in (_lib.DEVICE_CPU, _lib.DEVICE_CUDA_HOST):
        return torch.device("cpu")
    if d.device_type in (_lib.DEVICE_CUDA, _lib.DEVICE_ROCM):
        return torch.device("cuda", d.device_index)
    raise RuntimeError(f"cannot wrap memory of device type {d.device_type} that was not handed over by PyTorch")


# ---- DLPack fallback ----
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_DL_CODES = {_lib.F32: (2, 32), _lib.F16: (2, 16), _lib.BF16: (4, 16), _lib.F64: (2, 64),
             _lib.I32: (0, 32), _lib.I64: (0, 64)}
_alive: Dict[int, tuple] = {}  # managed-tensor address -> (struct, shape, strides), until PyTorch frees it
_alive_lock = threading.Lock()


def _release(managed_ptr):
    with _alive_lock:
        _alive.pop(ctypes.addressof(managed_ptr.contents), None)


_release_fn = _Deleter(_release)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _from_dlpack(d: _lib.Tensor, dtype, sizes, strides) -> torch.Tensor:
    device = _device_of(d)
    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * max(1, d.rank))(*sizes)
    stride = (ctypes.c_int64 * max(1, d.rank))(*strides)
    dl = managed.dl_tensor
    dl.data = d.data
    dl.device = _DLDevice(1 if device.type == "cpu" else d.device_type, d.device_index if device.type != "cpu" else 0)
    dl.ndim = d.rank
    code, bits = _DL_CODES[d.dtype]
    dl.dtype = _DLDataType(code, bits, 1)
    dl.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    dl.strides = ctypes.cast(stride, ctypes.POINTER(ctypes.c_int64))
    dl.byte_offset = 0
    managed.deleter = _release_fn
    with _alive_lock:
        _alive[ctypes.addressof(managed)] = (managed, shape, stride)
    capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)
