"""PyTorch modules built on libgla: the GLA layer, its decoding cache, and a small language model.

    from gla.nn import GatedLinearAttention, LayerCache
    layer = GatedLinearAttention(hidden_size=1024, num_heads=8)
    cache = LayerCache()
    y = layer(x_prompt, cache=cache)      # gla.chunk_gla; the final state goes into the cache
    y = layer(x_next, cache=cache)        # one token: gla.fused_recurrent_gla from the cached state

docs/nn.md describes them.
"""
from .attention import GatedLinearAttention
from .cache import LayerCache
from .conv import ShortConvolution
from .functional import ACTIVATIONS, GatedRMSNorm, RMSNorm
from .model import GLABlock, GLALanguageModel, SwiGLU

__all__ = ["GatedLinearAttention", "LayerCache", "GLALanguageModel", "GLABlock", "SwiGLU", "ShortConvolution", "RMSNorm",
           "GatedRMSNorm", "ACTIVATIONS"]
