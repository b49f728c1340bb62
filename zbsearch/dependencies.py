"""Pass dependencies (Qi et al., arXiv 2401.10241) on virtual stages: the one place that knows them.

One microbatch flows F(0) -> ... -> F(S-1) -> B(S-1) -> ... -> B(0); W(s) needs only B(s).
B(s) also needs F(s) of its own stage (its saved activations), which matters for the
per-rank order even though the chain implies it in time.

A recompute pass R(s) (or RS(s), selective) needs F(s), and it must run before the backward of
its stage and microbatch (B or BW) on their rank, since it rebuilds the activations that
backward reads: an order within one rank (``runs_before_backward``), which its list keeps, not
a wait for another rank. Recomputation is optional, so the per-microbatch graph of pass types
(``pass_types``, ``type_graph``), which the bounds and heuristics walk for every schedule, holds
no recompute pass: a recompute pass only lengthens the paths it lies on.

Everything else derives from ``predecessors``: successors, the delay on an edge (a
communication latency between different stages, none within a stage), the per-microbatch
graph of pass types that the bounds and the MILP walk, which pass type must precede which,
and the tensors an action receives from and sends to other stages, which the runtime's
receives (``runtime``) and its message plan (``runtime.p2p``) both read, so they cannot
disagree and deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from operator import attrgetter
from typing import Literal

from .actions import RECOMPUTES, Action, Op
from .costs import CostModel

__all__ = [
    "Pass",
    "PassType",
    "Graph",
    "predecessors",
    "successors",
    "edge_delay",
    "pass_types",
    "type_graph",
    "earliest_starts",
    "input_arrival",
    "must_precede",
    "runs_before_backward",
    "action_index",
    "pass_positions",
    "recompute_positions",
    "action_predecessors",
    "action_predecessor_types",
    "ACT",
    "GRAD",
    "Transfer",
    "inputs_from_other_stages",
    "outputs_to_other_stages",
    "remote_input",
    "remote_outputs",
]

Pass = tuple[int, Op, int]  # (stage, basic op, microbatch)
PassType = tuple[int, Op]  # (stage, basic op): one microbatch's pass
Graph = dict[PassType, list[tuple[PassType, float]]]  # pass type -> (predecessor, edge delay)

_NEG = float("-inf")
_MB = attrgetter("mb")


def predecessors(stage: int, op: Op, mb: int, num_stages: int) -> list[Pass]:
    """Basic passes that must finish before the basic pass (stage, op, mb) may start."""
    if op is Op.F:
        return [(stage - 1, Op.F, mb)] if stage > 0 else []
    if op is Op.B:
        deps = [(stage, Op.F, mb)]
        if stage < num_stages - 1:
            deps.append((stage + 1, Op.B, mb))
        return deps
    if op is Op.W:
        return [(stage, Op.B, mb)]
    if op in RECOMPUTES:
        return [(stage, Op.F, mb)]
    raise ValueError(f"{op} is not a basic pass")


def successors(stage: int, op: Op, mb: int, num_stages: int) -> list[Pass]:
    """Basic passes that wait for the basic pass (stage, op, mb) (none wait for a recompute
    pass: its backward follows it on the same rank, ``runs_before_backward``)."""
    if op in RECOMPUTES:
        return []
    return [(s, o, mb) for s, o in _successor_types(num_stages)[(stage, op)]]


def runs_before_backward(op: Op) -> bool:
    """Whether a pass of this type must come before the backward (B or BW) of its stage and
    microbatch on their rank: a recompute pass rebuilds the activations that backward reads."""
    return op in RECOMPUTES


def edge_delay(cost: CostModel, from_stage: int, to_stage: int) -> float:
    """Delay between the end of a pass and the start of a pass that depends on it: the
    communication time between two stages (zero between stages on one rank), none within one."""
    return cost.comm(from_stage, to_stage) if from_stage != to_stage else 0.0


def pass_types(num_stages: int) -> list[PassType]:
    """One microbatch's passes in a topological order of ``predecessors``."""
    return [(s, Op.F) for s in range(num_stages)] + [(s, Op.B) for s in reversed(range(num_stages))] + [
        (s, Op.W) for s in range(num_stages)
    ]


def type_graph(cost: CostModel) -> Graph:
    """One microbatch's dependency graph: pass type -> its predecessors with edge delays."""
    S = cost.num_stages
    return {
        (s, op): [((ds, dop), edge_delay(cost, ds, s)) for ds, dop, _ in predecessors(s, op, 0, S)]
        for s, op in pass_types(S)
    }


