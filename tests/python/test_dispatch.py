"""Dispatch from Python: the `fastest` policy (gla.tune ahead of time, chunk_gla under
gla.policy("fastest") served by the measured winner, the torch backend among the candidates) and the
declared capabilities (gla.capabilities), tested by looping over gla.backends()."""
import pathlib
import re

import pytest
import torch

import gla
from gla import _ops
from oracle import make_inputs, rel, run_gla

X = make_inputs(B=1, T=150, H=2, K=16, seed=11)


def _times(text):
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^    (\S+): ([0-9.]+) ms", text, re.M)}


def test_tune_times_every_candidate_and_chunk_gla_uses_the_winner():
    names = [b.name for b in gla.backends() if b.available]
    text = gla.tune(X["q"], X["k"], X["v"], X["g"], initial_state=X["initial_state"], output_final_state=True)
    times = _times(text)
    # Every available backend that accepts a host problem was timed (torch among them).
    assert set(times) == {n for n in names if n in ("cpu", "torch", "reference")}, text
    assert all(t > 0 for t in times.values()), text
    winner = re.search(r"^    (\S+): [0-9.]+ ms  <- winner", text, re.M).group(1)
    assert times[winner] <= 1.05 * min(times.values()), text
    assert f"decision: {winner} (whole operation)" in text
    with gla.policy("fastest"):
        explained = gla.explain(X["q"], X["k"], X["v"], X["g"], initial_state=X["initial_state"],
                                output_final_state=True)
        assert "measured (in this process" in explained and f"decision: {winner}" in explained
        got = run_gla(X)
    want = run_gla(X, backend="reference")
    for a, b in zip(got, want):
        if b is not None:
            assert rel(a, b) < 1e-5


def test_tune_backward():
    text = gla.tune(X["q"], X["k"], X["v"], X["g"], initial_state=X["initial_state"], output_final_state=True,
                    backward=True)
    assert text.startswith("problem: chunk_bwd") and "<- winner" in text, text
    assert len(_times(text)) >= 2


def test_tune_refuses_a_forced_backend():
    with gla.backend("cpu" if any(b.name == "cpu" for b in gla.backends()) else "reference"):
        try:
            gla.tune(X["q"], X["k"], X["v"], X["g"])
        except ValueError as e:
            assert "tune: expected no forced backend" in str(e)
        else:
            raise AssertionError("tune with a forced backend was accepted")


# ---- declared capabilities, looping over gla.backends() ----
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 5e-3}


def _host_chunk_records():
    """(backend, record) for every available backend's records that serve the whole chunked
    operation on host memory."""
    for info in gla.backends():
        if not info.available:
            continue
        for record in gla.capabilities(info.name):
            if "cpu" in record["devices"] and "chunk_fwd" in record["units"] and "chunk_bwd" in record["units"]:
                yield info.name, record


def test_every_backend_declares_something():
    for info in gla.backends():
        records = gla.capabilities(info.name)
        assert records, info.name
        for r in records:
            assert r["units"] and r["devices"] and r["dtypes"] and r["k"][0] >= 1, (info.name, r)


def test_declared_ranges_run_and_match_reference():
    seen = set()
    for name, record in _host_chunk_records():
        seen.add(name)
        K = record["k"][1] or 24
        V = record["v"][1] or 20
        for dtype in record["dtypes"]:
            if dtype not in record["gate_dtypes"] and "float32" not in record["gate_dtypes"]:
                continue
            x = make_inputs(B=2, T=45, H=2, K=K, V=V, dtype=_DTYPES[dtype], seed=3,
                            initial_state="initial_state" in record["features"])
            got = run_gla(x, output_final_state="final_state" in record["features"], backend=name)
            want = run_gla(x, output_final_state="final_state" in record["features"], backend="reference")
            for a, b in zip(got, want):
                if b is not None:
                    assert rel(a, b) < _TOL[dtype], (name, dtype)
    assert {"reference", "torch"} <= seen


# The vendor example, built against the installed package by the CTest ExamplePlugin.SDK (which
# CI runs before pytest).
_EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "build" / "sdk" / "plugin" / "libgla_example_stage.so"


