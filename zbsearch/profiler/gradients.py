"""What a stage adds to the iteration on a data-parallel mesh: the bytes of gradients it
reduces across its replicas, the time that reduction takes, and its optimizer step.

``zbsearch profile --dp N`` times each stage's reduction on a real data-parallel group of N
ranks, as the runtime reduces it (``GradientReducer``: its buckets, flattened and copied back),
every stage one after the other with all the group's members at once: on N local processes
of this machine over gloo (``measure_locally``), or under torchrun on the replicas started with
the pipeline (``reduction_samples`` on each rank's data-parallel group). With
``--dp-bandwidth GBS`` it prices them instead as a ring all-reduce of these bytes
(``zbsearch.reductions``). Either way it records the step of torch's AdamW on the stage's
parameters, timed on the profiling device, as its ``t_opt``. Where it times the reductions on a
real group it also times each stage's pass with the stage's reduction running beside it, and
records how much slower the pass ran (``reduce_slowdown``, ``zbsearch.profiler.slowdown``);
on local processes only for stages of one rank each (not ``--tp``).

With ``--shard`` the stages are sharded over the replicas (``fully_shard``), and each stage's
step starts by gathering its parameters and ends by reduce-scattering its gradients: both are
timed as the runtime runs them (``zbsearch.runtime.sharded``), on a stand-in with the stage's
units (``shard_units``: its parameters' shapes, sharded unit by unit as ``shard_stage`` shards
a stage) over the data-parallel group (``sharded_samples``), or priced from the bytes. Where
timed, the stage's pass is also timed beside its gathers and reduce-scatters, for its
``reduce_slowdown`` (``zbsearch.profiler.slowdown``).

Where it times them on a real group it also measures how the lanes of pipeline ranks on one
link slow each other (``LaneSharing``, ``lane_sharing``): each rank's reductions (sharded: its
reduce-scatters) alone, the other ranks waiting, then every rank's at once
(``sharing_samples``, ``sharded_sharing_samples``; locally ``measure_sharing_locally``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import run_local
from ..formats.profile import MAX_SLOWDOWN, LaneSharing, Profile, Quartiles
from ..reductions import with_measured_reductions, with_reductions
from .measure import Stats

if TYPE_CHECKING:
    from .slowdown import Factors

__all__ = ["gradient_layout", "gradient_bytes", "optimizer_step_ms", "with_data_parallel", "reduction_samples", "measure_locally",
           "with_measured_data_parallel", "shard_units", "sharded_samples", "sharded_sharing_samples",
           "measure_sharded_locally"]

# Untimed reductions of each stage before the timed ones (the first allocates the buckets and
# opens the group's connections).
_WARMUP = 1


def _trainable(module: nn.Module) -> list[torch.Tensor]:
    """What this rank holds of the module's parameters that get gradients, each once (a tied
    weight is one parameter; a tensor-parallel DTensor parameter is its local shard)."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters() if p.requires_grad]


Layout = list[tuple[tuple[int, ...], torch.dtype]]  # the shapes and dtypes of a stage's gradients


def gradient_layout(module: nn.Module, dtype: torch.dtype | None = None) -> Layout:
    """The shapes of the gradients ``module`` reduces on this rank, in ``dtype`` (None: each
    parameter's own)."""
    return [(tuple(p.shape), dtype or p.dtype) for p in _trainable(module)]


def gradient_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> float:
    """Bytes of the gradients ``module`` reduces on this rank: its trainable parameters'
    elements (their local shards, tensor-parallel) in ``dtype`` (None: each parameter's own)."""
    return float(sum(p.numel() * (dtype or p.dtype).itemsize for p in _trainable(module)))


def optimizer_step_ms(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None, *,
                      warmup: int = 2, repeat: int = 5) -> float:
    """Median time (ms) of an AdamW step over copies of ``module``'s trainable parameters on
    ``device`` (in ``dtype``; None: their own), with gradients in place."""
    params = [nn.Parameter(p.detach().to(device=device, dtype=dtype or p.dtype).clone()) for p in _trainable(module)]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + repeat):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def with_data_parallel(profile: Profile, stages: list[nn.Module], replicas: int, bandwidth_gbs: float,
                       device: torch.device, dtype: torch.dtype | None = None, sharded: bool = False,
                       sharing: LaneSharing | None = None) -> Profile:
    """``profile`` whose stages end the iteration with the ring all-reduce of their gradients
    across ``replicas`` at ``bandwidth_gbs`` GB/s per rank, then their AdamW step (timed here);
    ``sharded``, a reduce-scatter, after an all-gather of as many bytes at the step's start;
    ``sharing``, how the lanes of ranks on one link slow each other (``reductions.given_sharing``)."""
    grads = [gradient_bytes(m, dtype) for m in stages]
    steps = [optimizer_step_ms(m, device, dtype) for m in stages]
    return with_reductions(profile, replicas, bandwidth_gbs, grads, t_opt=steps, sharded=sharded, sharing=sharing)


