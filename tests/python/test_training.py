"""A small GLA model built on gla.chunk_gla, trained a few steps on CPU: every backend gives the
same loss curve."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gla


class TinyGLA(nn.Module):
    """Embedding -> one gated-linear-attention layer (GLA paper gate: logsigmoid / 16) -> logits."""

    def __init__(self, vocab=32, dim=32, heads=2, key=16, value=16):
        super().__init__()
        self.heads, self.key, self.value = heads, key, value
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, heads * key, bias=False)
        self.k = nn.Linear(dim, heads * key, bias=False)
        self.v = nn.Linear(dim, heads * value, bias=False)
        self.g = nn.Linear(dim, heads * key)
        self.h0 = nn.Parameter(torch.zeros(1, heads, key, value))
        self.out = nn.Linear(heads * value, vocab)

    def forward(self, tokens, cu_seqlens=None):
        B, T = tokens.shape
        x = self.embed(tokens)
        q = self.q(x).view(B, T, self.heads, self.key)
        k = self.k(x).view(B, T, self.heads, self.key)
        v = self.v(x).view(B, T, self.heads, self.value)
        g = F.logsigmoid(self.g(x).view(B, T, self.heads, self.key)) / 16
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        o, _ = gla.chunk_gla(q, k, v, g, initial_state=self.h0.expand(N, -1, -1, -1).contiguous(),
                             cu_seqlens=cu_seqlens)
        return self.out(o.reshape(B, T, -1))


def _curve(backend, varlen, steps=6):
    torch.manual_seed(0)
    model = TinyGLA()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    if varlen:
        tokens = torch.randint(0, 32, (1, 150), generator=gen)
        cu = torch.tensor([0, 40, 41, 150])
    else:
        tokens = torch.randint(0, 32, (3, 90), generator=gen)
        cu = None
    losses = []
    with gla.backend(backend):
        for _ in range(steps):
            logits = model(tokens[:, :-1], cu_seqlens=None if cu is None else cu.clamp(max=tokens.shape[1] - 1))
            loss = F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_same_loss_curve_under_each_backend(varlen):
    names = [b.name for b in gla.backends() if b.available]
    curves = {name: _curve(name, varlen) for name in names}
    curves["default"] = _curve(None, varlen)
    ref = curves["reference"]
    assert ref[-1] < ref[0], f"the model did not learn: {ref}"
    for name, curve in curves.items():
        for a, b in zip(curve, ref):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name}: {curve} vs reference {ref}"
