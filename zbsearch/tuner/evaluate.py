"""One configuration, scheduled and costed: ``plan`` for the configurations searched, a
classic schedule on its fixed cut for a baseline, the sequential schedule for one stage.

Every configuration is costed the same way (``costing``): its schedule on the composed stage
costs, ended by the stages' reductions and optimizer steps, and its memory against the budget.
A planned configuration's bound is the larger of its bound before planning
(``bounds.config_bound``) and plan's own over every cut, plus the least optimizer step a rank
takes (plan's objective ends with the reductions; the steps come after them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import clock
from ..classic import build_classic
from ..errors import ZbError
from ..formats.edit import updated
from ..formats.layers import LayerProfile
from ..formats.schedule import Schedule
from ..limits import allowance
from ..planner import plan
from .baselines import AS_NEEDED
from .cluster import Cluster
from .costing import Costed, cost_schedule, full_profile, rank_static, stage_to_rank, unit_steps
from .optimizer import OptimizerSetup
from .space import Config

__all__ = ["Task", "Evaluation", "evaluate"]


@dataclass
class Task:
    """What ``evaluate`` needs: the configuration, the per-layer profile at its microbatch size
    with the cluster's link, the budget's owner, the time plan may take, the bound found before
    planning, and the best iteration known (a schedule comes back only where it is better)."""

    config: Config
    layers: LayerProfile
    cluster: Cluster
    opt: OptimizerSetup
    time_limit: float
    bound: float
    incumbent: float = float("inf")
    milp: bool = True
    deterministic: bool = False  # the plan's time limit counts work (``zbsearch.clock``)


@dataclass
class Evaluation:
    """A configuration's outcome: ``costed`` (with its iteration), ``does not fit`` or ``no
    schedule`` (with a note saying why)."""

    status: str
    costed: Costed | None = None
    bound: float | None = None
    counts: tuple[int, ...] | None = None
    layers_per_stage: list[int] | None = None
    recompute: str | None = None  # what the schedule was allowed to recompute
    kind: str | None = None
    note: str | None = None
    time_s: float = 0.0  # on the task's clock: seconds, or work in nominal seconds
    schedule: Schedule | None = field(default=None, repr=False)
    pairs: int = 0  # the schedule's overlapped pairs


def evaluate(task: Task) -> Evaluation:
    """The configuration of ``task`` scheduled and costed (see the module); with
    ``task.deterministic``, on the work clock counted from zero, so that the outcome depends on
    the task alone, not on what the process evaluated before."""
    with clock.work_clock(task.deterministic):
        return _evaluate(task)


def _evaluate(task: Task) -> Evaluation:
    t0 = clock.now()
    c = task.config
    try:
        if c.method == "plan":
            out = _planned(task)
        else:
            out = _fixed(task)
    except ZbError as e:
        out = Evaluation("no schedule", note=str(e))
    out.time_s = clock.now() - t0
    out.pairs = out.schedule.num_pairs if out.schedule is not None else 0
    if out.schedule is not None and (out.costed is None or out.costed.iteration >= task.incumbent):
        out.schedule = None
    return out


def _layers_per_stage(layers: LayerProfile, counts: tuple[int, ...]) -> list[int]:
    out, lo = [], 0
    for k in counts:
        out.append(sum(u.kind == "layer" for u in layers.units[lo:lo + k]))
        lo += k
    return out


def _planned(task: Task) -> Evaluation:
    c, layers, opt = task.config, task.layers, task.opt
    mesh = c.mesh
    view = opt.plan_view(layers, mesh.dp)
    replicas = None if mesh.dp == 1 else (mesh.dp, mesh.dp_bandwidth(task.cluster) * opt.bandwidth_factor(mesh.dp))
    try:
        res = plan(view, mesh.pp, c.m, task.cluster.memory_bytes, placement=c.placement, optimizer="sgd",
                   time_limit=task.time_limit, milp=task.milp, recompute=c.recompute, data_parallel=replicas,
                   sharing=None if replicas is None else mesh.dp_sharing(task.cluster))
    except ZbError as e:
        text = str(e).replace(" with sgd:", f" with {opt}:")  # plan counted this optimizer's bytes as its sgd's
        return Evaluation("does not fit" if text.startswith("no cut fits") else "no schedule", note=text)
    counts = res.cut.counts
    full = full_profile(layers, counts, c.placement, mesh, task.cluster, opt)
    static = rank_static(layers, counts, c.placement, mesh.pp, opt, mesh.dp)
    sched, costed = cost_schedule(f"plan ({res.schedule.kind})", full, c.m, res.schedule.stage_to_rank,
                                  res.schedule.rank_actions, static, res.schedule.overlapped)
    steps, _ = unit_steps(layers, mesh, task.cluster, opt)
    bound = min(costed.iteration, max(task.bound, res.partition.lower_bound + min(steps)))
    part = res.partition.model_copy(update={
        "optimizer": str(opt), "objective": "iteration", "value": costed.iteration, "lower_bound": bound,
        "gap": costed.iteration / bound - 1 if bound > 0 else 0.0, "static_bytes": static,
    })
    sched = updated(sched, partition=part, memory_limit=res.schedule.memory_limit)
    return Evaluation("costed", costed, bound, counts, _layers_per_stage(layers, counts), c.recompute, sched.kind,
                      schedule=sched)


def _fixed(task: Task) -> Evaluation:
    """A baseline's classic schedule on its cut, or one stage's sequential schedule."""
    c, layers, opt = task.config, task.layers, task.opt
    mesh = c.mesh
    counts = c.counts if c.counts is not None else (layers.num_units,)
    full = full_profile(layers, counts, c.placement, mesh, task.cluster, opt)
    static = rank_static(layers, counts, c.placement, mesh.pp, opt, mesh.dp)
    owner = stage_to_rank(mesh.pp, len(counts), c.placement)
    budget = task.cluster.memory_bytes
    kinds = ["1f1b"] if c.method == "single" else [c.method]
    if c.recompute == AS_NEEDED:
        if all(u.t_r is not None and u.m_fc is not None for u in layers.units):
            kinds.append(f"{c.method}-recompute")
    if budget is not None and any(s >= budget for s in static):
        r = max(range(len(static)), key=static.__getitem__)
        return Evaluation("does not fit", counts=counts, note=f"rank {r}'s parameters, gradients and optimizer state "
                          f"({static[r] / 2**30:.4g} GiB) fill the {budget / 2**30:.4g} GiB")
    over = ""
    for kind in kinds:
        built = build_classic(kind, full, c.m)
        sched, costed = cost_schedule(kind, full, c.m, owner, built.rank_actions, static, built.overlapped)
        acts = [p - s for p, s in zip(costed.peak_bytes, static)]
        if budget is None or all(a <= allowance(budget - s) for a, s in zip(acts, static)):
            recompute = "full" if kind.endswith("-recompute") else "none"
            bound = min(costed.iteration, task.bound) if c.method == "single" else None
            return Evaluation("costed", costed, bound, counts, _layers_per_stage(layers, counts), recompute, kind,
                              schedule=sched)
        r = max(range(len(acts)), key=lambda i: acts[i] + static[i])
        over = (f"{kind} needs {(acts[r] + static[r]) / 2**30:.4g} GiB on rank {r}, over the "
                f"{budget / 2**30:.4g} GiB")
    if c.method == "single" and budget is not None:
        return Evaluation("does not fit", counts=counts, note=over)
    more = "" if len(kinds) > 1 or c.method != "1f1b" else " (the profile has no recomputation costs)"
    return Evaluation("does not fit", counts=counts, note=over + more)
