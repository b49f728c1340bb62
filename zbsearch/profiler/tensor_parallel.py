"""Profiling at a tensor-parallel degree: each stage split over the ranks that will share it.

``zbsearch profile --tp N`` splits every stage with the plan the runtime and the examples use
(``zbsearch.models.tensor_parallel.parallelize_stage``: the built-in GPT and Llama, Hugging Face
decoders) over N ranks and measures its passes there, the collectives inside them included: the
times are what each rank of the stage's tensor-parallel group spends, the memory the
activations each keeps (its shares). The ranks of a group run every pass together (their
collectives pair up), so each group measures its stages at once and its first rank's figures
are recorded.

Without torchrun the N ranks are local processes of this machine joined over gloo, measuring
stage after stage as ``profile_one_device`` does (``profile_tensor_parallel``); under torchrun
(``zbsearch.profiler.run``) each stage is split over the ``tp`` ranks ``build_mesh`` puts next
to each other. Either way each group also times the all-reduce of one microbatch's hidden
state across its ranks, recorded with the sizes in the profile's ``mesh`` section.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..distributed import run_local
from ..formats.mesh import TensorParallelLink
from ..formats.profile import Profile, Quartiles
from ..models.tensor_parallel import parallelize_stage
from .gradients import Layout, gradient_layout, optimizer_step_ms
from .links import LinkModel, estimate_link
from .measure import Stats
from .settings import Settings, resolve_device, resolve_dtype
from .stages import ModelSpec

__all__ = ["parallelize_spec", "time_all_reduce", "hidden_bytes", "with_mesh", "profile_tensor_parallel"]

# Untimed all-reduces before the timed ones (the first opens the group's connections).
_WARMUP = 2
# Timed all-reduces: one is cheap next to a pass, and noisier.
_REPEAT = 20


def parallelize_spec(spec: ModelSpec, tp_mesh: DeviceMesh, only: Sequence[int] | None = None, *,
                     sequence_parallel: bool = False) -> None:
    """Split ``spec``'s stages (those ``only`` names: a rank's under torchrun) over ``tp_mesh``, in
    place; every rank of the mesh must call it on the same stages, built alike."""
    for s, stage in enumerate(spec.stages):
        if only is None or s in only:
            spec.stages[s] = parallelize_stage(stage, tp_mesh, sequence_parallel=sequence_parallel)


@torch.no_grad()
def time_all_reduce(nbytes: int, dtype: torch.dtype, group: dist.ProcessGroup, device: torch.device,
                    repeat: int = _REPEAT) -> Stats:
    """Collective over ``group``: the times (ms) of ``repeat`` all-reduces of ``nbytes`` in
    ``dtype`` on ``device``, each started by every member at once after a barrier."""
    x = torch.ones(max(nbytes // dtype.itemsize, 1), dtype=dtype, device=device)
    samples = []
    for rep in range(_WARMUP + repeat):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep >= _WARMUP:
            samples.append((time.perf_counter() - t0) * 1e3)
    return Stats.of(samples)


def hidden_bytes(prof: Profile, tp: int, sequence_parallel: bool) -> int:
    """What one tensor-parallel all-reduce carries: the largest tensor a stage sends on (one
    microbatch's hidden state), whole where sequence parallelism sends each rank's slice; 0 for
    a profile of one stage (no boundary)."""
    sent = prof.measured.boundary_bytes if prof.measured is not None else []
    return max(sent, default=0) * (tp if sequence_parallel else 1)


def with_mesh(prof: Profile, tp: int, sequence_parallel: bool = False, link: TensorParallelLink | None = None) -> Profile:
    """``prof`` with its ``mesh`` section: its pipeline ranks at tensor-parallel degree ``tp``,
    the data-parallel sizes of its ``data_parallel`` section, and the tensor-parallel link."""
    made = prof.made_for.model_copy(update={"tp": tp, "sequence_parallel": sequence_parallel and tp > 1, "tp_link": link})
    return Profile.model_validate({**prof.model_dump(), "mesh": made.model_dump()})


Measured = tuple[Profile, list[Layout], list[float]]  # the profile, per stage its gradients' layout and AdamW step (ms)


def _worker(rank: int, world: int, send, spec: ModelSpec, settings: Settings, placement: list[int] | None,
            name: str | None, link: LinkModel | None, sequence_parallel: bool) -> Measured | None:
    from .run import profile_one_device

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_spec(spec, mesh, sequence_parallel=sequence_parallel)
    progress = (lambda what, done, total: send((what, done, total))) if rank == 0 else None
    prof = profile_one_device(spec, settings, placement=placement, name=name, progress=progress, link=link)
    device, dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
    nbytes = hidden_bytes(prof, world, sequence_parallel)
    timed = None
    if nbytes:
        first = next((q for q in spec.stages[0].parameters() if q.is_floating_point()), None)
        timed = time_all_reduce(nbytes, dtype or (first.dtype if first is not None else torch.float32),
                                mesh.get_group(), device, max(settings.repeat, _REPEAT))
    if rank != 0:
        return None
    tp_link = None if timed is None else TensorParallelLink(group="local", backend="gloo", bytes=nbytes,
                                                            all_reduce_ms=Quartiles(**timed.record()))
    layouts = [gradient_layout(m, dtype) for m in spec.stages]
    steps = [optimizer_step_ms(m, device, dtype) for m in spec.stages]
    prof = prof.model_copy(update={"mode": f"{prof.mode}, each split over {world} tensor-parallel local processes (gloo)"})
    return with_mesh(prof, world, sequence_parallel, tp_link), layouts, steps


def profile_tensor_parallel(
    spec: ModelSpec, settings: Settings, tp: int, *, placement: list[int] | None = None, name: str | None = None,
    progress=None, sequence_parallel: bool = False, link: LinkModel | None = None,
) -> Measured:
    """Every stage split over ``tp`` local processes (gloo) and measured there, stage after
    stage; links between pipeline ranks estimated here (``link``, else measured between two
    local processes). Returns the profile (with its ``mesh``), and per stage the shapes of the
    gradients one rank reduces and its AdamW step (ms), for the data-parallel reductions."""
    owner = list(range(len(spec.stages))) if placement is None else placement
    crosses = any(owner[b] != owner[b + 1] for b in range(len(owner) - 1))
    if crosses and link is None:  # here: the ranks are local processes, which start no processes of their own
        link = estimate_link(resolve_device(settings.device))

    def relay(rank: int, msg: Any) -> None:
        if progress is not None:
            progress(*msg)

    got = run_local(_worker, tp, spec, settings, placement, name, link, sequence_parallel, on_message=relay,
                    timeout=max(settings.timeout * 10, 600.0))
    assert got[0] is not None  # rank 0 returns the profile
    return got[0]

