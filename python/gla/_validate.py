"""Argument checks made in Python before a computation, where libgla's C ABI cannot make them.

- **meta tensors** carry shapes but no data: a real call on one cannot compute anything, so
  gla.chunk_gla rejects them (torch.compile traces with fake tensors, which report the device they
  stand for, so tracing is unaffected), and the operators' meta kernel rejects a meta tensor mixed
  with tensors that hold data (PyTorch dispatches such a call to the meta kernel).
- **float64** is outside the C ABI (gla.chunk_gla computes it in Python). Its dtypes are checked
  here; everything else goes through libgla's own validation: the tensors are described to
  gla_explain as float32 metadata (no data is read but the host offsets), so shapes, devices,
  cu_seqlens contents, state shapes and the scale get the same rules and messages as other dtypes.
- **check_inputs** for float64: libgla's input check (NaN/Inf inputs, NaN or positive gates; g = -inf
  is a legal hard reset) with its message, over the tensors in PyTorch.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _lib, _tensors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def reject_meta(named: Sequence[Tuple[str, Optional[Tensor]]]) -> None:
    """ValueError naming the first tensor on the meta device."""
    for name, t in named:
        if isinstance(t, Tensor) and t.is_meta:  # t.device.type builds a device object: ~4k instructions
            raise ValueError(f"{name}: expected a tensor with data (on cpu, cuda or another device), got a tensor on "
                             f"device meta, shape {list(t.shape)}: meta tensors have no data to compute on")


def _is_fake(t: Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def reject_meta_mixed_with_data(named: Sequence[Tuple[str, Optional[Tensor]]]) -> None:
    """For the operators' meta (fake) kernel: a call that reached it with plain tensors, some with data
    and some on meta, is a real call that would return uninitialised memory; ValueError naming the
    meta tensor. Tracing (fake tensors) and all-meta calls (shape propagation) pass."""
    tensors = [(n, t) for n, t in named if isinstance(t, Tensor)]
    if any(_is_fake(t) for _, t in tensors):
        return
    if any(t.device.type != "meta" for _, t in tensors):
        reject_meta(tensors)


def check_float64(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor], scale: float,
                  state_v_first: bool) -> Optional[list]:
    """Validates a float64 call of gla.chunk_gla by libgla's rules (TypeError / ValueError with libgla's
    message); returns the sequence offsets as a list (None without cu_seqlens)."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype != torch.float64:
            raise TypeError(f"{name}: expected dtype float64 (same as q), got {_dtype_name(t.dtype)}")
    if g.dtype not in (torch.float64, torch.float32):
        raise TypeError(f"g: expected dtype float64 (same as q) or float32, got {_dtype_name(g.dtype)}")
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.float64):
        raise TypeError("initial_state: expected dtype float32 or float64 (states are fp32, or float64 with float64 "
                        f"inputs), got {_dtype_name(initial_state.dtype)}")
    host = cu_seqlens_cpu
    if cu_seqlens is not None and host is None and cu_seqlens.device.type != "cpu":
        host = cu_seqlens.to("cpu")  # the float64 path reads the offsets on the host anyway

    def metadata(name, t):
        """q, k, v, g, initial_state as metadata (no data pointer), float64 described as float32."""
        d = _tensors.describe(name, t)
        if d is not None:
            d.data = None
            if t.dtype == torch.float64:
                d.dtype = _lib.F32
        return d

    d = [metadata(n, t) for n, t in (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state))]
    d += [_tensors.describe("cu_seqlens", cu_seqlens), _tensors.describe("cu_seqlens_host", host)]
    args = _lib.ForwardArgs(*[ctypes.pointer(x) if x is not None else None for x in d], None, None)
    opts = _lib.make_options(scale, state_v_first, "", _lib.POLICY_DEFAULT)
    text = ctypes.c_char_p()
    lib = _lib.library()
    _lib.raise_for(lib.gla_explain(ctypes.byref(args), None, ctypes.byref(opts), ctypes.byref(text)))
    if cu_seqlens is None:
        return None
    return (host if host is not None else cu_seqlens).tolist()


def check_values(named: Sequence[Tuple[str, Optional[Tensor], bool]]) -> None:
    """libgla's input check (gla_options.check_inputs) over (name, tensor, is_gate): ValueError at the
    first NaN or Inf (row-major order) of an input, or the first NaN or positive value of a gate."""
    for name, t, is_gate in named:
        if t is None or t.numel() == 0:
            continue
        bad = (torch.isnan(t) | (t > 0)) if is_gate else ~torch.isfinite(t)
        flat = bad.reshape(-1).nonzero()
        if flat.numel() == 0:
            continue
        i = int(flat[0, 0])
        x = float(t.reshape(-1)[i])
        index = []
        for size in reversed(t.shape):
            index.append(i % size)
            i //= size
        position = ", ".join(str(j) for j in reversed(index))
        what = ("NaN" if x != x else "Inf" if x in (float("inf"), float("-inf"))
                else f"a positive gate value {x:.6f} (expected g <= 0)")
        raise ValueError(f"{name}: input check found {what} at [{position}]")
