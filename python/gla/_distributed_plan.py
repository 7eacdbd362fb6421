"""The layout of a context-parallel call: which parts of which sequences each rank holds, and which
ranks' states each rank folds (forward) or whose gradients it folds (backward).

Pure bookkeeping on host integers, identical on every rank (every rank computes it from the same
global offsets and rank boundaries), so the exchange needs no flags or indices on the wire.

Terms. Rank r holds the global tokens [begin_r, end_r). A *segment* is the part of one sequence on
one rank. A sequence *crosses* a position P when it holds tokens on both sides (start < P < end).
The *incoming* sequence of rank r crosses begin_r (it is always r's first segment), the *outgoing*
one crosses end_r (its last segment); one sequence can be both (the rank holds only its interior).
A rank with no tokens holds no segment and is skipped by every chain.

Batched input (no cu_seqlens) is laid out as one virtual sequence [0, T) whose every part carries B
rows; packed input carries one row per segment.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Segment:
    seq: int  # global sequence index (0 for the virtual sequence of batched input)
    begin: int  # local token offsets on the rank
    end: int
    starts_here: bool  # the sequence's first token (or, when empty, its position) is on this rank
    ends_here: bool  # its last token is on this rank


@dataclass(frozen=True)
class RankLayout:
    rank: int
    begin: int  # global token range [begin, end)
    end: int
    segments: Tuple[Segment, ...]
    predecessors: Tuple[int, ...]  # ranks holding the incoming sequence before this one; [0] is where it starts
    successors: Tuple[int, ...]  # ranks holding the outgoing sequence after this one; [-1] is where it ends

    @property
    def tokens(self) -> int:
        return self.end - self.begin

    @property
    def incoming(self) -> bool:
        return bool(self.predecessors)

    @property
    def outgoing(self) -> bool:
        return bool(self.successors)

    @property
    def spans(self) -> bool:
        """The rank holds only the interior of one sequence (incoming and outgoing)."""
        return self.incoming and self.outgoing and len(self.segments) == 1

    def local_offsets(self, first: int = 0) -> List[int]:
        """cu_seqlens of a local packed call over segments[first:] (zero-length ones included),
        relative to the first of them."""
        base = self.segments[first].begin if first < len(self.segments) else self.tokens
        return [0] + [s.end - base for s in self.segments[first:]]


class Plan:
    """Segments and chains of every rank for global offsets `cu_seqlens` (None: batched input, one
    virtual sequence) and rank boundaries `boundaries` ([0, end_0, end_1, ..., T], W + 1 entries)."""

    def __init__(self, boundaries: Sequence[int], cu_seqlens: Optional[Sequence[int]] = None):
        bounds = [int(b) for b in boundaries]
        if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"boundaries: expected non-decreasing rank offsets starting at 0 (one more than the "
                             f"number of ranks), got {bounds}")
        total = bounds[-1]
        self.varlen = cu_seqlens is not None
        cu = [int(c) for c in cu_seqlens] if self.varlen else [0, total]
        if self.varlen:
            if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens: expected non-decreasing offsets starting at 0, got {_brief(cu)}")
            if cu[-1] != total:
                raise ValueError(f"cu_seqlens: expected the last offset to be the total token count over all ranks "
                                 f"({total}), got {cu[-1]}")
        self.boundaries, self.cu_seqlens = tuple(bounds), tuple(cu)
        self.world_size = len(bounds) - 1
        self.num_sequences = len(cu) - 1
        W = self.world_size
        nonempty = [r for r in range(W) if bounds[r + 1] > bounds[r]]

        def rank_of(token: int) -> int:  # the rank holding `token` (never an empty one)
            return bisect.bisect_right(bounds, token) - 1

        segments: List[List[Segment]] = [[] for _ in range(W)]
        first_rank, last_rank = [0] * len(cu), [0] * len(cu)
        for n in range(len(cu) - 1):
            s, e = cu[n], cu[n + 1]
            if s == e:  # an empty sequence lives on the rank holding its position (the last rank at the end)
                r = rank_of(s) if s < total else (nonempty[-1] if nonempty else 0)
                segments[r].append(Segment(n, s - bounds[r], s - bounds[r], True, True))
                first_rank[n] = last_rank[n] = r
                continue
            r0, r1 = rank_of(s), rank_of(e - 1)
            first_rank[n], last_rank[n] = r0, r1
            for r in range(r0, r1 + 1):
                if bounds[r + 1] == bounds[r]:
                    continue
                b, f = max(s, bounds[r]), min(e, bounds[r + 1])
                segments[r].append(Segment(n, b - bounds[r], f - bounds[r], s >= bounds[r], e <= bounds[r + 1]))
        layouts = []
        for r in range(W):
            segs = segments[r]
            preds: Tuple[int, ...] = ()
            succs: Tuple[int, ...] = ()
            if segs and not segs[0].starts_here:
                n = segs[0].seq
                preds = tuple(p for p in range(first_rank[n], r) if bounds[p + 1] > bounds[p])
            if segs and not segs[-1].ends_here:
                n = segs[-1].seq
                succs = tuple(p for p in range(r + 1, last_rank[n] + 1) if bounds[p + 1] > bounds[p])
            layouts.append(RankLayout(r, bounds[r], bounds[r + 1], tuple(segs), preds, succs))
        self.ranks: Tuple[RankLayout, ...] = tuple(layouts)

    def starting(self, rank: int) -> List[int]:
        """Sequences whose initial state rank `rank` reads (they start on it)."""
        return [s.seq for s in self.ranks[rank].segments if s.starts_here]

    def ending(self, rank: int) -> List[int]:
        """Sequences whose final state rank `rank` returns (they end on it)."""
        return [s.seq for s in self.ranks[rank].segments if s.ends_here]


def _brief(values: Sequence[int], limit: int = 12) -> str:
    if len(values) <= limit:
        return str(list(values))
    return f"[{', '.join(map(str, values[:limit]))}, ...] ({len(values)} entries)"
