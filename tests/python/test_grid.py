"""SPEC.md §5 correctness grid through gla.chunk_gla (forward and autograd backward), against the
`reference` backend and an independent fp64 token loop; and the `torch` backend forced against the
native `cpu` backend.

Every shape class of the grid is kept; T is trimmed for CI's two cores (GLA_FULL_GRID=1 restores the
SPEC's T). Trimmed lengths stay off multiples of 64 so partial last chunks stay covered.
"""
import functools
import os

import pytest
import torch

import gla
from oracle import NAMES, make_inputs, rel, run_gla, token_loop

FULL = os.environ.get("GLA_FULL_GRID") == "1"


def T_(full, trimmed):
    return full if FULL else trimmed


# id -> make_inputs keyword arguments (dtype added per test)
CASES = {
    # the SPEC grid (B, T, H, K=V, n)
    "1x63x1x64-n1": dict(B=1, T=63, H=1, K=64, n=1),
    "2x1024x4x60-n1": dict(B=2, T=T_(1024, 300), H=4, K=60, n=1),
    "2x1024x8x128-n0.1": dict(B=2, T=T_(1024, 200), H=8, K=128, n=0.1),
    "2x1024x8x128-n1": dict(B=2, T=T_(1024, 200), H=8, K=128, n=1),
    "2x1024x8x128-n10": dict(B=2, T=T_(1024, 200), H=8, K=128, n=10),
    "4x2048x8x64-n1": dict(B=4, T=T_(2048, 330), H=8, K=64, n=1),
    "1x128x4x256-n1": dict(B=1, T=128, H=4, K=256, n=1),
    "1x64x2x320-n1": dict(B=1, T=64, H=2, K=320, n=1),
    "1x128x4x512-n1": dict(B=1, T=T_(128, 80), H=4, K=512, n=1),
    # varlen, K = 64 and 100
    "varlen-0,15-K64": dict(B=1, T=15, H=2, K=64, cu_seqlens=[0, 15]),
    "varlen-0,0,16-K100": dict(B=1, T=16, H=2, K=100, cu_seqlens=[0, 0, 16]),
    "varlen-0,256,500,1000-K64": dict(B=1, T=1000, H=2, K=64, cu_seqlens=[0, 256, 500, 1000]),
    "varlen-0,256,500,1000-K100": dict(B=1, T=1000, H=2, K=100, cu_seqlens=[0, 256, 500, 1000]),
    "varlen-0,15,100,300,1200,2000-K64": dict(B=1, T=T_(2000, 700), H=2, K=64,
                                              cu_seqlens=[0, 15, 100, 300, T_(1200, 500), T_(2000, 700)]),
    "varlen-0,15,100,300,1200,2000-K100": dict(B=1, T=T_(2000, 700), H=2, K=100,
                                               cu_seqlens=[0, 15, 100, 300, T_(1200, 500), T_(2000, 700)]),
    # state_v_first
    "vfirst-2x256x4x64": dict(B=2, T=256, H=4, K=64, state_v_first=True),
    "vfirst-2x1024x4x128": dict(B=2, T=T_(1024, 200), H=4, K=128, state_v_first=True),
    "vfirst-varlen-K48-V80": dict(B=1, T=150, H=2, K=48, V=80, state_v_first=True, cu_seqlens=[0, 70, 70, 150]),
    # K != V
    "2x130x2x64-V32": dict(B=2, T=130, H=2, K=64, V=32),
    "1x200x2x32-V96": dict(B=1, T=200, H=2, K=32, V=96),
    # without an initial state
    "noh0-2x100x2x64": dict(B=2, T=100, H=2, K=64, initial_state=False),
    "noh0-varlen-K64": dict(B=1, T=300, H=2, K=64, initial_state=False, cu_seqlens=[0, 1, 129, 300]),
    # randn inputs (negative values), strong decay
    "randn-2x150x2x64": dict(B=2, T=150, H=2, K=64, randn=True),
    "strong-n0.1-1x300x2x64": dict(B=1, T=300, H=2, K=64, n=0.1),
    "strong-g-20-2x130x2x64": dict(B=2, T=130, H=2, K=64, gate_min=-20.0),
    "strong-g-20-randn-1x200x2x32": dict(B=1, T=200, H=2, K=32, gate_min=-20.0, randn=True),
    # tiny lengths
    "1x1x1x16": dict(B=1, T=1, H=1, K=16),
    "3x17x2x8-V5": dict(B=3, T=17, H=2, K=8, V=5),
}
# The SPEC grid runs in every dtype; the other cases in fp32 and bf16.
GRID_IDS = [c for c in CASES if c[0].isdigit()]
PARAMS = [(c, d) for c in CASES for d in ("float32", "bfloat16", "float16")
          if d == "float32" or c in GRID_IDS or (d == "bfloat16" and not c[0].isdigit())]

TOL = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 5e-3}


@functools.lru_cache(maxsize=None)
def inputs_for(case, dtype):
    return make_inputs(**CASES[case], dtype=getattr(torch, dtype), seed=hash(case) % 1000)


@functools.lru_cache(maxsize=4)
def reference_result(case, dtype):
    return run_gla(inputs_for(case, dtype), backend="reference")


