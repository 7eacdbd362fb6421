"""pytest setup for the Python package: finds `gla` in the source tree when it is not installed,
and registers the `cuda` marker (GPU tests: `pytest tests/python -m cuda`)."""
import os
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import gla  # noqa: F401  (an installed package wins)
except ImportError:
    sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _gla_environment():
    """libgla reads its environment variables once (gla.reload_environment re-reads them): after each
    test, once monkeypatch has restored what the test changed, it reads them again."""
    yield
    gla_module = sys.modules.get("gla")
    if gla_module is not None and gla_module._ops._loaded:
        gla_module.reload_environment()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (skips with a message without one)")
    config.addinivalue_line("markers", "slow: larger shapes")


def pytest_report_header(config):
    import torch

    if torch.cuda.is_available():
        return f"gla: CUDA device {torch.cuda.get_device_name(0)}: GPU tests (marker cuda) run"
    return "gla: no CUDA device: GPU tests (marker cuda) skip; run `pytest tests/python -m cuda` on an NVIDIA GPU"
