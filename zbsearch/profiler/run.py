"""A profile of a whole model: every stage measured, links timed, one ``zbsearch.profile`` file.

Two ways to run, the same measurements:

* one device (``profile_one_device``): stage after stage in this process, each fed the real
  outputs of the stage before; links estimated (``links.estimate_link``).
* torchrun, one rank per pipeline rank (``profile_distributed``): each rank measures its own
  stage on its own device, fed by the previous rank; neighbouring ranks time their real link,
  and what a message costs each end's own time while both compute (``t_send``, ``t_recv``);
  rank 0 gathers everything and returns the profile. The ranks measure at once, as they will
  compute in the runtime: on CPU ranks with cores of their own still share the caches and the
  memory bus, so each pass runs slower than with the other ranks idle. Only when the ranks'
  threads outnumber the cores do they take turns: at once they would time each other's share
  of a core, which in the runtime depends on the schedule.

With a ``placement`` (``--placement v``: 2 pieces per rank) the stages are pieces and each rank
measures the pieces it will run, on the device it will run them on, with as many ranks as the
schedule will use (not one process per piece): a piece's time is its rank's, and only the
boundaries between two ranks are timed as links; the hand-over between two pieces of one rank
is local and costs 0, as in the runtime.

Under torchrun, with the ranks measuring at once, each round then runs the stages in a few steps
of the runtime, and the profile's pass times are those steps' (``in_step``): what a schedule's
steps run, several microbatches in flight and waits between passes included.

``profile_model`` picks the mode from the environment torchrun sets (WORLD_SIZE > 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.heap import keep_heap
from ..errors import ZbError
from ..formats.mesh import ProfileMesh, TensorParallelLink
from ..formats.profile import LaneSharing, Profile, Quartiles
from ..pooling import pool_profiles
from ..runtime.identity import model_identity
from ..runtime.p2p import P2P
from .gradients import (
    Layout,
    gradient_bytes,
    gradient_layout,
    lane_sharing,
    measure_locally,
    measure_sharded_locally,
    measure_sharing_locally,
    optimizer_step_ms,
    shard_units,
    sharded_sharing_samples,
    sharing_samples,
    with_measured_data_parallel,
)
from .in_step import action_host_times, calibration_orders, calibration_steps, in_step_times, run_in_steps
from .links import LinkModel, busy_exchange, estimate_link, exchange_plan, pingpong
from .measure import StageMeasurement, Stats, disturbances, measure_stage
from .settings import Settings, cpu_cores, device_name, resolve_device, resolve_dtype
from .slowdown import Factors, reduction_buffers, sharded_buffers, slowdown_samples, stage_pass
from .stages import ModelSpec, leaves, run_stage, stage_inputs

__all__ = ["Progress", "profile_model", "profile_one_device", "profile_distributed"]

# Round trips per measured link: a message is cheap next to a pass, and its mean (what the
# cost model takes) needs enough samples to see the transport's occasional slow wake-ups.
_LINK_REPEAT = 40
# Untimed pairs of each message kind before the timed ones (the first message carries a header).
_BUSY_WARMUP = 2

Progress = Callable[[str, int, int], None]  # (what is being measured, done, total)


def profile_model(
    spec: ModelSpec, settings: Settings, *, placement: list[int] | None = None, name: str | None = None,
    progress: Progress | None = None, replicas: int | None = None, tp: int = 1, sequence_parallel: bool = False,
    shard: bool = False, link: LinkModel | None = None,
) -> Profile | None:
    """Measure ``spec``'s stages into a profile, on this device or on one rank per pipeline rank.

    Under torchrun (WORLD_SIZE > 1) each rank measures its own stages and times its links, and
    rank 0 returns the profile (the other ranks None); otherwise every stage runs here, one
    after the other (``profile_one_device``).

    Args:
        spec: the model (``load_model``, ``builtin_gpt`` or ``as_model``).
        settings: how to measure.
        placement: piece -> rank: the stages are pieces for that placement, several per rank
            (``--placement v``).
        name: the profile's name (default: the model's and the device type).
        progress: called with (what is being measured, steps done, steps in all).
        replicas: also time each stage's gradient reduction across this many data-parallel
            replicas, and its AdamW step (``zbsearch.profiler.gradients``): on one device
            across as many local processes, under torchrun across the replicas started with
            the pipeline (WORLD_SIZE = pipeline ranks x replicas; each replica measures its
            passes, replica 0's are recorded); and how much each stage's reduction slows its
            pass beside it (``zbsearch.profiler.slowdown``; not on local tensor-parallel ranks).
        tp: split each stage over this many tensor-parallel ranks with the runtime's plan and
            measure it there (``zbsearch.profiler.tensor_parallel``): on one device across as
            many local processes, under torchrun across the ranks started with the pipeline
            (WORLD_SIZE = pipeline ranks x replicas x tp). Times and memory are per rank.
        sequence_parallel: with ``tp``, the plan also splits the sequence (the built-in GPT).
        shard: with ``replicas``, the stages are sharded over them (``fully_shard``): each
            stage's parameter gather and gradient reduce-scatter are timed as the runtime runs
            them (``zbsearch.profiler.gradients.sharded_samples``), and how much they slow the
            stage's pass beside them (``zbsearch.profiler.slowdown``).
        link: on one device, the link between ranks (``LinkModel.given``; default: estimated
            between two local processes); under torchrun the links are measured.

    Raises:
        ZbError: bad settings, a stage that cannot take its inputs or be split, or ranks that
            do not fit the placement (and the replicas and tensor-parallel ranks).
    """
    settings.check()
    if replicas is not None and replicas < 1:
        raise ZbError(f"--dp must be at least 1, not {replicas}")
    if tp < 1:
        raise ZbError(f"--tp must be at least 1, not {tp}")
    if sequence_parallel and tp == 1:
        raise ZbError("--sequence-parallel splits the sequence over the tensor-parallel ranks: give --tp N too")
    if shard and (replicas is None or tp > 1):
        raise ZbError("--shard times the stages sharded over --dp N replicas (without --tp: price them with "
                      "--dp-bandwidth)" if replicas is not None else "--shard needs --dp N: the replicas the stages are "
                      "sharded over")
    if link is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ZbError("under torchrun the links between ranks are measured: --link-bandwidth and --link-latency apply "
                      "on one device")
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        _local_groups_on_host(settings, replicas, tp)
        if tp > 1:
            from .tensor_parallel import profile_tensor_parallel

            prof, layouts, steps = profile_tensor_parallel(spec, settings, tp, placement=placement, name=name,
                                                           progress=progress, sequence_parallel=sequence_parallel,
                                                           link=link)
            work = None  # the tensor-parallel stages' passes need their group: the slowdown is not timed
        else:
            prof = profile_one_device(spec, settings, placement=placement, name=name, progress=progress, link=link)
            device, dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
            layouts = [gradient_layout(m, dtype) for m in spec.stages] if replicas is not None else []
            steps = [optimizer_step_ms(m, device, dtype) for m in spec.stages] if replicas is not None else []
            work = list(zip(spec.stages, stage_inputs(spec))) if replicas is not None else None
        units = [shard_units(m, resolve_dtype(settings.dtype)) for m in spec.stages] if shard else None
        return prof if replicas is None else _reductions_locally(prof, layouts, steps, settings, replicas, work, units)
    device = resolve_device(settings.device, _local_rank())  # made current before NCCL starts on it
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        if replicas is None and tp == 1:
            return profile_distributed(spec, settings, placement=placement, name=name, progress=progress)
        return _profile_in_mesh(spec, settings, placement, name, progress, replicas, tp, sequence_parallel, device, shard)
    finally:
        dist.destroy_process_group()


def _local_groups_on_host(settings: Settings, replicas: int | None, tp: int) -> None:
    """Refuse, in one line, local processes (``--dp N``, ``--tp N`` without torchrun) on a GPU:
    they join a gloo group through the host and would share this process's GPU and its tensors,
    so their collectives would time the host's loopback beside passes on one shared device,
    nothing of the GPUs' links. Under torchrun each rank has its GPU and NCCL."""
    if resolve_device(settings.device).type != "cuda":
        return
    if replicas is not None and replicas > 1:
        raise ZbError(f"--dp {replicas} on {settings.device}: local processes would reduce the gradients through the "
                      f"host (gloo), not the GPUs' links; run under torchrun (pipeline ranks x {replicas} processes, "
                      f"NCCL), or price the reductions with --dp-bandwidth GB/s")
    if tp > 1:
        raise ZbError(f"--tp {tp} on {settings.device}: local processes would share one GPU and all-reduce through the "
                      f"host (gloo); run under torchrun (pipeline ranks x {tp} processes, NCCL)")


def _reductions_locally(prof: Profile, layouts: list[Layout], steps: list[float], settings: Settings,
                        replicas: int, work: list[tuple[torch.nn.Module, tuple]] | None = None,
                        units: list[list[Layout]] | None = None) -> Profile:
    """``prof`` with each stage's reduction (of gradients laid out as ``layouts``) timed across
    ``replicas`` local processes, and its AdamW step (``steps``, ms); given each stage's module
    and inputs (``work``), how much the reduction slows the stage's pass beside it
    (``zbsearch.profiler.slowdown``); ``units`` (each stage's, ``shard_units``): the stages
    sharded, each one's gather and reduce-scatter timed. Both ways, how the stages' reductions
    slow each other on this host (``measure_sharing_locally``)."""
    grads = [float(sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)) for layout in layouts]
    if units is not None:
        both, slow = ([([], []) for _ in units], None) if replicas == 1 else measure_sharded_locally(
            units, replicas, settings.repeat, settings.timeout, work, settings.warmup, settings.threads)
        sharing = measure_sharing_locally(units, replicas, settings.repeat, settings.timeout, settings.threads,
                                          sharded=True)
        return with_measured_data_parallel(prof, replicas, [r for _, r in both], grads, steps, group="local",
                                           backend="gloo", gathers=[g for g, _ in both], sharing=sharing,
                                           **_factors(slow))
    samples, slowdown = ([[] for _ in layouts], None) if replicas == 1 else measure_locally(
        layouts, replicas, settings.repeat, settings.timeout, work, settings.warmup, settings.threads)
    sharing = measure_sharing_locally(layouts, replicas, settings.repeat, settings.timeout, settings.threads)
    return with_measured_data_parallel(prof, replicas, samples, grads, steps, group="local", backend="gloo",
                                       sharing=sharing, **_factors(slowdown))


