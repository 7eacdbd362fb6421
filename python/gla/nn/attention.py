"""The gated linear attention layer of the GLA paper (Yang et al., 2023, arXiv:2312.06635)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import gla as _gla

from .cache import LayerCache
from .conv import ShortConvolution
from .functional import GatedRMSNorm, RMSNorm, activation, wide

MODES = ("auto", "chunk", "fused_recurrent")


def recurrent_gla(q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Optional[Tensor],
                  output_final_state: bool, cu_seqlens: Optional[Tensor]):
    """The decode path: ``gla.fused_recurrent_gla``, looked up when called."""
    return _gla.fused_recurrent_gla(q, k, v, gk=gk, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunked_gla(q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Optional[Tensor],
                output_final_state: bool, cu_seqlens: Optional[Tensor]):
    """The training and prefill path: ``gla.chunk_gla``, looked up when called."""
    return _gla.chunk_gla(q, k, v, gk, initial_state=initial_state, output_final_state=output_final_state,
                          cu_seqlens=cu_seqlens)


def _whole(value: float, argument: str) -> int:
    if not math.isclose(value, round(value)) or round(value) <= 0:
        raise ValueError(f"{argument}: expected a positive whole number, got {value}")
    return round(value)


class GatedLinearAttention(nn.Module):
    r"""Gated linear attention with a data-dependent per-key forget gate.

    Per token, with x the layer input (``[B, T, hidden_size]``)::

        q, k, v = x W_q, x W_k, x W_v                      split into heads
        g       = logsigmoid(x W_g1 W_g2 + b) / gate_logit_normalizer     (low-rank, per key)
        o       = GLA(q, k, v, g)                          S_t = Diag(e^{g_t}) S_{t-1} + k_t v_tᵀ, o_t = q_tᵀ S_t / √d_k
        y       = (RMSNorm(o) · act(x W_r)) W_o            per-head norm, output gate

    The defaults are those of fla's ``GLAConfig`` (hidden 2048, 4 heads, expand_k 0.5, expand_v 1,
    gate rank 16, normaliser 16, output gate with swish, eps 1e-6); parameters carry fla's names, so
    a state dict of fla's ``GatedLinearAttention`` with these options loads as is.

    Args:
        hidden_size: width of the input and output.
        expand_k, expand_v: key and value widths over all query heads, as multiples of hidden_size.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention; must divide num_heads). Each k/v
            head (with its gate) serves ``num_heads // num_kv_heads`` consecutive query heads.
        use_short_conv: a depthwise causal convolution with SiLU (``ShortConvolution``) on each of
            the q, k and v projections; ``conv_size`` taps, ``conv_bias`` a bias.
        feature_map: None, or an activation name applied to q and k (see ``ACTIVATIONS``).
        use_output_gate: ``RMSNorm(o) * act(x W_r)``; without it the output is ``RMSNorm(o)``.
        gate_fn: the output gate's activation.
        elementwise_affine: the output norm has a learned weight.
        norm_eps: epsilon of the output norm.
        gate_logit_normalizer: divides the logsigmoid of the gate logits.
        gate_low_rank_dim: rank of the gate projection.
        clamp_min: if set, the gate is clamped to be at least this (a floor on the decay).
        mode: ``"chunk"`` always calls ``gla.chunk_gla``; ``"fused_recurrent"`` always calls
            ``gla.fused_recurrent_gla``; ``"auto"`` calls the recurrent path for calls of at most
            ``recurrent_max_len`` tokens that autograd does not record (decoding) and the chunked
            path otherwise (training, long prefills).
        recurrent_max_len: the longest call ``"auto"`` sends to the recurrent path (64, fla's rule).
        layer_idx: the layer's position in a model (informational).

    ``forward(hidden_states, cache=None, cu_seqlens=None)``: with a ``LayerCache`` the layer starts
    from the cache's state and stores its final state there. ``cu_seqlens`` (``[N + 1]`` offsets,
    B = 1) packs N sequences into one row; the cache then holds N states.
    """

    def __init__(self, hidden_size: int = 2048, expand_k: float = 0.5, expand_v: float = 1.0, num_heads: int = 4,
                 num_kv_heads: Optional[int] = None, feature_map: Optional[str] = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", elementwise_affine: bool = True, norm_eps: float = 1e-6,
                 gate_logit_normalizer: float = 16, gate_low_rank_dim: int = 16, clamp_min: Optional[float] = None,
                 mode: str = "auto", recurrent_max_len: int = 64, layer_idx: Optional[int] = None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("gate_low_rank_dim", gate_low_rank_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}")
        key_dim = _whole(hidden_size * expand_k, "expand_k (hidden_size * expand_k)")
        value_dim = _whole(hidden_size * expand_v, "expand_v (hidden_size * expand_v)")
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"num_heads: expected a divisor of the key width {key_dim} and the value width "
                             f"{value_dim}, got {num_heads}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer: expected > 0, got {gate_logit_normalizer}")

        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.num_kv_groups = num_heads // num_kv_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.head_k_dim, self.head_v_dim = key_dim // num_heads, value_dim // num_heads
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        self.mode, self.recurrent_max_len, self.layer_idx = mode, recurrent_max_len, layer_idx
        self.feature_map = feature_map
        self.feature_map_fn = activation(feature_map, "feature_map") if feature_map is not None else None
        self.use_output_gate = use_output_gate

        kv_key, kv_value = key_dim // self.num_kv_groups, value_dim // self.num_kv_groups
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, kv_key, bias=False)
        self.v_proj = nn.Linear(hidden_size, kv_value, bias=False)
        self.use_short_conv = use_short_conv
        if use_short_conv:
            self.q_conv1d = ShortConvolution(key_dim, conv_size, conv_bias)
            self.k_conv1d = ShortConvolution(kv_key, conv_size, conv_bias)
            self.v_conv1d = ShortConvolution(kv_value, conv_size, conv_bias)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, kv_key, bias=True))
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
            norm = GatedRMSNorm(self.head_v_dim, norm_eps, elementwise_affine, gate_fn)
            # fla's parameter names: g_norm_swish_gate for its fused swish norm-gate, g_norm otherwise
            setattr(self, "g_norm_swish_gate" if gate_fn == "swish" else "g_norm", norm)
            self._out_norm_name = "g_norm_swish_gate" if gate_fn == "swish" else "g_norm"
        else:
            activation(gate_fn, "gate_fn")
            self.g_norm = RMSNorm(self.head_v_dim, norm_eps, elementwise_affine)
            self._out_norm_name = "g_norm"
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def state_shape(self, num_sequences: int):
        """Shape of the recurrent state a LayerCache holds for ``num_sequences`` sequences."""
        return (num_sequences, self.num_heads, self.head_k_dim, self.head_v_dim)

    def _heads(self, x: Tensor, width: int) -> Tensor:
        """``[B, T, h * width]`` -> ``[B, T, H, width]``, repeating each k/v head for its query group."""
        x = x.unflatten(-1, (-1, width))
        return x.repeat_interleave(self.num_kv_groups, dim=-2) if self.num_kv_groups > 1 else x

    def forward(self, hidden_states: Tensor, cache: Optional[LayerCache] = None,
                cu_seqlens: Optional[Tensor] = None) -> Tensor:
        x = hidden_states
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}], got {got}")
        if cache is not None and not isinstance(cache, LayerCache):
            raise TypeError(f"cache: expected a gla.nn.LayerCache, got {type(cache).__name__}")
        B, T, _ = x.shape
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if cache is not None and cache.state is not None and tuple(cache.state.shape) != self.state_shape(N):
            raise ValueError(f"cache.state: expected {list(self.state_shape(N))} (N, heads, head_k_dim, head_v_dim), "
                             f"got {list(cache.state.shape)}")

        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        conv_state = None
        if self.use_short_conv:
            carried = cache.conv_state if cache is not None and cache.conv_state is not None else (None,) * 3
            for i, (conv, s) in enumerate(zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), carried)):
                want = (N, conv.channels, conv.kernel_size - 1)
                if s is not None and tuple(s.shape) != want:
                    raise ValueError(f"cache.conv_state[{i}]: expected {list(want)}, got {list(s.shape)}")
            (q, cq), (k, ck), (v, cv) = (conv(y, s, cu_seqlens) for conv, y, s in
                                         zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), (q, k, v), carried))
            conv_state = (cq, ck, cv)
        q = q.unflatten(-1, (self.num_heads, self.head_k_dim))
        k, v = self._heads(k, self.head_k_dim), self._heads(v, self.head_v_dim)
        # The gate in float32 (float64 for float64 inputs): logsigmoid / 16 spans [-inf, 0) where bf16 keeps 8 bits.
        gk = F.logsigmoid(wide(self._heads(self.gk_proj(x), self.head_k_dim))) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = gk.clamp_min(self.clamp_min)
        if self.feature_map_fn is not None:
            q, k = self.feature_map_fn(q), self.feature_map_fn(k)

        kernel = chunked_gla
        if self.mode == "fused_recurrent" or (self.mode == "auto" and T <= self.recurrent_max_len
                                              and not _recorded(q, k, v, gk)):
            kernel = recurrent_gla
        o, final_state = kernel(q, k, v, gk, initial_state=None if cache is None else cache.state,
                                output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.update(final_state, T, conv_state)

        norm = getattr(self, self._out_norm_name)
        if self.use_output_gate:
            o = norm(o, self.g_proj(x).unflatten(-1, (self.num_heads, self.head_v_dim)))
        else:
            o = norm(o)
        return self.o_proj(o.flatten(-2))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, mode={self.mode}")


def _recorded(*tensors: Tensor) -> bool:
    """Whether autograd records an operation on these tensors (then it needs a backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
