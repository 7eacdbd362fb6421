"""The registry from Python: backends(), explain(), gla.backend() / gla.policy() selection, the
`torch` backend's place in the native registry, and the descriptor <-> tensor bridge."""
import pathlib
import re
import threading

import pytest
import torch

import gla
from gla import _chunked, _lib, _tensors
from oracle import make_inputs, rel, run_gla

X = make_inputs(B=2, T=70, H=2, K=16, seed=5)


def test_backends_lists_torch_and_reference():
    infos = gla.backends()
    names = [b.name for b in infos]
    assert "reference" in names and "torch" in names
    torch_info = infos[names.index("torch")]
    assert torch_info.priority == 80 and torch_info.available and torch_info.reason == ""
    assert [b.priority for b in infos] == sorted(b.priority for b in infos)
    assert gla.library_path().endswith((".so", ".dylib", ".dll"))
    assert gla.version()


def test_version_is_the_cmake_project_version():
    # One source: CMakeLists.txt's project() line (pyproject.toml reads it too).
    cmake = (pathlib.Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    assert gla.version() == re.search(r"project\(libgla VERSION ([0-9.]+)", cmake).group(1)


def test_explain_forward_and_backward():
    text = gla.explain(X["q"], X["k"], X["v"], X["g"], initial_state=X["initial_state"], output_final_state=True)
    assert text.startswith("problem: chunk_fwd B=2 T=70 H=2 K=16 V=16 N=2")
    assert "+initial_state +final_state" in text
    assert "backend 'torch' (priority 80): available, enabled" in text
    assert "decision:" in text
    text = gla.explain(X["q"], X["k"], X["v"], X["g"], backward=True)
    assert text.startswith("problem: chunk_bwd")
    assert "bwd_dqkg" in text


def test_explain_shows_forced_backend_and_policy():
    with gla.backend("torch"):
        text = gla.explain(X["q"], X["k"], X["v"], X["g"])
    assert "forced backend 'torch'" in text
    assert text.rstrip().endswith("decision: torch (whole operation)")
    with gla.policy("fastest"):
        assert "policy: fastest" in gla.explain(X["q"], X["k"], X["v"], X["g"])


def test_explain_varlen():
    x = make_inputs(B=1, T=40, H=2, K=8, cu_seqlens=[0, 10, 40])
    text = gla.explain(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                       output_final_state=True)
    assert "N=2 varlen" in text


def test_explain_rejects_bad_input():
    with pytest.raises(ValueError, match=r"^k:"):
        gla.explain(X["q"], X["k"][:, :3], X["v"], X["g"])


def _counting(monkeypatch):
    calls = []
    for fn in ("chunk_forward", "chunk_backward"):
        original = getattr(_chunked, fn)

        def wrapper(*a, _original=original, _fn=fn, **kw):
            calls.append(_fn)
            return _original(*a, **kw)

        monkeypatch.setattr(_chunked, fn, wrapper)
    return calls


def test_forced_torch_backend_serves_forward_and_backward(monkeypatch):
    calls = _counting(monkeypatch)
    got = run_gla(X, backend="torch")
    assert calls == ["chunk_forward", "chunk_backward"]
    calls.clear()
    ref = run_gla(X, backend="reference")
    assert calls == []
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-5


def test_backward_keeps_the_forward_selection_outside_the_block(monkeypatch):
    calls = _counting(monkeypatch)
    leaves = [X[n].clone().requires_grad_() for n in ("q", "k", "v", "g")]
    with gla.backend("torch"):
        o, _ = gla.chunk_gla(*leaves)
    o.sum().backward()  # outside the block: still the torch backend
    assert calls == ["chunk_forward", "chunk_backward"]


def test_torch_backend_is_chosen_when_native_backends_are_off(monkeypatch):
    calls = _counting(monkeypatch)
    natives = [b.name for b in gla.backends() if b.name != "torch" and b.available]
    for name in natives:
        gla.set_backend_enabled(name, False)
    try:
        text = gla.explain(X["q"], X["k"], X["v"], X["g"])
        assert text.rstrip().endswith("decision: torch (whole operation)")
        run_gla(X)
        assert calls == ["chunk_forward", "chunk_backward"]
        assert not [b for b in gla.backends() if b.name in natives and b.available]
    finally:
        for name in natives:
            gla.set_backend_enabled(name, True)


def test_selection_is_thread_local():
    seen = {}

    def other():
        seen["backend"] = gla._ops.current_backend()

    with gla.backend("torch"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert gla._ops.current_backend() == "torch"
    assert seen["backend"] == ""
    assert gla._ops.current_backend() == ""


def test_nested_selection_restores():
    with gla.backend("torch"):
        with gla.backend("reference"):
            assert gla._ops.current_backend() == "reference"
        assert gla._ops.current_backend() == "torch"
        with gla.backend(None):
            assert gla._ops.current_backend() == ""
    with gla.policy("priority"):
        assert gla._ops.current_policy() == _lib.POLICY_PRIORITY
    assert gla._ops.current_policy() == _lib.POLICY_DEFAULT


def test_policy_fastest_and_priority_compute_the_same():
    base = run_gla(X)
    for name in ("priority", "fastest", "default"):
        with gla.policy(name):
            got = run_gla(X)
        for a, b in zip(got, base):
            assert rel(a, b) < 1e-6


def test_unit_level_backend_spec_mixes_backends():
    """A per-unit spec passes through to the dispatcher: the forward's stages from one backend."""
    with gla.backend("fwd_h=reference"):
        text = gla.explain(X["q"], X["k"], X["v"], X["g"])
    assert "fwd_h forced to 'reference'" in text
    with gla.backend("fwd_h=reference"):
        got = run_gla(X)
    for a, b in zip(got, run_gla(X, backend="reference")):
        assert rel(a, b) < 1e-5


def test_descriptor_round_trip_and_dlpack_fallback():
    t = torch.randn(3, 5, 4)[:, 1:4]  # a strided view
    d = _tensors.describe("t", t)
    assert d.rank == 3 and list(d.sizes)[:3] == [3, 3, 4] and list(d.strides)[:3] == [20, 4, 1]
    with _tensors.handed_over(t):
        same = _tensors.to_torch(d)
    assert same.data_ptr() == t.data_ptr() and torch.equal(same, t)
    wrapped = _tensors.to_torch(d)  # nothing handed over: the DLPack path
    assert wrapped.data_ptr() == t.data_ptr() and wrapped.stride() == t.stride() and torch.equal(wrapped, t)
    wrapped.fill_(1.5)
    assert (t == 1.5).all()
    del wrapped  # PyTorch calls our deleter; the keep-alive table empties
    import gc
    gc.collect()
    assert not _tensors._alive
    for dtype in (torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64):
        x = torch.arange(6).to(dtype)
        assert torch.equal(_tensors.to_torch(_tensors.describe("x", x)), x)


def test_torch_backend_reregistration_is_harmless():
    from gla import torch_backend
    torch_backend.unregister()
    assert "torch" not in [b.name for b in gla.backends()]
    torch_backend.register()
    assert "torch" in [b.name for b in gla.backends()]
    run_gla(X, backend="torch")


def _explain_raw(device_type, hand_over):
    """gla_explain on descriptors that claim `device_type` (metadata only: nothing is read)."""
    import ctypes
    q = torch.rand(1, 32, 2, 16)
    ds = []
    for _ in range(4):
        d = _tensors.describe("q", q)
        d.device_type = device_type
        ds.append(d)
    lib = _lib.library()
    opts = _lib.make_options(0.25, False, "", 0)
    text = ctypes.c_char_p()
    args = _lib.ForwardArgs(*[ctypes.pointer(d) for d in ds])
    with _tensors.handed_over(q if hand_over else None):
        _lib.raise_for(lib.gla_explain(ctypes.byref(args), None, ctypes.byref(opts), ctypes.byref(text)))
    return text.value.decode()


@pytest.mark.parametrize("device_type,label", [(_lib.DEVICE_EXT, "ext"), (_lib.DEVICE_METAL, "metal"),
                                               (_lib.DEVICE_ONEAPI, "oneapi")])
def test_torch_backend_serves_devices_no_native_backend_serves(device_type, label):
    """An Ascend NPU / MPS / XPU tensor from PyTorch: no native backend serves the device, the torch
    backend takes it. Called from C (nothing handed over) it declines, saying why."""
    text = _explain_raw(device_type, hand_over=True)
    assert text.rstrip().endswith("decision: torch (whole operation)"), text
    text = _explain_raw(device_type, hand_over=False)
    assert "can be wrapped only when the call comes from PyTorch" in text
    assert "decision: none" in text


def _example_plugin():
    """The C example plugin built beside libgla (tests/cpp/example_plugin.c), or None."""
    import os

    lib_dir = os.path.dirname(gla.library_path())
    for candidate in (os.path.join(lib_dir, "tests", "cpp", "libgla_example_plugin.so"),):
        if os.path.exists(candidate):
            return candidate
    return None


def test_load_plugin_adds_a_backend_that_can_be_forced():
    path = _example_plugin()
    if path is None:
        pytest.skip("the example plugin is built with the C++ tests (build/tests/cpp); not found beside libgla")
    gla.load_plugin(path)
    try:
        assert "example_plugin" in [b.name for b in gla.backends()]
        torch.manual_seed(0)
        q, k = torch.rand(1, 40, 2, 16), torch.rand(1, 40, 2, 16)
        v = torch.rand(1, 40, 2, 8)
        g = torch.nn.functional.logsigmoid(torch.rand(1, 40, 2, 16))
        with torch.no_grad():
            with gla.backend("example_plugin"):
                o, _ = gla.chunk_gla(q, k, v, g)
            with gla.backend("reference"):
                ref, _ = gla.chunk_gla(q, k, v, g)
        assert torch.equal(o, ref)
    finally:  # leave the registry as the other tests expect it
        from gla import _lib
        _lib.raise_for(_lib.library().gla_unregister_backend(b"example_plugin"))
    with pytest.raises(ValueError, match="cannot load plugin"):
        gla.load_plugin("/nonexistent/libnothing.so")
