"""The `torch` backend's own properties: g = -inf hard resets and strong decay against the fp64 token
loop (on CPU, and on CUDA with the marker `cuda`), bounded intermediates (no tensor much larger than
the inputs), blocks of scan steps and CPU worker threads (also after a fork) giving the same result,
scratch buffers kept between calls never read before written,
every stage unit on its own inside a `reference` stage pipeline, and a plug-in stage registered from
Python mixed with `torch` stages in one call."""
import os
import signal

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gla
from gla import _chunked, _scratch, _torch_stages
from oracle import NAMES, make_inputs, rel, run_gla, token_loop
from stage_plugin import IntraPlugin, record_torch_stages


def loop_of(x, dht=True):
    return token_loop(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], x["cu_list"], x["state_v_first"],
                      x["do"], x["dht"] if dht else None)


def check(got, want, tol, what):
    for name, a, b in zip(NAMES, got, want):
        if a is None or b is None:
            continue
        assert torch.isfinite(a).all(), f"{what}: {name} has NaN/Inf"
        err = rel(a, b)
        assert err < tol, f"{what}: {name} relative RMS error {err:.3e} >= {tol:.0e}"


def with_resets(x, fraction, seed):
    """Sets a random `fraction` of the gate entries to -inf (hard resets)."""
    gen = torch.Generator().manual_seed(seed)
    g = x["g"].clone()
    g[torch.rand(g.shape, generator=gen) < fraction] = float("-inf")
    return dict(x, g=g)


@pytest.mark.parametrize("case", [
    dict(B=2, T=150, H=2, K=32),
    dict(B=1, T=200, H=2, K=16, V=24, cu_seqlens=[0, 7, 120, 200]),
    dict(B=2, T=70, H=2, K=16, per_head_gate=True),
], ids=["batch", "varlen", "per-head"])
def test_minus_infinity_gates_are_hard_resets(case):
    x = with_resets(make_inputs(**case, seed=21), 0.05, seed=22)
    got = run_gla(x, backend="torch")
    want = loop_of(x)
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(b).all(), f"oracle {name} not finite"
    check(got, want, 1e-5, "-inf gates")


def test_gate_all_minus_infinity_forgets_everything():
    """With g = -inf everywhere each step sees only its own token: o_t = scale (q_t . k_t) v_t."""
    x = make_inputs(B=1, T=80, H=2, K=16, seed=23)
    x["g"] = torch.full_like(x["g"], float("-inf"))
    got = run_gla(x, backend="torch")
    o = (x["q"] * x["k"]).sum(-1, keepdim=True) * x["v"] * 16 ** -0.5
    assert rel(got[0], o) < 1e-6
    assert rel(got[1], x["k"][:, -1, :, :, None] * x["v"][:, -1, :, None, :]) < 1e-6
    check(got, loop_of(x), 1e-5, "all -inf")


@pytest.mark.parametrize("gate", ["const-5", "const-7", "uniform-60", "n0.05"])
def test_strong_decay(gate):
    """64 steps of g = -5 overflow a full-chunk factorisation in fp32 (SPEC.md §3 rule 2)."""
    x = make_inputs(B=1, T=200, H=2, K=32, seed=24, n=0.05 if gate == "n0.05" else 1.0,
                    gate_min=-60.0 if gate == "uniform-60" else None)
    if gate.startswith("const"):
        x["g"] = torch.full_like(x["g"], -float(gate[-1]))
    got = run_gla(x, backend="torch")
    check(got, loop_of(x), 1e-5, f"strong decay {gate}")


@pytest.mark.parametrize("case", [
    dict(B=2, T=150, H=2, K=32),
    dict(B=1, T=200, H=2, K=16, V=24, cu_seqlens=[0, 7, 120, 200]),
    dict(B=2, T=70, H=2, K=16, per_head_gate=True),
    dict(B=1, T=200, H=2, K=32, gate_min=-60.0),
    dict(B=1, T=130, H=2, K=32, dtype=torch.float16),
    dict(B=1, T=150, H=2, K=32, resets=0.05),
], ids=["batch", "varlen", "per-head", "strong-decay", "fp16", "resets"])
def test_exponents_by_difference(monkeypatch, case):
    """The accelerators' 16-bit route (exponents as differences of the chunk's cumulative gate,
    _chunked.by_difference), forced on the CPU, against the fp64 token loop at SPEC's 16-bit bar."""
    case = dict(case)
    resets = case.pop("resets", 0.0)
    x = make_inputs(**{"dtype": torch.bfloat16, **case}, seed=26)
    if resets:
        x = with_resets(x, resets, seed=27)
    calls = []

    def forced(t):
        calls.append(t.dtype)
        return t.dtype in (torch.bfloat16, torch.float16)

    monkeypatch.setattr(_chunked, "by_difference", forced)
    got = run_gla(x, backend="torch")
    assert calls and all(d in (torch.bfloat16, torch.float16) for d in calls), calls
    check(got, loop_of(x), 5e-3, "exponents by difference")


