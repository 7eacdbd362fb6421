"""gla.fused_recurrent_gla and gla.recurrent_state_update: the native backends (cpu, reference) against
the `torch` backend's PyTorch-ops token loop in float64 (forward, and gradients by torch.autograd),
every gate combination, reverse, varlen with empty and length-1 sequences, both state layouts, the
chunked operator on the same inputs, the state pool with bad slots, errors, gradcheck, and on CUDA
(skipped without a GPU) the decode path and the cuda backend's gradients against the cpu backend and
the float64 oracle."""
import math

import pytest
import torch

import gla
from gla import _recurrent_torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make(B, T, H, K, V, dtype=torch.float32, gk=True, gv=False, h0=True, v_first=False, N=None, seed=0,
         device="cpu", strong=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    norm = 0.1 if strong else 1.0
    g_k = torch.nn.functional.logsigmoid(r(B, T, H, K)) / norm if gk else None
    g_v = torch.nn.functional.logsigmoid(r(B, T, H, V)) / norm if gv else None
    N = B if N is None else N
    state = (N, H, V, K) if v_first else (N, H, K, V)
    s0 = torch.randn(*state, generator=gen) if h0 else None
    cast = lambda x: None if x is None else x.to(dtype).to(device)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), gk=cast(g_k), gv=cast(g_v),
                initial_state=None if s0 is None else s0.to(device))


def oracle(inputs, reverse, cu, v_first, want_final=True):
    d = {n: (t.double() if t is not None else None) for n, t in inputs.items()}
    K = d["q"].shape[-1]
    return _recurrent_torch.recurrent_forward(d["q"], d["k"], d["v"], d["gk"], d["gv"], K ** -0.5,
                                              d["initial_state"], cu, reverse, v_first, want_final)


GATES = [(True, False), (False, True), (True, True), (False, False)]


