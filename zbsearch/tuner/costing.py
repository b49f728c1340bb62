"""A configuration's iteration: its schedule on the stage costs of its cut, ended by the
stages' gradient reductions across the replicas and the optimizer steps.

Each stage's profile is composed from its units (``zbsearch.planner.compose``), their
expert-parallel all-to-all included, so a schedule's overlapped pairs cost what the cost model
says a pair costs. Each stage
reduces its units' gradients, and a tied parameter's on every stage that uses it, across the
``dp`` replicas as a ring all-reduce at the mesh's data-parallel bandwidth, its expert
parameters' (a mixture-of-experts model's) only across each expert's dp / ep copies; each rank then steps
the optimizer over the parameters it holds, a tied one once (``optimizer``). The simulator's
reduction lane (``zbsearch.reductions``) turns the schedule into the iteration: per rank, from
its first pass to its last pass or reduction, plus its optimizer steps; the longest rank's is
the iteration. Memory per rank is its parameters, gradients and optimizer state
(``OptimizerSetup.static_bytes``) plus the schedule's peak activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..actions import RECOMPUTES, Action
from ..formats.layers import LayerProfile, LinkEstimate
from ..formats.profile import Profile
from ..formats.schedule import Schedule
from ..layout import placement as layout
from ..planner import Cut, stage_profile
from ..prediction import timeline, with_prediction
from ..reductions import reduction_time, with_reductions
from .cluster import Cluster, Mesh
from .optimizer import OptimizerSetup

__all__ = ["Costed", "on_cluster", "stage_to_rank", "full_profile", "rank_static", "cost_schedule", "unit_reductions",
           "unit_steps"]


@dataclass(frozen=True)
class Costed:
    """A schedule's iteration (ms) and what it holds."""

    iteration: float
    span: float  # the longest per-rank span, passes only
    busy: float  # the mean over ranks of compute time (ms)
    peak_bytes: list[float]  # per rank: static bytes plus peak activations
    recomputed: int  # forwards checkpointed and recomputed

    @property
    def bubble(self) -> float:
        """The share of the iteration the ranks spend on average not computing: pipeline
        bubbles, reductions the passes do not hide, optimizer steps."""
        return max(0.0, 1.0 - self.busy / self.iteration) if self.iteration > 0 else 0.0


def on_cluster(layers: LayerProfile, mesh: Mesh, cluster: Cluster) -> LayerProfile:
    """``layers`` whose pipeline messages take the mesh's links on the cluster (``Mesh.pp_bandwidth``;
    the latency the cluster's, else the profile's)."""
    latency = cluster.link_latency_ms if cluster.link_latency_ms is not None else layers.link.latency_ms
    link = LinkEstimate(latency_ms=latency, bandwidth_gb_s=mesh.pp_bandwidth(cluster), method="cluster",
                        how="the cluster's links between pipeline neighbours")
    return layers.model_copy(update={"link": link, "t_comm": None})


def stage_to_rank(num_ranks: int, num_stages: int, placement: str) -> list[int]:
    """Stage -> rank: one stage per rank, a V, or interleaving (``looped``)."""
    chunks = num_stages // num_ranks
    return layout(num_ranks, chunks, "v" if placement == "v" else "looped")


