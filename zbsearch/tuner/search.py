"""``tune``: the configuration of a whole training job on a cluster, searched with bounds.

1. The space (``space``): pipeline degrees, microbatch sizes and counts for the global batch,
   placements and recomputation; the baselines beside it (``baselines``).
2. The baselines are costed first (a share of the time limit): the best of them is the first
   incumbent.
3. Before planning anything, each configuration gets a bound over every cut and schedule
   within the memory (``bounds.config_bound``, only up to the incumbent, within a share of
   the time), or a proof that none of its cuts fits the memory. The least of these and the
   incumbent is the bound over the whole space before planning.
4. The configurations are planned in the order of their bounds, each with a share of the time
   left (its plan's time limit), and costed; a configuration whose bound reaches the best
   iteration found is pruned: it cannot win. Each runs in a worker process that is stopped
   where it runs past its share (``worker``), so the time limit holds.
5. The configurations that may win (``replan_order``: the fastest few costed, then every other
   whose bound is below the best, least bound first) are planned again while time is left,
   each with ``REPLAN_FACTOR`` times the time its first plan had, from a share of the time
   kept for it; each keeps its best plan. A plan under a time limit depends on how far its
   solves get, so one plan of the winner and of its rivals is a sample: the longer second
   plan decides between them.
6. The bound over the whole space is the least of the best iteration and the bounds of every
   configuration not proven unable to beat it.

Every configuration, planned or baseline, is costed the same way (``costing``); the winner is
the fastest of all, so it is never slower than a baseline costed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import clock as timing
from ..errors import ZbError
from ..formats.layers import LayerProfile
from ..formats.schedule import Schedule
from ..solver.verdict import CLOSED
from .baselines import baseline_configurations
from .bounds import cannot_fit, config_bound
from .cluster import Cluster
from .costing import on_cluster
from .evaluate import Evaluation, Task
from .optimizer import OptimizerSetup
from .result import ConfigRow, TuneResult
from .sizes import HOW_SIZES_SCALE, SizedLayers
from .space import PLACEMENTS, Config, configurations
from .worker import Worker

__all__ = ["tune", "Tuned", "Runnable", "TuneProgress", "replan_order", "REPLAN_FACTOR"]

TuneProgress = Callable[[int, int, str], None]  # (configurations done, in all, what is happening)

# share of the time limit for the baselines; the least worth giving a plan, and the most a
# configuration may run past its share before it is stopped (a share of it, and seconds)
_BASELINES = 0.25
_MIN_PLAN_S = 0.5
_OVERRUN, _OVERRUN_S = 0.5, 2.0
# share of the time left after the baselines for bounding every configuration before planning
_BOUNDS = 0.2
# the time limit less this share of it (at least _MARGIN_S) is when the search must end
_MARGIN, _MARGIN_S = 0.02, 0.5
# planning again: the share of the time left after bounding kept for it, how many of the fastest
# configurations first, how much longer than its first plan each is given, and how close to the
# best a costed configuration must be to be among the fastest
_REPLAN, _REPLAN_TOP, REPLAN_FACTOR, _REPLAN_WITHIN = 0.2, 3, 3.0, 0.05


@dataclass(frozen=True)
class Runnable:
    """A costed row's schedule, and the per-layer profile it was costed on."""

    row: ConfigRow
    schedule: Schedule
    layers: LayerProfile


@dataclass
class Tuned:
    """What ``tune`` returns: the result and the winner's schedule (with its ``partition``
    where it was planned), and the per-layer profile the winner was costed on; ``baselines``:
    the best configuration of each baseline costed (by its name), to run beside the winner."""

    result: TuneResult
    schedule: Schedule | None
    layers: LayerProfile | None
    baselines: dict[str, Runnable] = field(default_factory=dict)


# the statuses of the configurations that may be planned again
_REPLANNED = ("costed", "stopped", "not planned", "no schedule")