@pytest.mark.parametrize("backend", ["cpu", "reference", "torch"])
@pytest.mark.parametrize("gk,gv", GATES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("v_first", [False, True])
def test_forward_and_gradients_match_torch_float64(backend, gk, gv, reverse, v_first):
    inputs = make(2, 19, 2, 16, 24, gk=gk, gv=gv, v_first=v_first, seed=hash((gk, gv, reverse, v_first)) % 1000)
    leaves = {n: (t.clone().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    with gla.backend(backend):
        o, ht = gla.fused_recurrent_gla(**leaves, output_final_state=True, reverse=reverse, state_v_first=v_first)
    d = {n: (t.double().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    o_ref, ht_ref = oracle(d, reverse, None, v_first)
    assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5
    do, dht = torch.randn_like(o_ref), torch.randn_like(ht_ref)
    (o.double() * do).sum().add_((ht.double() * dht).sum()).backward()
    (o_ref * do).sum().add_((ht_ref * dht).sum()).backward()
    for name in leaves:
        if leaves[name] is not None:
            assert rel(leaves[name].grad, d[name].grad) < 1e-5, name


@pytest.mark.parametrize("backend", ["cpu", "reference", "torch"])
@pytest.mark.parametrize("gk,gv", GATES[:3])
def test_varlen_with_empty_and_single_token_sequences(backend, gk, gv):
    cu = [0, 0, 1, 9, 9, 23]
    inputs = make(1, 23, 2, 8, 12, gk=gk, gv=gv, N=5, seed=3)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    leaves = {n: (t.clone().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    with gla.backend(backend):
        o, ht = gla.fused_recurrent_gla(**leaves, output_final_state=True, cu_seqlens=cu_t, reverse=True)
    d = {n: (t.double().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    o_ref, ht_ref = oracle(d, True, cu, False)
    assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5
    assert torch.equal(ht[0], inputs["initial_state"][0]) and torch.equal(ht[3], inputs["initial_state"][3])
    (o.double().sum() + ht.double().square().sum()).backward()
    (o_ref.sum() + ht_ref.square().sum()).backward()
    for name in leaves:
        if leaves[name] is not None:
            assert rel(leaves[name].grad, d[name].grad) < 1e-5, name


def test_reverse_is_the_forward_on_flipped_time():
    inputs = make(2, 11, 2, 8, 8, gk=True, gv=True, seed=9)
    o_rev, ht_rev = gla.fused_recurrent_gla(**inputs, output_final_state=True, reverse=True)
    flipped = {n: (t.flip(1) if t is not None and n != "initial_state" else t) for n, t in inputs.items()}
    o_fwd, ht_fwd = gla.fused_recurrent_gla(**flipped, output_final_state=True)
    assert rel(o_rev, o_fwd.flip(1)) < 1e-6 and rel(ht_rev, ht_fwd) < 1e-6


@pytest.mark.parametrize("v_first", [False, True])
def test_agrees_with_chunked_operator(v_first):
    inputs = make(2, 150, 2, 32, 16, gk=True, v_first=v_first, seed=4, strong=True)
    o_c, ht_c = gla.chunk_gla(inputs["q"], inputs["k"], inputs["v"], inputs["gk"],
                              initial_state=inputs["initial_state"], output_final_state=True, state_v_first=v_first)
    o_r, ht_r = gla.fused_recurrent_gla(**inputs, output_final_state=True, state_v_first=v_first)
    assert rel(o_r, o_c) < 1e-5 and rel(ht_r, ht_c) < 1e-5


def test_bfloat16_on_cpu_matches_reference():
    inputs = make(2, 9, 2, 16, 32, dtype=torch.bfloat16, gk=True, gv=True, seed=5)
    with gla.backend("reference"):
        o_ref, ht_ref = gla.fused_recurrent_gla(**inputs, output_final_state=True)
    o, ht = gla.fused_recurrent_gla(**inputs, output_final_state=True)
    assert o.dtype == torch.bfloat16
    assert rel(o, o_ref) < 5e-3 and rel(ht, ht_ref) < 5e-3


def test_gradcheck_float64():
    inputs = make(1, 4, 1, 3, 4, gk=True, gv=True, seed=6)
    d = tuple(inputs[n].double().requires_grad_(True) for n in ("q", "k", "v", "gk", "gv", "initial_state"))

    def f(q, k, v, gk, gv, h0):
        o, ht = gla.fused_recurrent_gla(q, k, v, gk, gv, initial_state=h0, output_final_state=True, reverse=True)
        return o, ht

    assert torch.autograd.gradcheck(f, d)


def test_explain_names_the_units():
    inputs = make(2, 1, 2, 8, 8, gk=True, gv=True)
    text = gla.explain_recurrent(**inputs, output_final_state=True, state_v_first=False)
    assert "recurrent_fwd" in text and "decision: cpu" in text, text
    assert "backend 'torch'" in text
    text = gla.explain_recurrent(**inputs, backward=True)
    assert "recurrent_bwd" in text, text


def test_errors_name_the_argument():
    inputs = make(2, 3, 2, 8, 8, gk=True)
    with pytest.raises(ValueError, match=r"gv: expected shape \[2, 3, 2, 8\]"):
        gla.fused_recurrent_gla(**{**inputs, "gv": torch.zeros(2, 3, 2, 7)})
    with pytest.raises(ValueError, match=r"gk: expected shape \[2, 3, 2, 8\] \(\[B, T, H, K\] key gate\), got \[2, 3, 2\]"):
        gla.fused_recurrent_gla(**{**inputs, "gk": torch.zeros(2, 3, 2)})
    with pytest.raises(TypeError, match="initial_state: expected dtype float32"):
        gla.fused_recurrent_gla(**{**inputs, "initial_state": inputs["initial_state"].double()})


# ---- the state pool ----
def pool_reference(inputs, pool, slots, v_first):
    """Per sequence: a recurrent forward from its slot's state; skipped sequences o = 0."""
    P = pool.shape[0]
    seen, outs, new_pool = set(), [], pool.clone()
    for b, s in enumerate(slots):
        one = {n: (t[b:b + 1] if t is not None and n != "initial_state" else None) for n, t in inputs.items()}
        if 0 <= s < P and s not in seen:
            seen.add(s)
            one["initial_state"] = pool[s:s + 1]
            o, ht = oracle(one, False, None, v_first)
            outs.append(o.float())
            new_pool[s] = ht[0].float()
        else:
            outs.append(torch.zeros_like(one["v"], dtype=torch.float32))
    return torch.cat(outs), new_pool


@pytest.mark.parametrize("backend", ["cpu", "reference", "torch"])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("T", [1, 3])
def test_state_update_in_place_with_bad_slots(backend, v_first, T):
    B, H, K, V, P = 6, 2, 8, 12, 5
    inputs = make(B, T, H, K, V, gk=True, gv=True, h0=False, seed=T)
    storage = torch.randn(P + 4, H, *((V, K) if v_first else (K, V)))
    pool = storage[2:2 + P]
    before = storage.clone()
    slots = [4, -1, 0, 4, 5, 2]
    error = torch.zeros(1, dtype=torch.int32)
    want_o, want_pool = pool_reference(inputs, before[2:2 + P], slots, v_first)
    with gla.backend(backend):
        o, states = gla.recurrent_state_update(inputs["q"], inputs["k"], inputs["v"], pool,
                                               torch.tensor(slots, dtype=torch.int32), error, gk=inputs["gk"],
                                               gv=inputs["gv"], state_v_first=v_first)
    assert states is None
    assert error.item() == 3
    assert rel(o, want_o) < 1e-5
    assert rel(pool, want_pool) < 1e-5
    assert torch.equal(storage[:2], before[:2]) and torch.equal(storage[2 + P:], before[2 + P:])
    for s in (1, 3):  # slots nobody owns
        assert torch.equal(pool[s], before[2 + s])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_state_update_token_states_leave_pool_unchanged(backend):
    B, T, H, K, V, P = 3, 4, 2, 8, 8, 4
    inputs = make(B, T, H, K, V, gk=True, h0=False, seed=7)
    pool = torch.randn(P, H, K, V)
    before = pool.clone()
    error = torch.zeros(1, dtype=torch.int32)
    with gla.backend(backend):
        o, states = gla.recurrent_state_update(inputs["q"], inputs["k"], inputs["v"], pool,
                                               torch.tensor([2, 0, 3], dtype=torch.int32), error, gk=inputs["gk"],
                                               output_token_states=True)
    assert torch.equal(pool, before) and error.item() == 0
    _, want_pool = pool_reference(inputs, before, [2, 0, 3], False)
    assert rel(states[:, -1], want_pool[[2, 0, 3]]) < 1e-5


def test_state_update_check_slots_raises():
    inputs = make(2, 1, 1, 4, 4, gk=True, h0=False)
    pool = torch.randn(3, 1, 4, 4)
    before = pool.clone()
    error = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="state_slots: expected slots in \\[0, 3\\).*got 3 at index 1"):
        gla.recurrent_state_update(inputs["q"], inputs["k"], inputs["v"], pool, torch.tensor([0, 3], dtype=torch.int32),
                                   error, gk=inputs["gk"], check_slots=True)
    assert torch.equal(pool, before) and error.item() == 0


# ---- CUDA (skipped without a GPU) ----
cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device: recurrent GPU tests need an NVIDIA GPU (pytest -m cuda)")


def run_with_grads(inputs, backend, device, do, dht, **kw):
    """Forward and backward of gla.fused_recurrent_gla on `backend` with copies of `inputs` on
    `device` as leaves; the loss is sum(o * do) (+ sum(ht * dht)), so do and dht are dense."""
    leaves = {n: (t.detach().to(device).requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    with gla.backend(backend):
        o, ht = gla.fused_recurrent_gla(**leaves, output_final_state=dht is not None, **kw)
        loss = (o.float() * do.to(device)).sum()
        if dht is not None:
            loss = loss + (ht * dht.to(device)).sum()
        loss.backward()
    grads = {n: t.grad.cpu() for n, t in leaves.items() if t is not None}
    return o.cpu(), (ht.cpu() if ht is not None else None), grads


def check_cuda_against_cpu(inputs, dht_wanted, **kw):
    """The cuda backend (forced, so a decline fails) against the cpu backend on the same inputs:
    outputs and every gradient by relative RMS at the bar of the input dtype."""
    tol = TOL[inputs["q"].dtype]
    gen = torch.Generator().manual_seed(77)
    o_shape = inputs["v"].shape
    do = torch.randn(*o_shape, generator=gen)
    dht = None
    if dht_wanted:
        B, H, K, V = o_shape[0], o_shape[2], inputs["q"].shape[-1], o_shape[-1]
        N = len(kw["cu_seqlens"]) - 1 if kw.get("cu_seqlens") is not None else B
        dht = torch.randn(*((N, H, V, K) if kw.get("state_v_first") else (N, H, K, V)), generator=gen)
    cuda_kw = dict(kw)
    if kw.get("cu_seqlens") is not None:
        cuda_kw["cu_seqlens"] = kw["cu_seqlens"].cuda()
    o, ht, grads = run_with_grads(inputs, "cuda", "cuda", do, dht, **cuda_kw)
    o_ref, ht_ref, grads_ref = run_with_grads(inputs, "cpu", "cpu", do, dht, **kw)
    assert rel(o, o_ref) < tol
    if dht is not None:
        assert rel(ht, ht_ref) < 1e-5
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        assert rel(g, grads_ref[name]) < tol, name


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gk,gv", GATES[:3])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("h0,dht", [(True, True), (False, True), (True, False)])
def test_cuda_recurrent_gradients_match_cpu(dtype, gk, gv, reverse, v_first, h0, dht):
    # V = 72: three value tiles, the last partial; T = 37 crosses two checkpoints.
    inputs = make(2, 37, 2, 40, 72, dtype=dtype, gk=gk, gv=gv, h0=h0, v_first=v_first,
                  seed=hash((gk, gv, reverse, v_first, h0, dht)) % 1000)
    check_cuda_against_cpu(inputs, dht, reverse=reverse, state_v_first=v_first)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("gk,gv", GATES[:3])
@pytest.mark.parametrize("reverse", [False, True])
def test_cuda_recurrent_gradients_varlen_with_empty_and_single_token_sequences(gk, gv, reverse):
    cu = torch.tensor([0, 0, 1, 17, 17, 40], dtype=torch.int32)
    inputs = make(1, 40, 2, 64, 48, gk=gk, gv=gv, N=5, seed=12)
    check_cuda_against_cpu(inputs, True, cu_seqlens=cu, reverse=reverse)


@pytest.mark.cuda
@cuda
def test_cuda_recurrent_gradients_strong_decay_against_float64():
    """fp32 on the GPU against the float64 oracle's autograd at g = logsigmoid(U)/0.1: the gate
    gradients are exact per step, not a cancelling cumulative sum."""
    inputs = make(1, 90, 2, 64, 64, gk=True, gv=True, seed=13, strong=True)
    gen = torch.Generator().manual_seed(5)
    do, dht = torch.randn(1, 90, 2, 64, generator=gen), torch.randn(1, 2, 64, 64, generator=gen)
    o, ht, grads = run_with_grads(inputs, "cuda", "cuda", do, dht)
    d = {n: (t.double().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    o_ref, ht_ref = oracle(d, False, None, False)
    ((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum()).backward()
    assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5
    for name, g in grads.items():
        assert rel(g, d[name].grad) < 1e-5, name


@pytest.mark.cuda
@cuda
def test_cuda_recurrent_backward_is_served_by_cuda():
    inputs = make(2, 5, 2, 64, 128, dtype=torch.bfloat16, gk=True, gv=True, device="cuda", seed=8)
    text = gla.explain_recurrent(**inputs, backward=True)
    assert "recurrent_bwd" in text and "decision: cuda" in text, text
    assert "recurrent backward: one CTA per (sequence, head, 32-value tile)" in text, text


@pytest.mark.cuda
@cuda
def test_cuda_recurrent_sum_loss_backward_runs_on_the_cuda_backend():
    """`(o.sum() + ht.sum()).backward()` hands the backward expanded gradients (stride 0); forced to
    `cuda` it still runs there, on dense copies, and matches the cpu backend."""
    inputs = make(2, 9, 2, 64, 48, gk=True, gv=True, seed=14)
    grads = {}
    for backend, device in (("cuda", "cuda"), ("cpu", "cpu")):
        leaves = {n: (t.to(device).clone().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
        with gla.backend(backend):
            o, ht = gla.fused_recurrent_gla(**leaves, output_final_state=True)
            (o.sum() + ht.sum()).backward()
        grads[backend] = {n: t.grad for n, t in leaves.items() if t is not None}
    for name, g in grads["cuda"].items():
        assert g.is_cuda and rel(g.cpu(), grads["cpu"][name]) < 1e-5, name


@pytest.mark.cuda
@cuda
def test_cuda_state_update_graph_replay():
    B, H, K, V, P = 16, 4, 128, 128, 32
    pool = torch.randn(P, H, V, K, device="cuda")
    slots = torch.arange(0, 2 * B, 2, dtype=torch.int32, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    inputs = make(B, 1, H, K, V, dtype=torch.bfloat16, gk=True, h0=False, device="cuda", seed=10)
    q, k, v, gk = (inputs[n].clone() for n in ("q", "k", "v", "gk"))
    gla.recurrent_state_update(q, k, v, pool.clone(), slots, error, gk=gk, state_v_first=True)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = gla.recurrent_state_update(q, k, v, pool, slots, error, gk=gk, state_v_first=True)
    fresh = make(B, 1, H, K, V, dtype=torch.bfloat16, gk=True, h0=False, device="cuda", seed=11)
    for name, t in (("q", q), ("k", k), ("v", v), ("gk", gk)):
        t.copy_(fresh[name])
    before = pool.clone()
    graph.replay()
    torch.cuda.synchronize()
    want_o, want_pool = pool_reference({n: (t.cpu() if t is not None else None) for n, t in fresh.items()},
                                       before.cpu(), slots.tolist(), True)
    assert rel(o.cpu(), want_o) < 5e-3 and rel(pool.cpu(), want_pool) < 1e-5 and error.item() == 0


def test_operators_pass_opcheck():
    inputs = make(2, 3, 2, 8, 8, gk=True, gv=True)
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["gk"], inputs["gv"], inputs["initial_state"], None,
            8 ** -0.5, False, False, True, "", 0)
    torch.library.opcheck(torch.ops.gla.recurrent_fwd.default, args)
    pool = torch.randn(4, 2, 8, 8)
    update = (inputs["q"], inputs["k"], inputs["v"], inputs["gk"], None, pool, torch.tensor([1, 3], dtype=torch.int32),
              torch.zeros(1, dtype=torch.int32), 8 ** -0.5, False, False, False, "", 0)
    torch.library.opcheck(torch.ops.gla.recurrent_state_update.default, update,
                          test_utils=("test_schema", "test_faketensor"))
