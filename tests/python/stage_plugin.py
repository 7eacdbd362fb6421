"""A test backend registered from Python, as a vendor's would be: it implements only the fwd_intra
stage (A, computed its own way: fp64, per chunk, from cumulative gates) for the device types it is
given, so the dispatcher mixes it with another backend's stages for the rest."""
import ctypes

import torch

import gla
from gla import _lib, _tensors, _torch_stages


class IntraPlugin:
    def __init__(self, name="test_intra_plugin", devices=(_lib.DEVICE_CPU,)):
        self.NAME = name
        self.devices = devices
        self.calls = []  # (unit, device of the tensors it was handed)
        self._keep = []

    def _run(self, user_data, problem, message, capacity):
        try:
            p = problem.contents
            w = _tensors.to_torch
            q, k, g, A = w(p.q).double(), w(p.k).double(), w(p.g).double(), w(p.A)
            self.calls.append((p.unit, A.device.type))
            if p.gate_per_head:
                g = g[..., None].expand_as(q)
            C = p.chunk_size
            for n in range(p.N):
                start, end = int(p.seq_offsets[n]), int(p.seq_offsets[n + 1])
                row = 0 if p.varlen else n
                for first in range(start, end, C):
                    last = min(end, first + C)
                    b = g[row, first:last].cumsum(0)  # [L, H, K]
                    L = last - first
                    r = torch.arange(L, device=q.device)
                    later = r[None, :] > r[:, None]  # [t, s]: s after t
                    span = (b[:, None] - b[None, :]).masked_fill(later[..., None, None], float("-inf"))
                    a = torch.einsum("thk,shk,tshk->ths", q[row, first:last], k[row, first:last], torch.exp(span))
                    block = torch.zeros(L, a.shape[1], C, dtype=torch.float64, device=q.device)
                    block[:, :, :L] = a
                    A[row, first:last] = (block * p.scale).float()
            return _lib.OK
        except BaseException as e:  # noqa: BLE001 - nothing may cross into C
            msg = f"{type(e).__name__}: {e}".encode()[: capacity - 1]
            ctypes.memmove(message, msg + b"\0", len(msg) + 1)
            return _lib.BACKEND_ERROR

    def register(self):
        desc = _lib.BackendDesc()
        desc.abi_version = _lib.ABI_VERSION
        name = self.NAME.encode()
        desc.name = name
        desc.priority = 10
        desc.device_mask = sum(1 << d for d in self.devices)
        desc.unit_mask = 1 << _torch_stages.UNIT_FWD_INTRA
        run = _lib.RunFn(self._run)
        desc.available, desc.verify, desc.workspace_size = _lib.AvailableFn(), _lib.VerifyFn(), _lib.WorkspaceFn()
        desc.run = run
        self._keep += [desc, name, run]
        _lib.raise_for(_lib.library().gla_register_backend(ctypes.byref(desc)), "registering the test plug-in")

    def unregister(self):
        _lib.raise_for(_lib.library().gla_unregister_backend(self.NAME.encode()))


def record_torch_stages(monkeypatch) -> list:
    """Turns on the dispatch log and returns the list that the `torch` stage units append their
    names to as they run (for one test)."""
    ran = []
    patched = {u: (lambda s, _f=f: (ran.append(_f.__name__), _f(s))[1]) for u, f in _torch_stages.RUN.items()}
    monkeypatch.setattr(_torch_stages, "RUN", patched)
    monkeypatch.setenv("GLA_LOG", "dispatch")
    gla.reload_environment()  # conftest.py re-reads it after the test, once monkeypatch restored it
    return ran