def replan_order(found: Sequence[tuple[float | None, float | None]], top: int = _REPLAN_TOP,
                 within: float = _REPLAN_WITHIN) -> list[int]:
    """Which configurations to plan again, in order, from each one's (iteration or None, bound
    or None): the ``top`` fastest within ``within`` of the best, then every other by its
    bound, least first; none whose bound reaches the best (it cannot win; the best itself: its
    plan is proven). Ties go to the earlier."""
    best = min((v for v, _ in found if v is not None), default=math.inf)
    open_ = [i for i, (_, b) in enumerate(found) if b is None or b < best * (1 - CLOSED)]
    fastest = sorted((i for i in open_ if (v := found[i][0]) is not None and v <= best * (1 + within)),
                     key=lambda i: (found[i][0], i))[:top]
    rest = sorted((i for i in open_ if i not in fastest and found[i][1] is not None),
                  key=lambda i: (found[i][1], i))
    return fastest + rest


class _Clock:
    def __init__(self, limit: float) -> None:
        self.start = timing.now()
        self.limit = limit
        self.end = self.start + limit - max(_MARGIN * limit, _MARGIN_S)

    def left(self) -> float:
        return self.end - timing.now()


@timing.with_work_clock
def tune(
    profiles: Sequence[LayerProfile],
    cluster: Cluster,
    global_batch: int,
    *,
    tp: int = 1,
    ep: int | None = None,
    optimizer: str = "adamw",
    sharded: bool = False,
    shard: bool = False,
    sizes: Sequence[int] | None = None,
    placements: Sequence[str] = PLACEMENTS,
    recompute: Sequence[str] | None = None,
    seq: int | None = None,
    time_limit: float = 300.0,
    plan_time: float | None = None,
    milp: bool = True,
    baselines: bool = True,
    progress: TuneProgress | None = None,
    deterministic: bool = False,
) -> Tuned:
    """The fastest configuration found within ``time_limit`` seconds (see the module).

    Args:
        profiles: per-layer profiles of one model at one or more microbatch sizes, measured at
            tensor-parallel degree ``tp`` (``zbsearch profile --per-layer -b N``).
        cluster: ranks, nodes, memory and links.
        global_batch: sequences per iteration over all replicas.
        tp: the tensor-parallel degree, given (the profiles are one tensor-parallel rank's).
        ep: the expert-parallel degree of a mixture-of-experts model, given (default: the
            profiles', ``LayerProfile.ep``, which their all-to-all times hold for): only meshes
            whose data-parallel degree it divides are costed, their schedules with overlapped
            pairs where those pay, DualPipeV among the baselines.
        optimizer: ``sgd``, ``adamw`` or ``mixed``; ``sharded``: its state over the replicas
            (ZeRO-1); ``shard``: the stages sharded over the replicas (``fully_shard``).
        sizes: microbatch sizes to search (default: those measured); other sizes' costs are
            interpolated or extrapolated (``sizes``).
        placements: ``one`` and/or ``v``; ``recompute``: the modes searched, ``none``,
            ``auto`` and/or ``full`` (default: ``auto`` where the profiles have recomputation
            costs, else ``none``).
        seq: tokens per sequence for the rates (default: the profiles' ``model.seq``).
        time_limit: seconds for the whole search.
        plan_time: the most seconds one configuration's first plan may take (default: its share);
            the few planned again (see the module) get ``REPLAN_FACTOR`` times their first.
        milp: let plan polish with the solver's MILP windows.
        baselines: cost torchtitan's and Megatron's defaults beside the search.
        progress: called with (done, in all, text) as configurations are done.
        deterministic: ``time_limit`` and ``plan_time`` count work, not seconds
            (``zbsearch.clock``); each configuration's plan is then the same whatever the load
            and whatever was planned before it, and the same inputs give the same result.

    Raises:
        ZbError: bad inputs (one line), or no configuration at all.
    """
    clock = _Clock(time_limit)
    sized = SizedLayers(list(profiles))
    ref = sized.reference
    opt = OptimizerSetup(optimizer, sharded, shard)
    sizes = sorted(set(sizes or sized.measured))
    modes = _modes(ref, recompute)
    _check(cluster, tp, global_batch, sizes, placements, time_limit, plan_time, seq)
    ep = _expert_parallel(list(profiles), ep)
    if seq is None:
        found = (ref.model or {}).get("seq")
        seq = int(found) if isinstance(found, (int, float)) and found >= 1 else None
    configs, left_out = configurations(ref.num_units, cluster.ranks, tp, global_batch, sizes, tuple(placements),
                                       modes, ep)
    bases, not_based = (baseline_configurations(ref, cluster.ranks, tp, global_batch, sizes, ep) if baselines
                        else ([], []))
    if not configs:
        raise ZbError(f"no configuration of {cluster.ranks} ranks (tp {tp}{f', ep {ep}' if ep > 1 else ''}) takes a "
                      f"global batch of {global_batch}: {left_out[0] if left_out else 'nothing to search'}")
    search = _Search(sized, cluster, opt, tp, global_batch, seq, clock, plan_time, milp, progress,
                     len(configs) + len(bases), ep)
    with Worker() as worker:
        worker.start()  # it imports while the configurations are bounded
        search.worker = worker
        search.baselines(bases)
        search.configurations(configs)
        search.replan()
    return search.result(left_out + not_based, sizes, modes)


