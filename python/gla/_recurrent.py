"""The recurrent operator for PyTorch: `gla.fused_recurrent_gla` (fla's call) and
`gla.recurrent_state_update` (the serving step on a state pool).

Operators `gla::recurrent_fwd`, `gla::recurrent_bwd` and `gla::recurrent_state_update` registered
with torch.library.custom_op over libgla's C ABI (gla.h: gla_recurrent_*), with fake implementations
for torch.compile and autograd on the forward, as for the chunked operator (_ops.py). Outputs come
from PyTorch's allocator and kernels run on PyTorch's current stream; the state update mutates the
pool and the error flag in place and never synchronises the host (unless check_slots).
float64 inputs are computed by the `torch` backend's body in Python (_recurrent_torch.py).
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _ctypes_kernels, _lib, _ops, _recurrent_torch, _tensors

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


def _library():
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


def _describe(named):
    return [_tensors.describe(n, t) for n, t in named]


def _check_float64(q: Tensor, backend: str) -> bool:
    """float64 runs the `torch` backend's Python body; another forced backend is a TypeError."""
    if q.dtype != torch.float64:
        return False
    if backend not in ("", "torch"):
        raise TypeError(f"q: float64 is served only by the 'torch' backend (in Python), but backend '{backend}' "
                        "is forced; libgla takes float32, float16 or bfloat16")
    return True


def _ptrs(descs):
    return [ctypes.pointer(d) if d is not None else None for d in descs]


def _call(entry: str, args_type, named, last: int, q: Tensor, scale: float, state_v_first: bool, backend: str,
          policy: int) -> None:
    """Runs the C entry point on the named tensors (in the args struct's order) plus its trailing int."""
    lib = _library()
    args = args_type(*_ptrs(_describe(named)), int(last))
    opts = _lib.make_options(scale, state_v_first, backend, policy, stream=_ctypes_kernels._stream(q.device))
    with _tensors.handed_over(*(t for _, t in named)):
        _lib.raise_for(getattr(lib, entry)(ctypes.byref(args), ctypes.byref(opts)))


