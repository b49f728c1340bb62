"""Pass dependencies (REFERENCE section 1), on virtual stages.

One microbatch flows F(0) -> ... -> F(S-1) -> B(S-1) -> ... -> B(0); W(s) needs only B(s).
B(s) also needs F(s) of its own stage (its saved activations), which matters for the
per-rank order even though the chain implies it in time.
"""

from __future__ import annotations

from .actions import Action, Op

__all__ = ["pass_predecessors", "action_index", "action_predecessors"]

Pass = tuple[int, Op, int]  # (stage, basic op, microbatch)


def pass_predecessors(stage: int, op: Op, mb: int, num_stages: int) -> list[Pass]:
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
    raise ValueError(f"{op} is not a basic pass")


def action_index(rank_actions: list[list[Action]]) -> dict[Pass, tuple[int, int]]:
    """Basic pass -> (rank, position) of the action performing it (BW performs two)."""
    index: dict[Pass, tuple[int, int]] = {}
    for r, row in enumerate(rank_actions):
        for i, a in enumerate(row):
            for op in a.parts():
                index.setdefault((a.stage, op, a.mb), (r, i))
    return index


def action_predecessors(a: Action, num_stages: int) -> list[Pass]:
    """Basic passes an action waits for, excluding passes the action performs itself."""
    own = {(a.stage, op, a.mb) for op in a.parts()}
    out: list[Pass] = []
    for op in a.parts():
        for dep in pass_predecessors(a.stage, op, a.mb, num_stages):
            if dep not in own and dep not in out:
                out.append(dep)
    return out
