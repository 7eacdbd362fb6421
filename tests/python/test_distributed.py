"""gla.distributed (context parallelism) against one gla.chunk_gla call on the concatenated input:
o, the final state and every gradient (q, k, v, g, initial state).

- gloo: 2 and 4 processes spawned here (torch.multiprocessing, a free port on 127.0.0.1), each
  holding a random slice of the tokens; every rank checks its slice and the rank sums.
- simulated: every rank in this process with the exchange in memory (the same Function), on many
  random layouts on the CPU, and on CUDA tensors (marker `cuda`; skips without a GPU).
- the bytes each gather sends, and bad input.

Layouts are drawn so that the slices cut through chunks (64 tokens) and through sequences, with a
sequence over every rank, ranks holding only a sequence's interior, empty sequences and empty ranks.
"""
from __future__ import annotations

import datetime
import os
import random
import socket

import pytest
import torch

import gla
import gla.distributed as gd
from oracle import NAMES, make_inputs, rel, run_gla

TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
SHAPE = dict(H=2, K=8, V=12)


# ---- layouts ----
def _cuts(rng: random.Random, T: int, W: int, avoid=()):
    """W + 1 rank boundaries: sorted random interior cuts, none on a multiple of 64 or in `avoid`."""
    pool = [t for t in range(1, T) if t % 64 and t not in avoid]
    return [0] + sorted(rng.sample(pool, W - 1)) + [T]


def _packed(rng: random.Random, T: int, n: int):
    """Offsets of n sequences over T tokens, one of them empty."""
    inner = sorted(rng.sample(range(1, T), n - 2))
    cu = [0] + inner + [T]
    cu.insert(rng.randrange(1, len(cu)), cu[rng.randrange(1, len(cu) - 1)])  # an empty sequence
    return sorted(cu)


def layouts(W: int, seed: int = 0):
    """Named cases for W ranks: (name, dict(T, cu, bounds, B, initial_state, state_v_first, per_head_gate))."""
    rng = random.Random(1000 * W + seed)
    T = 190
    out = []
    cu = _packed(rng, T, 6)
    out.append(("packed-random", dict(T=T, cu=cu, bounds=_cuts(rng, T, W, avoid=cu), B=1)))
    # one sequence over every rank: every middle rank holds only its interior
    cu = [0, 5, T - 4, T]
    out.append(("packed-over-all", dict(T=T, cu=cu, bounds=[0] + sorted(rng.sample(range(6, T - 4), W - 1)) + [T],
                                        B=1, state_v_first=True)))
    out.append(("batched", dict(T=T, cu=None, bounds=_cuts(rng, T, W), B=2)))
    out.append(("batched-per-head-gate", dict(T=T, cu=None, bounds=_cuts(rng, T, W), B=2, per_head_gate=True,
                                              initial_state=False)))
    # an empty rank, and a sequence that starts and ends inside one rank
    bounds = _cuts(rng, T, W)
    bounds.insert(1, bounds[1])
    bounds.pop(-2)
    out.append(("empty-rank", dict(T=T, cu=[0, 40, 41, 120, T], bounds=bounds, B=1, initial_state=False)))
    for name, case in out:
        b = case["bounds"]
        assert len(b) == W + 1 and b[0] == 0 and b[-1] == T, (name, b)
        if name != "empty-rank":
            assert all(x % 64 for x in b[1:-1]), f"{name}: a cut on a chunk boundary {b}"
    return out


def _inputs(case, dtype=torch.float32, device="cpu", seed=0):
    return make_inputs(case["B"], case["T"], SHAPE["H"], SHAPE["K"], V=SHAPE["V"], dtype=dtype,
                       cu_seqlens=case["cu"], initial_state=case.get("initial_state", True),
                       state_v_first=case.get("state_v_first", False), per_head_gate=case.get("per_head_gate", False),
                       seed=seed, device=device)


def _slices(x, bounds, rank):
    return x[:, bounds[rank]:bounds[rank + 1]].detach().clone().requires_grad_(True)


def _loss(outs, dos, finals, dht):
    loss = sum((o.float() * d.float()).sum() for o, d in zip(outs, dos))
    if finals is not None:
        loss = loss + sum((f * dht).sum() for f in finals)
    return loss


