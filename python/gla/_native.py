"""Loading libgla_torch, the PyTorch operators compiled against PyTorch's stable C ABI (gla/csrc/).

Search order: next to this package (where `pip install .` puts it), then next to the libgla that
gla/_lib.py loaded (a build tree: build/libgla_torch.so beside build/libgla.so). libgla is loaded
first, so the operators bind to that very library (libgla_torch links it by soname) and share its
registry, the `torch` backend included.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional, Tuple

import torch

from . import _lib

_NAMES = {"linux": "libgla_torch.so", "darwin": "libgla_torch.dylib", "win32": "gla_torch.dll"}


def _candidates(library_path: str) -> List[str]:
    name = _NAMES.get(sys.platform, "libgla_torch.so")
    here = os.path.dirname(os.path.abspath(__file__))
    found = [os.path.join(here, name), os.path.join(os.path.dirname(library_path), name)]
    return list(dict.fromkeys(found))


def load() -> Tuple[Optional[str], str]:
    """(path, "") once the operators are registered, or (None, why not)."""
    if os.environ.get("GLA_NATIVE_OPS", "1") == "0":
        return None, "GLA_NATIVE_OPS=0 is set"
    tried = []
    for path in _candidates(_lib.library().path):
        if not os.path.isfile(path):
            tried.append(f"{path} (not found)")
            continue
        try:
            torch.ops.load_library(path)
        except (OSError, RuntimeError) as e:
            tried.append(f"{path} ({e})")
            continue
        return path, ""
    return None, "; ".join(tried)
