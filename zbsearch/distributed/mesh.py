"""The device mesh of a job: pipeline, data (replicated and sharded) and tensor dimensions.

A cluster job runs the pipeline as one dimension of a mesh: ``pp`` pipeline ranks, times
``dp_replicate`` replicas (gradients all-reduced), times ``dp_shard`` ranks sharding each
replica's parameters, times ``tp`` tensor-parallel ranks. ``build_mesh`` lays the world out in
that order, the tensor dimension innermost (its ranks are neighbours, on one node where ranks
per node allow), as torchtitan does, and names the dimensions so that each is reached by name::

    mesh = build_mesh(pp=2, dp_replicate=2)          # 4 ranks under torchrun
    rt = PipelineRuntime(schedule, stages, loss_fn, mesh=mesh)

``mesh["pp"]`` is this rank's pipeline (the ranks that run one replica's schedule together),
``mesh["dp_replicate"]`` the ranks holding the same stages in the other replicas, and
``mesh["tp"]`` the ranks that split each of this rank's layers (``parallelize_module``).
Every dimension is present, of size 1 where unused, so code need not ask which exist.

Expert parallelism is folded into the data dimension, as DeepSeek and torchtitan fold it: the
``ep`` ranks of an expert group are data-parallel peers of one pipeline position (consecutive
ranks of ``dp_replicate x dp_shard``), each holding 1/ep of every MoE layer's experts and
exchanging tokens with the others; it adds no ranks. ``expert_groups(mesh, ep)`` makes this
rank's group (``zbsearch.models.moe.ExpertGroups``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import ZbError
from ..formats.mesh import MESH_DIMS

__all__ = ["MESH_DIMS", "MeshSizes", "build_mesh", "mesh_sizes", "mesh_for", "expert_groups", "expert_data_group"]


@dataclass(frozen=True)
class MeshSizes:
    """The size of each mesh dimension; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ZbError(f"mesh size {name} must be a positive whole number, not {value!r}")

    @property
    def world(self) -> int:
        """Ranks the mesh needs."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    def shape(self) -> tuple[int, ...]:
        """The sizes in ``MESH_DIMS`` order."""
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def describe(self) -> str:
        """E.g. ``pp 2 x dp_replicate 2`` (dimensions of size 1 left out)."""
        used = [f"{n} {getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) > 1]
        return " x ".join(used) or "one rank"


def mesh_sizes(mesh: DeviceMesh) -> MeshSizes:
    """The sizes of a mesh's named dimensions (those of ``MESH_DIMS`` it has; 1 for the others)."""
    names = mesh.mesh_dim_names or ()
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise ZbError(f"mesh dimension {unknown[0]!r} is not one of {', '.join(MESH_DIMS)}")
    return MeshSizes(**{n: mesh.size(i) for i, n in enumerate(names)})


def build_mesh(
    pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, *, device_type: str | None = None
) -> DeviceMesh:
    """The job's mesh over every rank, dimensions named as ``MESH_DIMS`` (all of them present).

    Joins the default process group from torchrun's environment first if this process has not
    (NCCL where CUDA is available, else gloo). The sizes must multiply to the world size.
    ``device_type``: ``"cuda"`` or ``"cpu"`` (default: the default group's backend decides).
    """
    sizes = MeshSizes(pp, dp_replicate, dp_shard, tp)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ZbError("no process group and no torchrun environment (WORLD_SIZE): start the job with torchrun")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    if sizes.world != world:
        raise ZbError(
            f"mesh sizes {' x '.join(f'{n} {getattr(sizes, n)}' for n in MESH_DIMS)} make {sizes.world} ranks, "
            f"but the job has {world}"
        )
    if device_type is None:
        device_type = "cuda" if "nccl" in dist.get_backend() else "cpu"
    return init_device_mesh(device_type, sizes.shape(), mesh_dim_names=MESH_DIMS)


def mesh_for(num_ranks: int, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, *,
             device_type: str | None = None) -> DeviceMesh:
    """``build_mesh`` around a schedule for ``num_ranks`` pipeline ranks: the pipeline degree is
    what the other sizes leave of the world, and must be the schedule's."""
    if not dist.is_initialized():
        return build_mesh(num_ranks, dp_replicate, dp_shard, tp, device_type=device_type)
    world, per = dist.get_world_size(), MeshSizes(1, dp_replicate, dp_shard, tp).world
    if world != num_ranks * per:
        others = " x ".join(f"{n} {v}" for n, v in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("tp", tp)) if v > 1)
        raise ZbError(
            f"the schedule is for {num_ranks} pipeline ranks, so {others or 'a pipeline alone'} needs "
            f"{num_ranks * per} processes, but the job has {world}"
        )
    return build_mesh(num_ranks, dp_replicate, dp_shard, tp, device_type=device_type)



def expert_groups(mesh: DeviceMesh, ep: int | None = None):  # -> zbsearch.models.moe.ExpertGroups
    """Collective over the whole mesh: this rank's expert-parallel group, ``ep`` consecutive
    ranks of its data dimension (``dp_replicate x dp_shard``; default: all of it), as two
    process groups (one for the forward passes' all-to-all, one for the backward passes').
    ``ep`` must divide the data dimension; below it, each expert has data/ep copies, whose
    gradients the runtime sums over ``expert_data_group(mesh, ep)``."""
    from ..models.moe import ExpertGroups

    me, mine = dist.get_rank(), None
    for blocks in _expert_blocks(mesh, ep):
        for ranks in blocks:
            got = ExpertGroups.new(ranks)  # every rank makes every group, in one order
            if me in ranks:
                mine = got
    assert mine is not None  # every rank is in one block
    return mine


def expert_data_group(mesh: DeviceMesh, ep: int | None = None) -> dist.ProcessGroup | None:
    """Collective over the whole mesh: the ranks holding the same experts as this one (the same
    place in the expert groups of its pipeline position), over which expert gradients are
    summed; None where each expert has one holder (``ep`` = the data dimension)."""
    me, mine = dist.get_rank(), None
    copies = [list(ranks) for blocks in _expert_blocks(mesh, ep) for ranks in zip(*blocks)]
    if all(len(c) == 1 for c in copies):
        return None
    for ranks in copies:
        g = dist.new_group(ranks)
        if me in ranks:
            mine = g
    return mine


def _expert_blocks(mesh: DeviceMesh, ep: int | None) -> list[list[list[int]]]:
    """Per pipeline and tensor position, its data ranks cut into expert groups of ``ep``
    consecutive ones (default: one group)."""
    sizes = mesh_sizes(mesh)
    data = sizes.dp_replicate * sizes.dp_shard
    ep = data if ep is None else ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or data % ep:
        raise ZbError(f"expert parallelism ep {ep} must divide the data dimension (dp_replicate x dp_shard = {data})")
    grid = mesh.mesh.reshape(sizes.pp, data, sizes.tp)  # global ranks, MESH_DIMS order
    out = []
    for i in range(sizes.pp):
        for t in range(sizes.tp):
            ranks = grid[i, :, t].tolist()
            out.append([ranks[k:k + ep] for k in range(0, data, ep)])
    return out
