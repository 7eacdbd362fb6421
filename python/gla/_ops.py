"""PyTorch operators over libgla: `gla::chunk_fwd` and `gla::chunk_bwd`.

The schemas and the CPU and CUDA kernels come from libgla_torch (gla/csrc/, PyTorch's stable C ABI):
the kernels describe the tensors, allocate outputs and workspace with PyTorch's allocator, pass the
current stream and call libgla's C ABI, all in C++. This module adds what the stable ABI cannot
express: the fake (shape) kernels, which must handle symbolic shapes for torch.compile, and autograd.

When libgla_torch cannot load (not built, or built for another platform), the same schemas are
defined here with kernels in Python that reach libgla through ctypes (`_ctypes_kernels.py`), and a
warning says why. Those Python kernels also serve devices without a C++ kernel (MPS, XPU, PrivateUse1
devices such as Ascend NPUs), where the `torch` backend computes.

Custom operators cannot return None, so absent optional outputs travel as empty tensors (numel 0)
and the public wrapper turns them back into None.
"""
from __future__ import annotations

import threading
import warnings

import torch

from . import _lib, _native, _validate

# ---- thread-local backend selection (read by the public wrappers; dynamo guards on it) ----
class _Selection(threading.local):
    # Set per thread on its first access (threading.local runs __init__ in each thread), so a read
    # never takes getattr(local, name, default)'s raise-and-catch of AttributeError (~8k of the
    # ~148k instructions of a no_grad call, callgrind); instance attributes, which dynamo guards on
    # (class-level defaults are not guarded: a forced backend would be baked into a compiled graph).
    def __init__(self):
        self.backend = ""
        self.policy = _lib.POLICY_DEFAULT


selection = _Selection()


def current_backend() -> str:
    return selection.backend


def current_policy() -> int:
    return selection.policy


# The schemas; libgla_torch defines the same strings (gla/csrc/chunk_ops.cpp). chunk_fwd_no_autograd
# is chunk_fwd without an autograd formula, for the eager routes that build no graph (a call of it
# needs no below-autograd guard: ~9k instructions, ~1.5 us per call).
# chunk_fwd_saving_states (eager only, no autograd kernel: _ChunkFwd's forward) is chunk_fwd that
# also returns the chunk states it saved for the backward (bf16, gla.h's layout; numel 0 where none
# were saved), which chunk_bwd then reads (chunk_states) instead of recomputing them.
_CHUNK_FWD_ARGUMENTS = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? initial_state=None, Tensor? cu_seqlens=None, "
                        "Tensor? cu_seqlens_cpu=None, float? scale=None, bool state_v_first=False, "
                        "bool output_final_state=False, str backend=\"\", int policy=0, bool check_inputs=False)")