@torch.no_grad()
def reduction_samples(modules: Sequence[nn.Module], group: dist.ProcessGroup | None, repeat: int,
                      timeout: float) -> list[list[float]]:
    """Collective over ``group``: per module, ``repeat`` times (ms) of the reduction of its
    gradients across the group, as the runtime reduces them (``GradientReducer``), each started
    by every member at once after a barrier. A parameter without a gradient takes part with
    zeros, which leaves it without one afterwards."""
    from ..runtime.data_parallel import GradientReducer

    on = group if group is not None else dist.group.WORLD
    assert on is not None  # the default group exists: the caller joined it
    reducer = GradientReducer(dict(enumerate(modules)), list(range(len(modules))), on, timeout)
    cuda = [p.device for m in modules for p in _trainable(m) if p.device.type == "cuda"]
    out: list[list[float]] = []
    for i in range(len(modules)):
        samples = []
        for rep in range(_WARMUP + repeat):
            dist.barrier(group=on)
            t0 = time.perf_counter()
            reducer.start(i)
            reducer.finish()
            if cuda:
                torch.cuda.synchronize(cuda[0])
            if rep >= _WARMUP:
                samples.append((time.perf_counter() - t0) * 1e3)
        out.append(samples)
    return out


@torch.no_grad()
def sharing_samples(modules: Sequence[nn.Module], group: dist.ProcessGroup | None, me: int, ranks: int,
                    repeat: int, timeout: float) -> tuple[list[list[float]], list[list[float]]]:
    """Collective over every process: per module of this pipeline rank (``me`` of ``ranks``),
    ``repeat`` times (ms) of its reduction across its data-parallel ``group`` alone (the other
    pipeline ranks waiting) and together (every pipeline rank reducing its k-th module at once),
    as the runtime reduces them (``GradientReducer``): what ``lane_sharing`` makes the profile's
    ``LaneSharing`` of."""
    from ..runtime.data_parallel import GradientReducer

    on = group if group is not None else dist.group.WORLD
    assert on is not None
    reducer = GradientReducer(dict(enumerate(modules)), list(range(len(modules))), on, timeout)
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(modules))
    most = max(int(c) for c in counts)
    alone: list[list[float]] = [[] for _ in modules]
    together: list[list[float]] = [[] for _ in modules]

    def timed(k: int) -> float:
        t0 = time.perf_counter()
        reducer.start(k)
        reducer.finish()
        return (time.perf_counter() - t0) * 1e3

    for rep in range(_WARMUP + repeat):
        for k in range(most):
            for q in range(ranks):  # each pipeline rank's k-th reduction with the others waiting
                dist.barrier()
                if q == me and k < len(modules):
                    took = timed(k)
                    if rep >= _WARMUP:
                        alone[k].append(took)
            dist.barrier()  # then every rank's at once
            if k < len(modules):
                took = timed(k)
                if rep >= _WARMUP:
                    together[k].append(took)
    dist.barrier()
    return alone, together


def lane_sharing(alone: Sequence[Sequence[float]], together: Sequence[Sequence[float]], at_once: Sequence[int],
                 ranks_per_link: int | None) -> LaneSharing | None:
    """The profile's ``LaneSharing`` from each stage's reductions timed alone and together
    (``sharing_samples``, ms), ``at_once[s]`` the runs at once on stage s's link when timed
    together: each round's share is (together / median alone - 1) / (at_once - 1), the rule
    ``reductions.share_rate`` inverted; the share is their median, at least 0. None where no
    link held two runs at once."""
    shares = [(t / statistics.median(a) - 1) / (k - 1)
              for a, ts, k in zip(alone, together, at_once) if a and k > 1 and statistics.median(a) > 0 for t in ts]
    if not shares:
        return None
    q1, _, q3 = statistics.quantiles(shares * 2 if len(shares) == 1 else shares, n=4, method="inclusive")
    spread = Quartiles(median=statistics.median(shares), q1=q1, q3=q3, mean=statistics.fmean(shares))  # a share: may be < 0
    return LaneSharing(share=min(MAX_SLOWDOWN, max(0.0, spread.median)), ranks_per_link=ranks_per_link, measured=spread,
                       alone_ms=[Quartiles(**Stats.of(list(a) * 2 if len(a) == 1 else list(a)).record()) for a in alone],
                       together_ms=[Quartiles(**Stats.of(list(t) * 2 if len(t) == 1 else list(t)).record()) for t in together])


