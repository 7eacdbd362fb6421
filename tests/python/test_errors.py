"""Every error path of the Python surface: libgla's message surfaces as ValueError (invalid
argument), TypeError (dtype problems) or RuntimeError (nothing can serve / a backend failed), and a
failure inside the torch backend's callback becomes an error, never a crash."""
import re

import pytest
import torch

import gla
from gla import _chunked
from oracle import make_inputs

X = make_inputs(B=2, T=10, H=2, K=8)
q, k, v, g, h0 = X["q"], X["k"], X["v"], X["g"], X["initial_state"]
q1, k1, v1, g1 = q[:1], k[:1], v[:1], g[:1]


def expect(exc, pattern, fn):
    with pytest.raises(exc, match=pattern):
        fn()


CASES = {
    "q-rank": (ValueError, r"^q:", lambda: gla.chunk_gla(q[0], k, v, g)),
    "k-shape": (ValueError, r"^k:", lambda: gla.chunk_gla(q, k[:, :5], v, g)),
    "v-shape": (ValueError, r"^v:", lambda: gla.chunk_gla(q, k, v[:, :5], g)),
    "g-shape": (ValueError, r"^g:", lambda: gla.chunk_gla(q, k, v, g[..., :4])),
    "k-dtype": (TypeError, r"^k: expected dtype float32", lambda: gla.chunk_gla(q, k.half(), v, g)),
    "v-dtype": (TypeError, r"^v: expected dtype", lambda: gla.chunk_gla(q, k, v.bfloat16(), g)),
    "q-int": (TypeError, r"^q: expected dtype", lambda: gla.chunk_gla(q.int(), k.int(), v.int(), g.int())),
    "q-int8": (TypeError, r"^q: expected dtype", lambda: gla.chunk_gla(q.to(torch.int8), k, v, g)),
    "g-dtype": (TypeError, r"^g: expected dtype float16", lambda: gla.chunk_gla(q.half(), k.half(), v.half(), g.bfloat16())),
    "state-dtype": (TypeError, r"^initial_state: expected dtype float32",
                    lambda: gla.chunk_gla(q, k, v, g, initial_state=h0.half())),
    "state-count": (ValueError, r"^initial_state: expected shape \[2, 2, 8, 8\]",
                    lambda: gla.chunk_gla(q, k, v, g, initial_state=h0[:1])),
    "state-v-first-shape": (ValueError, r"^initial_state: .*state_v_first",
                            lambda: gla.chunk_gla(q, k, v[..., :4], g, initial_state=h0[..., :4], state_v_first=True)),
    "cu-batch": (ValueError, r"^cu_seqlens: requires B == 1",
                 lambda: gla.chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 5, 10]))),
    "cu-first": (ValueError, r"^cu_seqlens: expected first entry 0",
                 lambda: gla.chunk_gla(q1, k1, v1, g1, cu_seqlens=torch.tensor([1, 5, 10]))),
    "cu-decreasing": (ValueError, r"^cu_seqlens: expected non-decreasing",
                      lambda: gla.chunk_gla(q1, k1, v1, g1, cu_seqlens=torch.tensor([0, 6, 5, 10]))),
    "cu-last": (ValueError, r"^cu_seqlens: expected last entry T = 10",
                lambda: gla.chunk_gla(q1, k1, v1, g1, cu_seqlens=torch.tensor([0, 5, 9]))),
    "cu-dtype": (TypeError, r"^cu_seqlens: expected dtype int32 or int64",
                 lambda: gla.chunk_gla(q1, k1, v1, g1, cu_seqlens=torch.tensor([0.0, 5, 10]))),
    "cu-rank": (ValueError, r"^cu_seqlens: expected shape",
                lambda: gla.chunk_gla(q1, k1, v1, g1, cu_seqlens=torch.tensor([[0, 5, 10]]))),
    "cu-host-length": (ValueError, r"^cu_seqlens_host:",
                       lambda: gla.chunk_gla(q1, k1, v1, g1, cu_seqlens=torch.tensor([0, 5, 10]), cu_seqlens_cpu=[0, 10])),
    "cu-host-values": (ValueError, r"^cu_seqlens: expected last entry",
                       lambda: gla.chunk_gla(q1, k1, v1, g1, cu_seqlens=torch.tensor([0, 5, 10]),
                                             cu_seqlens_cpu=[0, 5, 9])),
    "state-count-varlen": (ValueError, r"^initial_state: expected shape \[2,",
                           lambda: gla.chunk_gla(q1, k1, v1, g1, initial_state=h0[:1],
                                                 cu_seqlens=torch.tensor([0, 5, 10]))),
    "K-zero": (ValueError, r"^q: expected K \(dim 3\) > 0",
               lambda: gla.chunk_gla(q[..., :0], k[..., :0], v, g[..., :0])),
    "V-zero": (ValueError, r"^v: expected V \(dim 3\) > 0", lambda: gla.chunk_gla(q, k, v[..., :0], g)),
    "not-a-tensor": (TypeError, r"^q: expected a torch.Tensor", lambda: gla.chunk_gla(q.numpy(), k, v, g)),
    "g-none": (TypeError, r"^g: expected a torch.Tensor, got NoneType", lambda: gla.chunk_gla(q, k, v, None)),
    "unknown-keyword": (TypeError, r"unexpected keyword", lambda: gla.chunk_gla(q, k, v, g, head_first=True)),
    "bad-policy": (ValueError, r"^policy: expected one of", lambda: gla.policy("bogus").__enter__()),
    "enable-unknown": (ValueError, r"no backend named 'nope'", lambda: gla.set_backend_enabled("nope", False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_error(case):
    exc, pattern, fn = CASES[case]
    expect(exc, pattern, fn)


def test_unknown_backend_names_the_known_ones():
    with gla.backend("nope"):
        with pytest.raises(ValueError, match=r"backend: expected one of .*reference.*got 'nope'"):
            gla.chunk_gla(q, k, v, g)


def test_forced_policy_needs_a_backend():
    with gla.policy("forced"):
        with pytest.raises(ValueError, match=r"policy: 'forced' needs a backend name"):
            gla.chunk_gla(q, k, v, g)


def test_float64_forced_to_a_native_backend():
    with gla.backend("reference"):
        with pytest.raises(TypeError, match=r"float64 is served only by the 'torch' backend"):
            gla.chunk_gla(q.double(), k.double(), v.double(), g.double())


def test_nothing_can_serve_lists_every_backend():
    names = [b.name for b in gla.backends() if b.available]
    for name in names:
        gla.set_backend_enabled(name, False)
    try:
        with pytest.raises(RuntimeError) as info:
            gla.chunk_gla(q, k, v, g)
        message = str(info.value)
        assert message.startswith("no available backend accepts chunk_fwd")
        for name in names:
            assert re.search(rf"backend '{name}' .*disabled", message), message
    finally:
        for name in names:
            gla.set_backend_enabled(name, True)
    gla.chunk_gla(q, k, v, g)  # and everything serves again


def test_exception_inside_torch_backend_becomes_an_error(monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted failure")

    monkeypatch.setattr(_chunked, "chunk_forward", broken)
    with gla.backend("torch"):
        with pytest.raises(RuntimeError, match=r"backend 'torch' failed: ZeroDivisionError: planted failure"):
            gla.chunk_gla(q, k, v, g)
    monkeypatch.undo()
    with gla.backend("torch"):
        gla.chunk_gla(q, k, v, g)  # the backend still works afterwards


def test_exception_inside_torch_backend_backward(monkeypatch):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    with gla.backend("torch"):
        o, _ = gla.chunk_gla(*leaves)
    monkeypatch.setattr(_chunked, "chunk_backward", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("planted")))
    with pytest.raises(MemoryError, match=r"planted"):
        o.sum().backward()


def test_out_of_memory_in_callback_maps_to_memory_error(monkeypatch):
    monkeypatch.setattr(_chunked, "chunk_forward", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("no room")))
    with gla.backend("torch"):
        with pytest.raises(MemoryError, match="no room"):
            gla.chunk_gla(q, k, v, g)