SCHEMAS = {
    "chunk_fwd": "chunk_fwd" + _CHUNK_FWD_ARGUMENTS + " -> (Tensor, Tensor)",
    "chunk_fwd_no_autograd": "chunk_fwd_no_autograd" + _CHUNK_FWD_ARGUMENTS + " -> (Tensor, Tensor)",
    "chunk_fwd_saving_states": "chunk_fwd_saving_states" + _CHUNK_FWD_ARGUMENTS + " -> (Tensor, Tensor, Tensor)",
    "chunk_bwd": "chunk_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? initial_state, Tensor? cu_seqlens, "
                 "Tensor? cu_seqlens_cpu, Tensor? do, Tensor? dht, float scale, bool state_v_first, str backend, "
                 "int policy, bool check_inputs=False, Tensor? chunk_states=None) "
                 "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}
# Devices whose kernels are the Python ones even when libgla_torch is loaded.
_PYTHON_KERNEL_KEYS = ("MPS", "XPU", "PrivateUse1")

native_path = None  # libgla_torch's path once loaded; None: the ctypes fallback serves
_loaded = False
_load_lock = threading.Lock()
_library = None  # the torch.library.Library of the Python registrations (kept alive)


def ensure_loaded():
    """Loads libgla, registers the `torch` backend and the operators (once); raises ImportError if
    libgla is missing."""
    global _loaded
    if _loaded:
        return _lib.library()
    with _load_lock:
        if not _loaded:
            _lib.library()
            from . import torch_backend
            torch_backend.register()
            _register_operators()
            _loaded = True
    return _lib.library()


def _register_operators() -> None:
    global native_path, _library
    native_path, reason = _native.load()
    _library = torch.library.Library("gla", "FRAGMENT")
    if native_path is None:
        warnings.warn(f"gla: the native PyTorch operators (libgla_torch) did not load, so gla.chunk_gla and "
                      f"gla.fused_recurrent_gla run through the ctypes fallback (tens of microseconds more per "
                      f"call): {reason}",
                      RuntimeWarning, stacklevel=4)
        for name, schema in SCHEMAS.items():
            _library.define(schema)
            _library.impl(name, _python_kernel(name), "CompositeExplicitAutograd")
    else:
        for name in SCHEMAS:
            for key in _PYTHON_KERNEL_KEYS:
                _library.impl(name, _python_kernel(name), key)
    torch.library.register_fake("gla::chunk_fwd", _chunk_fwd_fake, lib=_library)
    torch.library.register_fake("gla::chunk_fwd_no_autograd", _chunk_fwd_fake, lib=_library)
    # No autograd kernel at all: the dispatcher skips the key instead of running PyTorch's
    # autograd-not-implemented fallback (~5k instructions per call). Its callers build the graph
    # themselves (_ChunkFwd) or need none.
    _library.impl("chunk_fwd_no_autograd", torch.library.fallthrough_kernel, "Autograd")
    _library.impl("chunk_fwd_saving_states", torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake("gla::chunk_bwd", _chunk_bwd_fake, lib=_library)
    torch.library.register_autograd("gla::chunk_fwd", _backward, setup_context=_setup_context, lib=_library)
    global _chunk_fwd_op, _chunk_fwd_saving_op, _chunk_bwd_op
    _chunk_fwd_op, _chunk_bwd_op = eager_entry("chunk_fwd_no_autograd"), eager_entry("chunk_bwd")
    _chunk_fwd_saving_op = eager_entry("chunk_fwd_saving_states")
    from . import _recurrent
    _recurrent.register_operators(_library, native_path is not None)


def _python_kernel(name: str):
    """The Python (ctypes) kernel of op `name`: chunk_fwd_no_autograd's is chunk_fwd's."""
    from . import _ctypes_kernels
    return getattr(_ctypes_kernels, "chunk_fwd" if name == "chunk_fwd_no_autograd" else name)


def eager_entry(name: str):
    """The callable the eager routes use for torch.ops.gla.<name>.default: the builtin behind the
    OpOverload (its `_op`), which OpOverload.__call__ forwards to through a Python frame (~2 us of a
    decode step's host time on CPU). The same dispatcher call; torch.compile and torch.func get the
    OpOverload itself. Falls back to the OpOverload where a PyTorch has no `_op`."""
    overload = getattr(torch.ops.gla, name).default
    return getattr(overload, "_op", overload)


# Set by _register_operators: the eager entries of chunk_fwd_no_autograd (the forward of the eager
# routes, which build their graph themselves or none), chunk_fwd_saving_states and chunk_bwd.
_chunk_fwd_op = _chunk_fwd_saving_op = _chunk_bwd_op = None


# ---- shapes shared by the fake kernels and the Python kernels ----
def num_sequences(q, cu_seqlens) -> int:
    if cu_seqlens is not None:
        return max(0, cu_seqlens.shape[0] - 1) if cu_seqlens.dim() == 1 else 0
    return q.shape[0] if q.dim() >= 1 else 0


def state_shape(q, v, N, state_v_first: bool):
    if q.dim() != 4 or v.dim() != 4:
        return (0,)  # libgla rejects q / v first, naming them
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    return (N, H, V, K) if state_v_first else (N, H, K, V)


def default_scale(q, scale=None) -> float:
    """scale, or K ** -0.5 (1 for a q without a last dimension, which libgla rejects anyway); the C++
    kernels compute the same default (gla/csrc/chunk_ops.cpp)."""
    if scale is not None:
        return float(scale)
    K = q.shape[-1] if q.dim() > 0 else 0
    return K ** -0.5 if K > 0 else 1.0


def _chunk_fwd_fake(q, k, v, g, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None, scale=None,
                    state_v_first=False, output_final_state=False, backend="", policy=0, check_inputs=False):
    _validate.reject_meta_mixed_with_data((("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state),
                                           ("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)))
    torch._check(q.dim() == 4, lambda: f"q: expected shape [B, T, H, K], got {list(q.shape)}")
    torch._check(v.dim() == 4, lambda: f"v: expected shape [B, T, H, V], got {list(v.shape)}")
    o = v.new_empty(v.shape)
    if not output_final_state:
        return o, q.new_empty(0, dtype=torch.float32)
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    return o, q.new_empty(state_shape(q, v, N, state_v_first), dtype=torch.float32)


def _chunk_bwd_fake(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale, state_v_first,
                    backend, policy, check_inputs=False, chunk_states=None):
    _validate.reject_meta_mixed_with_data((("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state),
                                           ("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu), ("do", do),
                                           ("dht", dht)))
    dh0 = (initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None
           else q.new_empty(0, dtype=torch.float32))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), dh0


# ---- autograd ----
# Registered on gla::chunk_fwd for torch.compile, torch.func transforms, opcheck and direct calls of
# the op. Eager calls of gla.chunk_gla take _ChunkFwd below instead: the same formula as a plain
# autograd.Function over gla::chunk_fwd_no_autograd, which skips torch.library's Python autograd
# wrapper (about 80 us per call on CPU tensors, measured in bench/results/python_overhead.md). The
# backward op has no autograd kernel and runs below the key (_below_autograd).
_below_autograd = torch._C._AutoDispatchBelowAutograd


# The schema's defaults of chunk_fwd's last five arguments (state_v_first ... check_inputs).
_FWD_DEFAULTS = (False, False, "", 0, False)


def _save(ctx, q, k, v, g, initial_state, rest, chunk_states=None):
    """rest: (cu_seqlens, cu_seqlens_cpu, scale, state_v_first, output_final_state, backend, policy,
    check_inputs), or its first three when the others are the defaults; its tensors are saved as
    tensors (torch.compile traces them), the rest kept on ctx. chunk_states: what
    chunk_fwd_saving_states saved (None or numel 0: the backward recomputes the states)."""
    ctx.save_for_backward(q, k, v, g, initial_state, rest[0], rest[1], chunk_states)
    ctx.rest = rest[2:] + _FWD_DEFAULTS[len(rest) - 3:]


def unit_stride_rows(x):
    """x, or a dense copy where its last dimension is not unit-stride. Autograd hands out such
    gradients (`o.sum()` gives an expanded one: stride 0); the native backends read unit-stride rows
    and would decline the call to a slower backend."""
    return x.contiguous() if x is not None and x.dim() > 0 and x.size(-1) > 1 and x.stride(-1) != 1 else x


def _gradients(ctx, do, dht, chunk_bwd):
    """(dq, dk, dv, dg, dh0 or None) of the forward saved in ctx; chunk_bwd: the op or its eager entry."""
    q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_states = ctx.saved_tensors
    scale, state_v_first, _, backend, policy, check_inputs = ctx.rest
    if dht is not None and dht.numel() == 0:
        dht = None  # the placeholder for a final state nobody asked for
    do, dht = unit_stride_rows(do), unit_stride_rows(dht)
    try:
        with _below_autograd():
            if chunk_states is None:
                dq, dk, dv, dg, dh0 = chunk_bwd(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale,
                                                state_v_first, backend, policy, check_inputs)
            else:
                dq, dk, dv, dg, dh0 = chunk_bwd(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale,
                                                state_v_first, backend, policy, check_inputs, chunk_states)
    except RuntimeError as e:
        raise _lib.python_error(e) from None
    return dq, dk, dv, dg, (dh0 if initial_state is not None else None)


def _setup_context(ctx, inputs, output):
    _save(ctx, *inputs[:5], inputs[5:])


def _backward(ctx, do, dht):
    return _gradients(ctx, do, dht, torch.ops.gla.chunk_bwd.default) + (None,) * 8


class _ChunkFwd(torch.autograd.Function):
    """The eager route with a gradient: the five differentiable inputs as arguments and everything
    else as one tuple, because autograd.Function.apply inspects each argument (an isinstance check
    through torch.Tensor's metaclass per non-tensor): 6 arguments instead of 12 take ~6k of the
    ~177k instructions of a requires_grad call (callgrind, B1 T1 H1 D64)."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, rest):
        if q.is_cuda and q.dtype in _SAVED_STATE_DTYPES:
            # The cuda backend saves the chunk states for the backward (bf16; the backward then
            # skips recomputing them): B8 T4096 H16 D128 fwd+bwd 2.53 -> 2.23 ms on an H200, 256 MiB kept.
            o, final, chunk_states = _chunk_fwd_saving_op(q, k, v, g, initial_state, *rest)
            _save(ctx, q, k, v, g, initial_state, rest, chunk_states if chunk_states.numel() else None)
            return o, final
        out = _chunk_fwd_op(q, k, v, g, initial_state, *rest)
        _save(ctx, q, k, v, g, initial_state, rest)
        return out

    @staticmethod
    def backward(ctx, do, dht):
        return _gradients(ctx, do, dht, _chunk_bwd_op) + (None,)


_SAVED_STATE_DTYPES = (torch.bfloat16, torch.float16)


# autograd.Function.apply's C part. The Python classmethod in front of it binds default arguments
# (_ChunkFwd has none) and unwraps "dead" torch.func wrappers (tensors leaked out of a finished
# torch.func transform, not supported on this route); ~4 us per call.
_apply = super(torch.autograd.function._SingleLevelFunction, _ChunkFwd).apply


# Looked up once: each attribute walk (torch.compiler.is_compiling, ...) costs ~0.4k instructions
# per call. The same function objects, which torch.compile's tracing recognises.
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


def chunk_fwd(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first, output_final_state,
              backend, policy, check_inputs=False):
    """gla::chunk_fwd with autograd, by the cheapest route that keeps its semantics: the registered
    op under torch.compile and torch.func; in eager mode chunk_fwd_no_autograd, inside _ChunkFwd
    when a gradient is wanted. scale None: K ** -0.5."""
    graph = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad or
                                 (initial_state is not None and initial_state.requires_grad))
    if not (graph or state_v_first or output_final_state or backend or policy or check_inputs or
            initial_state is not None or cu_seqlens is not None or cu_seqlens_cpu is not None or scale is not None
            or _is_compiling() or _functorch_active()):
        return _chunk_fwd_op(q, k, v, g)  # every later argument the schema's default
    # Arguments equal to the schema's defaults are left out: PyTorch's binding checks each argument
    # passed (~1.4k instructions each).
    if state_v_first or output_final_state or backend or policy or check_inputs:
        args = (q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, default_scale(q, scale), state_v_first,
                output_final_state, backend, policy, check_inputs)
    else:
        args = (q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, default_scale(q, scale))
    if _is_compiling() or _functorch_active():
        return torch.ops.gla.chunk_fwd.default(*args)
    if graph:
        return _apply(q, k, v, g, initial_state, args[5:])
    return _chunk_fwd_op(*args)
