"""The public Python surface: chunk_gla (fla's call), the registry (backends, explain) and backend
selection (backend, policy, set_backend_enabled)."""
from __future__ import annotations

import contextlib
import ctypes
import os
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _chunked, _host_offsets, _lib, _ops, _tensors, _validate


def _as_host_offsets(cu_seqlens_cpu) -> Optional[Tensor]:
    if cu_seqlens_cpu is None or isinstance(cu_seqlens_cpu, Tensor):
        return cu_seqlens_cpu
    return torch.tensor(list(cu_seqlens_cpu), dtype=torch.int64)


def _reject_non_tensors(required, optional) -> None:
    """TypeError naming the first argument that is not a tensor (None allowed for the optional ones)."""
    for name, t in required + tuple((name, t) for name, t in optional if t is not None):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def chunk_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None,
              initial_state: Optional[Tensor] = None, output_final_state: bool = False,
              state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None,
              cu_seqlens_cpu: Optional[Union[Tensor, Sequence[int]]] = None,
              check_inputs: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Gated linear attention, chunked form; the call of fla's ``chunk_gla``.

    Args:
        q, k: ``[B, T, H, K]``, float32, float16 or bfloat16 (float64: computed in Python).
        v: ``[B, T, H, V]``, q's dtype.
        g: ``[B, T, H, K]`` per-key forget gate in natural-log space (expected <= 0), or ``[B, T, H]``
            per-head; q's dtype or float32.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` float32 (``[N, H, V, K]`` with ``state_v_first``).
        output_final_state: also return the final state (float32, like initial_state).
        cu_seqlens: ``[N + 1]`` int32/int64 sequence offsets for packed variable-length input (B == 1).
        cu_seqlens_cpu: a host copy of cu_seqlens; with it nothing synchronises the host.
        check_inputs: first scan the inputs (and, in the backward, the incoming gradients) for NaN/Inf
            and for NaN or positive gates, and raise ValueError naming the first position. Costs a
            pass over the data (and a device-to-host copy for device tensors).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state or None.

    Differentiable in q, k, v, g and initial_state. Raises ValueError (invalid argument) or TypeError
    (dtype problems) with libgla's message, RuntimeError otherwise. Tensors on the meta device are
    rejected (they hold no data); torch.compile traces through with fake tensors.
    """
    # The common case tested inline (a loop over the arguments costs ~10k instructions per call);
    # the slow paths name the argument.
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and isinstance(g, Tensor)
            and (initial_state is None or isinstance(initial_state, Tensor))
            and (cu_seqlens is None or isinstance(cu_seqlens, Tensor))):
        _reject_non_tensors((("q", q), ("k", k), ("v", v), ("g", g)),
                            (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)))
    if (q.is_meta or k.is_meta or v.is_meta or g.is_meta or (initial_state is not None and initial_state.is_meta)
            or (cu_seqlens is not None and cu_seqlens.is_meta) or cu_seqlens_cpu is not None):
        _validate.reject_meta((("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state),
                               ("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)))
    if not _ops._loaded:
        _ops.ensure_loaded()  # raises ImportError when libgla is missing
    backend_name = _ops.selection.backend
    host = cu_seqlens_cpu if cu_seqlens_cpu is None else _as_host_offsets(cu_seqlens_cpu)
    if q.dtype == torch.float64:
        return _float64_chunk_gla(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                                  host, backend_name, bool(check_inputs))
    if host is None and cu_seqlens is not None:
        host = _host_offsets.host_copy(cu_seqlens)  # one synchronisation per cu_seqlens, not per call
    try:
        o, final = _ops.chunk_fwd(q, k, v, g, initial_state, cu_seqlens, host, scale,
                                  bool(state_v_first), bool(output_final_state), backend_name, _ops.selection.policy,
                                  bool(check_inputs))
    except RuntimeError as e:
        raise _lib.python_error(e) from None
    return o, (final if output_final_state else None)


class _Float64ChunkGLA(torch.autograd.Function):
    """float64 is outside libgla's C ABI: the `torch` backend's body (_chunked) computes it in Python,
    its hand-written backward included, which is what torch.autograd.gradcheck checks."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, offsets, scale, state_v_first, output_final_state, check_inputs):
        o, ht = _chunked.chunk_forward(q, k, v, g, scale, initial_state, offsets, state_v_first, output_final_state)
        ctx.save_for_backward(q, k, v, g, initial_state)
        ctx.offsets, ctx.scale, ctx.state_v_first, ctx.check_inputs = offsets, scale, state_v_first, check_inputs
        return o.to(v.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, initial_state = ctx.saved_tensors
        if ctx.check_inputs:
            _validate.check_values((("do", do, False), ("dht", dht, False)))
        dq, dk, dv, dg, dh0 = _chunked.chunk_backward(q, k, v, g, ctx.scale, initial_state, ctx.offsets,
                                                      ctx.state_v_first, do=do, dht=dht)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype),
                dh0 if initial_state is not None else None, None, None, None, None, None)


