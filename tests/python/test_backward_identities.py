"""The identities the `cuda` backend's backward is built on (docs/cuda_backward.md), checked in fp64
against autograd through the token loop:

- dv is the forward run in reverse time: q' = k, k' = q, v' = do, the gate shifted by one token
  (g'_u = g_{T-u}, 0 at u = 0), initial state dht / scale; its output is dv reversed and its final
  state is dh0 / (scale * e^{g_0}).
- dq_t = scale * S_t do_t (S_t the state after token t), and dk is the same walk on the reversed
  problem with v as its do.
- dg is the reverse cumsum over the whole sequence of q * dq - k * dk, plus rowsum(S_T * dht).
"""
import torch

from oracle import rel


def token_loop(q, k, v, g, h0, scale):
    S, out = h0.clone(), []
    for t in range(q.shape[0]):
        S = g[t].exp()[:, None] * S + k[t][:, None] * v[t][None, :]
        out.append(scale * q[t] @ S)
    return torch.stack(out), S


def dq_walk(q, k, v, g, h0, scale, do):
    """scale * S_t do_t for every t, and the final state."""
    S, out = h0.clone(), []
    for t in range(q.shape[0]):
        S = g[t].exp()[:, None] * S + k[t][:, None] * v[t][None, :]
        out.append(scale * S @ do[t])
    return torch.stack(out), S


def test_reversed_forward_identities():
    torch.manual_seed(3)
    T, K, V, scale = 29, 6, 5, 0.37
    q, k = torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64)
    v, do = torch.randn(T, V, dtype=torch.float64), torch.randn(T, V, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(T, K, dtype=torch.float64))
    h0, dht = torch.randn(K, V, dtype=torch.float64), torch.randn(K, V, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = token_loop(*leaves, scale)
    torch.autograd.backward([o, ht], [do, dht])
    dq, dk, dv, dg, dh0 = (x.grad for x in leaves)

    flip = lambda x: x.flip(0)  # noqa: E731
    shifted = torch.cat([torch.zeros_like(g[:1]), flip(g)[:-1]])
    dv_rev, final_rev = token_loop(flip(k), flip(q), flip(do), shifted, dht / scale, scale)
    dq_mine, S_T = dq_walk(q, k, v, g, h0, scale, do)
    dk_rev, _ = dq_walk(flip(k), flip(q), flip(do), shifted, dht / scale, scale, flip(v))
    term = q * dq_mine - k * flip(dk_rev)
    dg_mine = term.flip(0).cumsum(0).flip(0) + (S_T * dht).sum(-1)[None]

    assert rel(flip(dv_rev), dv) < 1e-12
    assert rel(scale * g[0].exp()[:, None] * final_rev, dh0) < 1e-12
    assert rel(dq_mine, dq) < 1e-12
    assert rel(flip(dk_rev), dk) < 1e-12
    assert rel(dg_mine, dg) < 1e-12
