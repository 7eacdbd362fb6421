"""The one collective of context parallelism: an all-gather of one equally shaped tensor per rank.

Two implementations serve the same algorithm: `TorchDistributed` (each process is one rank of a
torch.distributed group: gloo on CPU, NCCL on GPUs) and `InMemory` (every rank simulated in this
process, the gather a stack). Both count the bytes each rank sends, for the traffic report.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor


class InMemory:
    """All `world_size` ranks live in this process; `all_gather` receives one payload per rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.local_ranks: Tuple[int, ...] = tuple(range(world_size))
        self.sent_bytes: List[int] = []  # per gather: bytes one rank sends

    def all_gather(self, payloads: Sequence[Tensor]) -> Tensor:
        """[world_size, *payload.shape] from one payload per rank."""
        self.sent_bytes.append(payloads[0].numel() * payloads[0].element_size())
        return torch.stack(list(payloads))


class TorchDistributed:
    """This process is one rank of `group` (None: the default group)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("gla.distributed: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first (or use gla.distributed.simulate)")
        self._dist, self.group = dist, group
        self.world_size = dist.get_world_size(group)
        self.local_ranks: Tuple[int, ...] = (dist.get_rank(group),)
        self.sent_bytes: List[int] = []

    def all_gather(self, payloads: Sequence[Tensor]) -> Tensor:
        """[world_size, *payload.shape] from this rank's one payload."""
        (payload,) = payloads
        payload = payload.contiguous()
        self.sent_bytes.append(payload.numel() * payload.element_size())
        out = payload.new_empty((self.world_size,) + tuple(payload.shape))
        self._dist.all_gather(list(out.unbind(0)), payload, group=self.group)
        return out
