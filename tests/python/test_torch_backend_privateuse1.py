"""The `torch` backend on a device type no native backend serves: gla.chunk_gla on tensors of the
test-only PrivateUse1 device of host_device/ (host memory behind PyTorch's out-of-tree device
mechanism, every op but factories, views and copies through PyTorch's CPU fallback). The
dispatcher picks `torch` and says why the others decline, forward and backward match the
`reference` backend on the same inputs on the CPU, and a vendor's plug-in stage for that device
mixes with `torch` stages in one call."""
import pytest
import torch

import gla
from gla import _lib, _torch_stages
from oracle import NAMES, make_inputs, rel, run_gla
from stage_plugin import IntraPlugin, record_torch_stages

import host_device

CASES = {
    "batch": dict(B=2, T=100, H=2, K=16, V=8),
    "varlen": dict(B=1, T=150, H=2, K=16, V=24, cu_seqlens=[0, 7, 70, 150]),
    "per-head gate, state_v_first": dict(B=2, T=80, H=2, K=8, V=8, per_head_gate=True, state_v_first=True),
}


# A PrivateUse1 device in a process that also has CUDA makes autograd's engine fail an internal
# assert (`opt_ready_stream && opt_parent_stream`, engine.cpp) in every CUDA backward that runs after
# it: on the H200, the whole `pytest -m cuda` run failed 151 of 156 tests that way. A device type
# with no native backend is a machine without CUDA; there these tests run (CI), and on a GPU machine
# with the GPU hidden.
if torch.cuda.is_available():
    pytest.skip("the test-only PrivateUse1 device cannot share a process with CUDA (autograd's engine asserts); "
                "run this file with CUDA_VISIBLE_DEVICES= on a GPU machine", allow_module_level=True)

# Built and loaded when this module is collected, before any test runs a backward: autograd's
# engine sizes its per-device queues once, at the process's first backward, from the devices
# registered then (a device loaded later fails an internal assert there). ~40 s on a fresh build.
DEVICE = host_device.device()


@pytest.fixture(scope="module")
def device():
    return DEVICE


def on(device, x):
    out = {}
    for name, t in x.items():
        out[name] = t.to(device) if isinstance(t, torch.Tensor) else t
    return out


def test_the_device_is_an_out_of_tree_device(device):
    x = torch.arange(6.0).to(device)
    assert x.device.type == host_device.NAME == torch._C._get_privateuse1_backend_name()
    assert x.data_ptr() != 0
    before = host_device.fallback_ops()
    y = (x * 2).cpu()
    assert host_device.fallback_ops() > before  # the multiply ran through the PrivateUse1 key
    assert torch.equal(y, torch.arange(6.0) * 2)


def test_dispatcher_picks_torch_and_says_why_the_others_decline(device):
    x = on(device, make_inputs(**CASES["varlen"], seed=40))
    for backward in (False, True):
        text = gla.explain(x["q"], x["k"], x["v"], x["g"], cu_seqlens=x["cu_seqlens"], backward=backward)
        assert "device=ext:0" in text, text
        assert text.rstrip().splitlines()[-1] == "decision: torch (whole operation)", text
        unit = "chunk_bwd" if backward else "chunk_fwd"
        for b in gla.backends():
            if b.name == "torch" or not b.available:
                continue
            section = text.split(f"backend '{b.name}'")[1].split("backend '")[0]
            line = next(ln for ln in section.splitlines() if ln.strip().startswith(unit))
            assert "declines:" in line and "device ext" in line, f"{b.name}: {line}"


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_reference(device, case):
    x = make_inputs(**CASES[case], seed=41)
    want = run_gla(x, backend="reference")
    before = host_device.fallback_ops()
    got = run_gla(on(device, x))  # the dispatcher's choice: torch
    assert host_device.fallback_ops() > before
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.device == device, f"{name} on {a.device}"
        a = a.cpu()
        assert torch.isfinite(a).all(), f"{name} has NaN/Inf"
        err = rel(a, b)
        assert err < 1e-5, f"{case}: {name} relative RMS error {err:.3e}"


