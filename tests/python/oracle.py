"""Test helpers: an independent fp64 token loop in PyTorch (the recurrence of SPEC.md §1 and its
exact reverse-time gradient), SPEC §5 input generation and the relative RMS error."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

CHECKPOINT = 32  # states kept every 32 steps; the backward recomputes the 32 in between


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖₂ / ‖b‖₂ in fp64 (0 when both are empty or zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.norm().item()
    num = (a - b).norm().item()
    if den == 0:
        return num
    return num / den


def _rows(q, k, v, g, scale, h0, do, dht):
    """Rows of equal length, fp64: q, k, g [B, T, H, K] (g per key), v/do [B, T, H, V], h0/dht
    [B, H, K, V] (zeros when None). Returns o, ht, dq, dk, dv, dg, dh0."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = h0.clone() if h0 is not None else q.new_zeros(B, H, K, V)
    decay = g.exp()
    o = q.new_zeros(B, T, H, V)
    checkpoints = {}
    for t in range(T):
        if t % CHECKPOINT == 0:
            checkpoints[t] = S
        S = decay[:, t, :, :, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    ht = S
    if do is None:
        do = q.new_zeros(B, T, H, V)
    dS = dht.clone() if dht is not None else q.new_zeros(B, H, K, V)
    dq, dk, dg = q.new_zeros(B, T, H, K), q.new_zeros(B, T, H, K), q.new_zeros(B, T, H, K)
    dv = q.new_zeros(B, T, H, V)
    for start in reversed(range(0, T, CHECKPOINT)):
        end = min(T, start + CHECKPOINT)
        states = [checkpoints[start]]
        for t in range(start, end):
            states.append(decay[:, t, :, :, None] * states[-1] + k[:, t, :, :, None] * v[:, t, :, None, :])
        for t in reversed(range(start, end)):
            S_t, S_prev = states[t - start + 1], states[t - start]
            dq[:, t] = scale * torch.einsum("bhkv,bhv->bhk", S_t, do[:, t])
            dS = dS + scale * q[:, t, :, :, None] * do[:, t, :, None, :]
            dk[:, t] = torch.einsum("bhkv,bhv->bhk", dS, v[:, t])
            dv[:, t] = torch.einsum("bhkv,bhk->bhv", dS, k[:, t])
            dg[:, t] = decay[:, t] * torch.einsum("bhkv,bhkv->bhk", dS, S_prev)
            dS = decay[:, t, :, :, None] * dS
    return o, ht, dq, dk, dv, dg, dS


def token_loop(q, k, v, g, scale=None, initial_state=None, cu_seqlens: Optional[List[int]] = None,
               state_v_first=False, do=None, dht=None):
    """The operator and its gradient by the token loop, in fp64 on the CPU.

    Returns o, final_state, dq, dk, dv, dg (like g), dh0 (like the state; zeros-state gradient when
    there is no initial state)."""
    f = lambda x: x.detach().double().cpu() if x is not None else None  # noqa: E731
    q, k, v, g, h0, do, dht = map(f, (q, k, v, g, initial_state, do, dht))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    per_head = g.dim() == 3
    if per_head:
        g = g[..., None].expand(B, T, H, K)
    if state_v_first:
        h0 = h0.transpose(-1, -2) if h0 is not None else None
        dht = dht.transpose(-1, -2) if dht is not None else None
    if cu_seqlens is None:
        out = list(_rows(q, k, v, g, scale, h0, do, dht))
    else:
        N = len(cu_seqlens) - 1
        out = [q.new_zeros(B, T, H, V), q.new_zeros(N, H, K, V), q.new_zeros(B, T, H, K), q.new_zeros(B, T, H, K),
               q.new_zeros(B, T, H, V), q.new_zeros(B, T, H, K), q.new_zeros(N, H, K, V)]
        for n in range(N):
            s, e = cu_seqlens[n], cu_seqlens[n + 1]
            sl = lambda x: x[:, s:e] if x is not None else None  # noqa: E731
            h0n = h0[n:n + 1] if h0 is not None else None
            dhtn = dht[n:n + 1] if dht is not None else None
            part = _rows(sl(q), sl(k), sl(v), sl(g), scale, h0n, sl(do), dhtn)
            out[0][:, s:e] = part[0]
            out[1][n] = part[1][0]
            for i in (2, 3, 4, 5):
                out[i][:, s:e] = part[i]
            out[6][n] = part[6][0]
    if per_head:
        out[5] = out[5].sum(-1)
    if state_v_first:
        out[1], out[6] = out[1].transpose(-1, -2), out[6].transpose(-1, -2)
    return tuple(out)


def make_inputs(B, T, H, K, V=None, n=1.0, dtype=torch.float32, gate_dtype=None, initial_state=True,
                cu_seqlens=None, state_v_first=False, randn=False, gate_min=None, per_head_gate=False,
                seed=0, device="cpu"):
    """SPEC §5 inputs: q, k, v uniform in [0, 1) (or randn), g = logsigmoid(U[0,1)) / n (or uniform in
    [gate_min, 0]), random initial state, do and dht. Returns a dict."""
    V = K if V is None else V
    gen = torch.Generator().manual_seed(seed)
    draw = (lambda *s: torch.randn(*s, generator=gen)) if randn else (lambda *s: torch.rand(*s, generator=gen))
    q, k, v = draw(B, T, H, K), draw(B, T, H, K), draw(B, T, H, V)
    gshape = (B, T, H) if per_head_gate else (B, T, H, K)
    if gate_min is not None:
        g = torch.rand(*gshape, generator=gen) * gate_min
    else:
        g = F.logsigmoid(torch.rand(*gshape, generator=gen)) / n
    N = len(cu_seqlens) - 1 if cu_seqlens is not None else B
    sshape = (N, H, V, K) if state_v_first else (N, H, K, V)
    h0 = torch.randn(*sshape, generator=gen) if initial_state else None
    dht = torch.randn(*sshape, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    gate_dtype = gate_dtype or dtype
    to = lambda x, dt: x.to(device=device, dtype=dt) if x is not None else None  # noqa: E731
    return dict(q=to(q, dtype), k=to(k, dtype), v=to(v, dtype), g=to(g, gate_dtype), initial_state=to(h0, torch.float32),
                do=to(do, dtype), dht=to(dht, torch.float32),
                cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int64, device=device) if cu_seqlens is not None else None,
                cu_list=cu_seqlens, state_v_first=state_v_first)


NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dh0")


def run_gla(inputs, output_final_state=True, backend=None, with_dht=True):
    """gla.chunk_gla forward and backward (autograd) on `inputs`; returns the NAMES tuple (dh0 None
    without an initial state, final_state None without output_final_state)."""
    import gla

    leaves = {}
    for name in ("q", "k", "v", "g", "initial_state"):
        x = inputs[name]
        leaves[name] = x.detach().clone().requires_grad_(True) if x is not None else None
    with gla.backend(backend):
        o, ht = gla.chunk_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                              initial_state=leaves["initial_state"], output_final_state=output_final_state,
                              state_v_first=inputs["state_v_first"], cu_seqlens=inputs["cu_seqlens"])
        outs, grads = [o], [inputs["do"]]
        if output_final_state and with_dht:
            outs.append(ht)
            grads.append(inputs["dht"])
        wrt = [x for x in leaves.values() if x is not None]
        got = torch.autograd.grad(outs, wrt, grads)
    got = dict(zip([n for n, x in leaves.items() if x is not None], got))
    return (o.detach(), ht.detach() if ht is not None else None, got["q"], got["k"], got["v"], got["g"],
            got.get("initial_state"))
