"""A small causal language model of GLA blocks (the examples' and tests' model)."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import GatedLinearAttention
from .cache import LayerCache
from .functional import RMSNorm


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GLABlock(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, norm_eps: float, layer_idx: int, **attention):
        super().__init__()
        self.attn_norm = RMSNorm(hidden_size, norm_eps)
        self.attn = GatedLinearAttention(hidden_size=hidden_size, norm_eps=norm_eps, layer_idx=layer_idx, **attention)
        self.mlp_norm = RMSNorm(hidden_size, norm_eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(self, x: Tensor, cache: Optional[LayerCache] = None, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cache=cache, cu_seqlens=cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


class GLALanguageModel(nn.Module):
    """Embedding, ``num_layers`` GLA blocks, a final RMSNorm and an (untied) output projection.

    ``forward(input_ids, caches=None)`` returns logits ``[B, T, vocab_size]``; with ``caches`` (one
    LayerCache per layer, from ``new_caches()``) it continues from their states and updates them, so
    a prompt followed by one token at a time gives the logits of one full-sequence call.
    ``generate`` decodes greedily that way. Extra keyword arguments go to every GatedLinearAttention
    (expand_k, num_kv_heads, mode, ...). Weights start as normal(0, 0.02), biases at zero.
    """

    def __init__(self, vocab_size: int, hidden_size: int = 256, num_layers: int = 2, num_heads: int = 4,
                 intermediate_size: Optional[int] = None, norm_eps: float = 1e-6, **attention):
        super().__init__()
        if intermediate_size is None:  # SwiGLU's 2/3 of a 4x MLP, rounded up to a multiple of 16
            intermediate_size = -(-(hidden_size * 8 // 3) // 16) * 16
        self.vocab_size = vocab_size
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(GLABlock(hidden_size, intermediate_size, norm_eps, i, num_heads=num_heads,
                                             **attention) for i in range(num_layers))
        self.norm = RMSNorm(hidden_size, norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def new_caches(self) -> List[LayerCache]:
        """One empty LayerCache per layer."""
        return [LayerCache() for _ in self.layers]

    def forward(self, input_ids: Tensor, caches: Optional[List[LayerCache]] = None,
                cu_seqlens: Optional[Tensor] = None) -> Tensor:
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(f"caches: expected {len(self.layers)} LayerCache objects (one per layer), got {len(caches)}")
        x = self.embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache=None if caches is None else caches[i], cu_seqlens=cu_seqlens)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, caches: Optional[List[LayerCache]] = None) -> Tensor:
        """Greedy decoding: one call over the prompt, then one call per new token, each continuing
        from the layers' caches. Returns ``[B, max_new_tokens]`` new tokens."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected [B, T] with T >= 1, got {list(input_ids.shape)}")
        caches = self.new_caches() if caches is None else caches
        logits = self(input_ids, caches)
        tokens = []
        for step in range(max_new_tokens):
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
            if step + 1 < max_new_tokens:
                logits = self(tokens[-1], caches)
        return torch.cat(tokens, 1) if tokens else input_ids.new_zeros(input_ids.shape[0], 0)