def test_plugin_stage_for_the_device_mixes_with_torch_stages(device, monkeypatch, capfd):
    plugin = IntraPlugin("test_host_device_intra", devices=(_lib.DEVICE_EXT,))
    plugin.register()
    ran = record_torch_stages(monkeypatch)
    x = make_inputs(B=1, T=130, H=2, K=12, V=20, seed=42, cu_seqlens=[0, 50, 130])  # a shape no other test logs
    want = run_gla(x, backend="reference")
    try:
        capfd.readouterr()
        got = run_gla(on(device, x), backend=f"torch,fwd_intra={plugin.NAME}")
        log = capfd.readouterr().err
    finally:
        plugin.unregister()
    assert plugin.calls == [(_torch_stages.UNIT_FWD_INTRA, host_device.NAME)] * 2  # forward and backward
    assert ran == ["cumsum", "fwd_h", "fwd_o",
                   "cumsum", "fwd_h", "bwd_dh", "bwd_dA", "bwd_dv", "bwd_dqk_intra", "bwd_dqkg"]
    assert f"cumsum->torch fwd_h->torch fwd_intra->{plugin.NAME} fwd_o->torch" in log, log
    assert (f"fwd_intra->{plugin.NAME} bwd_dh->torch bwd_dA->torch bwd_dv->torch bwd_dqk_intra->torch "
            "bwd_dqkg->torch") in log, log
    for name, a, b in zip(NAMES, got, want):
        assert a.device == device
        err = rel(a.cpu(), b)
        assert err < 1e-5, f"plug-in fwd_intra + torch stages on the device: {name} relative RMS error {err:.3e}"


def test_host_copy_of_device_offsets_is_kept_per_tensor_version(device):
    """gla/_host_offsets.py: one host copy per version of a device cu_seqlens; any write PyTorch
    makes (through the tensor or a view of it) gives a fresh copy with the new contents."""
    from gla import _host_offsets
    _host_offsets.forget()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32).to(device)
    first = _host_offsets.host_copy(cu)
    assert first.device.type == "cpu" and first.tolist() == [0, 3, 7]
    assert _host_offsets.host_copy(cu) is first
    cu[1:2].fill_(2)  # a write through a view
    second = _host_offsets.host_copy(cu)
    assert second is not first and second.tolist() == [0, 2, 7]
    cu.add_(1)
    assert _host_offsets.host_copy(cu).tolist() == [1, 3, 8]
    twin = cu.clone()  # equal contents, another tensor: its own copy
    assert _host_offsets.host_copy(twin) is not _host_offsets.host_copy(cu)
    assert _host_offsets.host_copy(torch.tensor([0, 1])) is None  # host tensors need no copy
    assert _host_offsets.host_copy(None) is None


def test_varlen_calls_copy_device_offsets_once_per_tensor(device, monkeypatch):
    """chunk_gla and fused_recurrent_gla with cu_seqlens on the device and no host copy (fla's
    calls): the layers of a model share one cu_seqlens, so only the first call copies it to the
    host; after an in-place change the next call copies again and computes the new segmentation."""
    from gla import _host_offsets
    _host_offsets.forget()
    copies = []
    real = _host_offsets._to_host
    monkeypatch.setattr(_host_offsets, "_to_host", lambda t: copies.append(1) or real(t))
    x = on(device, make_inputs(**CASES["varlen"], seed=43))
    cu = x["cu_seqlens"]
    args = dict(initial_state=x["initial_state"], output_final_state=True)
    outs = [gla.chunk_gla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu, **args) for _ in range(3)]
    assert len(copies) == 1
    o, ht = gla.fused_recurrent_gla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu, **args)
    assert len(copies) == 1
    want = gla.chunk_gla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu, cu_seqlens_cpu=[0, 7, 70, 150], **args)
    for got in outs + [(o, ht)]:
        assert rel(got[0].cpu(), want[0].cpu()) < 1e-5 and rel(got[1].cpu(), want[1].cpu()) < 1e-5
    cu.copy_(torch.tensor([0, 40, 41, 150], dtype=cu.dtype).to(device))  # a new segmentation, in place
    o2, ht2 = gla.chunk_gla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu, **args)
    assert len(copies) == 2
    want2 = gla.chunk_gla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu, cu_seqlens_cpu=[0, 40, 41, 150], **args)
    assert rel(o2.cpu(), want2[0].cpu()) < 1e-5 and rel(ht2.cpu(), want2[1].cpu()) < 1e-5
    assert rel(o2.cpu(), want[0].cpu()) > 1e-2  # the old segmentation's answer differs
