"""libgla for PyTorch: gated linear attention with pluggable backends.

    import gla
    o, final_state = gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)

Importing it loads libgla, registers the portable `torch` backend and the operators gla::chunk_fwd /
gla::chunk_bwd, whose kernels are C++ over libgla's C ABI (libgla_torch, built against PyTorch's
stable ABI: one build serves every Python; ctypes fallback with a warning when it cannot load).
See docs/python.md.
"""
from . import _ops
from ._api import (BackendInfo, backend, backends, chunk_gla, explain, library_path, load_plugin, policy,
                   reload_environment, set_backend_enabled, version)
from ._lib import GlaError
from ._recurrent import explain_recurrent, fused_recurrent_gla, recurrent_state_update
from ._capabilities import capabilities
from ._tune import tune

__all__ = ["chunk_gla", "backends", "explain", "backend", "policy", "set_backend_enabled", "load_plugin",
           "BackendInfo", "GlaError", "library_path", "version", "fused_recurrent_gla", "recurrent_state_update",
           "explain_recurrent", "tune", "capabilities", "reload_environment"]

try:
    _ops.ensure_loaded()
except ImportError as _error:  # gla.chunk_gla raises it again when called
    import warnings as _warnings

    _warnings.warn(str(_error), stacklevel=2)


def __getattr__(name):  # gla.distributed (context parallelism) loads on first use
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'gla' has no attribute {name!r}")
