"""The native operators (libgla_torch: gla/csrc/, PyTorch's stable C ABI): that they are the ones
serving CPU (and CUDA) tensors, that the eager fast routes compute what the registered autograd
computes, that their errors come back as the right Python classes, and the ctypes fallback with its
warning when the library cannot load."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gla
from gla import _lib, _native, _ops
from oracle import make_inputs, rel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_native = pytest.mark.skipif(_ops.native_path is None,
                                  reason="libgla_torch is not built beside libgla (needs torch at build time)")
X = make_inputs(B=2, T=70, H=2, K=16, V=8, seed=21)
LEAVES = ("q", "k", "v", "g", "initial_state")


def _op_args(x, output_final_state=True):
    return (x["q"], x["k"], x["v"], x["g"], x["initial_state"], x["cu_seqlens"], None, 0.25, x["state_v_first"],
            output_final_state, "", 0)


@needs_native
def test_cpu_and_cuda_kernels_are_the_native_ones():
    """The dispatcher's table: CPU and CUDA kernels from gla/csrc/chunk_ops.cpp, the Python kernels
    only for the devices without a C++ one, fake (Meta) and autograd from Python."""
    for op in ("gla::chunk_fwd", "gla::chunk_fwd_no_autograd", "gla::chunk_bwd"):
        table = dict(line.split(": registered at ", 1) for line in torch._C._dispatch_dump(op).splitlines()
                     if ": registered at " in line)
        for key in ("CPU", "CUDA"):
            assert "chunk_ops.cpp" in table[key], table
        for key in ("MPS", "XPU", "PrivateUse1", "Meta") + (("Autograd[alias]",) if op == "gla::chunk_fwd" else ()):
            assert "_ops.py" in table[key], table
        if op == "gla::chunk_fwd_no_autograd":
            assert "fallthrough" in torch._C._dispatch_dump(op).split("Autograd[alias]: ")[1].splitlines()[0]
    assert _native.load()[0] == _ops.native_path  # loading again is harmless


def _grads(fn, x):
    leaves = [x[n].detach().clone().requires_grad_() for n in LEAVES]
    o, ht = fn(*leaves)
    grads = torch.autograd.grad([o, ht], leaves, [x["do"], x["dht"]])
    return [o.detach(), ht.detach(), *grads]


@pytest.mark.parametrize("config", ["batch", "varlen"])
def test_eager_route_equals_registered_autograd(config):
    """gla.chunk_gla in eager mode runs the op below the autograd key inside its own
    autograd.Function; calling the op itself goes through the autograd registered with
    torch.library. Both give the same tensors, bit for bit."""
    kw = dict(B=1, T=90, H=2, K=16, V=8, cu_seqlens=[0, 30, 90]) if config == "varlen" else dict(B=2, T=70, H=2,
                                                                                                 K=16, V=8)
    x = make_inputs(**kw, seed=22)

    def wrapper(q, k, v, g, h0):
        return gla.chunk_gla(q, k, v, g, scale=0.25, initial_state=h0, output_final_state=True,
                             cu_seqlens=x["cu_seqlens"])

    def registered(q, k, v, g, h0):
        return torch.ops.gla.chunk_fwd(q, k, v, g, h0, x["cu_seqlens"], None, 0.25, False, True, "", 0)

    for a, b in zip(_grads(wrapper, x), _grads(registered, x)):
        assert torch.equal(a, b)


def test_graph_only_when_a_gradient_is_wanted():
    leaves = [X[n].clone().requires_grad_() for n in LEAVES]
    o, _ = gla.chunk_gla(*leaves[:4])
    assert o.requires_grad and o.grad_fn is not None
    with torch.no_grad():
        o, _ = gla.chunk_gla(*leaves[:4])
    assert not o.requires_grad
    o, ht = gla.chunk_gla(X["q"], X["k"], X["v"], X["g"], initial_state=X["initial_state"], output_final_state=True)
    assert not o.requires_grad and not ht.requires_grad
    with torch.inference_mode():
        o, _ = gla.chunk_gla(X["q"], X["k"], X["v"], X["g"])
    ref, _ = gla.chunk_gla(X["q"], X["k"], X["v"], X["g"])
    assert torch.equal(o, ref)


def test_eager_routes_call_the_forward_without_autograd_formula():
    """Eager calls run gla::chunk_fwd_no_autograd (no below-autograd guard needed), with a gradient
    inside _ChunkFwd; the registered gla::chunk_fwd is what torch.compile and torch.func see."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    leaves = [X[n].clone().requires_grad_() for n in LEAVES]
    for grad in (False, True):
        with torch.set_grad_enabled(grad), Log() as log:
            o, _ = gla.chunk_gla(*leaves[:4])
        assert [op for op in log.ops if op.startswith("gla.")] == ["gla.chunk_fwd_no_autograd.default"], log.ops
        assert (o.grad_fn is not None) == grad


