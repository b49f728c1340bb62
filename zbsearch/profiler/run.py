"""A profile of a whole model: every stage measured, links timed, one ``zbsearch.profile`` file.

Two ways to run, the same measurements:

* one device (``profile_one_device``): stage after stage in this process, each fed the real
  outputs of the stage before; links estimated (``links.estimate_link``).
* torchrun, one rank per stage (``profile_distributed``): each rank measures its own stage on
  its own device, fed by the previous rank; neighbouring ranks time their real link; rank 0
  gathers everything and returns the profile. On CPU the ranks take turns, because ranks of one
  machine share its cores and timing them together would measure the contention.

``profile_model`` picks the mode from the environment torchrun sets (WORLD_SIZE > 1).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ZbError
from ..formats.profile import Profile
from .links import LinkModel, estimate_link, pingpong
from .measure import StageMeasurement, Stats, disturbances, measure_stage
from .settings import Settings, device_name, resolve_device, resolve_dtype
from .stages import ModelSpec, leaves, run_stage

__all__ = ["Progress", "profile_model", "profile_one_device", "profile_distributed"]

Progress = Callable[[str, int, int], None]  # (what is being measured, done, total)


def profile_model(
    spec: ModelSpec, settings: Settings, *, name: str | None = None, progress: Progress | None = None
) -> Profile | None:
    """Under torchrun (WORLD_SIZE > 1) the distributed profile, returned on rank 0 only (None
    elsewhere); otherwise the one-device profile."""
    settings.check()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return profile_one_device(spec, settings, name=name, progress=progress)
    device = resolve_device(settings.device, _local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return profile_distributed(spec, settings, name=name, progress=progress)
    finally:
        dist.destroy_process_group()


def profile_one_device(
    spec: ModelSpec,
    settings: Settings,
    *,
    name: str | None = None,
    progress: Progress | None = None,
    link: LinkModel | None = None,
) -> Profile:
    """Every stage on one device; ``link`` (else measured between two local processes) gives
    the communication times."""
    settings.check()
    device = resolve_device(settings.device)
    p, reps = len(spec.stages), settings.warmup + settings.repeat
    with _threads(settings.threads), torch.enable_grad():
        spec.to(device, resolve_dtype(settings.dtype))
        inputs, x = [], spec.microbatch
        for s in range(p):
            inputs.append(leaves(x))
            x = run_stage(spec, s, inputs[-1])
        done = 0
        results = []
        for s in range(p):
            def tick(s=s) -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    progress(f"stage {s}: F, B, W", done, p * reps + 1)

            results.append(measure_stage(spec.stages[s], inputs[s], spec.post(s), device, settings.warmup, settings.repeat, tick))
        if progress is not None:
            progress("links", done, p * reps + 1)
        if p > 1:
            if link is None:
                link = estimate_link(device)
            t_comm, links = [link.time_ms(r.output_bytes) for r in results[:-1]], link.record()
        else:
            t_comm, links = [], {"method": "none", "how": "one stage, no links"}
        if progress is not None:
            progress("done", p * reps + 1, p * reps + 1)
        return _assemble(spec, settings.record(), device, results, t_comm, links, "one device, stage after stage", name)


def profile_distributed(
    spec: ModelSpec, settings: Settings, *, group: dist.ProcessGroup | None = None, name: str | None = None,
    progress: Progress | None = None,
) -> Profile | None:
    """Collective over ``group`` (one rank per stage): the profile on rank 0, None elsewhere."""
    settings.check()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    p = len(spec.stages)
    if p != world:
        raise ZbError(f"the model has {p} stages but {world} ranks were started; start one rank per stage")
    progress = progress if rank == 0 else None
    device = resolve_device(settings.device, _local_rank())
    with _threads(settings.threads), torch.enable_grad():
        spec.to(device, resolve_dtype(settings.dtype), only=rank)
        # Forward chain: each rank's inputs are the previous rank's real outputs. A failure is
        # passed down the chain, then shared, so that every rank stops with the same message.
        error: str | None = None
        inputs = leaves(spec.microbatch)
        outs: tuple[torch.Tensor, ...] = ()
        if rank > 0:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=_global(group, rank - 1), group=group)
            status, payload = box[0]
            if status == "error":
                error = payload
            else:
                inputs = tuple(t.to(device).requires_grad_(g) for t, g in payload)
        if error is None:
            try:
                outs = run_stage(spec, rank, inputs)
            except ZbError as err:
                error = str(err)
        if rank < world - 1:
            payload = (
                ("error", error)
                if error
                else ("ok", [(o.detach().cpu(), o.requires_grad and o.is_floating_point()) for o in outs])
            )
            dist.send_object_list([payload], dst=_global(group, rank + 1), group=group)
        outs = tuple(o.detach() for o in outs)  # the chain's graph is not needed any more
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
        first = next((e for e in errors if e), None)
        if first:
            raise ZbError(first)

        steps = 2 * world - 1  # progress: one step per stage, one per link

        def measure() -> StageMeasurement:
            return measure_stage(spec.stages[rank], inputs, spec.post(rank), device, settings.warmup, settings.repeat)

        if device.type == "cpu":  # ranks of one machine share its cores: take turns
            result = None
            for s in range(world):
                if progress is not None:
                    progress(f"stage {s} (rank {s}): F, B, W", s, steps)
                if s == rank:
                    result = measure()
                dist.barrier(group=group)
        else:
            if progress is not None:
                progress("all stages at once: F, B, W", 0, steps)
            result = measure()
        # Links one at a time, so that no two transfers share the network or the host.
        t_link = None
        for b in range(world - 1):
            if progress is not None:
                progress(f"link {b} -> {b + 1}", world + b, steps)
            if rank == b:
                t_link = Stats.of(pingpong([o.contiguous() for o in outs], b + 1, True, group))
            elif rank == b + 1:
                pingpong([t.detach().clone() for t in inputs], b, False, group)
            dist.barrier(group=group)
        parts: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object((result, t_link, device_name(device)), parts, dst=_global(group, 0), group=group)
        recorded = settings.record()
    if rank != 0:
        return None
    assert parts is not None  # rank 0 gathered them
    results = [r for r, _, _ in parts]
    links = {
        "method": "measured",
        "how": f"ping-pong of the boundary tensors between neighbouring ranks ({dist.get_backend(group)})",
        "devices": [d for _, _, d in parts],
    }
    if progress is not None:
        progress("done", steps, steps)
    mode = f"one rank per stage, {world} ranks" + (", in turns" if device.type == "cpu" else "")
    links["one_way_ms"] = [t.record() for _, t, _ in parts[:-1]]  # median and quartiles per boundary
    return _assemble(spec, recorded, device, results, [t.median for _, t, _ in parts[:-1]], links, mode, name)


def _assemble(
    spec: ModelSpec, settings: dict, device: torch.device, results: list[StageMeasurement], t_comm: list[float],
    links: dict, mode: str, name: str | None,
) -> Profile:
    dtype = next((q.dtype for q in spec.stages[0].parameters() if q.is_floating_point()), torch.get_default_dtype())
    return Profile(
        name=name or f"{spec.name}-{device.type}",
        memory_unit="bytes",
        stages=[r.cost() for r in results],
        t_comm=t_comm,
        microbatch_size=spec.microbatch[0].shape[0] if spec.microbatch[0].dim() else None,
        device=device_name(device),
        torch=torch.__version__,
        dtype=str(dtype).removeprefix("torch."),
        mode=mode,
        model=spec.settings,
        settings=settings,
        links=links,
        measured={
            "timing": "CUDA events" if device.type == "cuda" else "time.perf_counter",
            "memory": "CUDA allocator" if device.type == "cuda" else "bytes of tensors saved for backward",
            "boundary_bytes": [r.output_bytes for r in results[:-1]],
            "stages": [r.record() for r in results],
            "warnings": disturbances(results, device, settings["threads"], len(results)),
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
