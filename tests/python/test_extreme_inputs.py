"""Extreme but legal inputs through gla.chunk_gla on every CPU backend (torch, cpu) against the
reference backend, forward and backward in float32: gates in [-1e4, 0] with exact zeros and -inf,
q/k/v up to 1e4, K or V of 1, T = 1, varlen batches full of empty sequences; and non-contiguous
tensors, served with the contiguous answer or declined with a reason; on a GPU, the torch backend on
CUDA tensors (marker cuda). The C++ side of the same (reference stage pipeline, cpu, 10^6 tokens,
the cuda backend): tests/cpp/test_extreme_inputs.cpp, test_cuda_extremes.cpp."""
import pytest
import torch

import gla
from oracle import make_inputs, rel

BACKENDS = ["torch", "cpu"]
TOLERANCE = 1e-5  # SPEC.md §5, fp32 on a CPU backend


def _extreme_gates(shape, seed):
    """Exact 0, -1e4, -1e4 * U, -inf (every key of every 23rd token, and single entries), else logsigmoid."""
    gen = torch.Generator().manual_seed(seed)
    u, x = torch.rand(shape, generator=gen, dtype=torch.float64), torch.rand(shape, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.rand(shape, generator=gen, dtype=torch.float64))
    g = torch.where(x < 0.5, -1e4 * u, g)
    g = torch.where(x < 0.4, torch.full_like(g, -1e4), g)
    g = torch.where(x < 0.3, torch.zeros_like(g), g)
    g = torch.where(x < 0.05, torch.full_like(g, float("-inf")), g)
    g[:, 3::23] = float("-inf")
    return g.float()


def _case(name):
    c = dict(B=2, T=150, H=2, K=16, V=8, seed=401)
    edit = None
    if name.startswith("gates in [-1e4, 0]"):
        c["per_head_gate"] = name.endswith("per head")
        edit = lambda x: x.update(g=_extreme_gates(x["g"].shape, 402))  # noqa: E731
    elif name == "every gate -1e4":
        edit = lambda x: x["g"].fill_(-1e4)  # noqa: E731
    elif name == "every gate 0":
        edit = lambda x: x["g"].fill_(0.0)  # noqa: E731
    elif name == "q, k, v in [-1e4, 1e4]":
        c.update(K=32, V=16)

        def edit(x):
            gen = torch.Generator().manual_seed(403)
            for n in ("q", "k", "v"):
                x[n] = (torch.rand(x[n].shape, generator=gen) * 2 - 1) * 1e4
    elif name == "K = 1":
        c.update(K=1, V=16, H=3)
    elif name == "V = 1":
        c.update(K=16, V=1, H=3)
    elif name == "K = V = 1, extreme gates":
        c.update(K=1, V=1, H=3)
        edit = lambda x: x.update(g=_extreme_gates(x["g"].shape, 404))  # noqa: E731
    elif name == "T = 1":
        c.update(B=3, T=1)
    elif name == "T = 1 varlen":
        c.update(B=1, T=1, cu_seqlens=[0, 1])
    elif name == "empty sequences throughout":
        c.update(B=1, T=100, cu_seqlens=[0, 0, 0, 1, 1, 40, 40, 40, 41, 100, 100, 100])
    elif name == "empty sequences, extreme gates":
        c.update(B=1, T=100, cu_seqlens=[0, 0, 0, 1, 1, 40, 40, 40, 41, 100, 100, 100])
        edit = lambda x: x.update(g=_extreme_gates(x["g"].shape, 405))  # noqa: E731
    x = make_inputs(**c)
    if edit is not None:
        edit(x)
    return x


CASES = ["gates in [-1e4, 0] per key", "gates in [-1e4, 0] per head", "every gate -1e4", "every gate 0",
         "q, k, v in [-1e4, 1e4]", "K = 1", "V = 1", "K = V = 1, extreme gates", "T = 1", "T = 1 varlen",
         "empty sequences throughout", "empty sequences, extreme gates"]


