"""GPU tests (marker `cuda`; every test name contains "cuda"). Run on an NVIDIA GPU with

    pytest tests/python -m cuda -rs

Without a CUDA device they skip with that message. They check the `torch` backend on CUDA tensors
against the `reference` backend (on CPU copies), the default dispatch on CUDA, no host
synchronisation with cu_seqlens_cpu, CUDA-graph capture and replay of forward + backward, opcheck
and torch.compile on CUDA.
"""
import pytest
import torch

import gla
from oracle import NAMES, make_inputs, rel, run_gla

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU tests need an NVIDIA GPU (run `pytest tests/python -m cuda` on one)"),
]

CASES = {
    "2x300x4x64-n1": dict(B=2, T=300, H=4, K=64, n=1),
    "2x1024x8x128-n0.1": dict(B=2, T=1024, H=8, K=128, n=0.1),
    "1x63x1x64": dict(B=1, T=63, H=1, K=64),
    "1x128x4x256": dict(B=1, T=128, H=4, K=256),
    "varlen-K100": dict(B=1, T=2000, H=2, K=100, cu_seqlens=[0, 15, 100, 300, 1200, 2000]),
    "vfirst-K64-V32": dict(B=2, T=256, H=4, K=64, V=32, state_v_first=True),
    "noh0-randn": dict(B=2, T=200, H=2, K=64, initial_state=False, randn=True),
    "strong-g-20": dict(B=2, T=130, H=2, K=64, gate_min=-20.0),
    "per-head-gate": dict(B=2, T=150, H=3, K=32, per_head_gate=True),
}
PARAMS = [(c, d) for c in CASES for d in ("float32", "bfloat16")]
TOL = {"float32": 1e-5, "bfloat16": 5e-3}


def _to(x, device):
    out = dict(x)
    for n in ("q", "k", "v", "g", "initial_state", "do", "dht", "cu_seqlens"):
        if out[n] is not None:
            out[n] = out[n].to(device)
    return out


def _check(got, want, tol, what):
    for name, a, b in zip(NAMES, got, want):
        if a is None or b is None:
            continue
        assert a.is_cuda, f"{what}: {name} not on the GPU"
        assert torch.isfinite(a).all() or not torch.isfinite(b).all(), f"{what}: {name} has NaN/Inf"
        err = rel(a, b)
        assert err < tol, f"{what}: {name} relative RMS error {err:.3e} >= {tol:.0e}"


@pytest.fixture(autouse=True)
def _ieee_fp32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{d}" for c, d in PARAMS])
def test_cuda_torch_backend_matches_reference(case, dtype):
    x = make_inputs(**CASES[case], dtype=getattr(torch, dtype), seed=3)
    ref = run_gla(x, backend="reference")
    got = run_gla(_to(x, "cuda"), backend="torch")
    _check(got, ref, TOL[dtype], "torch backend on CUDA vs reference")


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{d}" for c, d in PARAMS])
def test_cuda_default_dispatch_matches_reference(case, dtype):
    x = make_inputs(**CASES[case], dtype=getattr(torch, dtype), seed=4)
    ref = run_gla(x, backend="reference")
    got = run_gla(_to(x, "cuda"))
    # a native cuda backend may use TF32 tensor cores: SPEC's bar for them is 1e-3
    _check(got, ref, 1e-3 if dtype == "float32" else TOL[dtype], "default dispatch on CUDA vs reference")


def test_cuda_explain_names_the_torch_backend():
    x = _to(make_inputs(B=1, T=64, H=2, K=32), "cuda")
    text = gla.explain(x["q"], x["k"], x["v"], x["g"], backward=True)
    assert "device=cuda:0" in text
    assert "backend 'torch' (priority 80)" in text
    with gla.backend("torch"):
        assert gla.explain(x["q"], x["k"], x["v"], x["g"]).rstrip().endswith("decision: torch (whole operation)")