# ---- gla::recurrent_fwd ----
@torch.library.custom_op("gla::recurrent_fwd", mutates_args=())
def recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor], gv: Optional[Tensor],
                  initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, reverse: bool,
                  state_v_first: bool, output_final_state: bool, backend: str, policy: int) -> Tuple[Tensor, Tensor]:
    """o [B, T, H, V] (v's dtype) and final_state (fp32; empty when not wanted)."""
    N = _ops.num_sequences(q, cu_seqlens)
    if _check_float64(q, backend):
        offsets = cu_seqlens.tolist() if cu_seqlens is not None else None
        o, ht = _recurrent_torch.recurrent_forward(q, k, v, gk, gv, scale, initial_state, offsets, reverse,
                                                   state_v_first, output_final_state)
        return o.to(v.dtype), (ht.clone() if ht is not None else _ctypes_kernels._empty_state(q))
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = (torch.empty(_ops.state_shape(q, v, N, state_v_first), dtype=torch.float32, device=q.device)
             if output_final_state else None)
    named = (("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens), ("cu_seqlens_host", _ctypes_kernels._host_offsets(cu_seqlens, None)), ("o", o),
             ("final_state", final))
    _call("gla_recurrent_forward", RecurrentForwardArgs, named, reverse, q, scale, state_v_first, backend, policy)
    return o, (final if final is not None else _ctypes_kernels._empty_state(q))


@recurrent_fwd.register_fake
def _recurrent_fwd_fake(q, k, v, gk, gv, initial_state, cu_seqlens, scale, reverse, state_v_first,
                        output_final_state, backend, policy):
    # The outputs have the chunked operator's metadata (its fake reads no gate).
    return _ops._chunk_fwd_fake(q, k, v, None, initial_state, cu_seqlens, None, scale, state_v_first,
                                output_final_state, backend, policy)


# ---- gla::recurrent_bwd ----
@torch.library.custom_op("gla::recurrent_bwd", mutates_args=())
def recurrent_bwd(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor], gv: Optional[Tensor],
                  initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], do: Optional[Tensor],
                  dht: Optional[Tensor], scale: float, reverse: bool, state_v_first: bool, backend: str,
                  policy: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dgk, dgv (empty without the gate) and dh0 (fp32; empty without an initial state)."""
    if _check_float64(q, backend):
        offsets = cu_seqlens.tolist() if cu_seqlens is not None else None
        grads = _recurrent_torch.recurrent_backward(q, k, v, gk, gv, scale, initial_state, offsets, reverse,
                                                    state_v_first, do, dht)
        return tuple(g if g is not None else _ctypes_kernels._empty_state(q) for g in grads)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dgk = torch.empty_like(gk) if gk is not None else None
    dgv = torch.empty_like(gv) if gv is not None else None
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
    named = (("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens), ("cu_seqlens_host", _ctypes_kernels._host_offsets(cu_seqlens, None)), ("do", do),
             ("dht", dht), ("dq", dq), ("dk", dk), ("dv", dv), ("dgk", dgk), ("dgv", dgv), ("dh0", dh0))
    _call("gla_recurrent_backward", RecurrentBackwardArgs, named, reverse, q, scale, state_v_first, backend, policy)
    return tuple(g if g is not None else _ctypes_kernels._empty_state(q) for g in (dq, dk, dv, dgk, dgv, dh0))


@recurrent_bwd.register_fake
def _recurrent_bwd_fake(q, k, v, gk, gv, initial_state, cu_seqlens, do, dht, scale, reverse, state_v_first, backend,
                        policy):
    def empty():
        return q.new_empty(0, dtype=torch.float32)

    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            gk.new_empty(gk.shape) if gk is not None else empty(), gv.new_empty(gv.shape) if gv is not None else empty(),
            initial_state.new_empty(initial_state.shape) if initial_state is not None else empty())


def _setup_context(ctx, inputs, output):
    (q, k, v, gk, gv, initial_state, cu_seqlens, scale, reverse, state_v_first, output_final_state, backend,
     policy) = inputs
    ctx.save_for_backward(q, k, v, gk, gv, initial_state, cu_seqlens)
    ctx.args = (scale, reverse, state_v_first, backend, policy)


def _backward(ctx, do, dht):
    q, k, v, gk, gv, initial_state, cu_seqlens = ctx.saved_tensors
    if dht is not None and dht.numel() == 0:
        dht = None
    dq, dk, dv, dgk, dgv, dh0 = torch.ops.gla.recurrent_bwd(q, k, v, gk, gv, initial_state, cu_seqlens, do, dht,
                                                            *ctx.args)
    return (dq, dk, dv, dgk if gk is not None else None, dgv if gv is not None else None,
            dh0 if initial_state is not None else None, None, None, None, None, None, None, None)


recurrent_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- gla::recurrent_state_update ----
@torch.library.custom_op("gla::recurrent_state_update", mutates_args=("state_pool", "slot_error"))
def recurrent_state_update_op(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor], gv: Optional[Tensor],
                              state_pool: Tensor, state_slots: Tensor, slot_error: Tensor, scale: float,
                              state_v_first: bool, output_token_states: bool, check_slots: bool, backend: str,
                              policy: int) -> Tuple[Tensor, Tensor]:
    """o [B, T, H, V] and the token states (empty unless output_token_states); the pool and the flag in place."""
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    token_states = None
    if output_token_states:
        B, T, H, K = q.shape
        V = v.shape[3]
        token_states = torch.empty((B, T, H, V, K) if state_v_first else (B, T, H, K, V), dtype=torch.float32,
                                   device=q.device)
    named = (("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("state_pool", state_pool),
             ("state_slots", state_slots), ("slot_error", slot_error), ("o", o), ("token_states", token_states))
    _call("gla_recurrent_state_update", StateUpdateArgs, named, check_slots, q, scale, state_v_first, backend, policy)
    return o, (token_states if token_states is not None else _ctypes_kernels._empty_state(q))


@recurrent_state_update_op.register_fake
def _state_update_fake(q, k, v, gk, gv, state_pool, state_slots, slot_error, scale, state_v_first,
                       output_token_states, check_slots, backend, policy):
    if not output_token_states:
        return v.new_empty(v.shape), q.new_empty(0, dtype=torch.float32)
    B, T, H, K = q.shape
    V = v.shape[3]
    return v.new_empty(v.shape), q.new_empty((B, T, H, V, K) if state_v_first else (B, T, H, K, V),
                                             dtype=torch.float32)


# ---- the public calls ----
def _check_tensors(**named):
    for name, t in named.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _scale(q: Tensor, scale: Optional[float]) -> float:
    if scale is not None:
        return float(scale)
    K = q.shape[-1] if q.dim() > 0 else 0
    return K ** -0.5 if K > 0 else 1.0


def fused_recurrent_gla(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                        scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                        output_final_state: bool = False, reverse: bool = False,
                        cu_seqlens: Optional[Tensor] = None,
                        state_v_first: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Gated linear attention as a token loop; the call of fla's ``fused_recurrent_gla``.

    ``S_t = Diag(exp(gk_t)) S_{t-1} Diag(exp(gv_t)) + k_t v_t^T``, ``o_t = scale * q_t^T S_t``.

    Args:
        q, k: ``[B, T, H, K]`` float32, float16 or bfloat16 (float64: computed in Python).
        v: ``[B, T, H, V]``, q's dtype.
        gk: optional ``[B, T, H, K]`` key gate (natural log, expected <= 0); q's dtype or float32.
        gv: optional ``[B, T, H, V]`` value gate, likewise.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` float32 (``[N, H, V, K]`` with ``state_v_first``).
        output_final_state: also return the final state.
        reverse: walk the tokens from last to first (the final state is then the state after token 0).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B == 1). On a device it is
            copied to the host (a synchronisation); the decode step needs none (recurrent_state_update).
        state_v_first: states are ``[N, H, V, K]`` (fla's layer passes True when decoding).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state (float32) or None.

    Differentiable in q, k, v, gk, gv and initial_state.
    """
    _check_tensors(q=q, k=k, v=v, gk=gk, gv=gv, initial_state=initial_state, cu_seqlens=cu_seqlens)
    o, final = torch.ops.gla.recurrent_fwd(q, k, v, gk, gv, initial_state, cu_seqlens, _scale(q, scale),
                                           bool(reverse), bool(state_v_first), bool(output_final_state),
                                           _ops.current_backend(), _ops.current_policy())
    return o, (final if output_final_state else None)


