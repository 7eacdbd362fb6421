"""PyTorch operators over libgla: `gla::chunk_fwd` and `gla::chunk_bwd`.

Registered with torch.library.custom_op, with fake implementations (shapes only) so that
torch.compile(fullgraph=True) traces through them, and with autograd registered once on the
forward op. The real implementations allocate every output and the workspace from PyTorch's
allocator, pass PyTorch's current stream, and hand the tensors to libgla as descriptors.

Custom operators cannot return None, so absent optional outputs travel as empty tensors (numel 0)
and the public wrapper turns them back into None.

float64 is outside libgla's C ABI (fp32/fp16/bf16 inputs); float64 inputs are computed by the
`torch` backend's body directly in Python, which is what torch.autograd.gradcheck needs.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _chunked, _lib, _tensors

# ---- thread-local backend selection (read by the public wrappers; dynamo guards on it) ----
selection = threading.local()


def current_backend() -> str:
    return getattr(selection, "backend", "")


def current_policy() -> int:
    return getattr(selection, "policy", _lib.POLICY_DEFAULT)


# ---- loading and registering the torch backend, once ----
_loaded = False
_load_lock = threading.Lock()


def ensure_loaded():
    """Loads libgla and registers the `torch` backend (once); raises ImportError if libgla is missing."""
    global _loaded
    if _loaded:
        return _lib.library()
    with _load_lock:
        if not _loaded:
            _lib.library()
            from . import torch_backend
            torch_backend.register()
            _loaded = True
    return _lib.library()


# ---- helpers shared by both operators ----
def _stream(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return None


def _host_offsets(cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor]) -> Optional[Tensor]:
    """The host copy of cu_seqlens to pass along. Without one for device offsets, copy here (a host
    synchronisation, as in fla): libgla's plugin backends have no device-to-host copy of their own."""
    if cu_seqlens is None or cu_seqlens_cpu is not None:
        return cu_seqlens_cpu
    if cu_seqlens.device.type == "cpu":
        return None
    return cu_seqlens.to("cpu")


def _ptr(d: Optional[_lib.Tensor]):
    return ctypes.pointer(d) if d is not None else None


def _num_sequences(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    if cu_seqlens is not None:
        return max(0, cu_seqlens.shape[0] - 1) if cu_seqlens.dim() == 1 else 0
    return q.shape[0] if q.dim() >= 1 else 0


def _state_shape(q: Tensor, v: Tensor, N: int, state_v_first: bool):
    if q.dim() != 4 or v.dim() != 4:
        return (0,)  # libgla rejects q / v first, naming them
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    return (N, H, V, K) if state_v_first else (N, H, K, V)


def _check_float64(q: Tensor, backend: str) -> bool:
    if q.dtype != torch.float64:
        return False
    if backend not in ("", "torch"):
        raise TypeError(f"q: float64 is served only by the 'torch' backend (in Python), but backend '{backend}' "
                        "is forced; libgla takes float32, float16 or bfloat16")
    return True


def _empty_state(q: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=q.device)


# ---- gla::chunk_fwd ----
@torch.library.custom_op("gla::chunk_fwd", mutates_args=())
def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Optional[Tensor],
              cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor], scale: float,
              state_v_first: bool, output_final_state: bool, backend: str, policy: int) -> Tuple[Tensor, Tensor]:
    """o [B, T, H, V] (v's dtype) and final_state (fp32; empty when not wanted)."""
    N = _num_sequences(q, cu_seqlens)
    if _check_float64(q, backend):
        offsets = cu_seqlens.tolist() if cu_seqlens is not None else None
        o, ht = _chunked.chunk_forward(q, k, v, g, scale, initial_state, offsets, state_v_first, output_final_state)
        return o.to(v.dtype), (ht.clone() if ht is not None else _empty_state(q))
    lib = ensure_loaded()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = (torch.empty(_state_shape(q, v, N, state_v_first), dtype=torch.float32, device=q.device)
             if output_final_state else None)
    host = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    d = {name: _tensors.describe(name, t) for name, t in
         (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
          ("cu_seqlens_host", host), ("o", o), ("final_state", final))}
    args = _lib.ForwardArgs(*(_ptr(d[n]) for n in ("q", "k", "v", "g", "initial_state", "cu_seqlens",
                                                   "cu_seqlens_host", "o", "final_state")))
    opts = _lib.make_options(scale, state_v_first, backend, policy, stream=_stream(q.device))
    with _tensors.handed_over(q, k, v, g, initial_state, cu_seqlens, host, o, final):
        size = ctypes.c_size_t(0)
        _lib.raise_for(lib.gla_chunk_forward_workspace_size(ctypes.byref(args), ctypes.byref(opts), ctypes.byref(size)))
        workspace = None
        if size.value:
            workspace = torch.empty(size.value, dtype=torch.uint8, device=q.device)
            opts.workspace, opts.workspace_bytes = workspace.data_ptr(), size.value
        _lib.raise_for(lib.gla_chunk_forward(ctypes.byref(args), ctypes.byref(opts)))
    return o, (final if final is not None else _empty_state(q))


@chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first,
                    output_final_state, backend, policy):
    torch._check(q.dim() == 4, lambda: f"q: expected shape [B, T, H, K], got {list(q.shape)}")
    torch._check(v.dim() == 4, lambda: f"v: expected shape [B, T, H, V], got {list(v.shape)}")
    o = v.new_empty(v.shape)
    if not output_final_state:
        return o, q.new_empty(0, dtype=torch.float32)
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    return o, q.new_empty(_state_shape(q, v, N, state_v_first), dtype=torch.float32)


# ---- gla::chunk_bwd ----
@torch.library.custom_op("gla::chunk_bwd", mutates_args=())
def chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Optional[Tensor],
              cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor], do: Optional[Tensor],
              dht: Optional[Tensor], scale: float, state_v_first: bool, backend: str,
              policy: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dg (g's dtype) and dh0 (fp32; empty without an initial state)."""
    if _check_float64(q, backend):
        offsets = cu_seqlens.tolist() if cu_seqlens is not None else None
        dq, dk, dv, dg, dh0 = _chunked.chunk_backward(q, k, v, g, scale, initial_state, offsets, state_v_first,
                                                      do=do, dht=dht)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype),
                dh0.to(initial_state.dtype) if initial_state is not None else _empty_state(q))
    lib = ensure_loaded()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    dh0 = (torch.empty(initial_state.shape, dtype=torch.float32, device=initial_state.device)
           if initial_state is not None else None)
    host = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
             ("cu_seqlens_host", host), ("do", do), ("dht", dht), ("dq", dq), ("dk", dk), ("dv", dv), ("dg", dg),
             ("dh0", dh0))
    d = [_tensors.describe(name, t) for name, t in named]
    args = _lib.BackwardArgs(*(_ptr(x) for x in d))
    opts = _lib.make_options(scale, state_v_first, backend, policy, stream=_stream(q.device))
    with _tensors.handed_over(*(t for _, t in named)):
        size = ctypes.c_size_t(0)
        _lib.raise_for(lib.gla_chunk_backward_workspace_size(ctypes.byref(args), ctypes.byref(opts),
                                                             ctypes.byref(size)))
        workspace = None
        if size.value:
            workspace = torch.empty(size.value, dtype=torch.uint8, device=q.device)
            opts.workspace, opts.workspace_bytes = workspace.data_ptr(), size.value
        _lib.raise_for(lib.gla_chunk_backward(ctypes.byref(args), ctypes.byref(opts)))
    return dq, dk, dv, dg, (dh0 if dh0 is not None else _empty_state(q))


@chunk_bwd.register_fake
def _chunk_bwd_fake(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale, state_v_first,
                    backend, policy):
    dh0 = (initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None
           else q.new_empty(0, dtype=torch.float32))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), dh0


# ---- autograd ----
def _setup_context(ctx, inputs, output):
    (q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first, output_final_state,
     backend, policy) = inputs
    ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.scale, ctx.state_v_first, ctx.backend, ctx.policy = scale, state_v_first, backend, policy


def _backward(ctx, do, dht):
    q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    if dht is not None and dht.numel() == 0:
        dht = None  # the placeholder for a final state nobody asked for
    dq, dk, dv, dg, dh0 = torch.ops.gla.chunk_bwd(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht,
                                                  ctx.scale, ctx.state_v_first, ctx.backend, ctx.policy)
    return (dq, dk, dv, dg, dh0 if initial_state is not None else None,
            None, None, None, None, None, None, None)


chunk_fwd.register_autograd(_backward, setup_context=_setup_context)
