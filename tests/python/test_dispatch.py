"""Dispatch from Python: the `fastest` policy (gla.tune ahead of time, chunk_gla under
gla.policy("fastest") served by the measured winner, the torch backend among the candidates)."""
import re

import gla
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
