"""What the Python layer checks before computing: meta tensors rejected by real calls (the meta/fake
kernel kept for tracing), float64 arguments validated by libgla's rules with its messages (the same
text as the float32 call gets), and check_inputs= reaching libgla's input check (and the float64
path's), forward and backward."""
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import gla
from oracle import make_inputs

X = make_inputs(B=1, T=12, H=2, K=8, V=4, seed=51)


def _call(x, **over):
    kw = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], initial_state=x["initial_state"], output_final_state=True)
    kw.update(over)
    return gla.chunk_gla(**kw)


# ---- meta tensors ----
@pytest.mark.parametrize("name", ["q", "initial_state", "cu_seqlens", "all"])
def test_real_call_on_meta_is_rejected(name):
    over = {"cu_seqlens": torch.tensor([0, 5, 12])} if name == "cu_seqlens" else {}
    if name == "cu_seqlens":
        over["initial_state"] = torch.zeros(2, 2, 8, 4)
    x = dict(X)
    if name == "all":
        x = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in X.items()}
        name = "q"
    else:
        over[name] = (over.get(name, x.get(name))).to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: expected a tensor with data .* got a tensor on device meta"):
        _call(x, **over)


def test_operator_rejects_meta_mixed_with_data_and_keeps_its_meta_kernel():
    args = [X["q"], X["k"], X["v"], X["g"], X["initial_state"].to("meta"), None, None, 0.3, False, True, "", 0]
    with pytest.raises(ValueError, match=r"^initial_state: expected a tensor with data"):
        torch.ops.gla.chunk_fwd(*args)
    # All on meta: shape propagation, as PyTorch's meta device means.
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    o, ht = torch.ops.gla.chunk_fwd(*meta)
    assert o.device.type == "meta" and o.shape == X["v"].shape and ht.shape == X["initial_state"].shape


def test_fake_tensors_still_trace():
    """torch.compile's tracing runs the fake kernel on fake tensors, which report a real device."""
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) for n, t in X.items() if isinstance(t, torch.Tensor)}
        o, ht = gla.chunk_gla(fake["q"], fake["k"], fake["v"], fake["g"], initial_state=fake["initial_state"],
                              output_final_state=True)
    assert o.shape == X["v"].shape and ht.shape == X["initial_state"].shape


# ---- float64: libgla's rules, libgla's messages ----
def _bad(case, x):
    """(overrides) of one bad call, built from inputs x of any dtype."""
    q, k, v, g, h0 = x["q"], x["k"], x["v"], x["g"], x["initial_state"]
    two = lambda t: torch.cat([t, t])  # noqa: E731
    return {
        "mismatched T": dict(k=k[:, :7]),
        "K = 0": dict(q=q[..., :0], k=k[..., :0], g=g[..., :0], initial_state=h0[..., :0, :]),
        "V = 0": dict(v=v[..., :0], initial_state=h0[..., :0]),
        "cu_seqlens with B = 2": dict(q=two(q), k=two(k), v=two(v), g=two(g), initial_state=None,
                                      cu_seqlens=torch.tensor([0, 4, 12])),
        "cu_seqlens ending before T": dict(cu_seqlens=torch.tensor([0, 4]), initial_state=None),
        "cu_seqlens decreasing": dict(cu_seqlens=torch.tensor([0, 9, 4, 12]), initial_state=None),
        "cu_seqlens empty": dict(cu_seqlens=torch.tensor([], dtype=torch.int64), initial_state=None),
        "cu_seqlens_cpu ending before T": dict(cu_seqlens=torch.tensor([0, 12]), cu_seqlens_cpu=[0, 5],
                                               initial_state=None),
        "state count != N": dict(initial_state=two(h0)),
        "state shape": dict(initial_state=h0.transpose(2, 3)),
        "gate shape": dict(g=g[..., :3]),
        "scale NaN": dict(scale=float("nan")),
    }[case]


CASES = [
    ("mismatched T", r"^k: expected shape \[1, 12, 2, 8\] \(\[B, T, H, K\] as q\), got \[1, 7, 2, 8\]"),
    ("K = 0", r"^q: expected K \(dim 3\) > 0, got K = 0"),
    ("V = 0", r"^v: expected V \(dim 3\) > 0, got V = 0"),
    ("cu_seqlens with B = 2", r"^cu_seqlens: requires B == 1 .* got B = 2"),
    ("cu_seqlens ending before T", r"^cu_seqlens: expected last entry T = 12, got 4"),
    ("cu_seqlens decreasing", r"^cu_seqlens: expected non-decreasing offsets, got 9 then 4"),
    ("cu_seqlens empty", r"^cu_seqlens: expected shape \[N \+ 1\] with N >= 0, got \[0\]"),
    ("cu_seqlens_cpu ending before T", r"^cu_seqlens: expected last entry T = 12, got 5"),
    ("state count != N", r"^initial_state: expected shape \[1, 2, 8, 4\]"),
    ("state shape", r"^initial_state: expected shape \[1, 2, 8, 4\]"),
    ("gate shape", r"^g: expected shape"),
    ("scale NaN", r"^scale: expected a finite number, got nan"),
]