def _factors(measured: list[Factors] | None) -> dict[str, list[list[float]] | None]:
    """``with_measured_data_parallel``'s ``slowdown`` and ``stretch`` from the stages' ``Factors``."""
    if measured is None:
        return {"slowdown": None, "stretch": None}
    return {"slowdown": [f.passes for f in measured], "stretch": [f.lane for f in measured]}


def _profile_in_mesh(spec: ModelSpec, settings: Settings, placement: list[int] | None, name: str | None,
                     progress: Progress | None, replicas: int | None, tp: int, sequence_parallel: bool,
                     device: torch.device, shard: bool = False) -> Profile | None:
    """Under torchrun, in the mesh the runtime builds (``build_mesh``: ``pp x replicas x tp``):
    each rank splits its stages over its tensor-parallel group, each pipeline measures its passes
    on its own group, each tensor-parallel group times its all-reduce, and, with ``replicas``,
    every rank its stages' reductions on its data-parallel group; the profile of the first
    pipeline on global rank 0."""
    from ..distributed.mesh import build_mesh
    from .tensor_parallel import hidden_bytes, parallelize_spec, time_all_reduce, with_mesh

    world = dist.get_world_size()
    ranks = len(spec.stages) if placement is None else max(placement) + 1
    dp = replicas or 1
    if ranks * dp * tp != world:
        need = " x ".join([f"{ranks} pipeline ranks", *([f"{dp} replicas"] if replicas else []),
                           *([f"{tp} tensor-parallel ranks"] if tp > 1 else [])])
        also = " (or price the reductions with --dp-bandwidth)" if replicas else ""
        raise ZbError(f"under torchrun the profile is measured in the job's mesh: start {need} = {ranks * dp * tp} "
                      f"processes, not {world}{also}")
    mesh = build_mesh(pp=ranks, dp_replicate=dp, tp=tp, device_type=device.type)
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp_replicate"].get_group()
    first = mesh["dp_replicate"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    me = mesh["pp"].get_local_rank()
    owner = list(range(len(spec.stages))) if placement is None else list(placement)
    mine = [s for s in range(len(spec.stages)) if owner[s] == me]
    dtype = resolve_dtype(settings.dtype)
    if tp > 1:
        spec.to(device, dtype, only=mine)
        parallelize_spec(spec, mesh["tp"], mine, sequence_parallel=sequence_parallel)
    inputs: dict[int, tuple] = {}
    prof = profile_distributed(spec, settings, placement=placement, group=pp_group, name=name,
                               progress=progress if first else None, kept_inputs=inputs)
    with _threads(settings.threads):
        # the hidden state's bytes: what this pipeline's first stage sends on (every pipeline's is alike)
        sent = [hidden_bytes(prof, tp, sequence_parallel) if prof is not None else None]
        dist.broadcast_object_list(sent, src=dist.get_global_rank(pp_group, 0), group=pp_group)
        nbytes = sent[0] if tp > 1 else 0
        timed = time_all_reduce(nbytes, dtype or torch.float32, mesh["tp"].get_group(), device,
                                max(settings.repeat, 20)) if nbytes else None
        found: dict[int, tuple] = {}
        if replicas is not None and shard:
            # sharded stages: each rank's gathers and reduce-scatters alone (t_gather, t_reduce), and every
            # rank's reduce-scatters at once (how they share links)
            units = [shard_units(spec.stages[s], dtype) for s in mine]
            gathers, samples, together = sharded_sharing_samples(units, mesh["dp_replicate"], me, ranks, settings.repeat)
            with torch.enable_grad():  # each stage's pass beside its gathers and reduce-scatters
                slow = slowdown_samples([stage_pass(spec.stages[s], inputs[s]) for s in mine],
                                        [sharded_buffers(u, dp, device) for u in units], dp_group, settings.repeat,
                                        settings.warmup, settings.timeout, device, sharded=True)
            found = {s: (samples[i], gradient_bytes(spec.stages[s], dtype), optimizer_step_ms(spec.stages[s], device, dtype),
                         gathers[i], slow[i].passes, together[i], slow[i].lane) for i, s in enumerate(mine)}
        elif replicas is not None:
            # each rank's reductions alone (its t_reduce) and every rank's at once (how they share links)
            samples, together = sharing_samples([spec.stages[s] for s in mine], dp_group, me, ranks, settings.repeat,
                                                settings.timeout)
            with torch.enable_grad():
                slow = slowdown_samples([stage_pass(spec.stages[s], inputs[s]) for s in mine],
                                        [reduction_buffers(spec.stages[s], dp_group, settings.timeout) for s in mine],
                                        dp_group, settings.repeat, settings.warmup, settings.timeout, device)
            found = {s: (samples[i], gradient_bytes(spec.stages[s], dtype), optimizer_step_ms(spec.stages[s], device, dtype),
                         [], slow[i].passes, together[i], slow[i].lane) for i, s in enumerate(mine)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, found)
    if dist.get_rank() != 0:
        return None
    assert prof is not None  # global rank 0 is the first pipeline's rank 0
    link = None if timed is None else TensorParallelLink(group="torchrun", backend=str(dist.get_backend(mesh["tp"].get_group())),
                                                         bytes=nbytes, all_reduce_ms=Quartiles(**timed.record()))
    if tp > 1:
        prof = prof.model_copy(update={"mode": f"{prof.mode}, each stage split over {tp} tensor-parallel ranks"})
    prof = with_mesh(prof, tp, sequence_parallel, link)
    if replicas is None:
        return prof
    pooled: dict[int, list[float]] = {}
    slowed: dict[int, list[float]] = {}
    gathered: dict[int, list[float]] = {}
    shared: dict[int, list[float]] = {}
    stretched: dict[int, list[float]] = {}
    for part in everyone:  # every replica timed the same collectives: pool their samples
        for s, (got, _, _, gathers, factors, at_once, lane) in part.items():
            shared.setdefault(s, []).extend(at_once)
            stretched.setdefault(s, []).extend(lane)
            pooled.setdefault(s, []).extend(got)
            slowed.setdefault(s, []).extend(factors)
            if shard:
                gathered.setdefault(s, []).extend(gathers)
    first_of = {s: v for part in reversed(everyone) for s, v in part.items()}
    p = len(spec.stages)
    return with_measured_data_parallel(prof, replicas, [pooled[s] for s in range(p)], [first_of[s][1] for s in range(p)],
                                       [first_of[s][2] for s in range(p)], group="torchrun",
                                       backend=str(dist.get_backend(dp_group)),
                                       slowdown=[slowed[s] for s in range(p)], stretch=[stretched[s] for s in range(p)],
                                       gathers=[gathered[s] for s in range(p)] if shard else None,
                                       sharing=_sharing(pooled, shared, owner, ranks, dp * tp))


def profile_one_device(
    spec: ModelSpec,
    settings: Settings,
    *,
    placement: list[int] | None = None,
    name: str | None = None,
    progress: Progress | None = None,
    link: LinkModel | None = None,
    units: bool = False,
) -> Profile:
    """Every stage on one device; ``link`` (else measured between two local processes) gives
    the communication times, except between pieces that ``placement`` puts on one rank (0: a
    local hand-over). ``units``: the stages are a per-layer profile's units
    (``StageMeasurement.cost``)."""
    settings.check()
    p, reps = len(spec.stages), settings.warmup + settings.repeat
    _check_placement(placement, p, None)
    device = resolve_device(settings.device)
    if settings.keep_heap:
        keep_heap()
    with _threads(settings.threads), torch.enable_grad():
        spec.to(device, resolve_dtype(settings.dtype))
        inputs = stage_inputs(spec)
        total = settings.rounds * p * reps + 1
        done = 0

        def tick(what: str) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(what, done, total)

        rounds = []
        for r in range(settings.rounds):  # each round every stage once: see zbsearch.pooling
            tag = f"round {r + 1}/{settings.rounds}: " if settings.rounds > 1 else ""
            rounds.append([
                measure_stage(spec.stages[s], inputs[s], spec.post(s), device, settings.warmup, settings.repeat,
                              functools.partial(tick, f"{tag}stage {s}: F, B, W"), recompute_too=settings.recompute,
                              selective=settings.selective)
                for s in range(p)
            ])
        if progress is not None:
            progress("links", done, total)
        # links are estimated once: what a boundary sends is the same in every round
        crosses = _crossings(placement, p)
        notes: list[str] = []
        if any(crosses):
            if link is None:
                link = estimate_link(device)
            t_comm = [link.time_ms(m.output_bytes) if c else 0.0 for m, c in zip(rounds[0], crosses)]
            links = link.record()
            notes = [link.caveat] if link.caveat else []
        else:
            t_comm, links = [0.0] * (p - 1), {"method": "none", "how": "no link between ranks"}
        ranks = p if placement is None else max(placement) + 1
        recorded = settings.record()
        profiles = [_assemble(spec, recorded, device, results, t_comm, links, "one device, stage after stage", name,
                              placement, ranks, [], units=units, notes=notes) for results in rounds]
        if progress is not None:
            progress("done", total, total)
        return pool_profiles(profiles)


def profile_distributed(
    spec: ModelSpec, settings: Settings, *, placement: list[int] | None = None, group: dist.ProcessGroup | None = None,
    name: str | None = None, progress: Progress | None = None, kept_inputs: dict[int, tuple] | None = None,
) -> Profile | None:
    """Collective over ``group``: the profile on rank 0, None elsewhere. Each rank measures the
    stages ``placement`` gives it (piece -> rank; default one stage per rank) on its own device,
    and times the real link for each boundary between two ranks; a boundary between two pieces
    of one rank is a local hand-over and costs 0, as in the runtime. ``kept_inputs`` gets this
    rank's stages' inputs (stage -> its inputs), for measurements after the profile's."""
    settings.check()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    p = len(spec.stages)
    _check_placement(placement, p, world)
    owner = list(range(p)) if placement is None else list(placement)
    mine = [s for s in range(p) if owner[s] == rank]
    progress = progress if rank == 0 else None
    device = resolve_device(settings.device, _local_rank())
    if settings.keep_heap:
        keep_heap()
    with _threads(settings.threads), torch.enable_grad():
        spec.to(device, resolve_dtype(settings.dtype), only=mine)
        # Forward chain, piece after piece: each piece's inputs are the previous piece's real
        # outputs, received from its rank or handed over locally. A failure is passed down the
        # chain, then shared, so that every rank stops with the same message.
        error: str | None = None
        inputs: dict[int, tuple] = {} if kept_inputs is None else kept_inputs
        outs: dict[int, tuple] = {}
        for s in range(p):
            if owner[s] != rank:
                continue
            if s == 0:
                inputs[s] = leaves(spec.microbatch)
            elif owner[s - 1] == rank:
                inputs[s] = leaves(outs.get(s - 1, ()))
            else:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=_global(group, owner[s - 1]), group=group)
                status, payload = box[0]
                if status == "error":
                    error = payload
                else:
                    inputs[s] = tuple(t.to(device).requires_grad_(g) for t, g in payload)
            if error is None:
                try:
                    outs[s] = run_stage(spec, s, inputs[s])
                except ZbError as err:
                    error = str(err)
            if s < p - 1 and owner[s + 1] != rank:
                payload = (
                    ("error", error)
                    if error
                    else ("ok", [(o.detach().cpu(), o.requires_grad and o.is_floating_point()) for o in outs[s]])
                )
                dist.send_object_list([payload], dst=_global(group, owner[s + 1]), group=group)
            if s in outs:  # the chain's graph is not needed any more; a local hand-over still needs the flags
                outs[s] = leaves(outs[s])
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
        first = next((e for e in errors if e), None)
        if first:
            raise ZbError(first)

        crosses = _crossings(owner, p)
        steps = p + sum(crosses)  # progress per round: one step per stage, one per link
        recorded = settings.record()  # inside the thread setting, which it records
        # the runtime's own message path, one step of messages per round (closed on NCCL: it
        # holds a communicator for each direction)
        together = _at_once(device, world, group)
        boundaries = [(b, owner[b], owner[b + 1]) for b in range(p - 1) if crosses[b]]
        comm = P2P(exchange_plan(boundaries, _BUSY_WARMUP + _busy_repeat(settings)), rank, group, device, settings.timeout)
        ctx = _RoundContext(spec=spec, settings=settings, group=group, rank=rank, world=world, owner=owner, mine=mine,
                            inputs=inputs, outs=outs, crosses=crosses, device=device, progress=progress, comm=comm,
                            together=together)
        try:
            rounds = [_round(ctx, r) for r in range(settings.rounds)]
        finally:
            comm.close()
    if rank != 0:
        return None
    layout = "one rank per stage" if placement is None else f"{p // world} pieces per rank, placement {owner}"
    mode = f"{layout}, {world} ranks" + ("" if together else ", in turns")
    profiles = [_assemble(spec, recorded, device, got.measured, got.t_comm, got.links, mode, name, placement, world,
                          got.link_stats, got.host_ms, got.host_stats, got.in_step, t_action=got.t_action)
                for got in rounds if got is not None]
    if progress is not None:
        progress("done", steps * settings.rounds, steps * settings.rounds)
    return pool_profiles(profiles)


