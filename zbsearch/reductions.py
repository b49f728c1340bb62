"""The end of an iteration on a mesh: each stage's gradient reduction, then the optimizer step.

In data parallelism every replica of a stage must sum its gradients with the others' before the
optimizer steps. A stage's gradients are complete on its rank once its last W (or BW) of the
iteration has run; the runtime then starts their reduction at once, beside the passes still to
run (``zbsearch.runtime.data_parallel``). The rule, in one place:

* each rank has a reduction lane beside its compute; stage s's reduction becomes ready when its
  last W or BW ends on its rank and takes ``t_reduce[s]``;
* a rank's lane runs its reductions one at a time, in the order they become ready (the order
  of the rank's actions): the runtime starts them on one data-parallel group, which runs its
  collectives in order;
* while the lane runs stage s's reduction, the rank's passes run at 1/``slowdown[s]`` of their
  speed (``reduce_slowdown``, a factor >= 1 measured by ``zbsearch profile --dp``: the
  collective takes cores, memory bandwidth and the host's attention from the passes beside it);
  a pass that overlaps the lane for part of its time is slowed for that part only
  (``slowed_end``). The lane's runs that can overlap a pass are known when it starts: a
  reduction becomes ready at the end of one of the rank's own passes, so every later one starts
  after the pass ends. A factor of 1 (older files) is compute at its own speed;
* the other way round, while the rank has a pass under way, the lane's run of stage s moves at
  1/``stretch[s]`` of its speed (``reduce_stretch``, a factor >= 1 measured in the same rounds
  as ``reduce_slowdown``: on a CPU the collective's threads share the cores with the pass, on a
  GPU its kernels the multiprocessors and memory bandwidth). A run then ends later the more the
  rank computes beside it, so the lane depends on when the rank's passes run, and the simulator
  advances the rank's passes and lane together in time (``SharedLanes``). A factor of 1 (older
  files) is a run at its own speed;
* the rank's iteration ends once its last pass and its last reduction have ended, plus the
  optimizer steps of its stages (``t_opt``), which follow (``iteration_end``).

Lanes of different ranks may share a link: the ranks of one node its NICs, the processes of one
host its cores (``CostModel.lane_link``, from the profile's ``LaneSharing``). While k runs
(reductions or gathers) of lanes on one link are under way, each moves at
1 / (1 + ``share`` (k - 1)) of its speed alone (``share_rate``): share 0, no sharing; share 1,
the link split evenly (processor sharing); the profiler measures it from every rank's reductions
at once against each alone. A run's time alone is ``t_reduce`` (``t_gather``); beside others it
takes longer, and slows the passes beside it for all of that time. A rank's lane then depends
on the others', so the simulator advances every rank's passes and lanes together in time
(``SharedLanes``). Sharing only lengthens: each run starts no earlier and moves no faster than
alone, so bounds priced at full speed still hold.

Sharded stages (``fully_shard``) also gather their parameters at the step's start
(``t_gather``; the runtime starts every gather at once and each stage's first pass waits for
its own, ``zbsearch.runtime.sharded``):

* a rank's lane runs its gathers first, one at a time in stage order, from the rank's step
  start; a stage's first pass of the step starts no earlier than its gather's end;
* every rank starts its step at time 0 (the simulator's origin), where its lane runs its
  gathers (and where the timeline draws them), so the first pass of stage s waits until the
  rank's gathers up to s have run (``gather_ends``); the rank's iteration counts from the
  latest step start that lets each stage's gather end by its first pass (``step_start``: in
  steady state a rank idle before its first input hides its gathers there);
* a stage's backward needs the forwards of every later stage, so every reduction becomes ready
  after the rank's last gather: the gathers never delay a reduction;
* while stage s's gather runs (from the rank's step start at 0, as its first pass waits for it)
  the rank's passes run at 1/``slowdown[s]`` of their speed, as beside a reduction.

A pass's time under a slowdown is never below its time alone, nor a run's under a stretch, and
a pass or run starting later never ends earlier, so every pass and run of a schedule ends no
earlier than with both factors 1: bounds computed at full speed (``CostModel.without_slowdown``)
hold with them.

A schedule that leaves a rank work after a stage's last backward hides that stage's reduction
behind it; one whose every stage ends with the rank's last pass pays the reductions in full.
Without reductions (``CostModel.has_reductions`` false) a rank's iteration is its span.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import permutations
from typing import Any

from .actions import Action, Op

__all__ = ["Reduction", "Slowing", "lane", "lane_next", "lane_runs", "share_rate", "SharedLanes", "shared_lane_runs",
           "iteration_end", "step_start", "slowed_end", "gather_ends", "first_passes", "gather_releases",
           "gathers", "last_backward", "lane_floors", "iteration_floor", "reduction_time", "with_reductions",
           "with_measured_reductions", "given_sharing", "grad_bytes_per_stage", "gain_kept"]

Reduction = tuple[int, float, float]  # (stage, start, end), ms
Slowing = tuple[float, float, float]  # (start, end, factor): a run of the lane that slows the passes beside it


def last_backward(row: Sequence[Action]) -> dict[int, int]:
    """Per stage of a rank's action list, the position of its last W or BW (where its gradients
    are complete), in the order of those positions."""
    last: dict[int, int] = {}
    for i, a in enumerate(row):
        if a.op in (Op.W, Op.BW):
            last.pop(a.stage, None)
            last[a.stage] = i
    return dict(sorted(last.items(), key=lambda kv: kv[1]))


def lane_next(free: float, at: float, took: float) -> tuple[float, float]:
    """(start, end) of a run of ``took`` ms ready at ``at`` on a lane free from ``free``, alone
    on its link: the lane runs one thing at a time, each from its ready time or the end of the
    one before."""
    start = at if at > free else free
    return start, start + took


def lane_runs(ready: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """When a lane runs its reductions, given each one's (ready time, duration) in the order
    they become ready (``lane_next``, one after the other). (start, end) of each, in that order."""
    free = 0.0
    out = []
    for at, took in ready:
        start, free = lane_next(free, at, took)
        out.append((start, free))
    return out


def share_rate(k: int, share: float) -> float:
    """The speed, against its time alone, of each of ``k`` runs at once on lanes sharing one
    link, for the link's measured ``share`` (module docstring): 1 / (1 + share (k - 1)). Share 0:
    every run at full speed; share 1: the link's bandwidth split evenly (processor sharing)."""
    return 1.0 / (1.0 + share * (k - 1)) if k > 1 else 1.0