def _modes(ref: LayerProfile, recompute: Sequence[str] | None) -> tuple[str, ...]:
    """The recomputation modes searched: as asked, else both where the profile allows."""
    offers = any(u.t_r is not None and u.m_fc is not None for u in ref.units) or any(
        u.t_rs is not None and u.m_fs is not None for u in ref.units)
    if recompute is None:  # auto chooses per microbatch and stage, none included
        return ("auto",) if offers else ("none",)
    modes = tuple(dict.fromkeys(recompute))
    bad = [x for x in modes if x not in ("none", "auto", "full")]
    if bad or not modes:
        raise ZbError(f"recompute {bad[0] if bad else 'nothing'!r}: search none, auto or full")
    if not offers and any(x != "none" for x in modes):
        raise ZbError(f"per-layer profile {ref.name!r} has no recomputation costs; measure them with zbsearch profile "
                      "--per-layer --recompute, or search --recompute none")
    return modes


def _expert_parallel(profiles: list[LayerProfile], ep: int | None) -> int:
    """The expert-parallel degree searched: ``ep`` where given, else the profiles'; one line
    where the profiles disagree or were measured at another degree than the one given (their
    all-to-all times hold for theirs)."""
    found = sorted({p.ep for p in profiles})
    if len(found) > 1:
        raise ZbError(f"the per-layer profiles were measured at expert-parallel degrees {', '.join(map(str, found))}: "
                      "give profiles of one degree")
    if ep is None:
        return found[0]
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ZbError(f"the expert-parallel degree must be a whole number of at least 1, not {ep!r}")
    if ep != found[0] and any(p.has_all_to_all for p in profiles):
        raise ZbError(f"--ep {ep}: the per-layer profiles' all-to-all times were measured at ep {found[0]}; profile the "
                      f"model at --ep {ep} (zbsearch profile --per-layer --ep {ep})")
    return ep


def _check(cluster: Cluster, tp: int, global_batch: int, sizes: list[int], placements: Sequence[str],
           time_limit: float, plan_time: float | None, seq: int | None) -> None:
    if tp < 1 or cluster.ranks % tp:
        raise ZbError(f"the tensor-parallel degree {tp} does not divide the {cluster.ranks} ranks")
    if global_batch < 1:
        raise ZbError(f"the global batch must be at least 1 sequence, not {global_batch}")
    if not sizes or min(sizes) < 1:
        raise ZbError("microbatch sizes must be at least 1 sequence")
    bad = [p for p in placements if p not in PLACEMENTS]
    if bad or not placements:
        raise ZbError(f"placement {bad[0] if bad else 'nothing'!r}: search one and/or v")
    if not time_limit > 0 or (plan_time is not None and not plan_time > 0):
        raise ZbError("time limits must be positive")
    if seq is not None and seq < 1:
        raise ZbError(f"the sequence length must be at least 1, not {seq}")