# ---- simulated, in this process ----
def _simulated(case, dtype=torch.float32, device="cpu", backend=None, seed=0):
    """(per-rank o, per-rank final states, grads) of gla.distributed.simulate and the single call."""
    inp = _inputs(case, dtype, device, seed)
    want = run_gla(inp, backend=backend)
    b, W = case["bounds"], len(case["bounds"]) - 1
    parts = {n: [_slices(inp[n], b, r) for r in range(W)] for n in "qkvg"}
    h0 = inp["initial_state"].clone().requires_grad_(True) if inp["initial_state"] is not None else None
    with gla.backend(backend):
        outs, finals = gd.simulate(parts["q"], parts["k"], parts["v"], parts["g"], initial_state=h0,
                                   output_final_state=True, state_v_first=inp["state_v_first"], cu_seqlens=case["cu"])
        _loss(outs, [inp["do"][:, b[r]:b[r + 1]] for r in range(W)], finals, inp["dht"]).backward()
    got = [torch.cat(outs, 1), sum(finals)] + [torch.cat([p.grad for p in parts[n]], 1) for n in "qkvg"]
    got.append(h0.grad if h0 is not None else None)
    return got, want, finals


def _compare(got, want, tol, what):
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, f"{what}: {name} present where one call has none"
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {name} {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
        assert torch.isfinite(a).all(), f"{what}: {name} has NaN/Inf"
        err = rel(a, b)
        assert err < tol, f"{what}: {name} relative RMS error {err:.3e} >= {tol:.0e}"


def _random_layout(rng: random.Random):
    W = rng.randint(1, 6)
    T = rng.randint(W, 300)
    packed = rng.random() < 0.7
    cu = sorted([0, T] + [rng.randint(0, T) for _ in range(rng.randint(0, 6))]) if packed else None
    bounds = sorted([0, T] + [rng.randint(0, T) for _ in range(W - 1)])
    return dict(T=T, cu=cu, bounds=bounds, B=1 if packed else rng.randint(1, 3),
                initial_state=rng.random() < 0.7, state_v_first=rng.random() < 0.3,
                per_head_gate=rng.random() < 0.2)


@pytest.mark.parametrize("seed", range(24))
def test_simulated_random_layout_matches_one_call(seed):
    case = _random_layout(random.Random(seed))
    got, want, _ = _simulated(case, backend="cpu", seed=seed)
    _compare(got, want, TOL[torch.float32], f"layout {case}")


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("name", [n for n, _ in layouts(2)])
def test_simulated_layouts_match_one_call(W, name):
    case = dict(layouts(W))[name]
    got, want, finals = _simulated(case, backend="cpu")
    _compare(got, want, TOL[torch.float32], f"{name}, {W} ranks, bounds {case['bounds']}")
    context = gd.Context(case["bounds"], case["cu"])
    for r, f in enumerate(finals):  # each final-state row on its owner only
        mine = context.ending(r, case["B"])
        others = [n for n in range(f.shape[0]) if n not in mine]
        assert (f[others] == 0).all(), f"rank {r}: rows {others} of sequences ending elsewhere are not 0"


def test_simulated_torch_backend():
    case = dict(layouts(4))["packed-over-all"]
    got, want, _ = _simulated(case, backend="torch")
    _compare(got, want, TOL[torch.float32], "torch backend")


def test_simulated_hard_reset_gate():
    """g = -inf (the state forgotten) at a rank's first token, inside a rank and at a sequence's
    first token: every D, the shifted gates of the backward's reversed call, the same as one call
    (on the reference backend: SPEC §3.8's finite answer for g = -inf)."""
    case = dict(T=60, cu=[0, 3, 56, 60], bounds=[0, 13, 30, 31, 60], B=1)
    b = case["bounds"]
    inp = _inputs(case)
    for t in (13, 33, 3):
        inp["g"][:, t, 0] = float("-inf")
    parts = {n: [_slices(inp[n], b, r) for r in range(4)] for n in "qkvg"}
    h0 = inp["initial_state"].clone().requires_grad_(True)
    want = run_gla(inp, backend="reference")
    with gla.backend("reference"):
        outs, finals = gd.simulate(parts["q"], parts["k"], parts["v"], parts["g"], initial_state=h0,
                                   output_final_state=True, cu_seqlens=case["cu"])
        _loss(outs, [inp["do"][:, b[r]:b[r + 1]] for r in range(4)], finals, inp["dht"]).backward()
    got = [torch.cat(outs, 1), sum(finals)] + [torch.cat([p.grad for p in parts[n]], 1) for n in "qkvg"] + [h0.grad]
    _compare(got, want, TOL[torch.float32], "g = -inf")


def test_simulated_gradcheck_float64():
    """Finite differences through the whole call (fp64 runs the torch backend's body): 4 ranks, a
    sequence over three of them, initial and final states."""
    gen = torch.Generator().manual_seed(5)
    T, H, K, V, b, cu = 20, 1, 3, 2, [0, 7, 8, 15, 20], [0, 5, 14, 20]
    q, k, g = (torch.rand(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.rand(1, T, H, V, generator=gen, dtype=torch.float64)
    h0 = torch.randn(3, H, K, V, generator=gen, dtype=torch.float64)

    def f(q, k, v, g, h0):
        parts = [[x[:, b[r]:b[r + 1]] for r in range(4)] for x in (q, k, v, -g)]
        outs, finals = gd.simulate(*parts, initial_state=h0, cu_seqlens=cu, output_final_state=True)
        return torch.cat(outs, 1), sum(finals)

    assert torch.autograd.gradcheck(f, [x.requires_grad_() for x in (q, k, v, g, h0)], fast_mode=True)


def test_exchange_sends_states_only():
    """Forward: M·H·K·(V+1) fp32 per rank (local final state and decay); backward M·H·K·V."""
    for name, case in layouts(4):
        inp = _inputs(case)
        b, W = case["bounds"], 4
        parts = {n: [_slices(inp[n], b, r) for r in range(W)] for n in "qkvg"}
        ex = gd._exchange.InMemory(W)
        with gla.backend("cpu"):
            outs, _ = gd.simulate(parts["q"], parts["k"], parts["v"], parts["g"], cu_seqlens=case["cu"], exchange=ex)
            sum(o.sum() for o in outs).backward()
        M, H, K, V = (1 if case["cu"] else case["B"]), SHAPE["H"], SHAPE["K"], SHAPE["V"]
        assert ex.sent_bytes == [M * H * K * (V + 1) * 4, M * H * K * V * 4], f"{name}: {ex.sent_bytes}"


def _ieee(fn):
    def wrapped(*a, **kw):
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return fn(*a, **kw)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    return wrapped


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the simulated CUDA run needs an NVIDIA GPU "
                           "(run `pytest tests/python/test_distributed.py -m cuda -rs` on one)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", [n for n, _ in layouts(4)])
def test_simulated_cuda_matches_one_call(name, dtype):
    """The local and combine steps on CUDA tensors (default dispatch), 4 simulated ranks, against
    one call on the same device."""
    case = dict(layouts(4))[name]
    got, want, _ = _ieee(_simulated)(case, dtype=dtype, device="cuda")
    for name_, x in zip(NAMES, got):
        assert x is None or x.is_cuda, f"{name_} not on the GPU"
    _compare(got, want, TOL[dtype], f"{name} on CUDA ({dtype})")


# ---- bad input ----
def _parts(case, W):
    inp = _inputs(case)
    return inp, [[_slices(inp[n], case["bounds"], r) for r in range(W)] for n in "qkvg"]


def test_bad_input_names_the_argument():
    case = dict(layouts(2))["packed-random"]
    inp, (q, k, v, g) = _parts(case, 2)
    cu = case["cu"]
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[6, 2, 8, 12\]"):
        gd.simulate(q, k, v, g, initial_state=torch.zeros(5, 2, 8, 12), cu_seqlens=cu)
    with pytest.raises(TypeError, match="initial_state: expected float32"):
        gd.simulate(q, k, v, g, initial_state=torch.zeros(6, 2, 8, 12, dtype=torch.float16), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected the last offset to be the total token count over "
                                         r"all ranks \(190\), got 189"):
        gd.simulate(q, k, v, g, cu_seqlens=cu[:-1] + [189])
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets starting at 0"):
        gd.simulate(q, k, v, g, cu_seqlens=[0, 100, 90, 190])
    with pytest.raises(ValueError, match=r"q\[0\]: expected B = 1 with cu_seqlens"):
        gd.simulate(*[[x.expand(2, *x.shape[1:]) for x in parts] for parts in (q, k, v, g)], cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"k: expected 2 per-rank slices"):
        gd.simulate(q, k[:1], v, g, cu_seqlens=cu)
    with pytest.raises(TypeError, match="q: expected a list of per-rank tensors, got Tensor"):
        gd.simulate(inp["q"], k, v, g)
    with pytest.raises(ValueError, match=r"q\[1\], v\[1\]: expected B, H, K, V and dtype of rank 0"):
        gd.simulate(q[:1] + [q[1][:, :, :1]], k[:1] + [k[1][:, :, :1]], v[:1] + [v[1][:, :, :1]],
                    g[:1] + [g[1][:, :, :1]], cu_seqlens=cu)
    T1 = case["bounds"][2] - case["bounds"][1]
    with pytest.raises(ValueError, match=rf"g\[1\]: expected shape \[1, {T1}, 2, 8\] \(per key\) or \[1, {T1}, 2\]"):
        gd.simulate(q, k, v, g[:1] + [g[1][:, :, :, :3]], cu_seqlens=cu)
    with pytest.raises(ValueError, match="q: rank 0 holds tokens"):
        gd._check_tokens(gd.Context([0, 10, 190], cu), 0, q[0])
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        gd.chunk_gla(q[0], k[0], v[0], g[0], cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens: pass the global offsets either to build_context or here"):
        gd.chunk_gla(q[0], k[0], v[0], g[0], cu_seqlens=cu, context=gd.Context(case["bounds"], cu))
    # the library's own checks still name the argument (here: the local call sees k's shape)
    with pytest.raises(ValueError, match="k"):
        gd.simulate(q, [x[..., :4] for x in k], v, g, cu_seqlens=cu)


# ---- gloo: real processes ----
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for name, case in layouts(world):
            _gloo_case(rank, world, name, case)
        _gloo_mismatch(rank, world)
        if world == 4:  # a subgroup whose ranks are not the global ones
            sub = dist.new_group([1, 2, 3])
            if rank >= 1:
                for name, case in layouts(3)[:2]:
                    _gloo_case(rank - 1, 3, name, case, group=sub)
    finally:
        dist.destroy_process_group()


def _gloo_case(rank, world, name, case, group=None):
    import torch.distributed as dist

    what = f"{name}, rank {rank} of {world}, bounds {case['bounds']}, cu_seqlens {case['cu']}"
    inp = _inputs(case)  # the same global input on every rank (fixed seed)
    want = run_gla(inp, backend="cpu")
    b = case["bounds"]
    context = gd.build_context(b[rank + 1] - b[rank], case["cu"], group=group)
    assert context.boundaries == tuple(b), f"{what}: context boundaries {context.boundaries}"
    results = []
    for per_call in (True, False):  # the layout exchanged per call, then a prebuilt context
        x = {n: _slices(inp[n], b, rank) for n in "qkvg"}
        h0 = inp["initial_state"].clone().requires_grad_(True) if inp["initial_state"] is not None else None
        with gla.backend("cpu"):
            kw = dict(cu_seqlens=case["cu"]) if per_call else dict(context=context)
            kw["group"] = group
            o, fs = gd.chunk_gla(x["q"], x["k"], x["v"], x["g"], initial_state=h0, output_final_state=True,
                                 state_v_first=inp["state_v_first"], **kw)
            _loss([o], [inp["do"][:, b[rank]:b[rank + 1]]], [fs], inp["dht"]).backward()
        results.append([o, fs] + [x[n].grad for n in "qkvg"] + [h0.grad if h0 is not None else None])
    for a, c in zip(*results):
        assert (a is None and c is None) or torch.equal(a, c), f"{what}: per-call and prebuilt context differ"
    o, fs, dq, dk, dv, dg, dh0 = results[0]
    mine = context.ending(rank, case["B"])
    others = [n for n in range(fs.shape[0]) if n not in mine]
    assert (fs[others] == 0).all(), f"{what}: final-state rows {others} of sequences ending elsewhere are not 0"
    summed = []
    for t in (fs, dh0):
        if t is not None:
            t = t.clone()
            dist.all_reduce(t, group=group)
        summed.append(t)
    sl = lambda t: t[:, b[rank]:b[rank + 1]]  # noqa: E731
    got = [o, summed[0], dq, dk, dv, dg, summed[1]]
    want = [sl(want[0]), want[1], sl(want[2]), sl(want[3]), sl(want[4]), sl(want[5]), want[6]]
    _compare(got, want, TOL[torch.float32], what)


def _gloo_mismatch(rank, world):
    """Ranks disagreeing on H, or one rank's bad input: every rank raises (no collective left hanging)."""
    H = 2 + (rank == world - 1)
    q = torch.rand(1, 10, H, 8)
    with pytest.raises(ValueError, match=r"q: every rank must pass the same H; got \[2, .*3\] by rank"):
        gd.chunk_gla(q, q, torch.rand(1, 10, H, 4), -q, cu_seqlens=[0, 10 * world])
    q = torch.rand(1, 10, 2, 8)
    g = -q[..., :3] if rank == 1 else -q
    want = r"g: expected shape \[1, 10, 2, 8\]" if rank == 1 else r"q: rank\(s\) \[1\] of the group rejected their input"
    with pytest.raises(ValueError, match=want):
        gd.chunk_gla(q, q, torch.rand(1, 10, 2, 4), g, cu_seqlens=[0, 10 * world])


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_match_one_call(world):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)