def _float64_chunk_gla(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, host,
                       backend_name, check_inputs):
    if backend_name not in ("", "torch"):
        raise TypeError(f"q: float64 is served only by the 'torch' backend (in Python), but backend '{backend_name}' "
                        "is forced; libgla takes float32, float16 or bfloat16")
    scale = _ops.default_scale(q, scale)
    offsets = _validate.check_float64(q, k, v, g, initial_state, cu_seqlens, host, scale, bool(state_v_first))
    if check_inputs:
        _validate.check_values((("q", q, False), ("k", k, False), ("v", v, False), ("g", g, True),
                                ("initial_state", initial_state, False)))
    o, ht = _Float64ChunkGLA.apply(q, k, v, g, initial_state, offsets, scale, bool(state_v_first),
                                   bool(output_final_state), check_inputs)
    return o, (ht if output_final_state else None)


# ---- registry ----
class BackendInfo(NamedTuple):
    name: str
    priority: int
    available: bool  # available on this machine and enabled
    reason: str  # why not, when not


def backends() -> List[BackendInfo]:
    """Every registered backend in priority order (the `torch` backend included)."""
    lib = _ops.ensure_loaded()
    out = []
    for i in range(lib.gla_backend_count()):
        name, reason = ctypes.c_char_p(), ctypes.c_char_p()
        priority, available = ctypes.c_int32(), ctypes.c_int32()
        _lib.raise_for(lib.gla_backend_info(i, ctypes.byref(name), ctypes.byref(priority), ctypes.byref(available),
                                            ctypes.byref(reason)))
        out.append(BackendInfo(name.value.decode(), priority.value, bool(available.value),
                               (reason.value or b"").decode()))
    return out


def set_backend_enabled(name: str, enabled: bool = True) -> None:
    """Switches a backend on or off for this process (like GLA_DISABLE)."""
    lib = _ops.ensure_loaded()
    _lib.raise_for(lib.gla_backend_set_enabled(name.encode(), int(bool(enabled))))


def reload_environment() -> None:
    """Has libgla read its environment variables (GLA_BACKEND, GLA_DISABLE, GLA_POLICY, GLA_LOG, ...)
    again: it reads them once, at the first call that needs one, so changes made later in this
    process (``os.environ[...] = ...``) apply to the calls made after this."""
    lib = _ops.ensure_loaded()
    _lib.raise_for(lib.gla_reload_environment())


def load_plugin(path: str) -> None:
    """Loads an out-of-tree backend: a shared library exporting ``gla_plugin_register`` (see gla.h).
    Its backends join the registry (``gla.backends()``, ``gla.explain``) like the built-in ones."""
    lib = _ops.ensure_loaded()
    _lib.raise_for(lib.gla_load_plugin(os.fsencode(path)))


