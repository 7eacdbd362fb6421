"""gla.tune: the `fastest` policy's measurement ahead of time (gla_tune in gla.h).

Times every backend that accepts the problem (torch included) on the given inputs, writing to
scratch outputs, and caches the winner for the problem's signature in this process (and in
$GLA_TUNE_FILE when set), so calls under ``gla.policy("fastest")`` or GLA_POLICY=fastest are served
without measuring.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import _lib, _ops, _tensors
from ._api import _as_host_offsets
from ._ctypes_kernels import _host_offsets, _ptr, _stream


def _entry(lib):
    fn = lib.gla_tune
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_lib.ForwardArgs), ctypes.POINTER(_lib.BackwardArgs), ctypes.POINTER(_lib.Options),
                   ctypes.POINTER(ctypes.c_char_p)]
    return fn


def tune(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None,
         initial_state: Optional[Tensor] = None, output_final_state: bool = False, state_v_first: bool = False,
         cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Union[Tensor, Sequence[int]]] = None,
         backward: bool = False, do: Optional[Tensor] = None, dht: Optional[Tensor] = None) -> str:
    """Measures the candidates of ``chunk_gla`` with these arguments (the backward with
    ``backward=True``: ``do`` defaults to random values, ``dht`` to random values when
    ``output_final_state``) and returns explain()'s text with the times and the winner."""
    lib = _ops.ensure_loaded()
    host = _host_offsets(cu_seqlens, _as_host_offsets(cu_seqlens_cpu))
    N = _ops.num_sequences(q, cu_seqlens)
    state_shape = _ops.state_shape(q, v, N, state_v_first)
    final = torch.empty(state_shape, dtype=torch.float32, device=q.device) if output_final_state else None
    inputs = (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
              ("cu_seqlens_host", host))
    if backward:
        do = do if do is not None else torch.randn(v.shape, dtype=v.dtype, device=v.device)
        if dht is None and output_final_state:
            dht = torch.randn(state_shape, dtype=torch.float32, device=q.device)
        dq, dk, dv, dg = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v, g))
        dh0 = torch.empty(initial_state.shape, dtype=torch.float32, device=q.device) if initial_state is not None else None
        named = inputs + (("do", do), ("dht", dht), ("dq", dq), ("dk", dk), ("dv", dv), ("dg", dg), ("dh0", dh0))
        args = _lib.BackwardArgs(*(_ptr(_tensors.describe(n, t)) for n, t in named))
    else:
        named = inputs + (("o", torch.empty(v.shape, dtype=v.dtype, device=v.device)), ("final_state", final))
        args = _lib.ForwardArgs(*(_ptr(_tensors.describe(n, t)) for n, t in named))
    opts = _lib.make_options(_ops.default_scale(q, scale), state_v_first, _ops.current_backend(), _lib.POLICY_FASTEST,
                             stream=_stream(q.device))
    text = ctypes.c_char_p()
    with _tensors.handed_over(*(t for _, t in named)):
        fwd, bwd = (None, ctypes.byref(args)) if backward else (ctypes.byref(args), None)
        _lib.raise_for(_entry(lib)(fwd, bwd, ctypes.byref(opts), ctypes.byref(text)))
    return text.value.decode()
