"""Named scratch buffers that the blocks of one `torch`-backend call reuse.

The chunked body (_chunked.py) walks a call in blocks of scan steps, and every block needs the same
temporaries. Each call site takes its temporary from a Scratch by a name of its own instead of
allocating a fresh tensor: on the CPU a freshly allocated tensor above glibc's trim threshold comes
back as new pages, each 4 KiB a page fault (~3 us on this project's VMs; 42 000 faults in one
forward at B1 T4096 H16 K=V=128, a third of its process CPU time), and a reused one is still in
cache. On the CPU the Scratch of a thread also outlives the call (the worker threads are
long-lived; its size is about the block budget, and a caller drops it past a bound:
keep_at_most). Elsewhere a Scratch lives for one call and only saves the allocator's round trips.

A name is one buffer: two tensors alive at the same time must have different names.
"""
from __future__ import annotations

import math
import threading
from typing import Dict, Tuple

import torch


class Scratch:
    """Buffers by name, each grown to the largest shape asked of it (dtype and device fixed)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, torch.device(device)
        self._buffers: Dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of `shape`, contents undefined (what the name's last user left)."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=self.dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:n].view(shape)

    def zeros(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        return self.take(name, shape).zero_()

    def keep_at_most(self, nbytes: int) -> None:
        """Drops every buffer when together they hold more than nbytes (a call of unusual size
        does not pin its memory to the thread)."""
        if sum(b.numel() for b in self._buffers.values()) * self._itemsize() > nbytes:
            self._buffers.clear()

    def _itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


_local = threading.local()


def for_call(dtype: torch.dtype, device) -> Scratch:
    """The Scratch a call on this thread uses: on the CPU the thread's own (kept between calls),
    elsewhere a new one."""
    device = torch.device(device)
    if device.type != "cpu":
        return Scratch(dtype, device)
    per_thread = getattr(_local, "scratch", None)
    if per_thread is None:
        per_thread = _local.scratch = {}
    if dtype not in per_thread:
        per_thread[dtype] = Scratch(dtype, device)
    return per_thread[dtype]


def fresh(like: torch.Tensor) -> Scratch:
    """A Scratch for one use (the stage units: their results are views of it)."""
    return Scratch(like.dtype, like.device)