def explain(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None,
            initial_state: Optional[Tensor] = None, output_final_state: bool = False,
            state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None,
            cu_seqlens_cpu: Optional[Union[Tensor, Sequence[int]]] = None, backward: bool = False) -> str:
    """The dispatcher's verdict table for this input (the same text as `gla explain`): every backend,
    unit by unit, available / enabled / accepts or declines with the reason, and the decision. Reads
    metadata only. ``backward=True`` explains the backward operation."""
    lib = _ops.ensure_loaded()
    host = _as_host_offsets(cu_seqlens_cpu)
    d = {name: _tensors.describe(name, t) for name, t in
         (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
          ("cu_seqlens_host", host))}
    p = {name: (ctypes.pointer(x) if x is not None else None) for name, x in d.items()}
    opts = _lib.make_options(_ops.default_scale(q, scale), state_v_first, _ops.current_backend(), _ops.current_policy())
    text = ctypes.c_char_p()
    N = _ops.num_sequences(q, cu_seqlens)
    state_shape = _ops.state_shape(q, v, N, state_v_first)

    def planned(like, shape, dtype=None):
        """Metadata of an output as the operator will allocate it (contiguous; no memory)."""
        return _meta_descriptor(shape, dtype if dtype is not None else d[like].dtype, d[like])

    with _tensors.handed_over(q, k, v, g, initial_state, cu_seqlens, host):
        if backward:
            g_dtype = d["g"].dtype
            outs = [planned("v", v.shape), None, planned("q", q.shape), planned("k", k.shape),
                    planned("v", v.shape), planned("g", g.shape, g_dtype),
                    planned("q", state_shape, _lib.F32) if initial_state is not None else None]
            args = _lib.BackwardArgs(p["q"], p["k"], p["v"], p["g"], p["initial_state"], p["cu_seqlens"],
                                     p["cu_seqlens_host"], *[_pointer(o) for o in outs])
            status = lib.gla_explain(None, ctypes.byref(args), ctypes.byref(opts), ctypes.byref(text))
        else:
            o = planned("v", v.shape)
            final = planned("q", state_shape, _lib.F32) if output_final_state else None
            args = _lib.ForwardArgs(p["q"], p["k"], p["v"], p["g"], p["initial_state"], p["cu_seqlens"],
                                    p["cu_seqlens_host"], _pointer(o), _pointer(final))
            status = lib.gla_explain(ctypes.byref(args), None, ctypes.byref(opts), ctypes.byref(text))
        _lib.raise_for(status)
    return text.value.decode()


def _pointer(d):
    return ctypes.pointer(d) if d is not None else None


def _meta_descriptor(shape, dtype: int, like: "_lib.Tensor") -> "_lib.Tensor":
    """A contiguous descriptor with no memory, on `like`'s device (for explain: metadata only)."""
    t = _lib.Tensor()
    t.dtype, t.rank = dtype, len(shape)
    t.device_type, t.device_index = like.device_type, like.device_index
    stride = 1
    for i in reversed(range(len(shape))):
        t.sizes[i], t.strides[i] = shape[i], stride
        stride *= shape[i]
    return t


# ---- selection: thread-local, captured by each forward for its backward ----
@contextlib.contextmanager
def backend(name: Optional[str]):
    """``with gla.backend("cpu"):`` forces one backend for the calls made in this thread inside the
    block (their backward included, wherever it runs). ``None`` or ``""`` restores the dispatcher's
    choice. A unit-level spec such as ``"fwd_h=torch,bwd_dqkg=cpu"`` is passed through as is."""
    previous = _ops.current_backend()
    _ops.selection.backend = name or ""
    try:
        yield
    finally:
        _ops.selection.backend = previous


@contextlib.contextmanager
def policy(name: str):
    """``with gla.policy("fastest"):`` sets the selection policy for this thread inside the block:
    "priority", "fastest", "forced" (with gla.backend) or "default" (GLA_POLICY, else priority)."""
    if name not in _lib.POLICY_NAMES:
        raise ValueError(f"policy: expected one of {', '.join(_lib.POLICY_NAMES)}, got {name!r}")
    previous = _ops.current_policy()
    _ops.selection.policy = _lib.POLICY_NAMES[name]
    try:
        yield
    finally:
        _ops.selection.policy = previous


def library_path() -> str:
    """Path of the libgla shared library in use."""
    return _ops.ensure_loaded().path


def version() -> str:
    return _ops.ensure_loaded().gla_version().decode()