@dataclass(frozen=True)
class _RoundContext:
    """What stays the same from one round of ``profile_distributed`` to the next."""

    spec: ModelSpec
    settings: Settings
    group: dist.ProcessGroup | None
    rank: int
    world: int
    owner: list[int]  # stage -> rank
    mine: list[int]  # the stages this rank measures
    inputs: dict[int, tuple]  # stage -> its inputs, for this rank's stages
    outs: dict[int, tuple]  # stage -> its outputs, for this rank's stages
    crosses: list[bool]  # per boundary: whether it joins two ranks
    device: torch.device
    progress: Progress | None
    comm: P2P  # the runtime's message path, for the link exchange
    together: bool  # whether the ranks measure their stages at once (else in turns)


@dataclass(frozen=True)
class _RoundResult:
    """One round's measurements, gathered on rank 0: what ``_assemble`` makes a profile of."""

    measured: list[StageMeasurement]  # per stage
    t_comm: list[float]  # per boundary: the link's mean one-way time (ms), 0 inside a rank
    links: dict  # the profile's links block
    link_stats: list[Stats | None]  # per boundary: the one-way times, None inside a rank
    host_ms: dict[str, list[float]]  # "send" / "recv" -> per boundary: host time per message (ms)
    host_stats: list[tuple[str, int, Stats]]  # (end, boundary, host times) for the warnings
    in_step: dict | None = None  # how the passes were timed in steps (the profile's measured.in_step), if they were
    t_action: float | None = None  # the runtime's host time per action in those steps (ms), if they ran


