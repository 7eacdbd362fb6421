r"""Context parallelism for chunk_gla: one long sequence (or a packed batch of them) split along the
token dimension across the ranks of a torch.distributed group.

    import gla.distributed
    o, final_state = gla.distributed.chunk_gla(q, k, v, g, cu_seqlens=cu_global, group=group)

Each rank passes its contiguous slice of the tokens (rank 0 the first ones); ``o`` and the gradients
are its slice of what one ``gla.chunk_gla`` call on the concatenated input gives, up to rounding.
GLA's transition is diagonal, so a rank's slice enters the result only through its final state and
its total decay: each rank computes them locally, one all-gather exchanges them (a K-vector and a
K×V state per head per crossing sequence, never activations), every rank folds its predecessors
into its initial state and completes its slice; the backward does the same in reverse order
(docs/distributed.md).

Two entry points share the algorithm: `chunk_gla` (one rank per process, torch.distributed: gloo on
CPU, NCCL on GPUs) and `simulate` (every rank in this process, the exchange in memory: a check of
the distributed path on one device). `Context` holds the layout (rank boundaries, global offsets);
build it once with `build_context` and pass ``context=`` to skip the per-call layout exchange.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _ops
from . import _distributed_exchange as _exchange
from . import _distributed_function as _function
from ._distributed_plan import Plan

__all__ = ["chunk_gla", "simulate", "Context", "build_context"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class Context:
    """The layout of a split: rank r holds the global tokens ``[boundaries[r], boundaries[r + 1])``;
    ``cu_seqlens`` (global, host integers) describes a packed batch, None a batched input.

    Build it with `build_context` (one all-gather of each rank's token count) or directly from
    known boundaries (no communication). It caches the per-rank offsets on each device, so reusing
    one context for the calls of every layer costs nothing per call."""

    def __init__(self, boundaries: Sequence[int], cu_seqlens: Optional[Union[Tensor, Sequence[int]]] = None):
        self.plan = Plan(list(boundaries), _host_list(cu_seqlens))
        self._offsets: dict = {}

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def boundaries(self) -> Tuple[int, ...]:
        return self.plan.boundaries

    def tokens(self, rank: int) -> int:
        return self.plan.ranks[rank].tokens

    def starting(self, rank: int, batch: int = 1) -> List[int]:
        """Sequences whose initial-state rows rank `rank` reads (packed: those starting on it;
        batched: every row on the first rank holding tokens)."""
        return self._rows(self.plan.starting(rank), batch)

    def ending(self, rank: int, batch: int = 1) -> List[int]:
        """Sequences whose final-state rows rank `rank` returns (those ending on it)."""
        return self._rows(self.plan.ending(rank), batch)

    def _rows(self, seqs: List[int], batch: int) -> List[int]:
        return seqs if self.plan.varlen else (list(range(batch)) if seqs else [])


def build_context(local_tokens: int, cu_seqlens: Optional[Union[Tensor, Sequence[int]]] = None, group=None,
                  device: Optional[torch.device] = None) -> Context:
    """The context of this rank's split: all-gathers every rank's token count over `group` (on
    `device`: a CUDA device for NCCL, the CPU for gloo; default the current CUDA device under NCCL)."""
    ex = _exchange.TorchDistributed(group)
    if device is None:
        device = _collective_device(group)
    counts = ex.all_gather([torch.tensor([int(local_tokens)], dtype=torch.int64, device=device)])
    return Context(_boundaries(counts[:, 0].tolist()), cu_seqlens)


def chunk_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None,
              initial_state: Optional[Tensor] = None, output_final_state: bool = False,
              state_v_first: bool = False, cu_seqlens: Optional[Union[Tensor, Sequence[int]]] = None,
              group=None, context: Optional[Context] = None) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Context-parallel ``gla.chunk_gla``: this rank's slice of one call on the concatenated input.

    Args:
        q, k, g: ``[B, T_r, H, K]`` (g may be ``[B, T_r, H]``), v: ``[B, T_r, H, V]``: this rank's
            contiguous slice of the tokens; ranks in group order hold consecutive slices (T_r may
            differ and may be 0). Dtypes, B, H, K and V as for ``gla.chunk_gla`` and equal on every rank.
        initial_state: ``[N, H, K, V]`` fp32 over the *global* sequences (``[N, H, V, K]`` with
            ``state_v_first``), or None; the same on every rank. A rank reads only the rows of the
            sequences that start on it, so the gradient of each row lands on that rank alone (zeros
            elsewhere): summed over ranks (as data parallelism does for a replicated parameter) it is
            the gradient of one call.
        output_final_state: also return ``[N, H, K, V]`` fp32 whose rows of the sequences ending on
            this rank hold their final states and whose other rows are 0; the sum over ranks is the
            final state of one call (``Context.ending`` lists a rank's rows).
        cu_seqlens: the *global* offsets of a packed batch (``[N + 1]``, B must be 1), the same on
            every rank; sequences may start, end or span anywhere relative to the slices. None:
            batched input, every sequence split at the same token positions.
        group: the torch.distributed group (None: the default group).
        context: a `Context` from `build_context`; without one the call builds it (one all-gather
            of 7 int64 per rank, and a host copy of cu_seqlens). Not with ``cu_seqlens``.

    Returns:
        ``(o, final_state)``: o ``[B, T_r, H, V]`` in v's dtype; final_state as above or None.

    Traffic per call: the forward all-gathers ``M·H·K·(V+1)`` values of the state dtype (fp32) from
    every rank, the backward ``M·H·K·V``; M = 1 for packed input, B for batched input. Every rank of
    the group must make the call and run its backward (they are collectives). Differentiable in q,
    k, v, g and initial_state, through any backend ``gla.chunk_gla`` dispatches to. Local work: the
    forward's calls cover each token once (twice on a rank holding only one sequence's interior),
    the backward is one ``chunk_bwd`` plus one forward call over the incoming segment.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if context is not None and cu_seqlens is not None:
        raise ValueError("cu_seqlens: pass the global offsets either to build_context or here, not both")
    ex = _exchange.TorchDistributed(group)
    rank = ex.local_ranks[0]
    if context is None:
        context = _agreed_context(ex, group, q, k, v, g, initial_state, state_v_first, _host_list(cu_seqlens))
    else:
        if context.world_size != ex.world_size:
            raise ValueError(f"context: built for {context.world_size} ranks, but the group has {ex.world_size}")
        _check_local(q, k, v, g, initial_state, state_v_first, _num_sequences(context, None))
    _check_tokens(context, rank, q)
    call = _call(context, ex, q, scale, output_final_state, state_v_first)
    out = _function.run(call, initial_state, [(q, k, v, g)])
    return out[0], (out[1] if output_final_state else None)


def simulate(q: Sequence[Tensor], k: Sequence[Tensor], v: Sequence[Tensor], g: Sequence[Tensor],
             scale: Optional[float] = None, initial_state: Optional[Tensor] = None, output_final_state: bool = False,
             state_v_first: bool = False, cu_seqlens: Optional[Union[Tensor, Sequence[int]]] = None,
             exchange: Optional[_exchange.InMemory] = None) -> Tuple[List[Tensor], Optional[List[Tensor]]]:
    """Every rank in this process: ``q[r]`` etc. are rank r's slices (any device); the local and
    combine steps run on their tensors, the exchange stacks them in memory. Returns the list of o
    slices and (with output_final_state) the list of per-rank final states, exactly as each rank of
    `chunk_gla` would return them. One ``initial_state`` serves every rank, so its gradient is the
    sum over ranks. `exchange` (an ``InMemory``) may be passed to read the bytes sent per gather."""
    lists = (("q", q), ("k", k), ("v", v), ("g", g))
    for name, parts in lists:
        if isinstance(parts, Tensor) or not isinstance(parts, (list, tuple)):
            raise TypeError(f"{name}: expected a list of per-rank tensors, got {type(parts).__name__}")
        if len(parts) != len(q) or len(parts) == 0:
            raise ValueError(f"{name}: expected {len(q)} per-rank slices (one per rank, as q), got {len(parts)}")
    W = len(q)
    for name, parts in lists:
        for r, t in enumerate(parts):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}[{r}]: expected a torch.Tensor, got {type(t).__name__}")
    if initial_state is not None and not isinstance(initial_state, Tensor):
        raise TypeError(f"initial_state: expected a torch.Tensor, got {type(initial_state).__name__}")
    cu = _host_list(cu_seqlens)
    for r in range(W):
        _check_local(q[r], k[r], v[r], g[r], initial_state, state_v_first, _num_sequences(None, cu), where=f"[{r}]")
    context = Context(_boundaries([x.shape[1] for x in q]), cu)
    ex = exchange if exchange is not None else _exchange.InMemory(W)
    if ex.world_size != W:
        raise ValueError(f"exchange: expected an InMemory of {W} ranks, got {ex.world_size}")
    for r in range(1, W):
        if (q[r].shape[0], q[r].shape[2:], v[r].shape[2:], q[r].dtype) != \
                (q[0].shape[0], q[0].shape[2:], v[0].shape[2:], q[0].dtype):
            raise ValueError(f"q[{r}], v[{r}]: expected B, H, K, V and dtype of rank 0 ({_signature(q[0], v[0])}), "
                             f"got {_signature(q[r], v[r])}")
    call = _call(context, ex, q[0], scale, output_final_state, state_v_first)
    out = _function.run(call, initial_state, list(zip(q, k, v, g)))
    return out[:W], (out[W:] if output_final_state else None)


# ---- helpers ----
def _call(context: Context, ex, q: Tensor, scale, output_final_state, state_v_first) -> _function.Call:
    backend, policy = _function.selection()
    return _function.Call(context.plan, ex, _ops.default_scale(q, scale), bool(output_final_state),
                          bool(state_v_first), backend, policy, context._offsets)


def _host_list(cu_seqlens) -> Optional[List[int]]:
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                             f"{list(cu_seqlens.shape)}")
        return cu_seqlens.tolist()
    return [int(c) for c in cu_seqlens]


def _boundaries(counts: Sequence[int]) -> List[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def _collective_device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _signature(q: Tensor, v: Tensor) -> str:
    B, _, H, K = q.shape
    return f"B={B}, H={H}, K={K}, V={v.shape[-1]}, {q.dtype}"


def _check_local(q, k, v, g, initial_state, state_v_first, num_sequences: Optional[int], where: str = ""):
    """What one rank can check alone before any collective: shapes of q, k, v, g against each other,
    B = 1 for packed input (num_sequences given), and the initial state's global shape and dtype.
    The library's local call checks the rest (dtypes of g, strides, devices)."""
    if q.dim() != 4:
        raise ValueError(f"q{where}: expected shape [B, T_r, H, K], got {list(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k{where}: expected q's shape {list(q.shape)}, got {list(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v{where}: expected shape [B, T_r, H, V] = {list(q.shape[:3])} + [V], got {list(v.shape)}")
    if g.shape != q.shape and g.shape != q.shape[:3]:
        raise ValueError(f"g{where}: expected shape {list(q.shape)} (per key) or {list(q.shape[:3])} (per head), "
                         f"got {list(g.shape)}")
    if num_sequences is not None and q.shape[0] != 1:
        raise ValueError(f"q{where}: expected B = 1 with cu_seqlens (packed input), got B = {q.shape[0]}")
    if initial_state is not None:
        N = num_sequences if num_sequences is not None else q.shape[0]
        H, K, V = q.shape[2], q.shape[3], v.shape[3]
        want = (N, H, V, K) if state_v_first else (N, H, K, V)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected shape {list(want)} (N = {N} global sequences), "
                             f"got {list(initial_state.shape)}")
        allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if initial_state.dtype not in allowed:
            raise TypeError(f"initial_state: expected float32{' or float64' if len(allowed) > 1 else ''}, "
                            f"got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: expected q's device {q.device}, got {initial_state.device}")


