"""Builds and loads the test-only PrivateUse1 device of host_device/host_device.cpp (once per
process): torch.utils.cpp_extension compiles it against the installed PyTorch into
build/host_device/ (reused while the source is unchanged)."""
import pathlib
import threading
import types

import torch

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SOURCE = pathlib.Path(__file__).with_name("host_device") / "host_device.cpp"
NAME = "gla_host"
_lock = threading.Lock()
_loaded = None


def device() -> torch.device:
    """The device (gla_host:0), building and loading the extension on first use."""
    global _loaded
    with _lock:
        if _loaded is None:
            from torch.utils import cpp_extension
            build = _ROOT / "build" / "host_device"
            build.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name="gla_host_device", sources=[str(_SOURCE)], build_directory=str(build),
                               extra_cflags=["-O1"], is_python_module=False, verbose=False)
            # named, as torch_npu names its device "npu": a PrivateUse1 backend counts as registered
            # (the current accelerator, which autograd's engine asks for streams) once renamed
            torch.utils.rename_privateuse1_backend(NAME)
            torch._register_device_module(NAME, _module())
            _loaded = torch.device(NAME, 0)
    return _loaded


def _module():
    """The torch.gla_host module PyTorch looks up for a PrivateUse1 device."""
    m = types.ModuleType("gla_host_device")
    m.is_available = lambda: True
    m.device_count = lambda: 1
    m.current_device = lambda: 0
    m.set_device = lambda index: None
    m.synchronize = lambda device=None: None
    m._is_in_bad_fork = lambda: False
    m.is_initialized = lambda: True
    return m


def live_bytes() -> int:
    return torch.ops.gla_host_device.live_bytes()


def fallback_ops() -> int:
    return torch.ops.gla_host_device.fallback_ops()