class _Gradients(nn.Module):
    """Parameters of given shapes and dtypes, with gradients: what a stage's replica reduces."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in layout)
        for p in self.params:
            p.grad = torch.ones_like(p)


def _local_worker(rank: int, world: int, send, layouts: list[Layout], repeat: int, timeout: float,
                  work: list[tuple[nn.Module, tuple]] | None, warmup: int,
                  threads: int | None) -> tuple[list[list[float]], list[Factors] | None]:
    from .slowdown import reduction_buffers, slowdown_samples, stage_pass

    if threads is not None:
        torch.set_num_threads(threads)
    out = []
    for layout in layouts:  # one stage's gradients at a time: no more memory than the largest stage's
        out += reduction_samples([_Gradients(layout)], None, repeat, timeout)
    if work is None:
        return out, None
    slow = []
    with torch.enable_grad():
        for layout, (module, inputs) in zip(layouts, work):
            bufs = reduction_buffers(_Gradients(layout), None, timeout)
            slow += slowdown_samples([stage_pass(module, inputs)], [bufs], None, repeat, warmup, timeout)
    return out, slow


def measure_locally(layouts: Sequence[Layout], replicas: int, repeat: int, timeout: float,
                    work: Sequence[tuple[nn.Module, tuple]] | None = None, warmup: int = 1,
                    threads: int | None = None) -> tuple[list[list[float]], list[Factors] | None]:
    """Per stage, ``repeat`` times (ms) of its gradients' reduction across ``replicas`` local
    processes of this machine (gloo on its loopback), each holding gradients of the stage's
    ``gradient_layout``; and, given each stage's module and inputs (``work``), the factors by
    which the reduction running beside the stage's pass slowed it and the pass the reduction
    (``zbsearch.profiler.slowdown.Factors``, None without ``work``), the processes running
    ``threads`` threads each."""
    return run_local(_local_worker, replicas, list(layouts), repeat, timeout, None if work is None else list(work),
                     warmup, threads)[0]


def _sharing_worker(rank: int, world: int, send, stages: list, replicas: int, repeat: int, timeout: float,
                    threads: int | None, sharded: bool) -> tuple[list[float], list[float]]:
    if threads is not None:
        torch.set_num_threads(threads)
    ranks = len(stages)
    me = rank // replicas
    if sharded:  # pipeline rank q: processes q * replicas to (q + 1) * replicas - 1, as below
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ranks, replicas), mesh_dim_names=("pp", "dp"))["dp"]
        _, alone, together = sharded_sharing_samples([stages[me]], mesh, me, ranks, repeat)
        return alone[0], together[0]
    groups = [dist.new_group(list(range(q * replicas, (q + 1) * replicas))) for q in range(ranks)]
    alone, together = sharing_samples([_Gradients(stages[me])], groups[me], me, ranks, repeat, timeout)
    return alone[0], together[0]


def measure_sharing_locally(stages: Sequence, replicas: int, repeat: int, timeout: float,
                            threads: int | None = None, sharded: bool = False) -> LaneSharing | None:
    """How the stages' reductions slow each other on this machine (``LaneSharing``, every stage on
    one link: its cores and loopback): each stage on a pipeline rank of its own, its gradients
    (``stages``: each one's ``gradient_layout``) reduced across ``replicas`` local processes
    (gloo), timed alone and with every stage's at once (``sharing_samples``); ``sharded``, each
    one's units (``shard_units``) sharded over them, their reduce-scatters timed
    (``sharded_sharing_samples``). None for one stage or one replica."""
    if len(stages) < 2 or replicas < 2:
        return None
    got = run_local(_sharing_worker, len(stages) * replicas, list(stages), replicas, repeat, timeout, threads, sharded,
                    timeout=max(timeout, 60.0) * (2 + len(stages)))
    mine = [got[q * replicas] for q in range(len(stages))]  # the first replica's of each stage
    return lane_sharing([a for a, _ in mine], [t for _, t in mine], [len(stages)] * len(stages), None)


def shard_units(module: nn.Module, dtype: torch.dtype | None = None) -> list[Layout]:
    """The layouts of ``module``'s units as ``zbsearch.models.sharding.shard_stage`` shards it:
    each child holding parameters, then the module's own (each parameter once, in ``dtype``;
    None: its own). Each unit is one all-gather and one reduce-scatter."""
    seen: set[int] = set()
    units = []
    for params in [*(list(c.parameters()) for c in module.children()), list(module.parameters(recurse=False))]:
        layout = [(tuple(p.shape), dtype or p.dtype) for p in params if p.requires_grad and id(p) not in seen]
        seen.update(map(id, params))
        if layout:
            units.append(layout)
    return units


class _Unit(nn.Module):
    """One unit's parameters; its forward adds their sum, so the backward gives each a gradient."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for shape, dtype in layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(p.sum().float() for p in self.params)