@pytest.mark.parametrize("backend", [None, "torch"])
def test_cuda_no_host_sync_with_cu_seqlens_cpu(backend):
    cu = [0, 15, 100, 300, 700]
    x = _to(make_inputs(B=1, T=700, H=2, K=64, cu_seqlens=cu, dtype=torch.bfloat16), "cuda")
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with gla.backend(backend):
            o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                                  cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=torch.tensor(cu))
            torch.autograd.backward([o, ht], [x["do"], x["dht"]])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_cuda_mixed_devices_are_rejected():
    x = _to(make_inputs(B=1, T=16, H=1, K=8), "cuda")
    with pytest.raises(ValueError, match=r"^k: expected device cuda:0 \(same as q\), got cpu:0"):
        gla.chunk_gla(x["q"], x["k"].cpu(), x["v"], x["g"])


def _capture_and_replay(backend, dtype=torch.float32, cu=(0, 100, 100, 333)):
    """cu None: B2 T333 without cu_seqlens (where the cuda backend saves chunk states)."""
    shape = dict(B=1, T=333, H=2, K=64, cu_seqlens=list(cu)) if cu else dict(B=2, T=333, H=2, K=64)
    base = make_inputs(**shape, seed=1, dtype=dtype)
    x = _to(base, "cuda")
    static = {n: x[n].clone() for n in ("q", "k", "v", "g", "initial_state", "do", "dht")}
    leaves = [static[n].requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
    cu_cpu = torch.tensor(cu) if cu else None

    def step():
        o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                              cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=cu_cpu)
        grads = torch.autograd.grad([o, ht], leaves, [static["do"], static["dht"]])
        return (o, ht) + tuple(grads)

    with gla.backend(backend):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up outside the capture (allocator, lazy init)
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        fresh = _to(make_inputs(**shape, seed=2, dtype=dtype), "cuda")
        with torch.no_grad():
            for n in ("q", "k", "v", "g", "initial_state", "do", "dht"):
                static[n].copy_(fresh[n])
        graph.replay()
        torch.cuda.synchronize()
        eager = run_gla(fresh, backend=backend)
    for name, a, b in zip(NAMES, outs, eager):
        assert rel(a, b) < 1e-6, f"{name}: replay differs from eager by {rel(a, b):.3e}"


def test_cuda_graph_capture_torch_backend():
    _capture_and_replay("torch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_graph_capture_cuda_backend(dtype):
    """Default dispatch, where the native cuda backend serves what it accepts (the torch backend
    the rest, e.g. the backward before the cuda backend has one)."""
    names = [b.name for b in gla.backends() if b.available]
    if "cuda" not in names:
        pytest.skip("no native cuda backend in this build of libgla")
    x = _to(make_inputs(B=1, T=333, H=2, K=64, cu_seqlens=[0, 100, 100, 333], dtype=dtype), "cuda")
    text = gla.explain(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"], output_final_state=True,
                       cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=[0, 100, 100, 333])
    if "decision: cuda" not in text:
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("backend 'cuda'"))
        pytest.skip("the cuda backend declines this forward: " + lines[start + 1].strip())
    _capture_and_replay(None, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_capture_with_saved_chunk_states(dtype):
    if "cuda" not in [b.name for b in gla.backends() if b.available]:
        pytest.skip("no native cuda backend in this build of libgla")
    _capture_and_replay(None, dtype, cu=None)


def _has_cuda_backend():
    return "cuda" in [b.name for b in gla.backends() if b.available]


def _check_saved_chunk_states(x, ref, K, chunks, cu=None):
    """chunk_fwd_saving_states on the CUDA inputs x: bf16 states [chunks, H, K, V], o and ht bitwise
    chunk_fwd's; chunk_bwd from them matches chunk_bwd without them and the reference ref; and
    gla.chunk_gla's autograd saves a tensor of that shape and gives the reference's gradients."""
    cu_t = x["cu_seqlens"] if cu is not None else None
    cu_cpu = torch.tensor(cu) if cu is not None else None
    args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"], cu_t, cu_cpu, K ** -0.5, False, True)
    o, ht, states = torch.ops.gla.chunk_fwd_saving_states(*args)
    assert states.dtype == torch.bfloat16 and states.shape == (chunks, x["q"].shape[2], K, x["v"].shape[-1])
    assert torch.isfinite(states).all()
    o_plain, ht_plain = torch.ops.gla.chunk_fwd(*args)
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain)
    bwd = args[:7] + (x["do"], x["dht"], K ** -0.5, False, "", 0, False)
    from_states = torch.ops.gla.chunk_bwd(*bwd, states)
    recomputed = torch.ops.gla.chunk_bwd(*bwd)
    for name, a, b, want in zip(NAMES[2:], from_states, recomputed, ref[2:]):
        assert rel(a.float(), b.float()) < 5e-3, f"{name}: from states vs recomputed {rel(a.float(), b.float()):.3e}"
        assert rel(a.double().cpu(), want.double()) < 5e-3, f"{name}: vs reference {rel(a.double().cpu(), want.double()):.3e}"
    # The autograd route saves them (a bf16 tensor of that shape among the saved tensors).
    saved = []
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
    varlen = {} if cu is None else {"cu_seqlens": cu_t, "cu_seqlens_cpu": cu}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True, **varlen)
    assert (torch.bfloat16, tuple(states.shape)) in saved, saved
    grads = torch.autograd.grad([o, ht], leaves, [x["do"], x["dht"]])
    for name, a, want in zip(("dq", "dk", "dv", "dg", "dh0"), grads, ref[2:]):
        assert rel(a.double().cpu(), want.double()) < 5e-3, f"autograd {name}: {rel(a.double().cpu(), want.double()):.3e}"