@pytest.mark.parametrize("K", [8, 60, 100, 128])
def test_default_scale_of_the_operator_is_pythons(K):
    """The no-argument route leaves scale to the kernel (K ** -0.5 in C++): bitwise the result of
    passing Python's K ** -0.5."""
    x = make_inputs(B=1, T=33, H=2, K=K, V=8, seed=K)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    with torch.no_grad():
        assert torch.equal(gla.chunk_gla(q, k, v, g)[0], gla.chunk_gla(q, k, v, g, scale=K ** -0.5)[0])
        assert torch.equal(torch.ops.gla.chunk_fwd_no_autograd(q, k, v, g)[0],
                           torch.ops.gla.chunk_fwd(q, k, v, g, None, None, None, K ** -0.5)[0])
        assert not torch.equal(gla.chunk_gla(q, k, v, g)[0], gla.chunk_gla(q, k, v, g, scale=0.5 * K ** -0.5)[0])


def test_only_initial_state_requires_grad():
    h0 = X["initial_state"].clone().requires_grad_()
    o, _ = gla.chunk_gla(X["q"], X["k"], X["v"], X["g"], initial_state=h0)
    (dh0,) = torch.autograd.grad(o, [h0], X["do"])
    leaves = [X[n].clone().requires_grad_() for n in LEAVES]
    o2, _ = gla.chunk_gla(*leaves[:4], initial_state=leaves[4])
    assert torch.equal(dh0, torch.autograd.grad(o2, [leaves[4]], X["do"])[0])


@needs_native
@pytest.mark.parametrize("case,cls,pattern", [
    ("rank", ValueError, r"^q: expected rank 4"),
    ("dtype", TypeError, r"^k: expected dtype float32"),
    ("int8", TypeError, r"^q: expected dtype float32, float16, bfloat16, int32 or int64, got torch.int8"),
    ("float64", TypeError, r"^q: expected dtype"),
    ("cu-values", ValueError, r"^cu_seqlens: expected last entry T = 10"),
])
def test_errors_of_the_operator_itself(case, cls, pattern):
    """The C++ kernels can only raise RuntimeError through the stable ABI; the message names the
    class, which gla.chunk_gla raises (and _lib.python_error recovers for direct calls)."""
    x = make_inputs(B=1, T=10, H=1, K=8)
    args = list(_op_args(x, output_final_state=False))
    if case == "rank":
        args[0] = x["q"][0]
    elif case == "dtype":
        args[1] = x["k"].half()
    elif case == "int8":
        args[0] = x["q"].to(torch.int8)
    elif case == "float64":
        args[:4] = [t.double() for t in args[:4]]
    else:
        args[5] = torch.tensor([0, 4, 9])
        args[4] = None
    with pytest.raises(RuntimeError) as info:
        torch.ops.gla.chunk_fwd(*args)
    assert str(info.value).startswith(f"[gla:{cls.__name__}] ")
    error = _lib.python_error(info.value)
    assert type(error) is cls
    import re
    assert re.search(pattern, str(error)), str(error)
    assert _lib.python_error(RuntimeError("unrelated")).args == ("unrelated",)