class _StandIn(nn.Module):
    """A stage's units (``shard_units``) one after another: what a sharded stage gathers and reduces."""

    def __init__(self, units: list[Layout], device: torch.device) -> None:
        super().__init__()
        self.units = nn.ModuleList(_Unit(u, device) for u in units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for u in self.units:
            x = u(x)
        return x


class _ShardedStep:
    """A stage's stand-in (its units, ``shard_units``) sharded with ``fully_shard`` unit by unit
    over ``mesh`` (a one-dimensional DeviceMesh of the data-parallel ranks), stepped as the
    runtime steps a sharded stage (``ShardedStages``): every unit's gather started at the step's
    start and waited for before the first pass; FSDP's post-backward after the last backward,
    waited for before the optimizer step."""

    def __init__(self, units: list[Layout], mesh) -> None:
        from torch.distributed.fsdp import fully_shard

        from ..runtime.sharded import ShardedStages

        cuda = mesh.device_type == "cuda"
        self.device = torch.device(mesh.device_type, torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.stand = _StandIn(units, self.device)
        for u in self.stand.units:
            fully_shard(u, mesh=mesh)
        fully_shard(self.stand, mesh=mesh)
        self.sharded = ShardedStages({0: self.stand}, mesh.size())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gather(self) -> float:
        """The step's start to every gather done (ms)."""
        t0 = time.perf_counter()
        self.sharded.begin_step()
        self.sharded.before(0)
        self._sync()
        return (time.perf_counter() - t0) * 1e3

    def backward(self) -> None:
        """The stand-in's forward and backward (not timed): gradients for the reduce-scatter."""
        self.stand(torch.zeros((), device=self.device)).backward()
        self._sync()

    def reduce_scatter(self) -> float:
        """The post-backward's reduce-scatter, started and waited for (ms)."""
        t0 = time.perf_counter()
        self.sharded.start(0)
        self.sharded.finish()
        self._sync()
        return (time.perf_counter() - t0) * 1e3


def sharded_samples(stages: Sequence[list[Layout]], mesh, repeat: int) -> list[tuple[list[float], list[float]]]:
    """Collective over ``mesh`` (a one-dimensional DeviceMesh of the data-parallel ranks): per
    stage (its units, ``shard_units``), ``repeat`` times (ms) of gathering its parameters and of
    reduce-scattering its gradients, each started by every member at once after a barrier, as the
    runtime runs a sharded stage's step (``ShardedStages``: every unit's gather started at the
    step's start and waited for before the first pass; FSDP's post-backward after the last
    backward, waited for before the optimizer step), on a stand-in of its units sharded with
    ``fully_shard`` unit by unit (``_ShardedStep``). The forward and backward between them are
    not timed."""
    group = mesh.get_group()
    out = []
    for units in stages:
        step = _ShardedStep(units, mesh)
        gathers, reductions = [], []
        for rep in range(_WARMUP + repeat):
            dist.barrier(group=group)
            gathered = step.gather()
            step.backward()
            dist.barrier(group=group)
            reduced = step.reduce_scatter()
            if rep >= _WARMUP:
                gathers.append(gathered)
                reductions.append(reduced)
        out.append((gathers, reductions))
    return out


def sharded_sharing_samples(stages: Sequence[list[Layout]], mesh, me: int, ranks: int, repeat: int
                            ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Collective over every process: per stage of this pipeline rank (``me`` of ``ranks``; its
    units, ``shard_units``), sharded over its data-parallel ``mesh`` as ``sharded_samples``
    shards it, ``repeat`` times (ms) of its gather and of its reduce-scatter alone (the other
    pipeline ranks waiting), and of its reduce-scatter together (every pipeline rank
    reduce-scattering its k-th stage at once): what ``lane_sharing`` makes the profile's
    ``LaneSharing`` of, as ``sharing_samples`` does with all-reduces."""
    group = mesh.get_group()
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(stages))
    most = max(int(c) for c in counts)
    steps = [_ShardedStep(units, mesh) for units in stages]
    gathers: list[list[float]] = [[] for _ in stages]
    alone: list[list[float]] = [[] for _ in stages]
    together: list[list[float]] = [[] for _ in stages]
    for rep in range(_WARMUP + repeat):
        for k in range(most):
            for q in range(ranks):  # each pipeline rank's k-th stage with the others waiting
                dist.barrier()
                if q == me and k < len(steps):
                    gathered = steps[k].gather()
                    steps[k].backward()
                    dist.barrier(group=group)
                    reduced = steps[k].reduce_scatter()
                    if rep >= _WARMUP:
                        gathers[k].append(gathered)
                        alone[k].append(reduced)
            if k < len(steps):  # then every rank's reduce-scatter at once
                steps[k].gather()
                steps[k].backward()
            dist.barrier()
            if k < len(steps):
                reduced = steps[k].reduce_scatter()
                if rep >= _WARMUP:
                    together[k].append(reduced)
    dist.barrier()
    return gathers, alone, together


def _sharded_worker(rank: int, world: int, send, stages: list[list[Layout]], repeat: int, timeout: float,
                    work: list[tuple[nn.Module, tuple]] | None, warmup: int, threads: int | None
                    ) -> tuple[list[tuple[list[float], list[float]]], list[Factors] | None]:
    from torch.distributed.device_mesh import init_device_mesh

    from .slowdown import sharded_buffers, slowdown_samples, stage_pass

    if threads is not None:
        torch.set_num_threads(threads)
    both = sharded_samples(stages, init_device_mesh("cpu", (world,)), repeat)
    if work is None:
        return both, None
    with torch.enable_grad():
        slow = slowdown_samples([stage_pass(module, inputs) for module, inputs in work],
                                [sharded_buffers(units, world, torch.device("cpu")) for units in stages], None, repeat,
                                warmup, timeout, sharded=True)
    return both, slow


def measure_sharded_locally(stages: Sequence[list[Layout]], replicas: int, repeat: int, timeout: float,
                            work: Sequence[tuple[nn.Module, tuple]] | None = None, warmup: int = 1,
                            threads: int | None = None
                            ) -> tuple[list[tuple[list[float], list[float]]], list[Factors] | None]:
    """Per stage (its units, ``shard_units``), ``repeat`` times (ms) of its gather and of its
    reduce-scatter across ``replicas`` local processes of this machine (gloo on its loopback);
    and, given each stage's module and inputs (``work``), the factors by which its gathers and
    reduce-scatters running beside the stage's pass slowed it and the pass them
    (``zbsearch.profiler.slowdown.Factors``, None without ``work``), the processes running
    ``threads`` threads each."""
    return run_local(_sharded_worker, replicas, list(stages), repeat, timeout, None if work is None else list(work),
                     warmup, threads, timeout=max(timeout, 60.0) * (1 + len(stages)))[0]


def with_measured_data_parallel(profile: Profile, replicas: int, samples: Sequence[Sequence[float]],
                                grad_bytes: Sequence[float], t_opt: Sequence[float], *, group: str,
                                backend: str, slowdown: Sequence[Sequence[float]] | None = None,
                                gathers: Sequence[Sequence[float]] | None = None,
                                sharing: LaneSharing | None = None,
                                stretch: Sequence[Sequence[float]] | None = None) -> Profile:
    """``profile`` whose stages end the iteration with their reductions as timed (``samples``
    per stage, ms, on a ``group`` of ``replicas``, ``local`` or ``torchrun``), then their
    optimizer step (``t_opt``, ms per stage), and, where measured, how much each reduction
    slowed the passes beside it (``slowdown``: per stage, the factors; none kept: not
    measured) and the passes it (``stretch``, likewise); ``gathers``, the stages sharded: the
    samples are reduce-scatters, and each stage's step starts with its gather, as timed (ms per
    stage); ``sharing``, how the reductions of ranks on one link slowed each other
    (``lane_sharing``). One replica reduces, gathers and slows nothing."""
    none = Quartiles(median=0.0, q1=0.0, q3=0.0, mean=0.0)

    def spread(times: Sequence[Sequence[float]]) -> list[Quartiles]:
        return [none if replicas == 1 else Quartiles(**Stats.of(list(s)).record()) for s in times]

    def factors(measured: Sequence[Sequence[float]] | None) -> list[Quartiles | None] | None:
        if measured is None or replicas == 1:
            return None
        return [None if not f else Quartiles(**Stats.of(list(f) * 2 if len(f) == 1 else list(f)).record())
                for f in measured]

    return with_measured_reductions(profile, replicas, spread(samples), grad_bytes, group=group, backend=backend,
                                    t_opt=t_opt, slowdown=factors(slowdown),
                                    gather_ms=None if gathers is None else spread(gathers),
                                    sharing=sharing if replicas > 1 else None, stretch=factors(stretch))
