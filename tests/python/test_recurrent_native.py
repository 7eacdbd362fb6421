"""The recurrent operators on the native path (libgla_torch: gla/csrc/recurrent_ops.cpp): that they
are the ones serving CPU (and CUDA) tensors, that the eager routes compute what the registered
autograd computes, torch.compile(fullgraph=True) of the forward + backward and of the pool update,
opcheck, errors of the op itself, version counters and the non-differentiable pool update, the
ctypes fallback, and (GPU) a decode step that never synchronises the host."""
import re
import textwrap

import pytest
import torch

import gla
from gla import _lib, _ops, _recurrent_ctypes
from test_native_ops import run_with_ctypes_fallback
from test_recurrent import make, oracle, pool_reference, rel

needs_native = pytest.mark.skipif(_ops.native_path is None,
                                  reason="libgla_torch is not built beside libgla (needs torch at build time)")
OPS = ("gla::recurrent_fwd", "gla::recurrent_bwd", "gla::recurrent_state_update")
LEAVES = ("q", "k", "v", "gk", "gv", "initial_state")


def _table(op):
    return dict(line.split(": registered at ", 1) for line in torch._C._dispatch_dump(op).splitlines()
                if ": registered at " in line)


@needs_native
def test_cpu_and_cuda_kernels_are_the_native_ones():
    for op in OPS:
        table = _table(op)
        for key in ("CPU", "CUDA"):
            assert "recurrent_ops.cpp" in table[key], table
        for key in ("MPS", "XPU", "PrivateUse1", "Meta") + (("Autograd[alias]",) if op.endswith("fwd") else ()):
            assert "_ops.py" in table[key], table  # the Python registrations (one Library, made in _ops.py)


@needs_native
def test_public_calls_never_reach_the_ctypes_kernels(monkeypatch):
    """Forward, backward and the pool update on CPU tensors run with the ctypes path disabled."""
    def refuse(*args, **kwargs):
        raise AssertionError("the ctypes path ran")

    monkeypatch.setattr(_recurrent_ctypes, "_call", refuse)
    x = make(2, 5, 2, 8, 12, gk=True, gv=True, seed=31)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = gla.fused_recurrent_gla(**leaves, output_final_state=True)
    (o.sum() + ht.sum()).backward()
    assert all(t.grad is not None for t in leaves.values())
    pool = torch.randn(3, 2, 8, 12)
    error = torch.zeros(1, dtype=torch.int32)
    gla.recurrent_state_update(x["q"], x["k"], x["v"], pool, torch.tensor([2, 0], dtype=torch.int32), error,
                               gk=x["gk"], gv=x["gv"])
    assert error.item() == 0


def _grads(fn, x, do, dht):
    leaves = [x[n].detach().clone().requires_grad_() for n in LEAVES]
    o, ht = fn(*leaves)
    return [o.detach(), ht.detach(), *torch.autograd.grad([o, ht], leaves, [do, dht])]


@pytest.mark.parametrize("varlen", [False, True])
def test_eager_route_equals_registered_autograd(varlen):
    """gla.fused_recurrent_gla runs the op below the autograd key inside its own autograd.Function;
    the op called itself goes through the autograd registered with torch.library: same tensors."""
    x = make(1, 13, 2, 8, 12, gk=True, gv=True, N=3, seed=32) if varlen else make(2, 13, 2, 8, 12, gk=True, gv=True,
                                                                                  seed=32)
    cu = torch.tensor([0, 4, 4, 13], dtype=torch.int32) if varlen else None
    N = x["initial_state"].shape[0]
    gen = torch.Generator().manual_seed(33)
    do, dht = torch.randn(x["v"].shape, generator=gen), torch.randn(N, 2, 8, 12, generator=gen)

    def wrapper(q, k, v, gk, gv, h0):
        return gla.fused_recurrent_gla(q, k, v, gk, gv, scale=0.3, initial_state=h0, output_final_state=True,
                                       reverse=True, cu_seqlens=cu)

    def registered(q, k, v, gk, gv, h0):
        return torch.ops.gla.recurrent_fwd(q, k, v, gk, gv, h0, cu, 0.3, True, False, True, "", 0)

    for a, b in zip(_grads(wrapper, x, do, dht), _grads(registered, x, do, dht)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_fullgraph_forward_and_backward(varlen):
    x = (make(1, 9, 2, 8, 8, gk=True, gv=True, v_first=True, N=3, seed=34) if varlen else
         make(2, 6, 2, 8, 8, gk=True, gv=True, v_first=True, seed=34))
    cu = torch.tensor([0, 2, 2, 9], dtype=torch.int32) if varlen else None

    def f(q, k, v, gk, gv, h0):
        o, ht = gla.fused_recurrent_gla(q, k, v, gk, gv, initial_state=h0, output_final_state=True,
                                        state_v_first=True, cu_seqlens=cu)
        return o.square().sum() + ht.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, f):
        leaves = [x[n].clone().requires_grad_() for n in LEAVES]
        loss = fn(*leaves)
        results.append([loss, *torch.autograd.grad(loss, leaves)])
    for a, b in zip(*results):
        assert rel(a, b) < 1e-6