class SharedLanes:
    """Lanes whose runs progress together in time, those on one link at ``share_rate`` of the
    runs under way on it, and each at 1/its ``stretch`` while its rank computes (module
    docstring): the rule in one place, for the simulator (which adds runs as passes end, says
    which ranks compute and advances the lanes between its events) and ``shared_lane_runs``.

    ``link[l]``: the link of lane l (lanes with the same value share it); ``share``: its
    parameter. Each lane runs its runs one at a time, in the order they were added; a run added
    to an idle lane starts at once. ``computing[l]``: whether lane l's rank has a pass under way
    (the caller sets it; False: the lane's runs at their speed on the link). ``runs[l]``: (tag,
    start, end) of lane l's finished runs."""

    def __init__(self, link: Sequence[int], share: float):
        self.link, self.share = list(link), share
        self.t = 0.0
        self.queue: list[list[tuple[Any, float, float]]] = [[] for _ in self.link]  # (tag, ms alone, stretch)
        # (tag, start, ms left alone, stretch)
        self.current: list[tuple[Any, float, float, float] | None] = [None] * len(self.link)
        self.runs: list[list[tuple[Any, float, float]]] = [[] for _ in self.link]
        self.computing = [False] * len(self.link)
        self._busy: dict[int, int] = {}  # per link, its lanes with a run under way

    def add(self, lane: int, took: float, tag: Any, stretch: float = 1.0) -> None:
        """A run of ``took`` ms alone, ready now (``self.t``), queued on ``lane``; ``stretch``:
        how much slower it moves while the lane's rank computes."""
        self.queue[lane].append((tag, took, stretch))
        if self.current[lane] is None:
            self._start(lane)

    def rate(self, lane: int) -> float:
        """The speed of ``lane``'s run under way, now."""
        rate = share_rate(self._busy.get(self.link[lane], 0), self.share)
        cur = self.current[lane]
        return rate / cur[3] if cur is not None and self.computing[lane] else rate

    def running(self, lane: int) -> Any:
        """The tag of ``lane``'s run under way, or None."""
        cur = self.current[lane]
        return None if cur is None else cur[0]

    def next_end(self) -> float:
        """When the first run under way ends if nothing is added (inf: none under way)."""
        best = float("inf")
        for lane, cur in enumerate(self.current):
            if cur is not None:
                at = self.t + cur[2] / self.rate(lane)
                if at < best:
                    best = at
        return best

    def advance(self, until: float) -> None:
        """Run the lanes to time ``until``, ending the runs that end by then (and starting the
        next of their lane at their end)."""
        while True:
            end = self.next_end()
            to = until if end > until else end
            if to > self.t and end < float("inf"):
                step = to - self.t
                for lane, cur in enumerate(self.current):
                    if cur is not None:
                        self.current[lane] = (cur[0], cur[1], cur[2] - step * self.rate(lane), cur[3])
                self.t = to
            if end > until or end == float("inf"):
                if until > self.t and end == float("inf"):  # nothing under way
                    self.t = until
                return
            done = [lane for lane, cur in enumerate(self.current)
                    if cur is not None and cur[2] <= 1e-9 * max(1.0, abs(self.t))]
            for lane in done:
                self._finish(lane)
            for lane in done:
                if self.queue[lane]:
                    self._start(lane)

    def _start(self, lane: int) -> None:
        tag, took, stretch = self.queue[lane].pop(0)
        if took <= 0:  # nothing to move: it ends where it starts, and the next one starts
            self.runs[lane].append((tag, self.t, self.t))
            if self.queue[lane]:
                self._start(lane)
            return
        self.current[lane] = (tag, self.t, took, stretch)
        self._busy[self.link[lane]] = self._busy.get(self.link[lane], 0) + 1

    def _finish(self, lane: int) -> None:
        cur = self.current[lane]
        assert cur is not None
        self.runs[lane].append((cur[0], cur[1], self.t))
        self.current[lane] = None
        self._busy[self.link[lane]] -= 1