@pytest.mark.parametrize("case,pattern", CASES, ids=[c for c, _ in CASES])
def test_float64_is_validated_like_float32(case, pattern):
    x64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() and n != "initial_state" else t)
           for n, t in X.items()}
    with pytest.raises(ValueError) as f32:
        _call(X, **_bad(case, X))
    with pytest.raises(ValueError) as f64:
        _call(x64, **_bad(case, x64))
    assert re.search(pattern, str(f64.value)), str(f64.value)
    assert str(f64.value) == str(f32.value)


@pytest.mark.parametrize("name,dtype,pattern", [
    ("k", torch.float32, r"^k: expected dtype float64 \(same as q\), got float32"),
    ("v", torch.float16, r"^v: expected dtype float64 \(same as q\), got float16"),
    ("g", torch.bfloat16, r"^g: expected dtype float64 \(same as q\) or float32, got bfloat16"),
    ("initial_state", torch.float16, r"^initial_state: expected dtype float32 or float64 .* got float16"),
])
def test_float64_dtypes(name, dtype, pattern):
    x64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in X.items()}
    x64[name] = x64[name].to(dtype)
    with pytest.raises(TypeError, match=pattern):
        _call(x64)


def test_float64_cu_seqlens_dtype_is_named_as_given():
    x64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in X.items()}
    with pytest.raises(TypeError, match=r"^cu_seqlens: expected dtype int32 or int64, got float64"):
        _call(x64, initial_state=None, cu_seqlens=torch.tensor([0.0, 12.0], dtype=torch.float64))


def test_float64_valid_calls_are_served():
    x = make_inputs(B=1, T=40, H=2, K=8, V=4, cu_seqlens=[0, 0, 17, 40], seed=52)
    x64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}
    for host in (None, [0, 0, 17, 40]):
        o64, ht64 = gla.chunk_gla(x64["q"], x64["k"], x64["v"], x64["g"], initial_state=x64["initial_state"],
                                  output_final_state=True, cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=host)
        o, ht = gla.chunk_gla(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"],
                              output_final_state=True, cu_seqlens=x["cu_seqlens"])
        assert o64.dtype == torch.float64
        assert torch.allclose(o64.float(), o, rtol=1e-4, atol=1e-5)
        assert torch.allclose(ht64.float(), ht, rtol=1e-4, atol=1e-5)


# ---- check_inputs ----
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,index,value,what", [
    ("k", (0, 3, 1, 5), float("nan"), "NaN"),
    ("q", (0, 11, 0, 0), float("inf"), "Inf"),
    ("g", (0, 2, 1, 7), 0.25, "a positive gate value 0.250000 (expected g <= 0)"),
    ("g", (0, 5, 0, 1), float("nan"), "NaN"),
    ("initial_state", (0, 1, 2, 3), float("-inf"), "Inf"),
])
def test_check_inputs_names_the_first_bad_value(dtype, name, index, value, what):
    x = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and n != "initial_state" else t)
         for n, t in X.items()}
    x[name] = x[name].clone()
    x[name][index] = value
    _call(x)  # off by default: computes (whatever comes out)
    with pytest.raises(ValueError, match=re.escape(f"{name}: input check found {what} at [{', '.join(map(str, index))}]")):
        _call(x, check_inputs=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_check_inputs_passes_hard_resets_and_checks_the_backward(dtype):
    x = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and n != "initial_state" else t)
         for n, t in X.items()}
    g = x["g"].clone()
    g[0, 4] = float("-inf")  # a hard reset is legal
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v")] + [g.requires_grad_()]
    o, ht = gla.chunk_gla(*leaves, initial_state=x["initial_state"], output_final_state=True, check_inputs=True)
    o_plain, _ = gla.chunk_gla(*leaves, initial_state=x["initial_state"], output_final_state=True)
    assert torch.equal(o, o_plain) and torch.isfinite(o).all()
    grads = torch.autograd.grad(o, leaves, x["do"].to(dtype), retain_graph=True)
    assert all(torch.isfinite(t).all() for t in grads)
    do = x["do"].to(dtype).clone()
    do[0, 6, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=re.escape("do: input check found NaN at [0, 6, 1, 2]")):
        torch.autograd.grad(o, leaves, do)


def test_check_inputs_of_the_operator_itself():
    k = X["k"].clone()
    k[0, 1, 0, 0] = float("nan")
    args = (X["q"], k, X["v"], X["g"], X["initial_state"], None, None, 0.3, False, True, "", 0)
    torch.ops.gla.chunk_fwd(*args)
    with pytest.raises(RuntimeError, match=re.escape("k: input check found NaN at [0, 1, 0, 0]")):
        torch.ops.gla.chunk_fwd(*args, check_inputs=True)