def test_compile_fullgraph_pool_update_mutates_the_pool():
    """The mutation is declared in the schema: compiled, the caller's pool and flag change as in eager."""
    B, H, K, V, P = 3, 2, 8, 8, 4
    x = make(B, 1, H, K, V, gk=True, h0=False, seed=35)
    slots = torch.tensor([3, 7, 3], dtype=torch.int32)

    def step(q, k, v, gk, pool, slots, error):
        o, _ = gla.recurrent_state_update(q, k, v, pool, slots, error, gk=gk)
        return o * 2

    pool = torch.randn(P, H, K, V)
    want_o, want_pool = pool_reference(x, pool, slots.tolist(), False)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    error = torch.zeros(1, dtype=torch.int32)
    got = compiled(x["q"], x["k"], x["v"], x["gk"], pool, slots, error)
    assert rel(got, 2 * want_o) < 1e-5 and rel(pool, want_pool) < 1e-5
    assert error.item() == 3  # slot 7 is out of range, the second 3 a repeat


def test_opcheck_backward_and_token_states():
    x = make(2, 3, 2, 8, 8, gk=True, gv=True, seed=36)
    do, dht = torch.randn(2, 3, 2, 8), torch.randn(2, 2, 8, 8)
    torch.library.opcheck(torch.ops.gla.recurrent_bwd.default,
                          (x["q"], x["k"], x["v"], x["gk"], x["gv"], x["initial_state"], None, do, dht, 0.3, True,
                           False, "", 0))
    update = (x["q"], x["k"], x["v"], x["gk"], None, torch.randn(4, 2, 8, 8), torch.tensor([1, 3], dtype=torch.int32),
              torch.zeros(1, dtype=torch.int32), 0.3, True, True, False, "", 0)
    torch.library.opcheck(torch.ops.gla.recurrent_state_update.default, update,
                          test_utils=("test_schema", "test_faketensor"))


@needs_native
@pytest.mark.parametrize("case,cls,pattern", [
    ("rank", ValueError, r"^q: expected"),
    ("dtype", TypeError, r"^k: expected dtype"),
    ("int8", TypeError, r"^q: expected dtype float32, float16, bfloat16, int32 or int64, got torch.int8"),
    ("gv", ValueError, r"^gv: expected shape \[2, 3, 2, 8\]"),
])
def test_errors_of_the_operator_itself(case, cls, pattern):
    """Direct calls of the op see the class-tagged RuntimeError of the stable ABI; the public call
    raises the class with libgla's message, and nothing is written to the outputs it was given."""
    x = make(2, 3, 2, 8, 8, gk=True, seed=37)
    args = [x["q"], x["k"], x["v"], x["gk"], None, x["initial_state"], None, 0.3, False, False, True, "", 0]
    if case == "rank":
        args[0] = x["q"][0]
    elif case == "dtype":
        args[1] = x["k"].half()
    elif case == "int8":
        args[0] = x["q"].to(torch.int8)
    else:
        args[4] = torch.zeros(2, 3, 2, 7)
    with pytest.raises(RuntimeError) as info:
        torch.ops.gla.recurrent_fwd(*args)
    assert str(info.value).startswith(f"[gla:{cls.__name__}] ")
    error = _lib.python_error(info.value)
    assert type(error) is cls and re.search(pattern, str(error)), str(error)
    with pytest.raises(cls, match=pattern):
        gla.fused_recurrent_gla(*args[:5], initial_state=args[5], output_final_state=True)