def shared_lane_runs(ready: Sequence[Sequence[tuple[float, float]]], link: Sequence[int],
                     share: float) -> list[list[tuple[float, float]]]:
    """``lane_runs`` of several lanes at once, lanes with the same ``link`` sharing it
    (``SharedLanes``): per lane, (start, end) of each of its runs, given each one's (ready time,
    ms alone) in the order they become ready. With share 0, or each lane on its own link, every
    lane's ``lane_runs``."""
    lanes = SharedLanes(link, share)
    events = sorted((at, lane, k) for lane, row in enumerate(ready) for k, (at, _) in enumerate(row))
    for at, lane, k in events:
        lanes.advance(at)
        lanes.add(lane, ready[lane][k][1], k)
    lanes.advance(float("inf"))
    return [[(a, b) for _, a, b in sorted(runs, key=lambda x: x[0])] for runs in lanes.runs]


def lane(row: Sequence[Action], ends: Sequence[float], t_reduce: Sequence[float],
         t_opt: Sequence[float]) -> tuple[list[Reduction], float]:
    """One rank's reductions (stage, start, end) and the end of its iteration, from its action
    list and the end of each action (module docstring)."""
    last = last_backward(row)
    runs = lane_runs([(ends[i], t_reduce[s]) for s, i in last.items()])
    out = [(s, start, end) for s, (start, end) in zip(last, runs)]
    return out, iteration_end(row, ends, out, t_opt)


