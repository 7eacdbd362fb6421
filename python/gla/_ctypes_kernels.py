"""Python kernels of gla::chunk_fwd / gla::chunk_bwd over libgla's C ABI through ctypes.

They serve every device when libgla_torch cannot load (the fallback), and otherwise the devices that
have no C++ kernel (MPS, XPU, PrivateUse1): the tensors handed to libgla are kept in a thread-local
table while the call runs, which is how the `torch` backend's callback gets the very tensors back on
any device (_tensors.py). Same contract as the C++ kernels (gla/csrc/chunk_ops.cpp): outputs and the
workspace from PyTorch's allocator, the current stream, libgla's errors as Python exceptions.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import Tensor

from . import _lib, _ops, _tensors


def _stream(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return None


def _host_offsets(cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor]) -> Optional[Tensor]:
    """The host copy of cu_seqlens to pass along (see host_offsets in gla/csrc/torch_bridge.hpp)."""
    if cu_seqlens is None or cu_seqlens_cpu is not None:
        return cu_seqlens_cpu
    if cu_seqlens.device.type == "cpu":
        return None
    return cu_seqlens.to("cpu")


def _ptr(d: Optional[_lib.Tensor]):
    return ctypes.pointer(d) if d is not None else None


def _empty_state(q: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=q.device)


def _call(entry, size_entry, args, opts, device, tensors, states=None) -> int:
    """entry(args[, states], opts) with the tensors handed over and a workspace of size_entry's size
    from PyTorch's allocator; returns its status. The plain call's workspace size bounds the
    saved-states call's (the same plan, or fewer buffers)."""
    with _tensors.handed_over(*tensors, states):
        size = ctypes.c_size_t(0)
        _lib.raise_for(size_entry(ctypes.byref(args), ctypes.byref(opts), ctypes.byref(size)))
        workspace = None
        if size.value:
            workspace = torch.empty(size.value, dtype=torch.uint8, device=device)
            opts.workspace, opts.workspace_bytes = workspace.data_ptr(), size.value
        with _tensors.handed_over(workspace):  # stage buffers inside it resolve to views of it
            if states is None:
                return entry(ctypes.byref(args), ctypes.byref(opts))  # workspace stays alive until here
            return entry(ctypes.byref(args), ctypes.pointer(_tensors.describe("chunk_states", states)),
                         ctypes.byref(opts))


def _run(entry, size_entry, args, opts, device, tensors) -> None:
    _lib.raise_for(_call(entry, size_entry, args, opts, device, tensors))


def _may_save_states(q, cu_seqlens) -> bool:
    """Where a backend may save chunk states (the cuda backend's conditions, as gla/csrc/chunk_ops.cpp)."""
    return (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and cu_seqlens is None
            and q.dim() == 4 and q.shape[3] <= 256)


def _run_with_states(entry, size_entry, args, states, opts, device, tensors) -> bool:
    """_run for a saved-states entry point; False (nothing written) where the backend declined."""
    status = _call(entry, size_entry, args, opts, device, tensors, states)
    if status == _lib.NOT_SUPPORTED:
        opts.workspace, opts.workspace_bytes = None, 0
        return False
    _lib.raise_for(status)
    return True


def chunk_fwd_saving_states(q, k, v, g, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None, scale=None,
                            state_v_first=False, output_final_state=False, backend="", policy=0, check_inputs=False):
    return chunk_fwd(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first, output_final_state,
                     backend, policy, check_inputs, save_states=True)


def chunk_fwd(q, k, v, g, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None, scale=None, state_v_first=False,
              output_final_state=False, backend="", policy=0, check_inputs=False, save_states=False):
    lib = _lib.library()
    scale = _ops.default_scale(q, scale)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = (torch.empty(_ops.state_shape(q, v, _ops.num_sequences(q, cu_seqlens), state_v_first),
                         dtype=torch.float32, device=q.device) if output_final_state else None)
    host = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
             ("cu_seqlens_host", host), ("o", o), ("final_state", final))
    args = _lib.ForwardArgs(*(_ptr(_tensors.describe(n, t)) for n, t in named))
    opts = _lib.make_options(scale, state_v_first, backend, policy, stream=_stream(q.device),
                             check_inputs=check_inputs)
    tensors = [t for _, t in named]
    if save_states and _may_save_states(q, cu_seqlens):
        states = torch.empty((q.shape[0] * -(-q.shape[1] // 64), q.shape[2], q.shape[3], v.shape[3]),
                             dtype=torch.bfloat16, device=q.device)
        if _run_with_states(lib.gla_chunk_forward_saving_states, lib.gla_chunk_forward_workspace_size, args, states,
                            opts, q.device, tensors):
            return o, (final if final is not None else _empty_state(q)), states
    _run(lib.gla_chunk_forward, lib.gla_chunk_forward_workspace_size, args, opts, q.device, tensors)
    if save_states:
        return o, (final if final is not None else _empty_state(q)), _empty_state(q)
    return o, (final if final is not None else _empty_state(q))


def chunk_bwd(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale, state_v_first, backend,
              policy, check_inputs=False, chunk_states=None):
    lib = _lib.library()
    dq, dk, dv, dg = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v, g))
    dh0 = (torch.empty(initial_state.shape, dtype=torch.float32, device=initial_state.device)
           if initial_state is not None else None)
    host = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
             ("cu_seqlens_host", host), ("do", do), ("dht", dht), ("dq", dq), ("dk", dk), ("dv", dv), ("dg", dg),
             ("dh0", dh0))
    args = _lib.BackwardArgs(*(_ptr(_tensors.describe(n, t)) for n, t in named))
    opts = _lib.make_options(scale, state_v_first, backend, policy, stream=_stream(q.device),
                             check_inputs=check_inputs)
    tensors = [t for _, t in named]
    if chunk_states is None or chunk_states.numel() == 0 or not _run_with_states(
            lib.gla_chunk_backward_from_states, lib.gla_chunk_backward_workspace_size, args, chunk_states, opts,
            q.device, tensors):
        _run(lib.gla_chunk_backward, lib.gla_chunk_backward_workspace_size, args, opts, q.device, tensors)
    return dq, dk, dv, dg, (dh0 if dh0 is not None else _empty_state(q))
