"""Activations by name and the gated RMS norm of the GLA layer's output."""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "swish": F.silu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "relu": F.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
}


def wide(x: Tensor) -> Tensor:
    """x in float32, or float64 if it is float64 (half-precision math widened, never narrowed)."""
    return x if x.dtype == torch.float64 else x.float()


def activation(name: str, argument: str) -> Callable[[Tensor], Tensor]:
    """The activation called ``name``; ValueError naming ``argument`` for an unknown one."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{argument}: expected one of {', '.join(sorted(ACTIVATIONS))}, got {name!r}")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """``RMSNorm(x) * weight`` over the last dimension, computed in float32 and returned in x's
    dtype (the model's pre-norms, and the layer's output norm without an output gate)."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def normalised(self, x: Tensor) -> Tensor:
        """The float32 result, before the cast back to x's dtype."""
        y = wide(x)
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        return y * wide(self.weight) if self.weight is not None else y

    def forward(self, x: Tensor) -> Tensor:
        return self.normalised(x).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.weight is not None}"


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * weight * act(gate)`` over the last dimension, computed in float32 and returned
    in x's dtype: the GLA layer's per-head output normalisation and output gate in one step."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, act: str = "swish"):
        super().__init__(dim, eps, elementwise_affine)
        self.act_name = act
        self.act = activation(act, "gate_fn")

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:  # type: ignore[override]
        return (self.normalised(x) * self.act(wide(gate))).to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", act={self.act_name}"