def iteration_end(row: Sequence[Action], ends: Sequence[float], reductions: Sequence[Reduction],
                  t_opt: Sequence[float]) -> float:
    """When a rank's iteration ends: its last pass or its last reduction, whichever ends later,
    then the optimizer steps of its stages (module docstring)."""
    finish = max([*(end for _, _, end in reductions), *ends[-1:]], default=0.0)
    return finish + sum(t_opt[s] for s in {a.stage for a in row})


def slowed_end(start: float, work: float, runs: Sequence[Slowing], first: int = 0) -> float:
    """When a pass of ``work`` ms alone, started at ``start``, ends beside the lane's ``runs``
    (start, end, factor; in time order, not overlapping, from index ``first``): at full speed
    outside them, at 1/factor inside (module docstring)."""
    t, left = start, work
    for k in range(first, len(runs)):
        a, b, f = runs[k]
        if b <= t or f == 1.0:
            continue
        if a > t:
            if t + left <= a:
                return t + left
            left -= a - t
            t = a
        if left * f <= b - t:
            return t + left * f
        left -= (b - t) / f
        t = b
    return t + left


def gather_ends(stages: Iterable[int], t_gather: Sequence[float]) -> dict[int, float]:
    """When each stage's gather ends from its rank's step start: the rank's gathers one at a
    time in stage order (``stages``: the rank's, any order)."""
    out, t = {}, 0.0
    for s in sorted(stages):
        t += t_gather[s]
        out[s] = t
    return out


def first_passes(row: Sequence[Action]) -> dict[int, int]:
    """Per stage of a rank's action list, the position of its first pass: the one that waits
    for the stage's gather."""
    first: dict[int, int] = {}
    for i, a in enumerate(row):
        first.setdefault(a.stage, i)
    return first


def gather_releases(row: Sequence[Action], t_gather: Sequence[float]) -> dict[int, float]:
    """Position -> when it may start, for the first pass of each stage of a rank's action list
    whose gather (or an earlier one of the rank) takes time: the end of its gather
    (``gather_ends``). Empty without gathers."""
    if not t_gather:
        return {}
    first = first_passes(row)
    ends = gather_ends(first, t_gather)
    return {i: ends[s] for s, i in first.items() if ends[s] > 0}


def gathers(row: Sequence[Action], starts: Sequence[float], t_gather: Sequence[float]) -> tuple[list[Reduction], float]:
    """One rank's gathers (stage, start, end), where its lane runs them alone on its link (from
    the origin, ``gather_ends``), and its step's start (``step_start``), from its action list and
    the start of each action."""
    first: dict[int, float] = {}
    for a, t in zip(row, starts):
        first.setdefault(a.stage, t)
    if not first:
        return [], 0.0
    ends = gather_ends(first, t_gather)
    return [(s, e - t_gather[s], e) for s, e in ends.items() if t_gather[s] > 0], step_start(row, starts, ends)


def step_start(row: Sequence[Action], starts: Sequence[float], gathered: dict[int, float]) -> float:
    """A rank's step start, from which its iteration counts: the latest that lets each stage's
    gather (ending at ``gathered[s]`` from the origin, where the lane runs it) end by the stage's
    first pass (module docstring); with no passes, 0."""
    first: dict[int, float] = {}
    for a, t in zip(row, starts):
        first.setdefault(a.stage, t)
    return min((first[s] - gathered.get(s, 0.0) for s in first), default=0.0)


def lane_floors(cost) -> list[float]:
    """Per rank, what its iteration adds to its span at least, in every schedule: its last pass
    is one of its stages' last backward, whose reduction starts after it (the least of its
    stages' ``t_reduce``), and then come its optimizer steps. Zero without reductions."""
    if not cost.has_reductions:
        return [0.0] * cost.num_ranks
    return [min(cost.t_reduce[s] for s in cost.rank_stages(r)) + sum(cost.t_opt[s] for s in cost.rank_stages(r))
            for r in range(cost.num_ranks)]