def earliest_starts(
    cost: CostModel, source: PassType, graph: Graph | None = None
) -> dict[PassType, float]:
    """Longest start-to-start path from ``source`` to every pass type of the same microbatch
    (-inf where none leads): how long after ``source`` starts each pass can start at the earliest."""
    graph = graph if graph is not None else type_graph(cost)
    rel = {n: _NEG for n in graph}
    rel[source] = 0.0
    for n in pass_types(cost.num_stages):
        for d, delay in graph[n]:
            if rel[d] > _NEG:
                rel[n] = max(rel[n], rel[d] + cost.time(d[0], d[1]) + delay)
    return rel


def input_arrival(
    graph: Graph, stage: int, op: Op, mb: int, count: Mapping[Op, Sequence[int]], end: Mapping[Op, Sequence[Sequence[float]]]
) -> float | None:
    """When every input of the basic pass (stage, op, mb) is there (``graph``: ``type_graph``),
    for a builder that runs the passes of one kind on each stage in microbatch order:
    ``count[o][s]`` passes of kind o have run on stage s and ``end[o][s][j]`` is when microbatch
    j's ended. 0.0 for a pass without inputs, None while one of its inputs has not run."""
    t = 0.0
    for (s, o), delay in graph[(stage, op)]:
        if count[o][s] <= mb:
            return None
        t = max(t, end[o][s][mb] + delay)
    return t


def must_precede(a: PassType, b: PassType, num_stages: int) -> bool:
    """Whether pass type a of a microbatch must precede pass type b of the same microbatch
    (a path of dependencies, or a recompute pass's order before its backward, leads from a to b)."""
    return b in _descendants(num_stages)[a]


@cache
def _successor_types(num_stages: int) -> dict[PassType, tuple[PassType, ...]]:
    out: dict[PassType, list[PassType]] = {t: [] for t in pass_types(num_stages)}
    for s, op in pass_types(num_stages):
        for ds, dop, _ in predecessors(s, op, 0, num_stages):
            out[(ds, dop)].append((s, op))
    return {t: tuple(v) for t, v in out.items()}


@cache
def _descendants(num_stages: int) -> dict[PassType, frozenset[PassType]]:
    succ = _successor_types(num_stages)
    out: dict[PassType, frozenset[PassType]] = {}
    for t in reversed(pass_types(num_stages)):  # successors first
        out[t] = frozenset(succ[t]).union(*(out[u] for u in succ[t]))
    for s in range(num_stages):  # F -> recompute -> its backward and all that follows it
        for op in RECOMPUTES:
            out[(s, op)] = out[(s, Op.B)] | {(s, Op.B)}
            out[(s, Op.F)] = out[(s, Op.F)] | {(s, op)}
    for s in range(num_stages):  # every F before F(s) precedes its recompute passes too
        for before in range(s):
            out[(before, Op.F)] = out[(before, Op.F)] | {(s, op) for op in RECOMPUTES}
    return out


def action_index(rank_actions: list[list[Action]]) -> dict[Pass, tuple[int, int]]:
    """Basic pass -> (rank, position) of the action performing it (BW performs two; a recompute
    pass is its own)."""
    index: dict[Pass, tuple[int, int]] = {}
    B, W, BW = Op.B, Op.W, Op.BW  # the simulator indexes every schedule it times: keep this loop tight
    for r, row in enumerate(rank_actions):
        for i, a in enumerate(row):
            if a.op is BW:
                index.setdefault((a.stage, B, a.mb), (r, i))
                index.setdefault((a.stage, W, a.mb), (r, i))
            else:
                index.setdefault((a.stage, a.op, a.mb), (r, i))
    return index


