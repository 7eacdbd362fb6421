"""Python kernels of gla::recurrent_fwd / recurrent_bwd / recurrent_state_update over libgla's C ABI
through ctypes, and the argument structs of gla.h's recurrent entry points.

Like _ctypes_kernels.py for the chunked operator: they serve every device when libgla_torch cannot
load (the fallback, with its warning), and otherwise the devices without a C++ kernel (MPS, XPU,
PrivateUse1). Same contract as the C++ kernels (gla/csrc/recurrent_ops.cpp).
"""
from __future__ import annotations

import ctypes

import torch

from . import _ctypes_kernels, _lib, _ops, _tensors

_TP = _lib.TensorP


class RecurrentForwardArgs(ctypes.Structure):
    _fields_ = [(n, _TP) for n in ("q", "k", "v", "gk", "gv", "initial_state", "cu_seqlens", "cu_seqlens_host", "o",
                                   "final_state")] + [("reverse", ctypes.c_int32)]


class RecurrentBackwardArgs(ctypes.Structure):
    _fields_ = [(n, _TP) for n in ("q", "k", "v", "gk", "gv", "initial_state", "cu_seqlens", "cu_seqlens_host", "do_",
                                   "dht", "dq", "dk", "dv", "dgk", "dgv", "dh0")] + [("reverse", ctypes.c_int32)]


class StateUpdateArgs(ctypes.Structure):
    _fields_ = [(n, _TP) for n in ("q", "k", "v", "gk", "gv", "state_pool", "state_slots", "slot_error", "o",
                                   "token_states")] + [("check_slots", ctypes.c_int32)]


_declared = False


def library():
    """libgla with the recurrent entry points' prototypes declared."""
    global _declared
    lib = _ops.ensure_loaded()
    if not _declared:
        c, opts = ctypes, ctypes.POINTER(_lib.Options)
        for name, args in (("gla_recurrent_forward", [c.POINTER(RecurrentForwardArgs), opts]),
                           ("gla_recurrent_backward", [c.POINTER(RecurrentBackwardArgs), opts]),
                           ("gla_recurrent_state_update", [c.POINTER(StateUpdateArgs), opts]),
                           ("gla_recurrent_explain", [c.POINTER(RecurrentForwardArgs), c.POINTER(RecurrentBackwardArgs),
                                                      c.POINTER(StateUpdateArgs), opts, c.POINTER(c.c_char_p)])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = c.c_int, args
        _declared = True
    return lib


def pointers(named):
    """ctypes pointers to the descriptors of (name, tensor or None) pairs."""
    out = []
    for name, t in named:
        d = _tensors.describe(name, t)
        out.append(ctypes.pointer(d) if d is not None else None)
    return out


def _call(entry: str, args_type, named, last: int, q, scale: float, state_v_first: bool, backend: str,
          policy: int) -> None:
    """Runs the C entry point on the named tensors (in the args struct's order) plus its trailing int."""
    lib = library()
    args = args_type(*pointers(named), int(last))
    opts = _lib.make_options(scale, state_v_first, backend, policy, stream=_ctypes_kernels._stream(q.device))
    with _tensors.handed_over(*(t for _, t in named)):
        _lib.raise_for(getattr(lib, entry)(ctypes.byref(args), ctypes.byref(opts)))


def _or_empty(t, q):
    return t if t is not None else _ctypes_kernels._empty_state(q)


def recurrent_fwd(q, k, v, gk, gv, initial_state, cu_seqlens, scale, reverse, state_v_first, output_final_state,
                  backend, policy, cu_seqlens_cpu=None):
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = None
    if output_final_state and q.dim() == 4 and v.dim() == 4:
        final = torch.empty(_ops.state_shape(q, v, _ops.num_sequences(q, cu_seqlens), state_v_first),
                            dtype=torch.float32, device=q.device)
    named = (("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens), ("cu_seqlens_host", _ctypes_kernels._host_offsets(cu_seqlens, cu_seqlens_cpu)),
             ("o", o), ("final_state", final))
    _call("gla_recurrent_forward", RecurrentForwardArgs, named, reverse, q, scale, state_v_first, backend, policy)
    return o, _or_empty(final, q)


def recurrent_bwd(q, k, v, gk, gv, initial_state, cu_seqlens, do, dht, scale, reverse, state_v_first, backend,
                  policy, cu_seqlens_cpu=None):
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dgk = torch.empty(gk.shape, dtype=gk.dtype, device=gk.device) if gk is not None else None
    dgv = torch.empty(gv.shape, dtype=gv.dtype, device=gv.device) if gv is not None else None
    dh0 = (torch.empty(initial_state.shape, dtype=torch.float32, device=q.device)
           if initial_state is not None else None)
    named = (("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens), ("cu_seqlens_host", _ctypes_kernels._host_offsets(cu_seqlens, cu_seqlens_cpu)),
             ("do", do), ("dht", dht), ("dq", dq), ("dk", dk), ("dv", dv), ("dgk", dgk), ("dgv", dgv), ("dh0", dh0))
    _call("gla_recurrent_backward", RecurrentBackwardArgs, named, reverse, q, scale, state_v_first, backend, policy)
    return dq, dk, dv, _or_empty(dgk, q), _or_empty(dgv, q), _or_empty(dh0, q)


def recurrent_state_update(q, k, v, gk, gv, state_pool, state_slots, slot_error, scale, state_v_first,
                           output_token_states, check_slots, backend, policy):
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    token_states = None
    if output_token_states and q.dim() == 4 and v.dim() == 4:
        token_states = torch.empty(token_states_shape(q, v, state_v_first), dtype=torch.float32, device=q.device)
    named = (("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("state_pool", state_pool),
             ("state_slots", state_slots), ("slot_error", slot_error), ("o", o), ("token_states", token_states))
    _call("gla_recurrent_state_update", StateUpdateArgs, named, check_slots, q, scale, state_v_first, backend, policy)
    return o, _or_empty(token_states, q)


def token_states_shape(q, v, state_v_first: bool):
    B, T, H, K = q.shape
    V = v.shape[3]
    return (B, T, H, V, K) if state_v_first else (B, T, H, K, V)
