"""Host copies of device cu_seqlens, kept per tensor version.

libgla checks cu_seqlens (starts at 0, never decreases, ends at T) and plans varlen work from a
host copy. fla's calls pass no host copy (its `chunk_gla` and `fused_recurrent_gla` have no
cu_seqlens_cpu), so each call copied cu_seqlens to the host: a synchronisation, which stops the
host from queueing work ahead of the GPU. A model hands one cu_seqlens tensor to every layer (fla's
layers unpad once per attention mask and cache the result), so the copy is kept for that tensor
while PyTorch's version counter of it is unchanged: one synchronisation per new cu_seqlens instead
of one per layer call (fla's 4-layer GLA model decoding packed: 1 a step instead of 4).

The version counter is shared by a tensor and its views and counts every in-place write PyTorch
makes, so a write through the tensor or any view of it makes the next call copy again. Writes
PyTorch does not see (through the data pointer from other code, or through `.data`, which has a
counter of its own) are not noticed: pass cu_seqlens_cpu, or a new tensor, after such a write.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

CAPACITY = 8  # tensors whose copies are kept (the layers of one step share one)

_kept: "OrderedDict[int, tuple]" = OrderedDict()
_lock = threading.Lock()


def _fingerprint(t: Tensor) -> tuple:
    return (t._version, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)


def _to_host(t: Tensor) -> Tensor:
    return t.to("cpu")


def host_copy(cu_seqlens: Optional[Tensor]) -> Optional[Tensor]:
    """The host copy of a device cu_seqlens (None for None or a host tensor): the kept one while
    the tensor is unchanged, else a fresh copy (a synchronisation), kept for the next call."""
    if (cu_seqlens is None or cu_seqlens.device.type == "cpu" or cu_seqlens.is_meta
            or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()):
        return None  # traced calls keep the operator's own handling
    key, now = id(cu_seqlens), _fingerprint(cu_seqlens)
    with _lock:
        entry = _kept.get(key)
        if entry is not None and entry[0]() is cu_seqlens and entry[1] == now:
            _kept.move_to_end(key)
            return entry[2]
    host = _to_host(cu_seqlens)
    with _lock:
        _kept[key] = (weakref.ref(cu_seqlens), now, host)
        _kept.move_to_end(key)
        while len(_kept) > CAPACITY:
            _kept.popitem(last=False)
    return host


def forget() -> None:
    """Drops every kept copy."""
    with _lock:
        _kept.clear()
