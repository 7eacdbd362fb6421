"""PyTorch integration: gradcheck (float64), torch.library.opcheck, torch.compile(fullgraph=True)."""
import pytest
import torch

import gla
from oracle import make_inputs, rel

CONFIGS = {
    "plain": dict(B=2, T=21, H=2, K=4, V=3),
    "no-h0": dict(B=1, T=19, H=1, K=3, V=4, initial_state=False),
    "varlen": dict(B=1, T=23, H=1, K=3, V=2, cu_seqlens=[0, 5, 5, 23]),
    "state-v-first": dict(B=1, T=18, H=2, K=3, V=4, state_v_first=True),
    "per-head-gate": dict(B=1, T=20, H=2, K=3, V=3, per_head_gate=True),
    "strong-decay": dict(B=1, T=20, H=1, K=3, V=2, gate_min=-8.0),
}


def _call(x, output_final_state=True):
    def f(q, k, v, g, h0):
        return gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=output_final_state,
                             state_v_first=x["state_v_first"], cu_seqlens=x["cu_seqlens"],
                             cu_seqlens_cpu=x["cu_list"])
    return f


@pytest.mark.parametrize("config", list(CONFIGS))
def test_gradcheck_float64(config):
    x = make_inputs(**CONFIGS[config], dtype=torch.float64, seed=7)
    leaves = [x[n].double().requires_grad_() if x[n] is not None else None
              for n in ("q", "k", "v", "g", "initial_state")]
    f = _call(x)
    if leaves[4] is None:
        assert torch.autograd.gradcheck(lambda q, k, v, g: f(q, k, v, g, None), leaves[:4])
    else:
        assert torch.autograd.gradcheck(f, leaves)


def test_gradcheck_without_final_state():
    x = make_inputs(B=1, T=17, H=1, K=3, V=2, dtype=torch.float64, seed=8)
    leaves = [x[n].double().requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
    f = _call(x, output_final_state=False)
    assert torch.autograd.gradcheck(lambda *a: f(*a)[0], leaves)


def _op_args(x, output_final_state=True):
    return (x["q"], x["k"], x["v"], x["g"], x["initial_state"], x["cu_seqlens"],
            torch.tensor(x["cu_list"]) if x["cu_list"] is not None else None, 0.37, x["state_v_first"],
            output_final_state, "", 0)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_opcheck_forward(config):
    x = make_inputs(**CONFIGS[config], seed=9)
    args = list(_op_args(x))
    for i in range(5):
        if args[i] is not None:
            args[i] = args[i].requires_grad_()
    torch.library.opcheck(torch.ops.gla.chunk_fwd.default, tuple(args))
    args[9] = False  # no final state
    torch.library.opcheck(torch.ops.gla.chunk_fwd.default, tuple(args))
    # The eager routes' forward: the same kernels without an autograd formula.
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.gla.chunk_fwd_no_autograd.default, plain)


@pytest.mark.parametrize("config", ["plain", "varlen", "no-h0"])
def test_opcheck_backward(config):
    x = make_inputs(**CONFIGS[config], seed=10)
    a = _op_args(x)
    args = a[:7] + (x["do"], x["dht"]) + (a[7], a[8], "", 0)
    torch.library.opcheck(torch.ops.gla.chunk_bwd.default, args)
    args = a[:7] + (x["do"], None) + (a[7], a[8], "", 0)  # no dht
    torch.library.opcheck(torch.ops.gla.chunk_bwd.default, args)


def _model_step(q, k, v, g, h0):
    o, ht = gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    return (o * o).sum() + (ht * ht).sum()


def _grads(fn, x):
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph(compiler):
    """A function calling gla.chunk_gla compiles with fullgraph=True (no graph breaks), forward and
    backward, and computes what eager does."""
    torch._dynamo.reset()
    x = make_inputs(B=2, T=70, H=2, K=16, V=8, seed=11)
    compiled = torch.compile(_model_step, fullgraph=True, backend=compiler)
    loss_c, grads_c = _grads(compiled, x)
    loss_e, grads_e = _grads(_model_step, x)
    assert rel(loss_c, loss_e) < 1e-6
    for a, b in zip(grads_c, grads_e):
        assert rel(a, b) < 1e-6


def test_compile_dynamic_shapes_and_backend_context():
    """Dynamic T traces once; a backend forced with gla.backend() reaches the compiled call (the
    selection is guarded, so changing it recompiles rather than being baked in)."""
    torch._dynamo.reset()
    compiled = torch.compile(_model_step, fullgraph=True, backend="aot_eager", dynamic=True)
    for T in (33, 65):
        x = make_inputs(B=1, T=T, H=1, K=8, seed=T)
        loss_c, grads_c = _grads(compiled, x)
        loss_e, grads_e = _grads(_model_step, x)
        assert rel(loss_c, loss_e) < 1e-6
    from gla import torch_backend
    from gla import _chunked
    calls = []
    original = _chunked.chunk_forward

    def counting(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    _chunked.chunk_forward = counting
    try:
        x = make_inputs(B=1, T=40, H=1, K=8, seed=1)
        with gla.backend("torch"):
            _grads(compiled, x)
        assert calls, "the compiled call did not run the forced torch backend"
        calls.clear()
        with gla.backend("reference"):
            _grads(compiled, x)
        assert not calls, "the forced backend was baked into the compiled graph"
    finally:
        _chunked.chunk_forward = original
    assert torch_backend.NAME == "torch"


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = make_inputs(B=1, T=30, H=2, K=8, V=5, cu_seqlens=[0, 10, 30], state_v_first=True, seed=2)
    with FakeTensorMode() as mode:
        fq, fk, fv, fg = (mode.from_tensor(x[n]) for n in ("q", "k", "v", "g"))
        fh = mode.from_tensor(x["initial_state"])
        fcu = mode.from_tensor(x["cu_seqlens"])
        o, ht = gla.chunk_gla(fq, fk, fv, fg, initial_state=fh, output_final_state=True, state_v_first=True,
                              cu_seqlens=fcu)
    assert tuple(o.shape) == (1, 30, 2, 5) and o.dtype == torch.float32
    assert tuple(ht.shape) == (2, 2, 5, 8) and ht.dtype == torch.float32