def test_backward_errors_keep_their_class(monkeypatch):
    from gla import _chunked
    leaves = [X[n].clone().requires_grad_() for n in ("q", "k", "v", "g")]
    with gla.backend("torch"):
        o, _ = gla.chunk_gla(*leaves)
    monkeypatch.setattr(_chunked, "chunk_backward", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(MemoryError, match=r"no room"):
        o.sum().backward()


def test_failed_load_reports_why(monkeypatch, tmp_path):
    bogus = tmp_path / "libgla_torch.so"
    bogus.write_text("not a shared library")
    monkeypatch.setattr(_native, "_candidates", lambda _: [str(bogus), str(tmp_path / "absent.so")])
    path, why = _native.load()
    assert path is None
    assert str(bogus) in why and "absent.so (not found)" in why


def test_ctypes_fallback_warns_and_serves():
    """GLA_NATIVE_OPS=0: the operators are defined in Python over ctypes, with a warning saying so;
    results equal the native ones, opcheck passes, torch.compile traces them."""
    script = textwrap.dedent("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import gla
        import torch
        from gla import _ops
        from oracle import make_inputs, rel, run_gla
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert _ops.native_path is None
        assert any("ctypes fallback" in m and "GLA_NATIVE_OPS=0" in m for m in messages), messages
        x = make_inputs(B=1, T=40, H=2, K=8, cu_seqlens=[0, 7, 40], seed=3)
        for a, b in zip(run_gla(x), run_gla(x, backend="reference")):
            assert rel(a, b) < 1e-5
        args = (x["q"].requires_grad_(), x["k"], x["v"], x["g"], x["initial_state"], x["cu_seqlens"], None, 0.3,
                False, True, "", 0)
        torch.library.opcheck(torch.ops.gla.chunk_fwd.default, args)
        try:
            gla.chunk_gla(x["q"][0], x["k"], x["v"], x["g"])
        except ValueError as e:
            assert str(e).startswith("q:"), e
        else:
            raise AssertionError("no ValueError")
        f = torch.compile(lambda q, k, v, g: gla.chunk_gla(q, k, v, g)[0].sum(), fullgraph=True, backend="aot_eager")
        assert rel(f(x["q"], x["k"], x["v"], x["g"]), gla.chunk_gla(x["q"], x["k"], x["v"], x["g"])[0].sum()) < 1e-6
        print("fallback ok")
    """)
    run_with_ctypes_fallback(script)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: GPU tests need an NVIDIA GPU (run `pytest tests/python -m cuda` on one)")
def test_cuda_ctypes_fallback_saves_chunk_states():
    """The ctypes fallback's chunk_fwd_saving_states saves the cuda backend's bf16 chunk states as
    the native kernel does, and chunk_bwd reads them: the same gradients as without them."""
    script = textwrap.dedent("""
        import warnings
        warnings.simplefilter("ignore")
        import gla, torch
        from gla import _ops
        from oracle import make_inputs, rel
        assert _ops.native_path is None
        if "cuda" not in [b.name for b in gla.backends() if b.available]:
            print("fallback ok")
            raise SystemExit
        x = {n: t.cuda() if isinstance(t, torch.Tensor) else t
             for n, t in make_inputs(B=2, T=300, H=2, K=64, V=128, dtype=torch.bfloat16, seed=4).items()}
        args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"], None, None, 0.125, False, True, "", 0, False)
        o, ht, states = torch.ops.gla.chunk_fwd_saving_states(*args)
        assert states.shape == (10, 2, 64, 128) and states.dtype == torch.bfloat16, states.shape
        assert torch.equal(o, torch.ops.gla.chunk_fwd(*args)[0])
        bwd = args[:7] + (x["do"], x["dht"], 0.125, False, "", 0, False)
        for a, b in zip(torch.ops.gla.chunk_bwd(*bwd, states), torch.ops.gla.chunk_bwd(*bwd)):
            assert rel(a.float(), b.float()) < 5e-3
        print("fallback ok")
    """)
    run_with_ctypes_fallback(script)


def run_with_ctypes_fallback(script: str) -> None:
    """Runs script in a child Python with GLA_NATIVE_OPS=0 (the same libgla); it must print
    "fallback ok"."""
    env = dict(os.environ, GLA_NATIVE_OPS="0",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), os.path.dirname(__file__),
                                           os.environ.get("PYTHONPATH", "")]))
    env.setdefault("GLA_LIBRARY", gla.library_path())
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fallback ok" in done.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: GPU tests need an NVIDIA GPU (run `pytest tests/python -m cuda` on one)")
def test_cuda_native_kernels_use_the_current_stream():
    """On a side stream the C++ kernels queue their work there (the stream comes from PyTorch's C
    shim), so the result equals the default stream's after the side stream is waited for."""
    x = make_inputs(B=2, T=200, H=2, K=64, seed=5, dtype=torch.bfloat16)
    dev = {n: x[n].cuda() for n in LEAVES}
    leaves = [dev[n].clone().requires_grad_() for n in LEAVES]
    o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True)
    want = [o, ht, *torch.autograd.grad([o, ht], leaves, [x["do"].cuda(), x["dht"].cuda()])]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # a queue ahead of the call: a wrong stream would read early
        leaves = [dev[n].clone().requires_grad_() for n in LEAVES]
        o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True)
        got = [o, ht, *torch.autograd.grad([o, ht], leaves, [x["do"].cuda(), x["dht"].cuda()])]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-6