def _rank_stages(owner: Sequence[int], bounds: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = [[] for _ in range(max(owner) + 1)]
    for b, r in zip(bounds, owner):
        out[r].append(b)
    return out


def _bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for k in counts:
        out.append((lo, lo + k))
        lo += k
    return out


def full_profile(layers: LayerProfile, counts: Sequence[int], placement: str, mesh: Mesh, cluster: Cluster,
                 opt: OptimizerSetup) -> Profile:
    """The stage profile of the cut ``counts`` with each stage's reduction and optimizer step
    (see the module); ``placement``: ``one``, ``v`` or ``looped``."""
    cut = Cut(tuple(counts), "v" if placement == "v" else "one")
    prof = stage_profile(layers, cut)
    owner = stage_to_rank(mesh.pp, len(counts), placement)
    if placement == "looped":  # the stages' ranks, in the mesh section too where the profile has one
        made = None if prof.mesh is None else prof.mesh.model_copy(update={"pp": mesh.pp})
        prof = prof.model_copy(update={"placement": owner, "mesh": made})
    bw = mesh.dp_bandwidth(cluster)
    grads, experts, steps = [], [], []
    stepped: set[tuple[int, str]] = set()  # (rank, tied key): a tied parameter stepped once per rank
    for s, (lo, hi) in enumerate(_bounds(counts)):
        units = layers.units[lo:hi]
        keys = sorted({k for u in units for k in u.tied})
        grads.append(sum(opt.grad_bytes(u.params, u.param_bytes) for u in units)
                     + sum(opt.grad_bytes(layers.tied[k].params, layers.tied[k].param_bytes) for k in keys))
        experts.append(sum(opt.grad_bytes(u.expert_params, u.expert_param_bytes) for u in units))
        step = sum(opt.step_ms(u.params, u.param_bytes, mesh.dp, cluster.memory_gbs, bw) for u in units)
        for k in keys:
            if (owner[s], k) not in stepped:
                stepped.add((owner[s], k))
                t = layers.tied[k]
                step += opt.step_ms(t.params, t.param_bytes, mesh.dp, cluster.memory_gbs, bw)
        steps.append(step)
    return with_reductions(prof, mesh.dp, bw, grads, sharded=opt.reduce_scatters(mesh.dp), t_opt=steps,
                           expert_bytes=experts, expert_replicas=mesh.dp // layers.ep,
                           sharing=mesh.dp_sharing(cluster)).model_copy(update={"name": prof.name})


def rank_static(layers: LayerProfile, counts: Sequence[int], placement: str, num_ranks: int, opt: OptimizerSetup,
                dp: int) -> list[float]:
    """Per rank, its parameters, gradients, optimizer state and buckets (bytes), a tied
    parameter once per rank that uses it."""
    owner = stage_to_rank(num_ranks, len(counts), placement)
    out = []
    for ranges in _rank_stages(owner, _bounds(counts)):
        units = [u for lo, hi in ranges for u in layers.units[lo:hi]]
        keys = sorted({k for u in units for k in u.tied})
        out.append(sum(opt.static_bytes(u.params, u.param_bytes, dp) + u.frozen_bytes for u in units)
                   + sum(opt.static_bytes(layers.tied[k].params, layers.tied[k].param_bytes, dp) for k in keys))
    return out


def cost_schedule(kind: str, profile: Profile, m: int, owner: list[int], actions: list[list[Action]],
                  static: list[float], overlapped: list[list[int]] | None = None) -> tuple[Schedule, Costed]:
    """The schedule of ``actions`` on ``profile`` (one with reductions), with its overlapped
    pairs where it has any, and its iteration."""
    sched = Schedule.build(kind, profile, m, owner, actions, overlapped=overlapped)
    tl = timeline(sched)
    with_prediction(sched, tl)
    pred = sched.predicted
    assert pred is not None
    iteration = max(pred.iteration) if pred.iteration is not None else max(pred.span)
    recomputed = sum(1 for row in actions for a in row if a.op in RECOMPUTES)
    return sched, Costed(iteration=iteration, span=max(pred.span), busy=sum(tl.busy) / len(tl.busy),
                         peak_bytes=[s + a for s, a in zip(static, pred.peak_memory)], recomputed=recomputed)


def unit_reductions(layers: LayerProfile, mesh: Mesh, cluster: Cluster, opt: OptimizerSetup) -> list[float]:
    """Per unit, the reduction of its gradients, its tied parameters' included (ms)."""
    bw = mesh.dp_bandwidth(cluster)
    sharded = opt.reduce_scatters(mesh.dp)
    return [reduction_time(opt.grad_bytes(u.params, u.param_bytes) - opt.grad_bytes(u.expert_params, u.expert_param_bytes)
                           + sum(opt.grad_bytes(layers.tied[k].params, layers.tied[k].param_bytes) for k in u.tied),
                           mesh.dp, bw, sharded)
            + reduction_time(opt.grad_bytes(u.expert_params, u.expert_param_bytes), mesh.dp // layers.ep, bw, sharded)
            for u in layers.units]


def unit_steps(layers: LayerProfile, mesh: Mesh, cluster: Cluster, opt: OptimizerSetup) -> tuple[list[float], float]:
    """Per unit, its optimizer step (ms), and the tied parameters' steps (each once)."""
    bw = mesh.dp_bandwidth(cluster)
    units = [opt.step_ms(u.params, u.param_bytes, mesh.dp, cluster.memory_gbs, bw) for u in layers.units]
    tied = sum(opt.step_ms(t.params, t.param_bytes, mesh.dp, cluster.memory_gbs, bw) for t in layers.tied.values())
    return units, tied