def test_fp64_path_matches_token_loop_to_rounding():
    x = make_inputs(B=2, T=130, H=2, K=16, V=8, dtype=torch.float64, seed=25)
    x["initial_state"] = x["initial_state"].double()
    x["dht"] = x["dht"].double()
    got = run_gla(x)
    check(got, loop_of(x), 1e-12, "float64")


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("K,V", [(64, 64), (32, 96)])
def test_no_intermediate_is_much_larger_than_inputs_and_states(K, V, threads):
    """The largest intermediate stays within 2x of the largest of: q, v, the chunk-start states and
    the [.., C, C] intra-chunk matrix (the old body built [.., 4, 16, 16, K] weights, 16x q)."""
    B, T, H = 1, 256, 2
    x = make_inputs(B=B, T=T, H=H, K=K, V=V, seed=26)
    C = _chunked.chunk_size_for(T)
    bound = 2 * max(B * T * H * K, B * T * H * V, B * (T // C) * H * K * V, B * T * H * C)
    threads(1)  # the mode sees only this thread's ops: no worker threads
    for backward in (False, True):
        mode = _LargestTensor()
        with mode:
            if backward:
                _chunked.chunk_backward(x["q"], x["k"], x["v"], x["g"], K ** -0.5, x["initial_state"], do=x["do"],
                                        dht=x["dht"])
            else:
                _chunked.chunk_forward(x["q"], x["k"], x["v"], x["g"], K ** -0.5, x["initial_state"])
        assert mode.largest <= bound, f"{'backward' if backward else 'forward'}: {mode.op} made {mode.largest} elements > {bound}"


@pytest.fixture
def threads():
    """Sets torch's thread count for one test and restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_blocks_and_worker_threads_give_the_same_result(monkeypatch, threads):
    """One block per scan step, and the heads split over worker threads, match one block in the
    calling thread (batch and varlen)."""
    for x in (make_inputs(B=2, T=200, H=5, K=16, V=8, seed=27),
              make_inputs(B=1, T=300, H=3, K=16, V=24, seed=33, cu_seqlens=[0, 0, 20, 150, 300])):
        threads(1)
        whole = run_gla(x, backend="torch")
        monkeypatch.setattr(_chunked, "CPU_BLOCK_BYTES", 1)
        layout = _chunked.layout_for(*x["q"].shape[:2], x["cu_list"], 64, "cpu")
        assert len(layout.step_blocks(1000, 1)) == len(layout.step_count) > 1
        check(run_gla(x, backend="torch"), whole, 1e-6, "a block per step vs one block")
        threads(2)
        check(run_gla(x, backend="torch"), whole, 1e-6, "worker threads vs the calling thread")
        monkeypatch.undo()


def test_uniform_scans_match_the_general_ones(monkeypatch, threads):
    """Equal-length sequences take the one-op-a-step scans (_chunked.uniform_scans): forward and
    backward match the general per-step scans, with one block and with a block per scan step."""
    threads(1)
    x = make_inputs(B=3, T=200, H=2, K=16, V=24, seed=41)
    for block_bytes in (None, 1):
        if block_bytes:
            monkeypatch.setattr(_chunked, "CPU_BLOCK_BYTES", block_bytes)
        fast = run_gla(x, backend="torch")
        monkeypatch.setattr(_chunked, "uniform_scans", lambda layout: False)
        check(run_gla(x, backend="torch"), fast, 1e-6, f"uniform vs general scans, block budget {block_bytes}")
        monkeypatch.undo()


def test_scratch_buffers_kept_between_calls_are_written_before_read(threads):
    """The calling thread's scratch buffers (kept between calls on the CPU) poisoned with NaN after
    a call of a larger shape: a smaller call still matches its result on a fresh thread's buffers,
    so no block reads what an earlier block or call left there (SPEC.md §3 rule 4)."""
    threads(1)  # the calls run on this thread, with its own Scratch
    small = make_inputs(B=2, T=200, H=3, K=16, V=24, seed=35)  # a partial last chunk: padding rows
    big = make_inputs(B=1, T=300, H=3, K=32, V=32, seed=36, cu_seqlens=[0, 100, 300])
    scratch = _scratch.for_call(torch.float32, "cpu")
    want = run_gla(small, backend="torch")  # the thread's buffers start at this call's sizes
    run_gla(big, backend="torch")
    assert scratch._buffers, "the CPU scratch keeps no buffers between calls"
    for buf in scratch._buffers.values():
        buf.fill_(float("nan"))
    check(run_gla(small, backend="torch"), want, 1e-6, "after poisoned scratch")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_with_its_own_worker_threads(threads):
    """The parent's CPU workers do not exist in a forked child (a DataLoader worker): the child
    makes its own instead of waiting on them forever. (_chunked directly: autograd itself refuses
    to run in a child forked after its device threads started.)"""
    threads(2)
    x = make_inputs(B=1, T=100, H=4, K=16, seed=34)

    def run():
        o, _ = _chunked.chunk_forward(x["q"], x["k"], x["v"], x["g"], 0.25, x["initial_state"])
        dq = _chunked.chunk_backward(x["q"], x["k"], x["v"], x["g"], 0.25, x["initial_state"], do=x["do"])[0]
        return o, dq

    want = run()  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 = same result, 3 = different, 4 = an error; killed after 60 s
        code = 4
        try:
            signal.alarm(60)
            code = 0 if all(rel(a, b) < 1e-6 for a, b in zip(run(), want)) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child: {os.waitstatus_to_exitcode(status)} (-14: hung)"


# ---- each stage unit inside a reference pipeline ----
FWD_STAGES = ["cumsum", "fwd_h", "fwd_intra", "fwd_o"]
BWD_STAGES = ["bwd_dh", "bwd_dA", "bwd_dv", "bwd_dqk_intra", "bwd_dqkg"]


@pytest.fixture(scope="module")
def stage_inputs():
    return {"batch": make_inputs(B=2, T=100, H=2, K=16, V=8, seed=28),
            "varlen": make_inputs(B=1, T=150, H=2, K=8, V=12, seed=29, cu_seqlens=[0, 70, 70, 150],
                                  state_v_first=True)}


@pytest.mark.parametrize("layout", ["batch", "varlen"])
@pytest.mark.parametrize("stage", FWD_STAGES + BWD_STAGES)
def test_each_torch_stage_in_a_reference_pipeline(stage_inputs, stage, layout):
    """`reference` runs every stage but one, `torch` that one: the result is the reference's, so the
    torch stage reads and writes the stage buffers in their documented layouts."""
    x = stage_inputs[layout]
    ran = []
    original = _torch_stages.RUN
    unit = {f.__name__: u for u, f in original.items()}[stage]
    patched = dict(original)
    patched[unit] = lambda s, _f=original[unit]: (ran.append(stage), _f(s))[1]
    try:
        _torch_stages.RUN = patched
        got = run_gla(x, backend=f"reference,{stage}=torch")
    finally:
        _torch_stages.RUN = original
    forward_only = stage in FWD_STAGES and stage != "fwd_h" and stage != "cumsum" and stage != "fwd_intra"
    assert ran and set(ran) == {stage}
    assert len(ran) == (1 if forward_only or stage in BWD_STAGES else 2), ran
    check(got, run_gla(x, backend="reference"), 1e-5, f"{stage}=torch in a reference pipeline")


# ---- a vendor's plug-in stage mixed with torch stages ----
def test_plugin_stage_mixes_with_torch_stages_and_the_log_names_who_ran_what(monkeypatch, capfd):
    plugin = IntraPlugin()
    plugin.register()
    ran = record_torch_stages(monkeypatch)
    x = make_inputs(B=1, T=150, H=3, K=24, V=16, seed=30, cu_seqlens=[0, 40, 150])  # a shape no other test logs
    try:
        capfd.readouterr()
        got = run_gla(x, backend=f"torch,fwd_intra={plugin.NAME}")
        log = capfd.readouterr().err
    finally:
        plugin.unregister()
    assert plugin.calls == [(_torch_stages.UNIT_FWD_INTRA, "cpu")] * 2  # forward and backward pipelines
    assert ran == ["cumsum", "fwd_h", "fwd_o",  # forward
                   "cumsum", "fwd_h", "bwd_dh", "bwd_dA", "bwd_dv", "bwd_dqk_intra", "bwd_dqkg"]  # backward
    assert (f"decision: stage pipeline: cumsum->torch fwd_h->torch fwd_intra->{plugin.NAME} fwd_o->torch"
            in log), log
    assert (f"decision: stage pipeline: cumsum->torch fwd_h->torch fwd_intra->{plugin.NAME} bwd_dh->torch "
            "bwd_dA->torch bwd_dv->torch bwd_dqk_intra->torch bwd_dqkg->torch") in log, log
    check(got, loop_of(x), 1e-5, "plug-in fwd_intra + torch stages")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: GPU tests need an NVIDIA GPU (run `pytest tests/python -m cuda` on one)")
@pytest.mark.parametrize("case", ["resets", "const-7"])
def test_cuda_torch_backend_resets_and_strong_decay(case):
    x = make_inputs(B=2, T=300, H=2, K=64, seed=31, cu_seqlens=None)
    if case == "resets":
        x = with_resets(x, 0.05, seed=32)
    else:
        x["g"] = torch.full_like(x["g"], -7.0)
    want = loop_of(x)
    on_gpu = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = run_gla(on_gpu, backend="torch")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert all(t is None or t.is_cuda for t in got)
    check(got, want, 1e-5, f"cuda {case}")