@pytest.fixture
def example_plugin():
    if not _EXAMPLE.exists():
        pytest.skip(f"{_EXAMPLE} not built: the CTest ExamplePlugin.SDK builds it")
    gla.load_plugin(str(_EXAMPLE))
    yield "example_stage"
    _ops.ensure_loaded().gla_unregister_backend(b"example_stage")


def test_declared_limits_decline_with_the_reason(example_plugin):
    """Every available backend's host records, whole operation or stage: just past a declared K or
    V, or in an undeclared dtype or gate dtype, the forced call fails naming it."""
    checked = 0
    for info in gla.backends():
        for record in gla.capabilities(info.name) if info.available else []:
            if "cpu" not in record["devices"]:
                continue
            unit = record["units"][0]
            spec = info.name if unit in ("chunk_fwd", "chunk_bwd") else f"{unit}={info.name}"
            k, v = record["k"][0], record["v"][0]
            probes = []
            if record["k"][1]:
                probes.append((dict(K=record["k"][1] + 1, V=v), f"K={record['k'][1] + 1} outside the declared"))
            if record["v"][1]:
                probes.append((dict(K=k, V=record["v"][1] + 1), f"V={record['v'][1] + 1} outside the declared"))
            for dtype in set(_DTYPES) - set(record["dtypes"]):
                probes.append((dict(K=k, V=v, dtype=_DTYPES[dtype], gate_dtype=torch.float32), f"dtype {dtype} not declared"))
            for dtype in set(record["dtypes"]) - set(record["gate_dtypes"]) - {"float32"}:
                probes.append((dict(K=k, V=v, dtype=_DTYPES[dtype]), f"g dtype {dtype} not declared"))
            for kwargs, reason in probes:
                x = make_inputs(B=1, T=20, H=1, seed=4, **kwargs)
                with pytest.raises((ValueError, TypeError, RuntimeError), match=reason):
                    run_gla(x, backend=spec)
                checked += 1
    assert checked >= 2  # the example plug-in's K limit and its gate dtype at least


def test_example_plugin_mixes_its_stage_with_the_built_in_backends(example_plugin):
    x = make_inputs(B=1, T=150, H=2, K=16, gate_dtype=torch.float32, seed=8)
    text = gla.explain(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"], output_final_state=True)
    assert "decision: stage pipeline: cumsum->example_stage" in text, text
    got, want = run_gla(x), run_gla(x, backend="reference")
    for a, b in zip(got, want):
        if b is not None:
            assert rel(a, b) < 1e-5


def test_explain_prints_the_declarations():
    text = gla.explain(X["q"], X["k"], X["v"], X["g"])
    for info in gla.backends():
        block = text.split(f"backend '{info.name}' (priority {info.priority})", 1)[1]
        assert block.split("\n", 2)[1].startswith("    declares "), info.name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU `fastest` check runs on an NVIDIA GPU")
def test_fastest_picks_cuda_for_a_gpu_input():
    """On a GPU the candidates are `cuda` and `torch` (reference serves host memory only), timed with
    CUDA events on the current stream: the cuda kernels win and explain() shows both times."""
    if not any(b.name == "cuda" and b.available for b in gla.backends()):
        pytest.skip("this libgla has no usable cuda backend")
    x = make_inputs(B=2, T=4096, H=16, K=128, dtype=torch.bfloat16, gate_dtype=torch.float32, seed=2, device="cuda")
    text = gla.tune(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"], output_final_state=True)
    print(text)
    times = _times(text)
    assert {"cuda", "torch"} <= set(times), text
    assert "decision: cuda (whole operation)" in text, text
    back = gla.tune(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"], output_final_state=True,
                    backward=True)
    print(back)
    assert "decision: cuda (whole operation)" in back, back
    with gla.policy("fastest"):
        got = run_gla(x)
    want = run_gla(x, backend="torch")
    for a, b in zip(got, want):
        if b is not None:
            assert rel(a, b) < 2e-2
