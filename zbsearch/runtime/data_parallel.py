"""Data parallelism around the pipeline: each stage's gradients summed over its replicas.

In a mesh, every pipeline position is held by ``dp`` ranks (one per replica), which run the same
schedule on different data. A stage's gradients are complete on a rank once the stage's last W
(or BW) of the step has run there; ``GradientReducer.start(stage)`` then launches their
reduction across the stage's data-parallel group at once, asynchronously, in buckets of about
``bucket_bytes``, while the rank goes on with the passes still to run: a zero-bubble schedule's
last W passes fill the drain, and the reductions of stages finished earlier hide behind them.
``finish()`` waits for them, only before the optimizer step.

Exactness: the runtime seeds each replica's backward with ``1/(m * dp)`` (or ``1/N``, ``N`` the
global batch's tokens), so the SUM over replicas is the gradient of the loss on the global batch,
as one process would compute it. A parameter that has no gradient on a replica (not used by its
microbatches) takes part as zeros; each bucket carries one presence flag per parameter, so a
parameter that no replica gave a gradient keeps ``grad = None``, as on one process. Frozen
parameters (``requires_grad=False``) are left out, and so are expert parameters (``is_expert``):
each rank of an expert-parallel group holds other experts, and a holder's gradient already counts
the tokens every rank of its group sent them. A parameter shared by two stages of one rank
is reduced once, after the later of them.

Buckets are flat copies of a stage's gradients (grouped by dtype and device, in reverse order
of registration, as ``DistributedDataParallel`` groups them); the reduced values are copied back
into ``.grad``. Each bucket's flat tensor is allocated once and kept across steps, as
``DistributedDataParallel`` keeps its buckets (a fresh one costs the host page faults each
step). Copying a host stage's gradients into its buckets takes the host a while (12 MiB: a
millisecond on an idle core, several on a busy one), so ``start`` hands the copies and the
launches of host buckets (CPU tensors, no DTensor) to one thread of the reducer, in the order
the stages finish (every replica launches its collectives in the same order), and the rank
goes on with its next pass at once, as the simulator has it (``zbsearch.reductions``: a
reduction is ready at its stage's last W, and its time is from there). Device buckets are
copied and launched on the rank's thread: their copies are queued on the device, whose order
with the passes is the stream's. Every wait is bounded by the runtime's timeout: a replica
that died or hangs mid-reduction is a one-line ``PipelineError``.

Each reduction is timed from its start to its completion (``last_step``, the trace's lane). A
bucket on the host (gloo on CPU tensors) completes on the group's thread, which notes the time
as it completes; elsewhere (NCCL: the future completes when the work is queued, not run) the
rank notes it when it first sees the work complete, between passes, so such an end reads late
by up to the pass under way.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import PipelineError, post, wait
from .groups import PrivateGloo

__all__ = [
    "GradientReducer", "DEFAULT_BUCKET_BYTES", "refuse_wrapped", "check_replicas", "replica_sum", "mark_expert", "is_expert",
    "Reductions", "note_in_flight", "in_flight",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
_EXPERT = "_zbsearch_expert"  # the marker attribute of expert parameters


def mark_expert(p: nn.Parameter) -> nn.Parameter:
    """Mark ``p`` as an expert parameter: held by one rank of its expert-parallel group (other
    ranks hold other experts), so never reduced across the data-parallel replicas."""
    setattr(p, _EXPERT, True)
    return p


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert parameter (``mark_expert``)."""
    return bool(getattr(p, _EXPERT, False))


# This process's reductions started and not yet seen complete: (stage, whether it is done),
# stage None for one that stands for any stage (the profiler's, ``zbsearch.profiler.slowdown``).
_IN_FLIGHT: list[tuple[int | None, Callable[[], bool]]] = []


def note_in_flight(stage: int | None, done: Callable[[], bool]) -> None:
    """Note a reduction this process has started: ``done()`` says when it has completed."""
    _IN_FLIGHT.append((stage, done))


