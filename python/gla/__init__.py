"""libgla for PyTorch: gated linear attention with pluggable backends.

    import gla
    o, final_state = gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)

The package talks to libgla only through its C ABI (ctypes), so one build serves every Python
version. Importing it loads libgla and registers the portable `torch` backend (docs/python.md).
"""
from . import _ops  # registers the gla::chunk_fwd / gla::chunk_bwd operators
from ._api import (BackendInfo, backend, backends, chunk_gla, explain, library_path, load_plugin, policy,
                   set_backend_enabled, version)
from ._lib import GlaError
from ._recurrent import explain_recurrent, fused_recurrent_gla, recurrent_state_update

__all__ = ["chunk_gla", "backends", "explain", "backend", "policy", "set_backend_enabled", "load_plugin",
           "BackendInfo", "GlaError", "library_path", "version", "fused_recurrent_gla", "recurrent_state_update",
           "explain_recurrent"]

try:
    _ops.ensure_loaded()
except ImportError as _error:  # the operators raise it again when called
    import warnings as _warnings

    _warnings.warn(str(_error), stacklevel=2)


def __getattr__(name):  # gla.distributed (context parallelism) loads on first use
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'gla' has no attribute {name!r}")