def _run(x, backend, **layout):
    """o, final_state and the gradients of q, k, v, g, initial_state on one backend."""
    t = {n: layout.get(n, x[n]) for n in ("q", "k", "v", "g", "initial_state")}
    leaves = [t[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
    if "k_is_q" in layout:
        leaves[1] = leaves[0]
    with gla.backend(backend):
        o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                              cu_seqlens=x["cu_seqlens"])
        wrt = [leaves[i] for i in ((0, 2, 3, 4) if "k_is_q" in layout else range(5))]
        grads = torch.autograd.grad([o, ht], wrt, [x["do"], x["dht"]])
    return [o.detach(), ht.detach(), *grads]


def _compare(got, want, what, tolerance=TOLERANCE):
    for name, a, b in zip(("o", "final_state", "dq", "dk", "dv", "dg", "dh0"), got, want):
        finite = torch.isfinite(b)
        assert finite.all(), f"{what}: the reference's {name} is not finite"
        assert torch.isfinite(a).all(), f"{what}: {name} has NaN/Inf where the reference has none"
        err = rel(a, b)
        assert err < tolerance, f"{what}: {name} rel {err:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_extreme_inputs_match_reference(case, backend):
    x = _case(case)
    _compare(_run(x, backend), _run(x, "reference"), f"{backend}, {case}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the torch backend on CUDA tensors skipped")
@pytest.mark.parametrize("case", CASES)
def test_extreme_inputs_torch_backend_on_cuda(case):
    """The torch backend computing on CUDA tensors (SPEC.md §5: 1e-3 for fp32 on a GPU, TF32 allowed)."""
    x = _case(case)
    on_gpu = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    _compare(_run(on_gpu, "torch"), _run(x, "reference"), f"torch on cuda, {case}", tolerance=1e-3)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("cu", [None, [0, 0, 0]], ids=["batch", "varlen"])
def test_no_tokens_at_all(backend, cu):
    """T = 0: o is empty, the final state is the initial state and its gradient passes through."""
    x = make_inputs(B=1 if cu else 2, T=0, H=2, K=8, V=4, cu_seqlens=cu, seed=407)
    o, ht, dq, dk, dv, dg, dh0 = _run(x, backend)
    assert o.shape == (x["q"].shape[0], 0, 2, 4) and dq.numel() == 0
    assert torch.equal(ht, x["initial_state"]) and torch.equal(dh0, x["dht"])


def _layouts(x):
    """name -> the inputs stored differently (same values)."""
    def head_major(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def every_other_token(t):
        wide = torch.full((t.shape[0], 2 * t.shape[1], *t.shape[2:]), float("nan"))
        wide[:, ::2] = t
        return wide[:, ::2]

    def strided_last_dim(t):
        wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"))
        wide[..., ::2] = t
        return wide[..., ::2]

    per_head = x["g"][..., :1]
    return {
        "head-major (q, k, v, g)": {n: head_major(x[n]) for n in ("q", "k", "v", "g")},
        "every other token (q, k, v, g)": {n: every_other_token(x[n]) for n in ("q", "k", "v", "g")},
        "stride 2 in the last dim (q, k, v, g, initial_state)": {n: strided_last_dim(x[n])
                                                                 for n in ("q", "k", "v", "g", "initial_state")},
        "state transposed (initial_state)": {"initial_state": x["initial_state"].transpose(2, 3).contiguous()
                                             .transpose(2, 3)},
        "g expanded over the keys (stride 0)": {"g": per_head.expand_as(x["g"])},
        "k is q": {"k_is_q": True},
    }


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_non_contiguous_served_or_declined_with_a_reason(backend):
    x = make_inputs(B=2, T=70, H=2, K=16, V=8, seed=406)
    x["g"][..., 1:] = x["g"][..., :1]  # the values "g expanded" stands for
    for name, layout in _layouts(x).items():
        plain = dict(x)
        if "k_is_q" in layout:
            plain["k"] = x["q"]
        want = _run(plain, "reference")
        if "k_is_q" in layout:  # one leaf for q and k: its gradient is dq + dk
            want = want[:2] + [want[2] + want[3]] + want[4:]
        try:
            got = _run(x, backend, **layout)
        except (ValueError, RuntimeError) as e:
            assert backend != "reference", f"the reference declined {name}: {e}"
            first = str(e).split("\n", 1)[0]
            assert "stride" in str(e) or "contiguous" in str(e), f"{backend} declined {name} without a reason: {first}"
            continue
        _compare(got, want, f"{backend}, {name}")
