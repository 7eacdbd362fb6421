"""The recurrent operator for PyTorch: `gla.fused_recurrent_gla` (fla's call) and
`gla.recurrent_state_update` (the serving step on a state pool).

The operators `gla::recurrent_fwd`, `gla::recurrent_bwd` and `gla::recurrent_state_update` come from
libgla_torch (gla/csrc/recurrent_ops.cpp: schemas and CPU / CUDA kernels over libgla's C ABI, on
PyTorch's stable ABI), like the chunked operator's (_ops.py); this module registers what the stable
ABI cannot express: the fake kernels for torch.compile and the forward's autograd. When libgla_torch
cannot load, the same schemas get the ctypes kernels of _recurrent_ctypes.py (the fallback, with the
warning of _ops.py); those also serve the devices without a C++ kernel.

Outputs come from PyTorch's allocator and kernels run on PyTorch's current stream; the state update
mutates the pool and the error flag in place and never synchronises the host (unless check_slots).
float64 inputs are computed by the `torch` backend's body in Python (_recurrent_torch.py).
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _host_offsets, _lib, _ops, _recurrent_torch

# The schemas; libgla_torch defines the same strings (gla/csrc/recurrent_ops.cpp).
SCHEMAS = {
    "recurrent_fwd": "recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, Tensor? initial_state, "
                     "Tensor? cu_seqlens, float scale, bool reverse, bool state_v_first, bool output_final_state, "
                     "str backend, int policy, Tensor? cu_seqlens_cpu=None) -> (Tensor, Tensor)",
    "recurrent_bwd": "recurrent_bwd(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, Tensor? initial_state, "
                     "Tensor? cu_seqlens, Tensor? do, Tensor? dht, float scale, bool reverse, bool state_v_first, "
                     "str backend, int policy, Tensor? cu_seqlens_cpu=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "recurrent_state_update": "recurrent_state_update(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, "
                              "Tensor(a!) state_pool, Tensor state_slots, Tensor(b!) slot_error, float scale, "
                              "bool state_v_first, bool output_token_states, bool check_slots, str backend, "
                              "int policy) -> (Tensor, Tensor)",
}


def register_operators(library: torch.library.Library, native: bool) -> None:
    """Called by _ops once libgla_torch has loaded (native) or not: the Python kernels (every device
    in the fallback, else the devices without a C++ kernel), the fake kernels and autograd."""
    from . import _recurrent_ctypes

    for name, schema in SCHEMAS.items():
        kernel = getattr(_recurrent_ctypes, name)
        if native:
            for key in _ops._PYTHON_KERNEL_KEYS:
                library.impl(name, kernel, key)
        else:
            library.define(schema)
            library.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake("gla::recurrent_fwd", _recurrent_fwd_fake, lib=library)
    torch.library.register_fake("gla::recurrent_bwd", _recurrent_bwd_fake, lib=library)
    torch.library.register_fake("gla::recurrent_state_update", _state_update_fake, lib=library)
    torch.library.register_autograd("gla::recurrent_fwd", _backward, setup_context=_setup_context, lib=library)
    global _fwd_op, _bwd_op, _update_op
    _fwd_op, _bwd_op, _update_op = (_ops.eager_entry(n) for n in SCHEMAS)


_fwd_op = _bwd_op = _update_op = None  # the eager entries (_ops.eager_entry), set by register_operators


# ---- fake kernels ----
def _recurrent_fwd_fake(q, k, v, gk, gv, initial_state, cu_seqlens, scale, reverse, state_v_first,
                        output_final_state, backend, policy, cu_seqlens_cpu=None):
    # The outputs have the chunked operator's metadata (its fake reads no gate).
    return _ops._chunk_fwd_fake(q, k, v, None, initial_state, cu_seqlens, None, scale, state_v_first,
                                output_final_state, backend, policy)


def _recurrent_bwd_fake(q, k, v, gk, gv, initial_state, cu_seqlens, do, dht, scale, reverse, state_v_first, backend,
                        policy, cu_seqlens_cpu=None):
    def empty():
        return q.new_empty(0, dtype=torch.float32)

    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            gk.new_empty(gk.shape) if gk is not None else empty(), gv.new_empty(gv.shape) if gv is not None else empty(),
            initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None else empty())


def _state_update_fake(q, k, v, gk, gv, state_pool, state_slots, slot_error, scale, state_v_first,
                       output_token_states, check_slots, backend, policy):
    torch._check(q.dim() == 4, lambda: f"q: expected shape [B, T, H, K], got {list(q.shape)}")
    torch._check(v.dim() == 4, lambda: f"v: expected shape [B, T, H, V], got {list(v.shape)}")
    if not output_token_states:
        return v.new_empty(v.shape), q.new_empty(0, dtype=torch.float32)
    B, T, H, K = q.shape
    V = v.shape[3]
    return v.new_empty(v.shape), q.new_empty((B, T, H, V, K) if state_v_first else (B, T, H, K, V),
                                             dtype=torch.float32)


# ---- autograd ----
# Registered on gla::recurrent_fwd for torch.compile, torch.func, opcheck and direct calls of the op;
# eager calls take _RecurrentFwd (the same formula over the op below the autograd key), which skips
# torch.library's Python autograd wrapper, as gla.chunk_gla does (_ops.py).
_below_autograd = torch._C._AutoDispatchBelowAutograd


def _save(ctx, q, k, v, gk, gv, initial_state, rest):
    """rest: (cu_seqlens, scale, reverse, state_v_first, output_final_state, backend, policy[,
    cu_seqlens_cpu]); cu_seqlens is saved as a tensor (torch.compile traces it), the rest kept on ctx."""
    ctx.save_for_backward(q, k, v, gk, gv, initial_state, rest[0])
    ctx.rest = rest[1:]


def _setup_context(ctx, inputs, output):
    _save(ctx, *inputs[:6], inputs[6:])


def _gradients(ctx, do, dht, recurrent_bwd):
    q, k, v, gk, gv, initial_state, cu_seqlens = ctx.saved_tensors
    scale, reverse, state_v_first, _, backend, policy = ctx.rest[:6]
    host = ctx.rest[6] if len(ctx.rest) > 6 else None
    if dht is not None and dht.numel() == 0:
        dht = None  # the placeholder for a final state nobody asked for
    do, dht = _ops.unit_stride_rows(do), _ops.unit_stride_rows(dht)
    try:
        with _below_autograd():
            dq, dk, dv, dgk, dgv, dh0 = recurrent_bwd(q, k, v, gk, gv, initial_state, cu_seqlens, do, dht, scale,
                                                      reverse, state_v_first, backend, policy, host)
    except RuntimeError as e:
        raise _lib.python_error(e) from None
    return (dq, dk, dv, dgk if gk is not None else None, dgv if gv is not None else None,
            dh0 if initial_state is not None else None)


def _backward(ctx, do, dht):
    return _gradients(ctx, do, dht, torch.ops.gla.recurrent_bwd.default) + (None,) * 8


class _RecurrentFwd(torch.autograd.Function):
    """The eager route with a gradient; the non-differentiable arguments travel as one tuple, as in
    _ops._ChunkFwd (apply inspects every argument)."""

    @staticmethod
    def forward(ctx, q, k, v, gk, gv, initial_state, rest):
        with _below_autograd():
            out = _fwd_op(q, k, v, gk, gv, initial_state, *rest)
        _save(ctx, q, k, v, gk, gv, initial_state, rest)
        return out

    @staticmethod
    def backward(ctx, do, dht):
        return _gradients(ctx, do, dht, _bwd_op) + (None,)


# autograd.Function.apply's C part (see _ops._apply).
_apply = super(torch.autograd.function._SingleLevelFunction, _RecurrentFwd).apply


def _wants_grad(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def recurrent_fwd(q, k, v, gk, gv, initial_state, cu_seqlens, scale, reverse, state_v_first, output_final_state,
                  backend, policy):
    """gla::recurrent_fwd with autograd by the cheapest route that keeps its semantics (as _ops.chunk_fwd).
    Eager calls pass the kept host copy of a device cu_seqlens (_host_offsets)."""
    args = (q, k, v, gk, gv, initial_state, cu_seqlens, scale, reverse, state_v_first, output_final_state, backend,
            policy)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return torch.ops.gla.recurrent_fwd.default(*args)
    args += (_host_offsets.host_copy(cu_seqlens),)  # None without a device cu_seqlens
    if _wants_grad(q, k, v, gk, gv, initial_state):
        return _apply(q, k, v, gk, gv, initial_state, args[6:])
    with _below_autograd():
        return _fwd_op(*args)


_increment_version = torch.autograd.graph.increment_version


class _StateUpdate(torch.autograd.Function):
    """The state update when an input requires grad: the same op, an autograd node whose backward
    raises (the step is not differentiable), as the op registered through torch.library did."""

    @staticmethod
    def forward(ctx, *args):
        with _below_autograd():
            return _update_op(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("gla.recurrent_state_update is not differentiable (a serving step); use "
                           "gla.fused_recurrent_gla for gradients")


def state_update(q, k, v, gk, gv, state_pool, state_slots, slot_error, scale, state_v_first, output_token_states,
                 check_slots, backend, policy):
    """gla::recurrent_state_update. In eager mode the op runs below the autograd key (inside
    _StateUpdate when an input requires grad) and the mutated tensors' version counters are bumped
    here, as PyTorch does for its own in-place ops."""
    args = (q, k, v, gk, gv, state_pool, state_slots, slot_error, scale, state_v_first, output_token_states,
            check_slots, backend, policy)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return torch.ops.gla.recurrent_state_update.default(*args)
    if _wants_grad(q, k, v, gk, gv):
        out = _StateUpdate.apply(*args)
    else:
        with _below_autograd():
            out = _update_op(*args)
    _increment_version((state_pool, slot_error))
    return out


class _Float64Recurrent(torch.autograd.Function):
    """float64 is outside libgla's C ABI: the `torch` backend's body computes it in Python, its
    hand-written backward included (what torch.autograd.gradcheck checks)."""

    @staticmethod
    def forward(ctx, q, k, v, gk, gv, initial_state, offsets, scale, reverse, state_v_first, output_final_state):
        o, ht = _recurrent_torch.recurrent_forward(q, k, v, gk, gv, scale, initial_state, offsets, reverse,
                                                   state_v_first, output_final_state)
        ctx.save_for_backward(q, k, v, gk, gv, initial_state)
        ctx.args = (scale, offsets, reverse, state_v_first)
        return o.to(v.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gk, gv, initial_state = ctx.saved_tensors
        scale, offsets, reverse, state_v_first = ctx.args
        grads = _recurrent_torch.recurrent_backward(q, k, v, gk, gv, scale, initial_state, offsets, reverse,
                                                    state_v_first, do, dht)
        return grads + (None,) * 5


def _float64(q, k, v, gk, gv, scale, initial_state, output_final_state, reverse, cu_seqlens, state_v_first, backend):
    if backend not in ("", "torch"):
        raise TypeError(f"q: float64 is served only by the 'torch' backend (in Python), but backend '{backend}' "
                        "is forced; libgla takes float32, float16 or bfloat16")
    offsets = cu_seqlens.tolist() if cu_seqlens is not None else None
    o, ht = _Float64Recurrent.apply(q, k, v, gk, gv, initial_state, offsets, scale, bool(reverse), bool(state_v_first),
                                    bool(output_final_state))
    return o, (ht if output_final_state else None)


# ---- the public calls ----
def _check_tensors(named):
    for name, t in named:
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
            copied to the host once per version of the tensor (a synchronisation; gla/_host_offsets.py);
            the decode step needs none (recurrent_state_update).
        state_v_first: states are ``[N, H, V, K]`` (fla's layer passes True when decoding).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state (float32) or None.

    Differentiable in q, k, v, gk, gv and initial_state.
    """
    _check_tensors((("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens)))
    if not _ops._loaded:
        _ops.ensure_loaded()  # raises ImportError when libgla is missing
    backend = _ops.current_backend()
    if q.dtype == torch.float64:
        return _float64(q, k, v, gk, gv, _scale(q, scale), initial_state, output_final_state, reverse, cu_seqlens,
                        state_v_first, backend)
    try:
        o, final = recurrent_fwd(q, k, v, gk, gv, initial_state, cu_seqlens, _scale(q, scale), bool(reverse),
                                 bool(state_v_first), bool(output_final_state), backend, _ops.current_policy())
    except RuntimeError as e:
        raise _lib.python_error(e) from None
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
    _check_tensors((("q", q), ("k", k), ("v", v), ("state_pool", state_pool), ("state_slots", state_slots),
                    ("slot_error", slot_error), ("gk", gk), ("gv", gv)))
    if not _ops._loaded:
        _ops.ensure_loaded()
    try:
        o, states = state_update(q, k, v, gk, gv, state_pool, state_slots, slot_error, _scale(q, scale),
                                 bool(state_v_first), bool(output_token_states), bool(check_slots),
                                 _ops.current_backend(), _ops.current_policy())
    except RuntimeError as e:
        raise _lib.python_error(e) from None
    return o, (states if output_token_states else None)


def explain_recurrent(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                      initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                      reverse: bool = False, cu_seqlens: Optional[Tensor] = None, state_v_first: bool = False,
                      backward: bool = False) -> str:
    """The dispatcher's verdict table for a fused_recurrent_gla call (metadata only)."""
    from . import _recurrent_ctypes as rc

    lib = rc.library()
    N = _ops.num_sequences(q, cu_seqlens)
    final = (torch.empty(_ops.state_shape(q, v, N, state_v_first), dtype=torch.float32, device=q.device)
             if output_final_state else None)
    common = rc.pointers([("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv), ("initial_state", initial_state),
                          ("cu_seqlens", cu_seqlens), ("cu_seqlens_host", None)])
    for p in common:
        if p is not None:
            p.contents.data = None
    opts = _lib.make_options(None, state_v_first, _ops.current_backend(), _ops.current_policy())
    text = ctypes.c_char_p()
    if backward:
        args = rc.RecurrentBackwardArgs(*common, *([None] * 8), int(reverse))
        status = lib.gla_recurrent_explain(None, ctypes.byref(args), None, ctypes.byref(opts), ctypes.byref(text))
    else:
        args = rc.RecurrentForwardArgs(*common, None, *rc.pointers([("final_state", final)]), int(reverse))
        status = lib.gla_recurrent_explain(ctypes.byref(args), None, None, ctypes.byref(opts), ctypes.byref(text))
    _lib.raise_for(status)
    return text.value.decode()