def iteration_floor(span: float, ends: dict[int, float], t_reduce: Sequence[float], t_opt: Sequence[float]) -> float:
    """The least iteration of a rank holding the stages of ``ends``, given a lower bound on its
    span (``span``) and on the end of each stage's last backward (``ends``), both from its first
    start. Whatever order the stages finish in, each one's last backward ends no earlier than
    its own bound and those of the stages finished before it, the last one no earlier than the
    span's; the lane then runs the reductions in that order, each from its stage's end, so it
    ends no earlier than any stage's end plus its reduction and those of the stages after it.
    The least over the orders, plus the optimizer steps. With one stage: span + its reduction.
    Sound for any number of stages; beyond 6 the orders are not tried and the floor is the
    span plus the smallest reduction (``lane_floors``)."""
    stages = list(ends)
    steps = sum(t_opt[s] for s in stages)
    if not stages:
        return span + steps
    if len(stages) > 6:
        return span + min(t_reduce[s] for s in stages) + steps
    best = float("inf")
    for order in permutations(stages):
        lows, low = [], 0.0
        for k, s in enumerate(order):
            low = max(low, ends[s])
            lows.append(max(low, span) if k == len(order) - 1 else low)
        finish, after = 0.0, 0.0
        for k in reversed(range(len(order))):
            after += t_reduce[order[k]]
            finish = max(finish, lows[k] + after)
        best = min(best, finish)
    return best + steps


def reduction_time(grad_bytes: float, replicas: int, bandwidth_gbs: float, sharded: bool = False,
                   latency_ms: float = 0.0) -> float:
    """Milliseconds to reduce ``grad_bytes`` of gradients across ``replicas`` ranks on links of
    ``bandwidth_gbs`` GB/s per rank, as a ring does it: an all-reduce moves 2(N-1)/N of the bytes
    through each rank in 2(N-1) steps, a reduce-scatter (sharded data parallelism) half that;
    each step also costs ``latency_ms``. One replica reduces nothing."""
    n = replicas
    if n <= 1:
        return 0.0
    steps = (n - 1) * (1 if sharded else 2)
    return steps / n * grad_bytes / (bandwidth_gbs * 1e9) * 1e3 + steps * latency_ms


def given_sharing(share: float, ranks_per_link: int | None = None, *,
                  names: tuple[str, str] = ("the share", "ranks_per_link")):
    """The ``LaneSharing`` a user gives for reductions priced from bytes (``with_reductions``):
    while k runs of ranks on one link are under way each moves at 1 / (1 + ``share`` (k - 1))
    of its speed alone (``share_rate``); ``ranks_per_link`` consecutive pipeline ranks share a
    link (None: every rank of the pipeline). ZbError, one line naming the value by ``names``,
    for one out of range."""
    import math

    from .errors import ZbError
    from .formats.profile import MAX_SLOWDOWN, LaneSharing

    if not (isinstance(share, (int, float)) and math.isfinite(share) and 0 <= share <= MAX_SLOWDOWN):
        raise ZbError(f"{names[0]} must be a number from 0 to {MAX_SLOWDOWN:g}, not {share}: 0, lanes on one link never "
                      "slow each other; 1, runs at once split the link evenly")
    if ranks_per_link is not None and not (isinstance(ranks_per_link, int) and ranks_per_link >= 1):
        raise ZbError(f"{names[1]} must be a whole number of pipeline ranks, at least 1, not {ranks_per_link}")
    return LaneSharing(share=float(share), ranks_per_link=ranks_per_link)