def pass_positions(
    rank_actions: list[list[Action]], num_stages: int, num_microbatches: int | None = None
) -> dict[Op, list[list[tuple[int, int] | None]]]:
    """``action_index`` as tables: ``[op][stage][mb]`` -> (rank, position) of the action performing
    that basic pass (the first, if several do), None where none does; for ``num_microbatches``
    microbatches (default: up to the highest in the schedule). Lists, not a dict of tuples:
    the simulator looks up every dependency of every action in them. Only F, B and W: no
    pass waits for a recompute pass (``recompute_positions`` finds those)."""
    m = num_microbatches
    if m is None:
        m = 1 + max((max(map(_MB, row)) for row in rank_actions if row), default=-1)
    table: dict[Op, list[list[tuple[int, int] | None]]] = {
        op: [[None] * m for _ in range(num_stages)] for op in (Op.F, Op.B, Op.W)
    }
    B, W, BW = Op.B, Op.W, Op.BW
    for r, row in enumerate(rank_actions):
        for i, a in enumerate(row):
            if a.op is BW:
                for op in (B, W):
                    if table[op][a.stage][a.mb] is None:
                        table[op][a.stage][a.mb] = (r, i)
            elif a.op in RECOMPUTES:
                continue
            else:
                slot = table[a.op][a.stage]
                if slot[a.mb] is None:
                    slot[a.mb] = (r, i)
    return table


def recompute_positions(rank_actions: list[list[Action]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(stage, microbatch) -> (rank, position) of each recompute pass (R or RS) of it, in rank and
    position order (a valid schedule has at most one)."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, row in enumerate(rank_actions):
        for i, a in enumerate(row):
            if a.op in RECOMPUTES:
                out.setdefault((a.stage, a.mb), []).append((r, i))
    return out


def action_predecessors(a: Action, num_stages: int) -> list[Pass]:
    """Basic passes an action waits for, excluding passes the action performs itself."""
    return [(s, op, a.mb) for s, op in action_predecessor_types(a.stage, a.op, num_stages)]


@cache
def action_predecessor_types(stage: int, op: Op, num_stages: int) -> tuple[PassType, ...]:
    """Pass types (of the same microbatch) an action (stage, op) waits for, in a fixed order,
    excluding those it performs itself: what the simulator and validator resolve per action."""
    parts = (Op.B, Op.W) if op is Op.BW else (op,)
    own = {(stage, o) for o in parts}
    out: list[PassType] = []
    for o in parts:
        for ds, dop, _ in predecessors(stage, o, 0, num_stages):
            if (ds, dop) not in own and (ds, dop) not in out:
                out.append((ds, dop))
    return tuple(out)


# ---- tensors between stages ---------------------------------------------------------------
# A dependency between passes of two stages is a tensor sent from one to the other: the
# activations of stage s (F(s) -> F(s+1)) or their gradient (B(s+1) -> B(s)).

ACT: Literal["activations"] = "activations"
GRAD: Literal["gradient"] = "gradient"


@dataclass(frozen=True)
class Transfer:
    """Tensors crossing the boundary after stage ``boundary`` for microbatch ``mb``."""

    kind: Literal["activations", "gradient"]
    boundary: int
    mb: int
    src_stage: int
    dst_stage: int

    @property
    def key(self) -> tuple[str, int, int]:
        """(kind, boundary, microbatch): what names the message in the runtime's plan."""
        return (self.kind, self.boundary, self.mb)


def _transfer(src: Pass, dst: Pass) -> Transfer:
    (s1, op, mb), (s2, _, _) = src, dst
    return Transfer(ACT if op is Op.F else GRAD, min(s1, s2), mb, s1, s2)


def inputs_from_other_stages(a: Action, num_stages: int) -> list[Transfer]:
    """Tensors the action needs from passes of other stages."""
    return [_transfer(dep, (a.stage, a.op, a.mb)) for dep in action_predecessors(a, num_stages) if dep[0] != a.stage]


def outputs_to_other_stages(a: Action, num_stages: int) -> list[Transfer]:
    """Tensors the action produces for passes of other stages."""
    return [
        _transfer((a.stage, op, a.mb), nxt)
        for op in a.parts()
        for nxt in successors(a.stage, op, a.mb, num_stages)
        if nxt[0] != a.stage
    ]


def remote_input(a: Action, stage_to_rank: list[int]) -> Transfer | None:
    """The tensor the action receives from another rank (at most one), or None."""
    here = stage_to_rank[a.stage]
    remote = [t for t in inputs_from_other_stages(a, len(stage_to_rank)) if stage_to_rank[t.src_stage] != here]
    assert len(remote) <= 1, f"{a} receives {len(remote)} tensors"
    return remote[0] if remote else None


def remote_outputs(a: Action, stage_to_rank: list[int]) -> list[Transfer]:
    """The tensors the action sends to other ranks, in the order they are produced."""
    here = stage_to_rank[a.stage]
    return [t for t in outputs_to_other_stages(a, len(stage_to_rank)) if stage_to_rank[t.dst_stage] != here]