def _check_tokens(context: Context, rank: int, q, where: str = ""):
    lay = context.plan.ranks[rank]
    if q.shape[1] != lay.tokens:
        raise ValueError(f"q{where}: rank {rank} holds tokens [{lay.begin}, {lay.end}) of the layout "
                         f"({lay.tokens}), got T = {q.shape[1]}")


def _num_sequences(context: Optional[Context], cu: Optional[List[int]]) -> Optional[int]:
    if context is not None:
        return context.plan.num_sequences if context.plan.varlen else None
    return len(cu) - 1 if cu is not None else None


def _agreed_context(ex, group, q, k, v, g, initial_state, state_v_first, cu: Optional[List[int]]) -> Context:
    """Checks this rank's input, then builds the context with one all-gather of (T_r, B, H, K, V,
    dtype, ok) and checks that every rank agrees: a bad input or a mismatch raises on every rank
    instead of leaving the others in a collective."""
    try:
        _check_local(q, k, v, g, initial_state, state_v_first, _num_sequences(None, cu))
        error = None
        mine = [q.shape[1], q.shape[0], q.shape[2], q.shape[3], v.shape[3],
                _DTYPES.index(q.dtype) if q.dtype in _DTYPES else len(_DTYPES), 1]
    except (ValueError, TypeError) as e:
        error, mine = e, [0] * 6 + [0]
    device = q.device if _collective_device(group).type != "cpu" else torch.device("cpu")
    table = ex.all_gather([torch.tensor(mine, dtype=torch.int64, device=device)]).tolist()
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(table) if not row[6]]
    if bad:
        raise ValueError(f"q: rank(s) {bad} of the group rejected their input (their error names the argument)")
    names = ("B", "H", "K", "V", "dtype")
    for i, name in enumerate(names, start=1):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            shown = [str(_DTYPES[x]) if x < len(_DTYPES) else "other" for x in values] if name == "dtype" else values
            raise ValueError(f"q: every rank must pass the same {name}; got {shown} by rank")
    return Context(_boundaries([row[0] for row in table]), cu)