def with_reductions(profile, replicas: int, bandwidth_gbs: float, grad_bytes: Sequence[float], *,
                    sharded: bool = False, latency_ms: float = 0.0, t_opt: Sequence[float] | None = None,
                    expert_bytes: Sequence[float] | None = None, expert_replicas: int = 1, sharing=None):
    """A copy of ``profile`` whose stages end the iteration with their gradient reduction across
    ``replicas`` (``reduction_time`` of each stage's ``grad_bytes``) and, where given, their
    optimizer step (``t_opt``, ms per stage); ``sharded``, a reduce-scatter, and each stage
    gathers its parameters (as many bytes) at the step's start (``t_gather``).

    ``expert_bytes``: per stage, the part of ``grad_bytes`` that is expert parameters', reduced
    only across each expert's ``expert_replicas`` copies (the data-parallel ranks over the
    expert-parallel degree; one copy reduces nothing), after the rest across ``replicas``.
    ``sharing`` (``LaneSharing``, ``given_sharing``): how the lanes of ranks on one link slow
    each other (None: not at all)."""
    from .errors import ZbError
    from .formats.profile import DataParallel

    _check_per_stage(profile, grad_bytes, t_opt)
    experts = [0.0] * len(grad_bytes) if expert_bytes is None else list(expert_bytes)
    if replicas < 1 or bandwidth_gbs <= 0 or latency_ms < 0 or min(grad_bytes) < 0:
        raise ZbError("reductions need at least 1 replica, a positive bandwidth and no negative bytes or latency")
    if len(experts) != len(grad_bytes) or min(experts) < 0 or any(e > b for e, b in zip(experts, grad_bytes)) \
            or not 1 <= expert_replicas <= replicas:
        raise ZbError("expert gradient bytes must be given per stage, at most each stage's gradient bytes, and "
                      "reduced across 1 to the data-parallel replicas")
    t_reduce = [reduction_time(b - e, replicas, bandwidth_gbs, sharded, latency_ms)
                + reduction_time(e, expert_replicas, bandwidth_gbs, sharded, latency_ms) for b, e in zip(grad_bytes, experts)]
    # sharded: the parameters are gathered at the step's start, an all-gather of as many bytes
    # as the gradients (the same dtype), which a ring moves like a reduce-scatter
    t_gather = t_reduce if sharded else None
    dp = DataParallel(replicas=replicas, sharded=sharded, how="bandwidth", bandwidth_gbs=bandwidth_gbs,
                      grad_bytes=list(grad_bytes), sharing=sharing,
                      **({"expert_bytes": experts, "expert_replicas": expert_replicas} if any(experts) else {}))
    return _ending_with(profile, dp, t_reduce, t_opt, t_gather)


def with_measured_reductions(profile, replicas: int, reduce_ms: Sequence, grad_bytes: Sequence[float], *,
                             group: str, backend: str, t_opt: Sequence[float] | None = None,
                             slowdown: Sequence | None = None, gather_ms: Sequence | None = None, sharing=None,
                             stretch: Sequence | None = None):
    """A copy of ``profile`` whose stages end the iteration with their gradient reduction across
    ``replicas`` as timed on a real group: ``reduce_ms`` per stage (``Quartiles``; ``t_reduce``
    is the median), ``group`` ``local`` or ``torchrun``, ``backend`` the process group's; and,
    where given, their optimizer step (``t_opt``, ms per stage) and how much the reduction
    slowed a pass beside it (``slowdown``, per stage ``Quartiles`` of the factor or None where
    not measured; ``reduce_slowdown`` is the median, at least 1) and how much a pass beside it
    slowed the reduction (``stretch``, likewise; ``reduce_stretch``). ``gather_ms`` (``Quartiles``
    per stage): the stages are sharded, their reductions reduce-scatters, and each gathers its
    parameters at the step's start (``t_gather``, the median). ``sharing`` (``LaneSharing``): how
    the reductions of ranks on one link slowed each other."""
    from .errors import ZbError
    from .formats.profile import DataParallel

    _check_per_stage(profile, grad_bytes, t_opt)
    if len(reduce_ms) != profile.num_stages or replicas < 1 or (gather_ms is not None and len(gather_ms) != len(reduce_ms)):
        raise ZbError(f"profile {profile.name!r} has {profile.num_stages} stages: give one reduction (and gather) time per "
                      "stage and at least 1 replica")
    for what, f in (("slowdown", slowdown), ("stretch", stretch)):
        if f is not None and len(f) != profile.num_stages:
            raise ZbError(f"profile {profile.name!r} has {profile.num_stages} stages: give one {what} per stage")
    dp = DataParallel(replicas=replicas, sharded=gather_ms is not None, how="measured", grad_bytes=list(grad_bytes),
                      group=group, backend=backend, reduce_ms=list(reduce_ms),
                      gather_ms=None if gather_ms is None else list(gather_ms),
                      slowdown=None if slowdown is None else list(slowdown), sharing=sharing,
                      stretch=None if stretch is None else list(stretch))
    out = _ending_with(profile, dp, [q.median for q in reduce_ms], t_opt,
                       None if gather_ms is None else [q.median for q in gather_ms])
    from .formats.profile import MAX_SLOWDOWN

    stages = out.stages
    for name, measured in (("reduce_slowdown", slowdown), ("reduce_stretch", stretch)):
        if measured is not None:
            factors = [None if q is None else min(MAX_SLOWDOWN, max(1.0, q.median)) for q in measured]
            stages = [c.model_copy(update={name: f}) for c, f in zip(stages, factors)]
    return out if stages is out.stages else out.model_copy(update={"stages": stages})