def in_flight() -> list[int | None]:
    """The stages whose reductions this process has started and that have not completed yet
    (None: any stage): what an emulated stage asks to run at the speed the profile gives it
    beside a reduction (``zbsearch.runtime.emulation``)."""
    _IN_FLIGHT[:] = [(s, done) for s, done in _IN_FLIGHT if not done()]
    return [s for s, _ in _IN_FLIGHT]


@dataclass
class _Bucket:
    """Gradients of some parameters of one dtype and device, reduced as one flat tensor;
    ``completed``: perf_counter when its work completed, noted by the group's thread (host
    buckets only, ``_note_completion``)."""

    params: list[nn.Parameter]
    numel: int
    flat: torch.Tensor | None = None
    work: object | None = None
    completed: float | None = None


def _note_completion(bucket: _Bucket) -> None:
    """Have ``bucket``'s work note when it completes, where its completion is the collective's
    (a host tensor: gloo completes the work on its thread once the sum is in; a device
    tensor's future completes when the work is queued, so those are polled instead)."""
    flat = bucket.flat
    if flat is None or flat.device.type != "cpu" or not hasattr(bucket.work, "get_future"):
        return

    def done(_future, bucket=bucket):
        bucket.completed = time.perf_counter()

    bucket.work.get_future().then(done)


@dataclass
class _Pending:
    """One stage's reduction in flight."""

    stage: int
    buckets: list[_Bucket]
    started: float = 0.0  # perf_counter when start() was called (its stage's last W had just ended)
    done: float | None = None  # perf_counter when it completed (``GradientReducer.poll``)
    works: list = field(default_factory=list)
    posting: Future | None = None  # the reducer's thread copying and launching its buckets, if it does

    def is_done(self) -> bool:
        """Whether every bucket has been launched and has completed (no wait)."""
        if self.posting is not None and not self.posting.done():
            return False
        return all(b.work is None or b.work.is_completed() for b in self.buckets)  # type: ignore[attr-defined]

    def completed(self) -> float | None:
        """When the last of its buckets completed, where every bucket noted it, else None."""
        times = [b.completed for b in self.buckets]
        return None if not times or any(t is None for t in times) else max(t for t in times if t is not None)