@pytest.mark.parametrize("T,K,V", [(300, 64, 128), (256, 128, 128), (192, 256, 512)])
def test_cuda_saved_chunk_states(T, K, V):
    """gla::chunk_fwd_saving_states saves bf16 chunk states [B * ceil(T / 64), H, K, V] (o bitwise
    chunk_fwd's), chunk_bwd from them matches chunk_bwd without them and the reference, and
    gla.chunk_gla's autograd keeps them for its backward."""
    if not _has_cuda_backend():
        pytest.skip("no native cuda backend in this build of libgla")
    host = make_inputs(B=2, T=T, H=2, K=K, V=V, dtype=torch.bfloat16, seed=11)
    _check_saved_chunk_states(_to(host, "cuda"), run_gla(host, backend="reference"), K, 2 * -(-T // 64))


@pytest.mark.parametrize("K,V", [(64, 128), (100, 36), (256, 512)])
def test_cuda_saved_chunk_states_varlen(K, V):
    """With cu_seqlens the saved states are in the per-sequence layout, [sum of ceil(T_n / 64), H, K, V]
    (empty, one-token and partial-chunk sequences here); chunk_bwd from them matches chunk_bwd without
    them and the reference, and gla.chunk_gla's autograd keeps them."""
    if not _has_cuda_backend():
        pytest.skip("no native cuda backend in this build of libgla")
    cu = [0, 0, 1, 65, 200, 200, 330]
    host = make_inputs(B=1, T=cu[-1], H=2, K=K, V=V, cu_seqlens=cu, dtype=torch.bfloat16, seed=14)
    chunks = sum(-(-(b - a) // 64) for a, b in zip(cu, cu[1:]))
    _check_saved_chunk_states(_to(host, "cuda"), run_gla(host, backend="reference"), K, chunks, cu)


@pytest.mark.parametrize("T,K,V", [(300, 64, 128), (192, 256, 512), (256, 128, 64)])
def test_cuda_fla_layer_call_matches_reference(T, K, V):
    """The call fla's GLA layer makes in training: bf16, state_v_first=True, no initial state, no
    final state (saved chunk states on the cuda backend), gradients through autograd."""
    x = make_inputs(B=2, T=T, H=2, K=K, V=V, dtype=torch.bfloat16, initial_state=False, state_v_first=True,
                    randn=True, seed=12)
    want = run_gla(x, output_final_state=False, backend="reference")
    got = run_gla(_to(x, "cuda"), output_final_state=False)
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, name
            continue
        err = rel(a.double().cpu(), b.double())
        assert err < 5e-3, f"{name}: relative RMS error {err:.3e}"


def test_cuda_no_saved_chunk_states_where_the_backend_saves_none():
    """fp32 inputs and a backend without saved states (`torch`, also with cu_seqlens): no states
    (numel 0), the same outputs as chunk_fwd."""
    if not _has_cuda_backend():
        pytest.skip("no native cuda backend in this build of libgla")
    cu = [0, 64, 200]
    for inputs, backend in ((make_inputs(B=1, T=200, H=2, K=64, cu_seqlens=cu, dtype=torch.bfloat16), "torch"),
                            (make_inputs(B=2, T=200, H=2, K=64, dtype=torch.float32), ""),
                            (make_inputs(B=2, T=200, H=2, K=64, dtype=torch.bfloat16), "torch")):
        x = _to(inputs, "cuda")
        cu_cpu = torch.tensor(cu) if x["cu_seqlens"] is not None else None
        args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"], x["cu_seqlens"], cu_cpu, 0.125, False, True,
                backend, 0, False)
        o, ht, states = torch.ops.gla.chunk_fwd_saving_states(*args)
        assert states.numel() == 0
        o_plain, ht_plain = torch.ops.gla.chunk_fwd(*args)
        assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain)


def test_cuda_opcheck():
    x = _to(make_inputs(B=1, T=40, H=2, K=8, V=6, cu_seqlens=[0, 7, 40]), "cuda")
    args = (x["q"].requires_grad_(), x["k"].requires_grad_(), x["v"].requires_grad_(), x["g"].requires_grad_(),
            x["initial_state"].requires_grad_(), x["cu_seqlens"], torch.tensor([0, 7, 40]), 0.3, False, True, "", 0)
    torch.library.opcheck(torch.ops.gla.chunk_fwd.default, args)
    bwd = args[:7] + (x["do"], x["dht"], 0.3, False, "", 0)
    torch.library.opcheck(torch.ops.gla.chunk_bwd.default, tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                                                 for a in bwd))


def test_cuda_compile_fullgraph():
    torch._dynamo.reset()
    x = _to(make_inputs(B=2, T=70, H=2, K=16, V=8), "cuda")

    def f(q, k, v, g, h0):
        o, ht = gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
        return (o * o).sum() + (ht * ht).sum()

    compiled = torch.compile(f, fullgraph=True)
    grads = []
    for fn in (compiled, f):
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-5


def test_cuda_sum_loss_backward_runs_on_the_cuda_backend():
    """`(o.sum() + ht.sum()).backward()`: autograd hands the backward expanded gradients (last-dim
    stride 0), which the cuda backend does not read. Forced to `cuda`, the backward must still run
    there (on dense copies) and match the reference's gradients of the same loss."""
    x = make_inputs(B=2, T=200, H=2, K=64, dtype=torch.bfloat16, seed=7)
    grads = {}
    for backend, device in (("cuda", "cuda"), ("reference", "cpu")):
        leaves = {n: x[n].detach().to(device).clone().requires_grad_(True) for n in ("q", "k", "v", "g", "initial_state")}
        if device == "cpu":
            leaves = {n: t.detach().float().requires_grad_(True) for n, t in leaves.items()}
        with gla.backend(backend):
            o, ht = gla.chunk_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                  initial_state=leaves["initial_state"], output_final_state=True)
            (o.sum() + ht.sum()).backward()
        grads[backend] = {n: t.grad for n, t in leaves.items()}
    for n in ("q", "k", "v", "g", "initial_state"):
        got, want = grads["cuda"][n], grads["reference"][n]
        assert got.is_cuda and torch.isfinite(got).all(), n
        assert rel(got.double().cpu(), want) < 5e-3, f"{n}: {rel(got.double().cpu(), want):.3e}"