@functools.lru_cache(maxsize=4)
def loop_result(case, dtype):
    x = inputs_for(case, dtype)
    return token_loop(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], x["cu_list"], x["state_v_first"],
                      x["do"], x["dht"])


def check(got, want, tol, what):
    for name, a, b in zip(NAMES, got, want):
        if a is None or b is None:
            assert a is None or name == "dh0", f"{what}: {name} present on one side only"
            continue
        assert a.shape == b.shape, f"{what}: {name} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        finite_ref = torch.isfinite(b.double().cpu())
        assert torch.isfinite(a.double().cpu())[finite_ref].all(), f"{what}: {name} has NaN/Inf where the reference has none"
        err = rel(a, b)
        assert err < tol, f"{what}: {name} relative RMS error {err:.3e} >= {tol:.0e}"


def has_backend(name):
    return any(b.name == name and b.available for b in gla.backends())


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{d}" for c, d in PARAMS])
def test_default_dispatch_matches_reference_and_token_loop(case, dtype):
    ref = reference_result(case, dtype)
    loop = loop_result(case, dtype)
    # The reference backend is itself checked against the independent loop (its outputs are rounded
    # to the input dtype, hence the dtype's bar).
    check(ref, loop, 1e-6 if dtype == "float32" else TOL[dtype], "reference vs token loop")
    got = run_gla(inputs_for(case, dtype))
    check(got, ref, TOL[dtype], "default dispatch vs reference")
    check(got, loop, TOL[dtype], "default dispatch vs token loop")


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{d}" for c, d in PARAMS])
def test_torch_backend_matches_cpu_backend(case, dtype):
    x = inputs_for(case, dtype)
    got = run_gla(x, backend="torch")
    check(got, reference_result(case, dtype), TOL[dtype], "torch backend vs reference")
    if not has_backend("cpu"):
        pytest.skip("the native cpu backend is not registered in this build of libgla")
    check(got, run_gla(x, backend="cpu"), TOL[dtype], "torch backend vs cpu backend")


@pytest.mark.parametrize("case", ["2x130x2x64-V32", "varlen-0,256,500,1000-K64", "vfirst-2x256x4x64"])
def test_without_final_state(case):
    x = inputs_for(case, "float32")
    got = run_gla(x, output_final_state=False)
    assert got[1] is None
    loop = token_loop(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], x["cu_list"], x["state_v_first"],
                      x["do"], None)
    check(got, loop, 1e-5, "no final state vs token loop")


@pytest.mark.parametrize("backend", [None, "torch", "reference"])
def test_gate_fp32_with_bf16_inputs(backend):
    x = make_inputs(B=2, T=100, H=2, K=32, dtype=torch.bfloat16, gate_dtype=torch.float32, seed=3)
    got = run_gla(x, backend=backend)
    assert got[5].dtype == torch.float32
    loop = token_loop(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], None, False, x["do"], x["dht"])
    check(got, loop, 5e-3, f"bf16 with fp32 gate ({backend or 'default'})")


def _per_head_supported(backend):
    x = make_inputs(B=1, T=4, H=1, K=8, per_head_gate=True)
    try:
        with gla.backend(backend):
            gla.chunk_gla(x["q"], x["k"], x["v"], x["g"])
        return True
    except (ValueError, RuntimeError):
        return False


@pytest.mark.parametrize("backend", [None, "torch", "reference"])
def test_per_head_gate(backend):
    if backend != "torch" and not _per_head_supported(backend):
        pytest.skip(f"backend {backend or 'default'} does not accept a per-head gate")
    x = make_inputs(B=2, T=150, H=3, K=32, V=24, per_head_gate=True, seed=4)
    got = run_gla(x, backend=backend)
    assert got[5].shape == x["g"].shape
    loop = token_loop(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], None, False, x["do"], x["dht"])
    check(got, loop, 1e-5, f"per-head gate ({backend or 'default'})")


@pytest.mark.parametrize("backend", [None, "torch", "reference", "cpu"])
def test_strided_inputs(backend):
    """Views as models produce them (q, k, v sliced out of one projection, a permuted gate, an
    expanded initial state): the same answer as contiguous copies, gradients included."""
    if backend == "cpu" and not has_backend("cpu"):
        pytest.skip("the native cpu backend is not registered in this build of libgla")
    x = make_inputs(B=2, T=70, H=2, K=16, V=8, seed=12)
    qkv = torch.cat([x["q"], x["k"], x["v"]], -1).requires_grad_()
    g = x["g"].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    h0 = x["initial_state"][:1].clone().requires_grad_()
    with gla.backend(backend):
        o, ht = gla.chunk_gla(qkv[..., :16], qkv[..., 16:32], qkv[..., 32:], g, initial_state=h0.expand(2, -1, -1, -1),
                              output_final_state=True)
    torch.autograd.backward([o, ht], [x["do"], x["dht"]])
    contiguous = dict(x, initial_state=x["initial_state"][:1].expand(2, -1, -1, -1).contiguous())
    want = run_gla(contiguous, backend=backend)
    got = (o, ht, qkv.grad[..., :16], qkv.grad[..., 16:32], qkv.grad[..., 32:], g.grad)
    check(got, want[:6], 1e-6, "strided vs contiguous")
    assert rel(h0.grad[0], want[6].sum(0)) < 1e-6