def refuse_wrapped(stage: int, module: nn.Module) -> None:
    """Refuse a stage wrapped for data parallelism by a torch wrapper whose hooks fire in the
    wrong pass: ``DistributedDataParallel`` reduces from hooks on parameters that a split
    backward's W does not run, and from a backward it expects once per step, so under a
    pipeline schedule its results are silently wrong; the runtime reduces instead
    (``data_group`` / ``mesh``). FSDP1 likewise. Stages under ``fully_shard`` (FSDP2) run:
    the runtime drives its hooks (``sharded``)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        raise PipelineError(
            f"stage {stage} is wrapped in DistributedDataParallel, whose hooks a pipeline's split backward does not run "
            f"(its gradients would be wrong): pass the module itself (ddp.module) and the data-parallel group as "
            f"PipelineRuntime(..., data_group=...) or mesh=..., and the runtime reduces the gradients"
        )
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    if isinstance(module, FullyShardedDataParallel):
        raise PipelineError(
            f"stage {stage} is wrapped in FullyShardedDataParallel (FSDP1), which the pipeline's split backward cannot "
            f"drive: shard the module with fully_shard (FSDP2) instead, or pass it unwrapped with data_group=... or "
            f"mesh=..., and the runtime reduces the gradients"
        )


def stage_signature(module: nn.Module) -> list[tuple]:
    """What replicas of a stage must agree on: each parameter's name, shape, dtype, whether it
    trains, and how it is laid out across ranks (a DTensor's mesh shape and placements)."""
    out = []
    for name, p in module.named_parameters():
        layout = ""
        if hasattr(p, "placements") and hasattr(p, "device_mesh"):  # a DTensor (tensor parallel, sharded)
            layout = f"{tuple(p.device_mesh.shape)} {tuple(str(x) for x in p.placements)}"
        out.append((name, tuple(p.shape), str(p.dtype), p.requires_grad, layout))
    return out


def check_replicas(group: dist.ProcessGroup, schedule, stages: Mapping[int, nn.Module], rank: int, timeout: float) -> None:
    """Collective over ``group``: every replica runs the same schedule on the same stages (same
    parameters, laid out the same way), else a one-line ``PipelineError`` on every member."""
    ranks = dist.get_process_group_ranks(group)
    digest = repr((schedule.stage_to_rank, schedule.num_microbatches, schedule.actions))
    mine = (rank, digest, {s: stage_signature(m) for s, m in sorted(stages.items())})
    gloo = PrivateGloo("data-parallel", ranks, timeout)
    try:
        theirs = gloo.exchange("replica", mine)
    finally:
        gloo.close()
    me = dist.get_rank()
    for r, (pos, dig, sig) in zip(gloo.ranks, theirs):
        if pos != rank:
            raise PipelineError(
                f"rank {me}: its data-parallel group holds different pipeline positions (rank {me} is pipeline rank "
                f"{rank}, rank {r} is pipeline rank {pos}): each data-parallel group must join the ranks that hold the "
                f"same stages in each replica"
            )
        if dig != digest:
            raise PipelineError(f"rank {me}: replicas were given different schedules (global ranks {me} and {r})")
        if sig != mine[2]:
            raise PipelineError(f"rank {me}: replicas hold different stages: {_difference(mine[2], sig, me, r)}")


def _difference(a: dict, b: dict, ra: int, rb: int) -> str:
    """The first difference between two replicas' stage signatures, in words."""
    for s in sorted(set(a) | set(b)):
        pa, pb = a.get(s, []), b.get(s, [])
        for x, y in zip(pa, pb):
            if x != y:
                what = ["name", "shape", "dtype", "requires_grad", "layout across ranks"]
                field_ = next(i for i in range(5) if x[i] != y[i])
                shown = [v if field_ != 4 else v or "plain" for v in (x[field_], y[field_])]
                return (f"stage {s} parameter {x[0]!r}: {what[field_]} {shown[0]} on global rank {ra}, "
                        f"{shown[1]} on global rank {rb}")
        if len(pa) != len(pb):
            return f"stage {s} has {len(pa)} parameters on global rank {ra}, {len(pb)} on global rank {rb}"
    return "different stage sets"


def replica_sum(value: float, group: dist.ProcessGroup, device: torch.device, timeout: float) -> float:
    """Collective over ``group``: the sum of every member's ``value`` (e.g. a batch's token count)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    what = f"rank {dist.get_rank()}: summing the token count over the data-parallel replicas"
    wait(post(lambda: dist.all_reduce(t, group=group, async_op=True), what), timeout, what)
    return float(t.item())


class GradientReducer:
    """Sums each stage's gradients over its data-parallel replicas, one stage at a time.

    ``stages``: this rank's stages; ``order``: the stages in the order their gradients become
    complete in a step (a parameter held by several is reduced with the last of them).
    ``group``: the data-parallel process group of this rank (its replicas of the same stages).
    ``experts``: reduce the expert parameters (over the ranks holding copies of the same
    experts) instead of the others.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        order: Sequence[int],
        group: dist.ProcessGroup,
        timeout: float,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        experts: bool = False,
    ) -> None:
        if bucket_bytes <= 0:
            raise PipelineError(f"bucket_bytes must be positive, not {bucket_bytes}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.timeout = timeout
        owner: dict[int, int] = {}  # id(param) -> the stage whose completion reduces it
        params: dict[int, nn.Parameter] = {}
        for s in order:
            for p in stages[s].parameters():
                if p.requires_grad and is_expert(p) == experts:
                    owner[id(p)] = s
                    params[id(p)] = p
        self._buckets: dict[int, list[list[nn.Parameter]]] = {}
        for s in order:
            mine = [p for p in stages[s].parameters() if owner.get(id(p)) == s]
            mine = list({id(p): p for p in mine}.values())[::-1]  # once each; the last registered first
            self._buckets[s] = _bucket(mine, bucket_bytes)
        self._flats: dict[int, list[torch.Tensor | None]] = {s: [None] * len(b) for s, b in self._buckets.items()}
        self._poster: ThreadPoolExecutor | None = None  # copies and launches host buckets (module docstring)
        self._pending: list[_Pending] = []
        self.last_step: list[tuple[int, float, float]] = []  # (stage, started, completed) in perf_counter seconds

    @property
    def stages(self) -> list[int]:
        """The stages whose gradients this reducer reduces."""
        return list(self._buckets)

    def parameters(self, stage: int) -> list[nn.Parameter]:
        """The parameters reduced when ``stage`` is done."""
        return [p for ps in self._buckets[stage] for p in ps]

    def buffers(self, stage: int) -> list[torch.Tensor]:
        """Zeros shaped as the flat buckets ``start(stage)`` reduces, one per bucket: what the
        profiler reduces to time the reduction beside a pass (``zbsearch.profiler.slowdown``)."""
        return [torch.zeros(sum(_shard(p).numel() for p in ps) + len(ps), dtype=ps[0].dtype, device=ps[0].device)
                for ps in self._buckets[stage]]

    def start(self, stage: int) -> None:
        """Launch the reduction of ``stage``'s gradients (asynchronous; host buckets copied and
        launched by the reducer's thread, module docstring)."""
        pending = _Pending(stage, [], started=time.perf_counter())
        host = all(p.device.type == "cpu" and not isinstance(p, DTensor) for ps in self._buckets[stage] for p in ps)
        if host:
            if self._poster is None:
                self._poster = ThreadPoolExecutor(1, thread_name_prefix=f"zbsearch-reduce-r{dist.get_rank()}")
            pending.posting = self._poster.submit(self._launch, pending)
        else:
            self._launch(pending)
        self._pending.append(pending)
        note_in_flight(stage, pending.is_done)

    @torch.no_grad()
    def _launch(self, pending: _Pending) -> None:
        """Copy ``pending``'s stage's gradients into its buckets and launch their all-reduces."""
        stage, kept = pending.stage, self._flats[pending.stage]
        for k, params in enumerate(self._buckets[stage]):
            flat = kept[k] = _flatten(params, kept[k])
            what = f"rank {dist.get_rank()}: the data-parallel reduction of stage {stage}"
            work = post(functools.partial(dist.all_reduce, flat, group=self.group, async_op=True), what)
            bucket = _Bucket(params, flat.numel() - len(params), flat, work)
            _note_completion(bucket)
            pending.buckets.append(bucket)

    def poll(self) -> None:
        """Note the time of reductions complete (between passes: no wait): when their buckets
        completed where they noted it, else now (module docstring)."""
        now = None
        for p in self._pending:
            if p.done is None and p.is_done():
                p.done = p.completed() or (now := now or time.perf_counter())

    def close(self) -> None:
        """Stop the reducer's thread, if it has one (after ``finish``)."""
        if self._poster is not None:
            self._poster.shutdown(wait=True)
            self._poster = None

    @torch.no_grad()
    def finish(self) -> list[int]:
        """Wait for every reduction started in this step and write the sums into ``.grad``;
        returns the stages in the order they were started."""
        done = []
        self.last_step = []
        try:
            for p in self._pending:
                if p.posting is not None:
                    p.posting.result()  # launching never blocks: its error (a peer gone), raised here
                for b in p.buckets:
                    what = f"rank {dist.get_rank()}: the data-parallel reduction of stage {p.stage} ({self.size} replicas)"
                    wait(b.work, self.timeout, what)
                    assert b.flat is not None  # set by start
                    _unflatten(b.params, b.flat, b.numel)
                    b.flat = b.work = None  # the flat tensor stays the reducer's, for the next step
                if p.done is None:
                    p.done = p.completed() or time.perf_counter()
                self.last_step.append((p.stage, p.started, p.done))
                done.append(p.stage)
        finally:
            self._pending = []
        return done


def _shard(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (tensor parallelism: the replicas
    of a stage hold the same shards, so shards add up as whole tensors do), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def lay_out_as_parameter(p: nn.Parameter) -> None:
    """A DTensor gradient laid out as its parameter, so that every replica reduces the same shard
    (torch leaves some otherwise: an embedding split by rows gets a replicated gradient, this
    rank keeps its rows; a norm under sequence parallelism a partial one, summed across the
    tensor-parallel group here, where all its ranks are at the same pass)."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)


def _bucket(params: list[nn.Parameter], cap: int) -> list[list[nn.Parameter]]:
    """Parameters in buckets of one dtype and device, each about ``cap`` bytes at most (a
    parameter larger than the cap is a bucket of its own)."""
    buckets: list[list[nn.Parameter]] = []
    open_: dict[tuple, tuple[list[nn.Parameter], int]] = {}
    for p in params:
        key = (p.dtype, p.device)
        size = _shard(p).numel() * p.element_size()
        ps, used = open_.get(key, ([], 0))
        if ps and used + size > cap:
            buckets.append(ps)
            ps, used = [], 0
        ps.append(p)
        open_[key] = (ps, used + size)
    buckets += [ps for ps, _ in open_.values() if ps]
    return buckets


def _flatten(params: list[nn.Parameter], into: torch.Tensor | None = None) -> torch.Tensor:
    """The gradients of ``params`` (zeros for a missing one) as one flat tensor, followed by one
    presence flag per parameter (1 where this rank has a gradient): written into ``into`` where
    it has the size, dtype and device (the bucket's tensor of an earlier step), else a new one."""
    for p in params:
        lay_out_as_parameter(p)
    p0 = params[0]
    numel = sum(_shard(p).numel() for p in params)
    fits = into is not None and into.numel() == numel + len(params) and into.dtype == p0.dtype and into.device == p0.device
    flat = into if fits and into is not None else torch.empty(numel + len(params), dtype=p0.dtype, device=p0.device)
    at = 0
    for i, p in enumerate(params):
        n = _shard(p).numel()
        if p.grad is None:
            flat[at:at + n].zero_()
            flat[numel + i] = 0
        else:
            flat[at:at + n].copy_(_shard(p.grad).reshape(-1))
            flat[numel + i] = 1
        at += n
    return flat


def _unflatten(params: list[nn.Parameter], flat: torch.Tensor, numel: int) -> None:
    """Write the reduced sums back into ``.grad``; a parameter no replica had a gradient for stays None."""
    present = flat[numel:].tolist()
    at = 0
    for p, flag in zip(params, present):
        local = _shard(p)
        n = local.numel()
        if flag > 0:
            value = flat[at:at + n].view_as(local)
            if p.grad is not None:
                _shard(p.grad).copy_(value)
            elif isinstance(p, DTensor):  # laid out as its parameter
                p.grad = DTensor.from_local(value.clone(), p.device_mesh, p.placements, run_check=False)
            else:
                p.grad = value.clone()
        at += n


class Reductions:
    """Several reducers driven as one (the replicated parameters', the expert copies'); the
    first one's lane is the step's (``last_step``)."""

    def __init__(self, reducers: Sequence[GradientReducer]) -> None:
        self.reducers = list(reducers)

    @property
    def last_step(self) -> list[tuple[int, float, float]]:
        """The first reducer's (stage, started, completed) of the last step."""
        return self.reducers[0].last_step

    def start(self, stage: int) -> None:
        """Launch every reducer's reduction of ``stage``."""
        for r in self.reducers:
            r.start(stage)

    def poll(self) -> None:
        """Note reductions seen complete."""
        for r in self.reducers:
            r.poll()

    def finish(self) -> list[int]:
        """Wait for them all; the stages in the order the first reducer started them."""
        done = [r.finish() for r in self.reducers]
        return done[0]

    def close(self) -> None:
        """Stop the reducers' threads."""
        for r in self.reducers:
            r.close()