def recurrent_state_update(q: Tensor, k: Tensor, v: Tensor, state_pool: Tensor, state_slots: Tensor,
                           slot_error: Tensor, gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                           scale: Optional[float] = None, state_v_first: bool = False,
                           output_token_states: bool = False,
                           check_slots: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    r"""One serving step: B sequences, T new tokens each, their states in a pool, updated in place.

    Args:
        q, k: ``[B, T, H, K]``; v ``[B, T, H, V]``; gk, gv optional gates as in fused_recurrent_gla.
        state_pool: ``[P, H, K, V]`` float32 (``[P, H, V, K]`` with ``state_v_first``), on q's device;
            sequence b reads ``state_pool[state_slots[b]]`` and writes the state after its last token back.
        state_slots: ``[B]`` int32 on q's device.
        slot_error: ``[1]`` int32 on q's device. A sequence whose slot is negative or >= P is skipped
            and 1 is ORed in; one whose slot an earlier sequence of the call uses is skipped and 2 is
            ORed in. Skipped sequences get o = 0 and touch nothing in the pool. Never cleared here.
        output_token_states: also return the state after each token ``[B, T, H, K, V]`` (or V, K) and
            leave the pool unchanged (speculative decoding: verify, then commit the accepted state).
        check_slots: check the slots on the host first and raise ValueError naming a bad or repeated
            one (a synchronisation; for debugging). Otherwise nothing synchronises the host, and the
            call can be captured in a CUDA graph.

    Returns:
        ``(o, token_states)``: o ``[B, T, H, V]`` in v's dtype; token_states or None. Not differentiable.
    """
    _check_tensors(q=q, k=k, v=v, state_pool=state_pool, state_slots=state_slots, slot_error=slot_error, gk=gk, gv=gv)
    o, states = torch.ops.gla.recurrent_state_update(q, k, v, gk, gv, state_pool, state_slots, slot_error,
                                                     _scale(q, scale), bool(state_v_first), bool(output_token_states),
                                                     bool(check_slots), _ops.current_backend(), _ops.current_policy())
    return o, (states if output_token_states else None)


def explain_recurrent(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                      initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                      reverse: bool = False, cu_seqlens: Optional[Tensor] = None, state_v_first: bool = False,
                      backward: bool = False) -> str:
    """The dispatcher's verdict table for a fused_recurrent_gla call (metadata only)."""
    lib = _library()
    N = _ops.num_sequences(q, cu_seqlens)
    final = (torch.empty(_ops.state_shape(q, v, N, state_v_first), dtype=torch.float32, device=q.device)
             if output_final_state else None)
    common = [("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("initial_state", initial_state),
              ("cu_seqlens", cu_seqlens), ("cu_seqlens_host", None)]
    descs = _describe(common)
    for d in descs:
        if d is not None:
            d.data = None
    opts = _lib.make_options(None, state_v_first, _ops.current_backend(), _ops.current_policy())
    text = ctypes.c_char_p()
    if backward:
        args = RecurrentBackwardArgs(*_ptrs(descs), *([None] * 8), int(reverse))
        status = lib.gla_recurrent_explain(None, ctypes.byref(args), None, ctypes.byref(opts), ctypes.byref(text))
    else:
        fd = _describe([("final_state", final)])[0] if final is not None else None
        args = RecurrentForwardArgs(*_ptrs(descs), None, ctypes.pointer(fd) if fd is not None else None, int(reverse))
        status = lib.gla_recurrent_explain(ctypes.byref(args), None, None, ctypes.byref(opts), ctypes.byref(text))
    _lib.raise_for(status)
    return text.value.decode()
