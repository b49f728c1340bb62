"""Before planning a configuration: a lower bound on its iteration over every cut and every
schedule, and a proof, where there is one, that no cut of it fits the memory.

The bound is the larger of two, each holding for every cut of the placement and every
schedule, recomputing as the configuration allows:

* the planner's relaxed bound on the longest rank's span (``relaxed_bound``: the least over
  every cut of the largest per-rank bound from the rank's work, the fill its forwards cannot
  cover and the area its microbatches hold against what the rank's memory leaves them, the
  plan's budget and static bytes counted as ``plan`` counts them), plus what every rank adds
  after its last pass at least: one stage's reduction (the least any unit's gradients take; a
  stage holds at least one) and the optimizer step of at least one unit;
* the mean over ranks: each rank computes its units' m microbatches, reduces after its last
  pass and steps its parameters, so the longest rank takes at least m times all units' least
  compute plus every unit's optimizer step, over the pipeline ranks, plus the least reduction;
  with the runtime's host time per action, each microbatch's forward and backward on each of
  the rank's stages pay it (``action_floor``).

With one stage (``pp = 1``) the rank computes every unit's m microbatches, then reduces all the
gradients and steps: the bound is that sum.

A configuration does not fit where even its pieces cannot: on every rank the parameters,
gradients, optimizer state and one microbatch's activations of each of its stages must fit (a
stage's backward needs its whole forward's activations, whatever is recomputed). Cutting the
units greedily into pieces that fit, in model order, needs the fewest pieces of any cut that
fits (a piece's bytes only grow with its units); where that is more than the configuration's
stages, or the ranks' static bytes together exceed what the ranks hold, no cut fits.
"""

from __future__ import annotations

import math

from ..formats.layers import LayerProfile
from ..limits import allowance
from ..planner.relaxation import action_floor, relaxed_bound, unit_work
from .cluster import Cluster, Mesh
from .costing import full_profile, unit_reductions, unit_steps
from .optimizer import OptimizerSetup

__all__ = ["config_bound", "cannot_fit"]


def config_bound(layers: LayerProfile, mesh: Mesh, placement: str, m: int, recompute: str, cluster: Cluster,
                 opt: OptimizerSetup, cap: float = math.inf, deadline: float | None = None) -> float:
    """A lower bound (ms) on the iteration of every cut and schedule of this configuration.
    ``cap``: the bound is wanted only up to it (the best iteration known: a configuration whose
    bound reaches it is pruned), which makes it faster; ``deadline`` (``time.monotonic()``):
    past it the span's program falls back to the busiest rank's work."""
    reduce = min(unit_reductions(layers, mesh, cluster, opt))
    steps, tied = unit_steps(layers, mesh, cluster, opt)
    work = unit_work(layers, recompute)
    host = m * action_floor(layers) * (2 if placement == "v" and mesh.pp > 1 else 1)  # per rank: its stages' actions
    mean = (m * sum(work) + sum(steps) + tied) / mesh.pp + reduce + host
    if mesh.pp == 1:  # one stage: its whole reduction and step follow its last pass
        whole = full_profile(layers, (layers.num_units,), "one", mesh, cluster, opt).stages[0]
        return m * sum(work) + host + (whole.t_reduce or 0.0) + (whole.t_opt or 0.0)
    if mean >= cap:
        return mean
    after = reduce + min(steps)
    span = relaxed_bound(opt.plan_view(layers, mesh.dp), mesh.pp, "v" if placement == "v" else "one", m, recompute,
                         budget=cluster.memory_bytes, optimizer="sgd", deadline=deadline, cap=cap - after)
    return max(mean, span + after)


def cannot_fit(layers: LayerProfile, pieces: int, ranks: int, budget: float | None, opt: OptimizerSetup,
               dp: int) -> str | None:
    """Why no cut of ``layers`` into ``pieces`` stages on ``ranks`` ranks fits ``budget`` bytes
    per rank (see the module), or None where that is not proven."""
    if budget is None:
        return None
    static = [opt.static_bytes(u.params, u.param_bytes, dp) + u.frozen_bytes for u in layers.units]
    tied = {k: opt.static_bytes(t.params, t.param_bytes, dp) for k, t in layers.tied.items()}
    total = sum(static) + sum(tied.values())
    if total > ranks * budget:
        return (f"the parameters, gradients and optimizer state ({total / 2**30:.4g} GiB) exceed the {ranks} ranks' "
                f"{ranks * budget / 2**30:.4g} GiB")
    used = 0
    i, n = 0, layers.num_units
    while i < n:
        held, acts = 0.0, 0.0
        keys: set[str] = set()
        j = i
        while j < n:
            u = layers.units[j]
            more = static[j] + sum((tied[k] for k in set(u.tied) - keys), 0.0)
            if held + more >= budget or acts + u.m_f > allowance(budget - held - more):
                break
            held, acts = held + more, acts + u.m_f
            keys |= set(u.tied)
            j += 1
        if j == i:
            u = layers.units[i]
            return (f"unit {u.name!r} alone needs {(static[i] + u.m_f) / 2**30:.4g} GiB for its parameters, gradients, "
                    f"optimizer state and one microbatch's activations, more than the {budget / 2**30:.4g} GiB a rank has")
        used += 1
        i = j
    if used > pieces:
        return (f"the units need at least {used} stages whose parameters, gradients, optimizer state and one "
                f"microbatch's activations fit {budget / 2**30:.4g} GiB, more than the {pieces} stages")
    return None