def _check_per_stage(profile, grad_bytes: Sequence[float], t_opt: Sequence[float] | None) -> None:
    from .errors import ZbError

    P = profile.num_stages
    if len(grad_bytes) != P or (t_opt is not None and len(t_opt) != P):
        raise ZbError(f"profile {profile.name!r} has {P} stages: give one gradient size (and optimizer time) per stage")


def _ending_with(profile, dp, t_reduce: Sequence[float], t_opt: Sequence[float] | None,
                 t_gather: Sequence[float] | None = None):
    """``profile`` with each stage's ``t_reduce``, ``t_opt`` and ``t_gather`` and its ``data_parallel`` section."""
    stages = [c.model_copy(update={"t_reduce": t_reduce[i], "t_opt": None if t_opt is None else t_opt[i],
                                   "t_gather": None if t_gather is None else t_gather[i]})
              for i, c in enumerate(profile.stages)]
    update = {"stages": stages, "data_parallel": dp, "name": f"{profile.name}-dp{dp.replicas}"}
    if profile.mesh is not None:  # the mesh's data-parallel sizes are the reductions'
        sizes = {"dp_replicate": 1, "dp_shard": dp.replicas} if dp.sharded else {"dp_replicate": dp.replicas, "dp_shard": 1}
        update["mesh"] = profile.mesh.model_copy(update=sizes)
    return profile.model_copy(update=update)


def grad_bytes_per_stage(text: str, num_stages: int) -> list[float]:
    """Gradient bytes per stage as users write them: the model's total (``3GB``), split evenly
    over the stages, or one size per stage, comma-separated (``1.6GB,1.4GB``)."""
    from .errors import ZbError
    from .limits import parse_bytes

    parts = [x for x in text.split(",") if x.strip()]
    sizes = [parse_bytes(x) for x in parts]
    if not sizes or any(x is None for x in sizes):
        raise ZbError(f"cannot read the gradient bytes {text!r}: give the model's total (3GB) or one size per stage")
    if len(sizes) == 1:
        return [sizes[0] / num_stages] * num_stages  # type: ignore[operator]
    if len(sizes) != num_stages:
        raise ZbError(f"{len(sizes)} gradient sizes for {num_stages} stages: give the model's total or one per stage")
    return [float(x) for x in sizes]  # type: ignore[arg-type]


def gain_kept(base_span: float, base_iteration: float, span: float, iteration: float) -> float | None:
    """How much of a schedule's gain over a base schedule (1F1B, say) in span remains in the
    iteration, the reductions and optimizer steps included: (base_iteration - iteration) /
    (base_span - span). 1 keeps it all; below 1 the reductions eat part of it; above 1 the
    schedule also hides more of them. None where the span gains nothing."""
    gain = base_span - span
    if gain <= 1e-9 * max(base_span, 1.0):
        return None
    return (base_iteration - iteration) / gain
