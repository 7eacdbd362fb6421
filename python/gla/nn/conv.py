"""The short causal convolution the GLA layer can apply to its q, k and v projections."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


class ShortConvolution(nn.Module):
    """Depthwise causal 1-D convolution over time followed by SiLU: channel d of output t is
    ``silu(b_d + Σ_j w[d, j] · x[t − (W−1) + j, d])``, with x = 0 before the sequence start (or the
    carried inputs of the previous call). Weight ``[D, 1, W]``, as torch's Conv1d with groups = D.

    ``forward(x [B, T, D], state=None, cu_seqlens=None) -> (y [B, T, D], state)``: ``state``
    ``[N, D, W−1]`` holds the last W−1 inputs of each sequence, so calls can continue a sequence.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"conv_size: expected >= 1, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # Conv1d's default

    def _one(self, x: Tensor, state: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        x = x.transpose(1, 2)  # [B, D, T]
        if state is None:
            state = x.new_zeros(x.shape[0], self.channels, self.kernel_size - 1)
        x = torch.cat([state.to(x.dtype), x], -1)
        y = F.silu(F.conv1d(x, self.weight, self.bias, groups=self.channels))
        return y.transpose(1, 2), x[..., x.shape[-1] - (self.kernel_size - 1):]

    def forward(self, x: Tensor, state: Optional[Tensor] = None,
                cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        if cu_seqlens is None:
            return self._one(x, state)
        bounds = cu_seqlens.tolist()
        parts = [self._one(x[:, s:e], None if state is None else state[n:n + 1])
                 for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 0)

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}"