@needs_native
@pytest.mark.parametrize("position,name", [(3, "gk"), (5, "initial_state")])
def test_backward_op_rejects_too_many_dimensions_before_allocating(position, name):
    """An input of rank above GLA_MAX_RANK is named before any output shaped like it is made."""
    x = make(1, 2, 1, 4, 4, gk=False, h0=False)
    args = [x["q"], x["k"], x["v"], None, None, None, None, None, None, 0.5, False, False, "", 0]
    args[position] = torch.rand(*([1] * 9))
    with pytest.raises(RuntimeError) as info:
        torch.ops.gla.recurrent_bwd(*args)
    error = _lib.python_error(info.value)
    assert type(error) is ValueError and str(error).startswith(f"{name}: expected at most"), str(error)


def test_pool_update_errors_leave_the_pool_alone():
    x = make(2, 1, 2, 8, 8, gk=True, h0=False, seed=38)
    pool = torch.randn(3, 2, 8, 8)
    before = pool.clone()
    error = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^state_slots: expected dtype int32"):
        gla.recurrent_state_update(x["q"], x["k"], x["v"], pool, torch.tensor([0, 1]), error, gk=x["gk"])
    with pytest.raises(ValueError, match=r"^state_pool: expected"):
        gla.recurrent_state_update(x["q"], x["k"], x["v"], pool[:, :1], torch.tensor([0, 1], dtype=torch.int32),
                                   error, gk=x["gk"])
    assert torch.equal(pool, before) and error.item() == 0


def test_pool_update_bumps_versions_and_is_not_differentiable():
    x = make(2, 1, 2, 8, 8, gk=True, h0=False, seed=39)
    pool, error = torch.randn(3, 2, 8, 8), torch.zeros(1, dtype=torch.int32)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    versions = pool._version, error._version
    o, _ = gla.recurrent_state_update(x["q"], x["k"], x["v"], pool, slots, error, gk=x["gk"])
    assert pool._version > versions[0] and error._version > versions[1] and not o.requires_grad
    q = x["q"].clone().requires_grad_()
    o, _ = gla.recurrent_state_update(q, x["k"], x["v"], pool, slots, error, gk=x["gk"])
    with pytest.raises(RuntimeError, match="recurrent_state_update is not differentiable"):
        o.sum().backward()


def test_ctypes_fallback_serves_the_recurrent_ops():
    """GLA_NATIVE_OPS=0: the recurrent schemas are defined in Python with the ctypes kernels, which
    compute the same as the oracle; opcheck and torch.compile pass there too."""
    script = textwrap.dedent("""
        import warnings
        warnings.simplefilter("ignore")
        import torch
        import gla
        from gla import _ops
        from test_recurrent import make, oracle, rel
        assert _ops.native_path is None
        table = torch._C._dispatch_dump("gla::recurrent_fwd")
        assert "recurrent_ops.cpp" not in table and "CompositeExplicitAutograd" in table, table
        x = make(2, 7, 2, 8, 8, gk=True, gv=True, seed=40)
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, ht = gla.fused_recurrent_gla(**leaves, output_final_state=True)
        d = {n: t.double().requires_grad_() for n, t in x.items()}
        o_ref, ht_ref = oracle(d, False, None, False)
        assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5
        (o.sum() + ht.sum()).backward()
        (o_ref.sum() + ht_ref.sum()).backward()
        assert all(rel(leaves[n].grad, d[n].grad) < 1e-5 for n in leaves)
        args = (x["q"], x["k"], x["v"], x["gk"], x["gv"], x["initial_state"], None, 0.3, False, False, True, "", 0)
        torch.library.opcheck(torch.ops.gla.recurrent_fwd.default, args)
        f = torch.compile(lambda q, k, v: gla.fused_recurrent_gla(q, k, v)[0].sum(), fullgraph=True,
                          backend="aot_eager")
        assert rel(f(x["q"], x["k"], x["v"]), gla.fused_recurrent_gla(x["q"], x["k"], x["v"])[0].sum()) < 1e-6
        print("fallback ok")
    """)
    run_with_ctypes_fallback(script)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: recurrent GPU tests need an NVIDIA GPU (pytest -m cuda)")
