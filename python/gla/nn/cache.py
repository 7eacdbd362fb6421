"""The per-layer decoding cache of a GatedLinearAttention layer."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor


class LayerCache:
    """The recurrent state one GatedLinearAttention layer carries from one call to the next.

    Pass the same object to every call of the layer for one stream of tokens (a prefill, then one
    call per decoded token): the layer starts from ``state`` and replaces it with its final state.

    Attributes:
        state: ``[N, H, K, V]`` float32 (one state per sequence, H = the layer's query heads), or
            None before the first call (the layer then starts from zeros).
        conv_state: with ``use_short_conv``, the last ``conv_size - 1`` inputs of the q, k and v
            convolutions (three ``[N, D, conv_size - 1]`` tensors), else None.
        seen_tokens: tokens consumed so far (per sequence when the batch is not packed).
    """

    def __init__(self, state: Optional[Tensor] = None, seen_tokens: int = 0,
                 conv_state: Optional[Tuple[Tensor, Tensor, Tensor]] = None):
        self.state = state
        self.conv_state = conv_state
        self.seen_tokens = seen_tokens

    def update(self, state: Tensor, num_tokens: int, conv_state: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> None:
        """Records the layer's final state (and convolution inputs) after a call over ``num_tokens`` tokens."""
        self.state = state
        self.conv_state = conv_state
        self.seen_tokens += int(num_tokens)

    def reset(self) -> None:
        """Forgets everything: the next call starts from the zero state."""
        self.state = None
        self.conv_state = None
        self.seen_tokens = 0

    def detach(self) -> "LayerCache":
        """Cuts the autograd history of the state in place (truncated backpropagation through time:
        the next call still starts from this state, but gradients stop here). Returns self."""
        if self.state is not None:
            self.state = self.state.detach()
        if self.conv_state is not None:
            self.conv_state = tuple(s.detach() for s in self.conv_state)
        return self

    def __repr__(self) -> str:
        shape = None if self.state is None else list(self.state.shape)
        return f"LayerCache(state={shape}, seen_tokens={self.seen_tokens})"