class _Search:
    """The state of one search: the rows found, the incumbent, the worker."""

    def __init__(self, sized: SizedLayers, cluster: Cluster, opt: OptimizerSetup, tp: int, global_batch: int,
                 seq: int | None, clock: _Clock, plan_time: float | None, milp: bool, progress: TuneProgress | None,
                 total: int, ep: int = 1) -> None:
        self.sized, self.cluster, self.opt, self.tp, self.ep = sized, cluster, opt, tp, ep
        self.global_batch, self.seq, self.clock, self.plan_time, self.milp = global_batch, seq, clock, plan_time, milp
        self.progress, self.total, self.done = progress, total, 0
        self.rows: list[ConfigRow] = []
        self.best = float("inf")
        self.schedule: Schedule | None = None
        self.winner_layers: LayerProfile | None = None
        self.family: dict[str, Runnable] = {}  # per baseline, its best configuration's schedule
        self.worker: Worker | None = None
        self._layers: dict[tuple[int, float], LayerProfile] = {}
        self.before: float | None = None  # the bound over the space before planning
        self.tried: list[tuple[Config, ConfigRow]] = []  # every row, with its configuration
        self.given: dict[str, float] = {}  # per configuration planned, the seconds its first plan had

    # ------------------------------------------------------------------ inputs per configuration

    def layers(self, c: Config) -> LayerProfile:
        """The per-layer profile at the configuration's microbatch size, its pipeline messages
        on the cluster's links."""
        key = (c.b, c.mesh.pp_bandwidth(self.cluster))
        if key not in self._layers:
            self._layers[key] = on_cluster(self.sized.at(c.b), c.mesh, self.cluster)
        return self._layers[key]

    def tell(self, text: str) -> None:
        if self.progress is not None:
            best = f"; best {self.best:.6g} ms" if self.best < float("inf") else ""
            self.progress(self.done, self.total, text + best)

    # ------------------------------------------------------------------ the phases

    def baselines(self, bases: list[Config]) -> None:
        """Cost the baselines within their share of the time limit."""
        until = min(self.clock.end, self.clock.start + _BASELINES * self.clock.limit)
        for i, c in enumerate(bases):
            left = until - timing.now()
            if left <= 0:
                self.add(c, None, "not planned", note="the baselines' share of the time limit was spent")
                continue
            self.tell(f"costing {c}")
            share = left / (len(bases) - i)
            best = self.family.get(c.source)  # its schedule comes back where it beats the baseline's best
            ev = self.run(c, float("inf"), share, max(share, left / 2),
                          float("inf") if best is None else best.row.iteration_ms or float("inf"))
            if ev is None:
                self.add(c, None, "stopped", note=f"costing it took more than {max(share, left / 2):.3g} s")
            else:
                self.add(c, ev, ev.status)

    def configurations(self, configs: list[Config]) -> None:
        """Plan the configurations in the order of their bounds, pruning by the best found."""
        bounded: list[tuple[float, Config]] = []
        until = min(self.clock.end, timing.now() + _BOUNDS * self.clock.left())
        for i, c in enumerate(configs):
            self.tell(f"bounding {c}")
            layers = self.layers(c)
            why = cannot_fit(layers, c.stages, c.mesh.pp, self.cluster.memory_bytes, self.opt, c.mesh.dp)
            if why is not None:
                self.add(c, None, "does not fit", note=why)
                continue
            deadline = timing.now() + max(0.0, until - timing.now()) / (len(configs) - i)
            bound = config_bound(layers, c.mesh, c.placement, c.m, c.recompute, self.cluster, self.opt, cap=self.best,
                                 deadline=deadline)
            if bound == math.inf:  # the relaxation found no cut that fits the memory
                self.add(c, None, "does not fit", note="no cut's stages fit the memory with one microbatch's activations "
                                                       "each")
                continue
            bounded.append((bound, c))
        # before planning: every configuration searched is at least the least of these and the best baseline
        self.before = min([self.best, *(b for b, _ in bounded)]) if bounded or self.best < math.inf else None
        bounded.sort(key=lambda bc: (bc[0], str(bc[1])))
        stopped: dict[str, tuple[int, float]] = {}  # per placement: the least stages x m whose plan ran past its share
        kept = _REPLAN * self.clock.left()  # for planning the few that may win again (``replan``)
        for i, (bound, c) in enumerate(bounded):
            if bound >= self.best * (1 - 1e-9):
                self.add(c, None, "pruned", bound=bound, note=f"its bound {bound:.6g} ms reaches the best "
                                                               f"{self.best:.6g} ms")
                continue
            open_ = sum(1 for b, _ in bounded[i:] if b < self.best)
            left = self.clock.left()
            share = (left - kept) / max(1, open_)
            if share < _MIN_PLAN_S:
                if left < _MIN_PLAN_S or self.rows_costed():
                    self.add(c, None, "not planned", bound=bound, note="the time limit was spent")
                    continue
                share = left / max(1, open_)  # nothing costed yet: the time kept for planning again goes here
            if self.plan_time is not None:
                share = min(share, self.plan_time)
            size = c.stages * c.m
            known = stopped.get(c.placement)
            if known is not None and size >= known[0] and share <= known[1]:
                self.add(c, None, "not planned", bound=bound, note=f"the plan of a smaller {c.placement} configuration "
                         f"({known[0]} stages x microbatches) ran past its {known[1]:.3g} s")
                continue
            self.tell(f"planning {c}")
            self.given[str(c)] = max(share, 0.1)
            ev = self.run(c, bound, max(share, 0.1), share + max(_OVERRUN * share, _OVERRUN_S))
            if ev is None:
                self.add(c, None, "stopped", bound=bound, note=f"its plan ran past its {share:.3g} s")
                if known is None or size < known[0]:
                    stopped[c.placement] = (size, share)
            else:
                self.add(c, ev, ev.status, bound=bound)

    def replan(self) -> None:
        """Plan again the configurations that may win (``replan_order``), each given
        ``REPLAN_FACTOR`` times its first plan's time (the longest first plan's where it had
        none) within the time left, keeping its best plan: its row lists every plan's iteration
        (``plans_ms``)."""
        tried = [(c, r) for c, r in self.tried if c.source == "tune" and r.status in _REPLANNED]
        order = replan_order([(r.iteration_ms, r.bound_ms) for _, r in tried])
        longest = max(self.given.values(), default=_MIN_PLAN_S)
        for i in order:
            c, row = tried[i]
            if row.bound_ms is not None and row.bound_ms >= self.best * (1 - CLOSED):
                continue  # the best found meanwhile reaches its bound: it cannot win
            seconds = min(self.clock.left(), REPLAN_FACTOR * self.given.get(str(c), longest))
            if seconds < _MIN_PLAN_S:
                break
            self.tell(f"planning {c} again")
            ev = self.run(c, row.bound_ms or 0.0, seconds, seconds + max(_OVERRUN * seconds, _OVERRUN_S))
            again = f"planned again with {seconds:.3g} s: "
            if ev is None or ev.costed is None:
                if row.status != "costed" and ev is not None:  # what its longer plan found out
                    self.fill(row, c, ev, ev.status, row.bound_ms, row.note)
                row.note = (f"{row.note}; " if row.note else "") + again + (
                    "it ran past that" if ev is None else ev.note or ev.status)
                continue
            plans = [*(row.plans_ms or []), ev.costed.iteration]
            if row.iteration_ms is None or ev.costed.iteration < row.iteration_ms:
                self.fill(row, c, ev, "costed", row.bound_ms, None)
            else:
                row.time_s = round(row.time_s + ev.time_s, 3)
                if ev.bound is not None:  # a bound over every schedule of it, as the first plan's
                    row.bound_ms = max(row.bound_ms or 0.0, ev.bound)
            row.plans_ms = plans

    def rows_costed(self) -> bool:
        return any(r.status == "costed" for r in self.rows)

    def run(self, c: Config, bound: float, seconds: float, wait: float, incumbent: float | None = None
            ) -> Evaluation | None:
        """Evaluate ``c`` in the worker, its plan given ``seconds``; None where it has not
        answered within ``wait`` seconds, or by the end of the time limit. Its schedule comes
        back where it is faster than ``incumbent`` (default: the best iteration found)."""
        assert self.worker is not None
        work = timing.counting()
        task = Task(c, self.layers(c), self.cluster, self.opt, seconds, bound,
                    self.best if incumbent is None else max(incumbent, self.best), self.milp, work)
        if not work:
            return self.worker.evaluate(task, wait, self.clock.start + self.clock.limit - _MARGIN_S)
        # on the work clock the plan keeps to its work limit: it is never stopped by wall time
        # (that would depend on the load), and the work it counted is the search's
        ev = self.worker.evaluate(task, math.inf, math.inf)
        timing.spend(seconds if ev is None else ev.time_s)
        return ev

    # ------------------------------------------------------------------ rows and the result

    def add(self, c: Config, ev: Evaluation | None, status: str, bound: float | None = None,
            note: str | None = None) -> None:
        """Record a configuration's row (and the winner's schedule where it is the best)."""
        self.done += 1
        row = ConfigRow(source=c.source, pp=c.mesh.pp, dp=c.mesh.dp, tp=c.mesh.tp, microbatch_size=c.b,
                        microbatches=c.m, placement=c.placement,
                        recompute=c.recompute, sizes=self.sized.how(c.b), status=status,
                        bound_ms=bound if c.source == "tune" else None, note=note)
        if ev is not None:
            self.fill(row, c, ev, status, bound, note)
        self.rows.append(row)
        self.tried.append((c, row))
        self.tell(f"{c}: {status}")

    def fill(self, row: ConfigRow, c: Config, ev: Evaluation, status: str, bound: float | None,
             note: str | None) -> None:
        """``row`` as ``ev`` found it (and the winner's schedule where it is the best)."""
        row.status = status  # type: ignore[assignment]
        row.note = ev.note or note
        row.time_s = round(row.time_s + ev.time_s, 3)
        row.schedule = ev.kind
        row.units_per_stage = list(ev.counts) if ev.counts is not None else None
        row.layers_per_stage = ev.layers_per_stage
        if ev.recompute is not None:
            row.recompute = ev.recompute
        if ev.bound is not None:
            row.bound_ms = ev.bound if bound is None or c.source != "tune" else max(bound, ev.bound)
        if status == "does not fit" and c.source == "tune" and ev.note and ev.note.startswith("no cut fits"):
            row.note = ev.note + " (among the cuts plan priced)"
        got = ev.costed
        if got is None:
            return
        row.iteration_ms = got.iteration
        row.plans_ms = [got.iteration]
        row.bubble = got.bubble
        row.peak_bytes = max(got.peak_bytes)
        row.recomputed = got.recomputed
        row.overlapped_pairs = ev.pairs
        row.tokens_per_s = self.global_batch * (self.seq or 1) / (got.iteration / 1e3)
        if got.iteration < self.best:
            self.best = got.iteration
            if ev.schedule is not None:
                self.schedule = ev.schedule
                self.winner_layers = self.layers(c)
        known = self.family.get(c.source)
        if c.source != "tune" and ev.schedule is not None and (
                known is None or got.iteration < (known.row.iteration_ms or float("inf"))):
            self.family[c.source] = Runnable(row, ev.schedule, self.layers(c))

    def result(self, left_out: list[str], sizes: list[int], modes: tuple[str, ...]) -> Tuned:
        order = {s: i for i, s in enumerate(("costed", "pruned", "stopped", "not planned", "no schedule", "does not fit"))}
        rows = sorted(self.rows, key=lambda r: (order[r.status], r.iteration_ms if r.iteration_ms is not None else
                                                (r.bound_ms if r.bound_ms is not None else float("inf"))))
        best = next((i for i, r in enumerate(rows) if r.status == "costed"), None)
        lower = gap = before = before_gap = None
        if best is not None:
            value = rows[best].iteration_ms
            assert value is not None
            # every searched configuration's bound, but where it is proven not to fit
            bounds = [r.bound_ms for r in rows if r.source == "tune" and r.bound_ms is not None]
            lower = min([value, *bounds])
            gap = value / lower - 1 if lower > 0 else 0.0
            if self.before is not None:
                before = min(self.before, value)
                before_gap = value / before - 1 if before > 0 else 0.0
        step = ("not priced (no device memory bandwidth given)" if self.cluster.memory_gbs is None else
                f"the optimizer's state streamed at {self.cluster.memory_gbs:g} GB/s")
        result = TuneResult(
            layers=[p.name for p in self.sized.by_size.values()], measured_sizes=self.sized.measured,
            how_sizes_scale=HOW_SIZES_SCALE, cluster=self.cluster, tp=self.tp, ep=self.ep,
            global_batch=self.global_batch, seq=self.seq, optimizer=self.opt.name, sharded=self.opt.sharded,
            shard=self.opt.fully_sharded,
            optimizer_step=step, time_limit_s=self.clock.limit, time_s=round(timing.now() - self.clock.start, 3),
            clock=timing.kind(),
            sizes=sizes, recompute=list(modes), rows=rows, best=best, lower_bound_ms=lower, gap=gap,
            bound_before_planning_ms=before, gap_before_planning=before_gap, left_out=left_out,
        )
        return Tuned(result, self.schedule if best is not None else None, self.winner_layers, dict(self.family))