def test_cuda_decode_step_never_synchronises():
    """fla's decode call and the pool update on CUDA tensors under torch.cuda's sync debug mode
    "error": any host synchronisation inside the calls would raise."""
    B, H, K, V = 4, 2, 64, 64
    x = make(B, 1, H, K, V, dtype=torch.bfloat16, gk=True, v_first=True, device="cuda", seed=41)
    pool = torch.randn(B + 2, H, V, K, device="cuda")
    slots = torch.tensor([5, 0, 2, 1], dtype=torch.int32, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(2):  # the first call loads kernels
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, ht = gla.fused_recurrent_gla(**x, output_final_state=True, state_v_first=True)
            gla.recurrent_state_update(x["q"], x["k"], x["v"], pool, slots, error, gk=x["gk"],
                                               state_v_first=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    host = {n: (t.cpu() if t is not None else None) for n, t in x.items()}
    o_ref, ht_ref = oracle(host, False, None, True)
    assert rel(o.cpu(), o_ref) < 5e-3 and rel(ht.cpu(), ht_ref) < 1e-5 and error.item() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: recurrent GPU tests need an NVIDIA GPU (pytest -m cuda)")
def test_cuda_varlen_calls_synchronise_once_per_cu_seqlens():
    """fla's layers decode packed (B = 1, cu_seqlens on the GPU, no host copy) and hand the same
    cu_seqlens to every layer: only the first call copies it to the host (a synchronisation); the
    others run under the sync debug mode "error". An in-place change makes the next call copy again."""
    from gla import _host_offsets
    _host_offsets.forget()
    N, H, K, V = 4, 2, 64, 128
    x = make(1, N, H, K, V, dtype=torch.bfloat16, gk=True, v_first=True, N=N, device="cuda", seed=44)
    cu = torch.arange(N + 1, dtype=torch.int32, device="cuda")
    g = torch.nn.functional.logsigmoid(torch.randn(1, 2 * N, H, K, device="cuda")).bfloat16()
    qc, kc, vc = (torch.rand(1, 2 * N, H, D, device="cuda").bfloat16() for D in (K, K, V))
    cu_chunk = torch.tensor([0, 3, 8], dtype=torch.int64, device="cuda")
    gla.fused_recurrent_gla(**x, output_final_state=True, state_v_first=True, cu_seqlens=cu)  # copies cu
    gla.chunk_gla(qc, kc, vc, g, cu_seqlens=cu_chunk, output_final_state=True)  # copies cu_chunk
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # the other layers of the step
            o, ht = gla.fused_recurrent_gla(**x, output_final_state=True, state_v_first=True, cu_seqlens=cu)
            oc, hc = gla.chunk_gla(qc, kc, vc, g, cu_seqlens=cu_chunk, output_final_state=True)
        cu_chunk.add_(0)  # a new version: the next call must look again
        with pytest.raises(RuntimeError, match="synchroniz"):
            gla.chunk_gla(qc, kc, vc, g, cu_seqlens=cu_chunk, output_final_state=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = {n: (t.cpu() if t is not None else None) for n, t in x.items()}
    o_ref, ht_ref = oracle(host, False, list(range(N + 1)), True)
    assert rel(o.cpu(), o_ref) < 5e-3 and rel(ht.cpu(), ht_ref) < 1e-5
    want = gla.chunk_gla(qc, kc, vc, g, cu_seqlens=cu_chunk, cu_seqlens_cpu=[0, 3, 8], output_final_state=True)
    assert torch.equal(oc, want[0]) and torch.equal(hc, want[1])
