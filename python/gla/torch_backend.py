"""The `torch` backend: libgla's chunked operator in PyTorch tensor ops, joined to the native registry.

It is registered through gla_register_backend with ctypes callbacks (name "torch", priority 80, all
device types, units chunk_fwd, chunk_bwd, every stage of the stage pipeline, recurrent_fwd and
recurrent_bwd (_recurrent_torch.py)), so it appears in explain(), serves tensors on devices
no native backend serves (CUDA backward before the cuda backend has one, Ascend NPU, MPS, XPU) and
can be forced anywhere, and its stages mix with another backend's (a vendor's native stage plus
`torch` for the rest). Its run callback turns the problem's descriptors back into torch tensors
(see _tensors.py), runs `_chunked` (whole operations) or `_torch_stages` (one stage) on them and
writes the results into the output tensors in place, on PyTorch's current stream.

Callbacks never let an exception escape into C: every failure becomes a status and a message.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from . import _chunked, _lib, _recurrent_torch, _tensors, _torch_stages

NAME = "torch"
PRIORITY = 80
_UNITS = (_lib.UNIT_CHUNK_FWD, _lib.UNIT_CHUNK_BWD) + tuple(_torch_stages.RUN) + tuple(_recurrent_torch.UNITS)
_ALL_DEVICES = (_lib.DEVICE_CPU, _lib.DEVICE_CUDA, _lib.DEVICE_CUDA_HOST, _lib.DEVICE_OPENCL, _lib.DEVICE_VULKAN,
                _lib.DEVICE_METAL, _lib.DEVICE_ROCM, _lib.DEVICE_EXT, _lib.DEVICE_ONEAPI)


def _write_message(buffer, capacity, text: str) -> None:
    if not buffer or capacity == 0:
        return
    data = text.encode("utf-8", "replace")[: capacity - 1]
    ctypes.memmove(buffer, data + b"\0", len(data) + 1)


def _device_reason(p) -> str:
    """Why PyTorch cannot reach the problem's memory ("" = it can)."""
    if p.device_type in (_lib.DEVICE_CPU, _lib.DEVICE_CUDA_HOST):
        return ""
    if p.device_type in (_lib.DEVICE_CUDA, _lib.DEVICE_ROCM):
        if not torch.cuda.is_available():
            return "this PyTorch build sees no CUDA device"
        return ""
    if not getattr(_tensors._inflight, "table", None):
        return ("memory of this device type can be wrapped only when the call comes from PyTorch "
                "(gla.chunk_gla), not from C")
    return ""


def _verify(user_data, problem, message, capacity):
    try:
        p = problem.contents
        if p.unit not in _UNITS:
            _write_message(message, capacity, "implements chunk_fwd, chunk_bwd, the stages, recurrent_fwd and recurrent_bwd, not this unit")
            return 0
        reason = _device_reason(p)
        if reason:
            _write_message(message, capacity, reason)
            return 0
        return 1
    except BaseException as e:  # noqa: BLE001 - nothing may cross into C
        _write_message(message, capacity, f"verify failed: {type(e).__name__}: {e}")
        return 0


def _offsets(p):
    if not p.varlen:
        return None
    return [int(p.seq_offsets[i]) for i in range(p.N + 1)]


def _run_problem(p) -> None:
    if p.unit in _recurrent_torch.UNITS:
        return _recurrent_torch.run_problem(p)
    w = _tensors.to_torch
    if p.unit in _torch_stages.RUN:
        _torch_stages.run(p, w)
        return
    q, k, v, g = w(p.q), w(p.k), w(p.v), w(p.g)
    h0 = w(p.initial_state)
    if p.backward:
        outs = tuple(w(t) for t in (p.dq, p.dk, p.dv, p.dg, p.dh0))
        _chunked.chunk_backward(q, k, v, g, p.scale, h0, _offsets(p), bool(p.state_v_first), do=w(p.do_), dht=w(p.dht),
                                outs=outs)
    else:
        final = w(p.final_state)
        _chunked.chunk_forward(q, k, v, g, p.scale, h0, _offsets(p), bool(p.state_v_first),
                               want_final_state=final is not None, o_out=w(p.o), final_out=final)


def _run(user_data, problem, message, capacity):
    try:
        p = problem.contents
        with torch.no_grad():
            if p.device_type in (_lib.DEVICE_CUDA, _lib.DEVICE_ROCM) and p.stream:
                device = torch.device("cuda", p.device_index)
                current = torch.cuda.current_stream(device)
                if current.cuda_stream != p.stream:  # a C caller's stream: run there
                    with torch.cuda.stream(torch.cuda.ExternalStream(p.stream, device=device)):
                        _run_problem(p)
                    return _lib.OK
            _run_problem(p)
        return _lib.OK
    except BaseException as e:  # noqa: BLE001 - nothing may cross into C
        _write_message(message, capacity, f"{type(e).__name__}: {e}")
        if isinstance(e, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
            return _lib.OUT_OF_MEMORY
        return _lib.BACKEND_ERROR


# The ctypes objects C holds pointers to: they must live as long as the registration.
_keep = {}
_registrations = []  # every callback table ever registered: C may still hold an older one
_lock = threading.Lock()


def register() -> None:
    """Adds (or replaces) the `torch` backend in libgla's registry."""
    with _lock:
        lib = _lib.library()
        desc = _lib.BackendDesc()
        desc.abi_version = _lib.ABI_VERSION
        name = NAME.encode()
        desc.name = name
        desc.priority = PRIORITY
        desc.device_mask = sum(1 << d for d in _ALL_DEVICES)
        desc.unit_mask = sum(1 << u for u in _UNITS)
        desc.user_data = None
        callbacks = {"available": _lib.AvailableFn(), "verify": _lib.VerifyFn(_verify), "run": _lib.RunFn(_run),
                     "workspace_size": _lib.WorkspaceFn()}
        desc.available = callbacks["available"]
        desc.verify = callbacks["verify"]
        desc.run = callbacks["run"]
        desc.workspace_size = callbacks["workspace_size"]
        _lib.raise_for(lib.gla_register_backend(ctypes.byref(desc)), "registering the torch backend")
        _keep.update(desc=desc, name=name, **callbacks)
        _registrations.append(dict(_keep))


def unregister() -> None:
    """Removes the `torch` backend from libgla's registry."""
    with _lock:
        if not _keep:
            return
        _lib.raise_for(_lib.library().gla_unregister_backend(NAME.encode()), "unregistering the torch backend")
        _keep.clear()  # the callback objects stay alive in _registrations