def _sharing(alone: dict[int, list[float]], together: dict[int, list[float]], owner: list[int], ranks: int,
             per_rank: int) -> LaneSharing | None:
    """The profile's ``LaneSharing`` from each stage's reductions (sharded: reduce-scatters) timed
    alone and with every rank's at once (``sharing_samples``, ``sharded_sharing_samples``), the
    pipeline ranks on one node sharing its link: as
    many as its processes (``LOCAL_WORLD_SIZE``) hold, ``per_rank`` processes each."""
    node = int(os.environ.get("LOCAL_WORLD_SIZE", per_rank * ranks))
    per_link = max(1, min(ranks, node // per_rank))
    p = len(owner)
    # the k-th stage of each rank reduced at once: on stage s's link, the ranks of its link holding a k-th stage
    kth = {s: sum(1 for x in owner[:s] if x == owner[s]) for s in range(p)}
    at_once = [sum(1 for q in range(ranks) if q // per_link == owner[s] // per_link and sum(1 for x in owner if x == q) > kth[s])
               for s in range(p)]
    return lane_sharing([alone[s] for s in range(p)], [together.get(s, []) for s in range(p)], at_once,
                        None if per_link >= ranks else per_link)


def _round(ctx: _RoundContext, r: int) -> _RoundResult | None:
    """Round ``r`` of profile_distributed: every stage (all ranks at once, or in turns where their
    threads outnumber the cores), then, at once, the stages' passes inside steps (``in_step``),
    then every link; the round's measurements on rank 0 (None elsewhere)."""
    spec, settings, group, rank, world = ctx.spec, ctx.settings, ctx.group, ctx.rank, ctx.world
    owner, mine, inputs, outs, crosses = ctx.owner, ctx.mine, ctx.inputs, ctx.outs, ctx.crosses
    device, progress, comm = ctx.device, ctx.progress, ctx.comm
    p = len(spec.stages)
    steps = p + sum(crosses)
    done = r * steps
    tag = f"round {r + 1}/{settings.rounds}: " if settings.rounds > 1 else ""

    def measure(s: int) -> StageMeasurement:
        return measure_stage(spec.stages[s], inputs[s], spec.post(s), device, settings.warmup, settings.repeat,
                             recompute_too=settings.recompute, selective=settings.selective)

    results: dict[int, StageMeasurement] = {}
    if not ctx.together:
        for s in range(p):
            if progress is not None:
                progress(f"{tag}stage {s} (rank {owner[s]}): F, B, W", done + s, steps * settings.rounds)
            if s in mine:
                results[s] = measure(s)
            dist.barrier(group=group)
    else:  # all ranks at once, a rank's pieces one after the other
        if progress is not None:
            progress(f"{tag}all ranks at once: F, B, W", done, steps * settings.rounds)
        results = {s: measure(s) for s in mine}
    # the same passes inside steps of the runtime, all ranks at once as they were measured
    # (ranks that take turns would time each other's share of a core in the steps)
    orders = calibration_orders(owner, results[0].deferred_first if 0 in results else False) \
        if settings.in_step and ctx.together else None
    traces = None
    if orders is not None:
        if progress is not None:
            progress(f"{tag}passes in steps", done, steps * settings.rounds)
        n_steps = calibration_steps(settings.repeat, orders)
        traces = run_in_steps(orders, {s: spec.stages[s] for s in mine}, spec.microbatch if 0 in mine else (),
                              spec.loss_fn, spec.target, n_steps, group=group, device=device,
                              timeout=settings.timeout, keep_heap=settings.keep_heap)
    # Links one at a time, so that no two transfers share the network or the host: the
    # link idle (ping-pong), then what a message costs each end while both compute.
    t_link: dict[int, Stats] = {}
    t_host: dict[tuple[str, int], list[float]] = {}  # ("send" | "recv", boundary) -> this rank's samples
    comm.start_step()
    for b in (b for b in range(p - 1) if crosses[b]):
        if progress is not None:
            progress(f"{tag}link {b} -> {b + 1} (rank {owner[b]} -> {owner[b + 1]})", done + p + sum(crosses[:b]),
                     steps * settings.rounds)
        lead: bool | None = None  # None: neither end of this link
        if rank == owner[b]:
            sent = [o.contiguous() for o in outs[b]]
            t_link[b] = Stats.of(pingpong(sent, owner[b + 1], True, group, repeat=_LINK_REPEAT))
            lead, tensors, work = True, list(outs[b]), _work(spec, b, inputs[b])
        elif rank == owner[b + 1]:
            got = [t.detach().clone() for t in inputs[b + 1]]
            pingpong(got, owner[b], False, group, repeat=_LINK_REPEAT)
            lead, tensors, work = False, list(inputs[b + 1]), _work(spec, b + 1, inputs[b + 1])
        else:
            tensors, work = [], _idle
        dist.barrier(group=group)  # every rank joins busy_exchange's barriers
        exchanged = busy_exchange(comm, b, tensors, lead, work, group, warmup=_BUSY_WARMUP, repeat=_busy_repeat(settings))
        if lead is not None:
            for kind, samples in exchanged.items():
                t_host[(kind, b)] = samples
    comm.finish_step()
    parts: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((results, t_link, device_name(device), t_host), parts, dst=_global(group, 0), group=group)
    if rank != 0:
        return None
    assert parts is not None  # rank 0 gathered them
    measured = {s: m for got, _, _, _ in parts for s, m in got.items()}
    in_step = None
    t_action = None
    if orders is not None and traces is not None:
        for s, times in enumerate(in_step_times(traces, p)):
            measured[s] = dataclasses.replace(measured[s], in_step=times or None)
        in_step = {
            "how": "each pass costs its repetitions' mean times its median in the runtime's trace of these steps over "
                   "its repetitions' median; every microbatch a copy of the profiled one; the stages' quartiles are the "
                   "repetitions', their in_step the steps'",
            "orders": [o.kind for o in orders.values()],
            "microbatches": next(iter(orders.values())).num_microbatches,
            "steps": n_steps,
        }
    timed = {b: t for _, got, _, _ in parts for b, t in got.items()}
    # a boundary's send time pools both ends' sends (activations one way, gradients the other)
    pooled: dict[tuple[str, int], list[float]] = {}
    for _, _, _, got in parts:
        for k, xs in got.items():
            pooled.setdefault(k, []).extend(xs)
    host = {k: Stats.of(xs) for k, xs in pooled.items()}
    links = {
        "method": "measured",
        "how": f"ping-pong of the boundary tensors between the ranks of neighbouring stages ({dist.get_backend(group)}); "
               "host time per message at each end while both ranks run their stage's forward, through the runtime's "
               "message path, activations one way and their gradient back (send_ms pools both directions' sends)",
        "devices": [d for _, _, d, _ in parts],
        # median, quartiles and mean per boundary; none between two pieces of one rank
        "one_way_ms": [timed[b].record() if b in timed else None for b in range(p - 1)],
        "send_ms": [host[("send", b)].record() if b in timed else None for b in range(p - 1)],
        "recv_ms": [host[("recv", b)].record() if b in timed else None for b in range(p - 1)],
    }
    # a link costs its mean one-way time, not its median: see zbsearch.profiler.links
    t_comm = [timed[b].mean if b in timed else 0.0 for b in range(p - 1)]
    host_ms = {k: [host[(k, b)].median if b in timed else 0.0 for b in range(p - 1)] for k in ("send", "recv")}
    if in_step is not None and traces is not None:  # the runtime's host time per action, its messages' apart
        gaps = action_host_times([t for way in traces.values() for t in way], owner, host_ms["send"], host_ms["recv"])
        action = Stats.of(gaps) if len(gaps) >= 2 else None
        t_action = None if action is None else max(action.mean, 0.0)  # a cost: the mean, as a pass's
        if action is not None:
            in_step["t_action"] = action.record()
            in_step["t_action_how"] = ("the runtime's host time between two actions of a rank whose inputs were in, "
                                       "over the steps' gaps, less the host time of the messages sent and received in "
                                       "each (t_send, t_recv); the profile's t_action is their mean")
    return _RoundResult(
        measured=[measured[s] for s in range(p)],
        t_comm=t_comm,
        links=links,
        link_stats=[timed.get(b) for b in range(p - 1)],
        host_ms=host_ms,
        host_stats=[(end, b, st) for (end, b), st in sorted(host.items())],
        in_step=in_step,
        t_action=t_action,
    )


def _at_once(device: torch.device, world: int, group) -> bool:
    """Collective: whether the ranks measure their stages at the same time (see the module
    docstring): always on GPUs, on CPU when on every machine the threads of the ranks it runs
    (torchrun's LOCAL_WORLD_SIZE, else all ranks) have cores of their own. Every rank must take
    the same way (one takes turns by barriers), and machines may differ: all must agree."""
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mine = device.type != "cpu" or torch.get_num_threads() * here <= cpu_cores()
    votes: list[Any] = [None] * world
    dist.all_gather_object(votes, mine, group=group)
    return all(votes)


def _busy_repeat(settings: Settings) -> int:
    """Pairs per message kind: a forward per message is cheap, and the time is noisier than a pass."""
    return max(settings.repeat, 20)


def _idle() -> None:
    """What a rank at neither end of the link being timed does between the barriers."""


def _work(spec: ModelSpec, stage: int, inputs: tuple) -> Callable[[], object]:
    """The stage's forward without autograd: what keeps a rank busy between two messages."""

    def run() -> object:
        with torch.no_grad():
            return spec.stages[stage](*inputs)

    return run


def _check_placement(placement: list[int] | None, pieces: int, world: int | None) -> None:
    if placement is None:
        if world is not None and pieces != world:
            raise ZbError(f"the model has {pieces} stages but {world} ranks were started; start one rank per stage")
        return
    if len(placement) != pieces:
        raise ZbError(f"the placement has {len(placement)} entries for the model's {pieces} stages")
    ranks = max(placement) + 1
    if min(placement) < 0 or any(placement.count(r) != pieces // ranks for r in range(ranks)):
        raise ZbError(f"placement {placement} must give ranks 0..{ranks - 1} the same number of stages each")
    if world is not None and ranks != world:
        raise ZbError(f"the placement puts the model's {pieces} stages on {ranks} ranks but {world} ranks were started; "
                      f"start one rank per pipeline rank")


def _crossings(placement: list[int] | None, pieces: int) -> list[bool]:
    """Per boundary: whether it joins two ranks (True) or two pieces of one rank."""
    owner = list(range(pieces)) if placement is None else placement
    return [owner[b] != owner[b + 1] for b in range(pieces - 1)]


def _assemble(
    spec: ModelSpec, settings: dict, device: torch.device, results: list[StageMeasurement], t_comm: list[float],
    links: dict, mode: str, name: str | None, placement: list[int] | None, ranks: int, link_stats: list[Stats | None],
    host_ms: dict[str, list[float]] | None = None, host_stats: list[tuple[str, int, Stats]] | None = None,
    in_step: dict | None = None, units: bool = False, t_action: float | None = None, notes: list[str] | None = None,
) -> Profile:
    """One round's profile; ``notes``: warnings besides the measurement's disturbances."""
    dtype = next((q.dtype for q in spec.stages[0].parameters() if q.is_floating_point()), torch.get_default_dtype())
    return Profile(
        name=name or f"{spec.name}-{device.type}",
        memory_unit="bytes",
        stages=[r.cost(unit=units) for r in results],
        t_comm=t_comm,
        selective=settings["selective"] if any(r.rs is not None for r in results) else None,
        t_send=host_ms["send"] if host_ms else None,
        t_recv=host_ms["recv"] if host_ms else None,
        t_action=t_action,
        placement=placement,
        mesh=None if units else ProfileMesh(pp=ranks),  # one pipeline, whole stages (profile --tp: with_mesh)
        microbatch_size=spec.microbatch[0].shape[0] if spec.microbatch[0].dim() else None,
        device=device_name(device),
        torch=torch.__version__,
        dtype=str(dtype).removeprefix("torch."),
        mode=mode,
        model={**spec.settings, "identity": model_identity(spec.stages, spec.microbatch, spec.target)},
        settings=settings,
        links=links,
        measured={
            "timing": "CUDA events" if device.type == "cuda" else "time.perf_counter",
            "memory": "CUDA allocator" if device.type == "cuda" else "bytes of tensors saved for backward",
            "boundary_bytes": [r.output_bytes for r in results[:-1]],
            "stages": [r.record() for r in results],
            "warnings": [*(notes or []),
                         *disturbances(results, device, settings["threads"], ranks, link_stats, host_stats or ())],
            **({"in_step": in_step} if in_step else {}),
        },
    )


def _local_rank() -> int | None:
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else None


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
