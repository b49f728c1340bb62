"""The mesh a profile was measured for: the profile's optional ``mesh`` section (version 1).

A job runs the pipeline as one dimension of a device mesh, ``pp x dp_replicate x dp_shard x
tp`` (``MESH_DIMS``, the order ``zbsearch.distributed.build_mesh`` lays ranks out in). A stage's
costs depend on the mesh: at tensor-parallel degree ``tp`` each rank runs its share of every
layer and keeps its share of the activations, and with data parallelism each stage ends the
iteration with its gradients' reduction. The section records the sizes the costs hold for, and
the tensor-parallel collective as ``zbsearch profile --tp`` timed it; the link of the other
dimensions is where it always was (``t_comm`` and ``links`` for the pipeline, the
``data_parallel`` section for the replicas). For a mixture-of-experts model the section also
records the expert-parallel degree ``ep`` the stages' all-to-all times (``a_f``, ``a_b``) hold
for: expert parallelism is folded into the data dimension (an expert group is ``ep`` data-parallel
peers of one pipeline position), so it adds no ranks to the mesh. A profile without the section is of one pipeline
at tensor-parallel degree 1 (``Profile.made_for`` fills the data-parallel sizes from its
``data_parallel`` section, where it has one).

The runtime compares the section's ``tp`` with the degree its stages are split at and refuses a
schedule made for another (``zbsearch.runtime``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .spread import Quartiles

__all__ = ["MESH_DIMS", "TensorParallelLink", "ProfileMesh"]

# The mesh's dimensions, outermost first: pipeline, replicated and sharded data, tensor.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class TensorParallelLink(BaseModel):
    """The tensor-parallel dimension's collective as the profiler timed it: an all-reduce, across
    the ``tp`` ranks that share a stage, of one microbatch's hidden state (``bytes``: the
    largest floating tensor crossing a stage boundary). Megatron's split runs two per layer in
    the forward (after attention, after the MLP) and two in the input-gradient pass (B); their
    time is already in the stages' F and B, measured with the collectives in them."""

    model_config = ConfigDict(extra="allow")

    how: Literal["measured"] = "measured"
    group: Literal["local", "torchrun"] = Field(description=(
        "where: local processes of the profiling machine (gloo on its loopback), or the tensor-parallel group torchrun "
        "started"))
    backend: str = Field(description="the process group's backend (gloo, nccl)")
    bytes: int = Field(ge=0, description="bytes all-reduced per collective")
    all_reduce_ms: Quartiles = Field(description="the spread of the timed all-reduces (ms)")


class ProfileMesh(BaseModel):
    """The sizes of the mesh a profile's costs hold for, per rank, and the tensor-parallel link.

    ``pp`` is the profile's pipeline ranks; ``dp_replicate`` and ``dp_shard`` agree with its
    ``data_parallel`` section (the replicas the reductions were found for, all in one of the
    two); ``tp`` is the tensor-parallel degree each stage's passes were measured at: the times
    are what each rank of the stage's tensor-parallel group spends, the memory what each keeps.
    """

    model_config = ConfigDict(extra="allow")

    version: Literal[1] = 1
    pp: int = Field(ge=1, description="pipeline ranks")
    dp_replicate: int = Field(1, ge=1, description="replicas whose gradients are all-reduced")
    dp_shard: int = Field(1, ge=1, description="ranks sharding each replica's parameters (fully_shard)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks sharing each stage")
    sequence_parallel: bool = Field(False, description="the tensor-parallel plan also splits the sequence")
    tp_link: TensorParallelLink | None = Field(None, description="the tensor-parallel all-reduce, as timed (tp > 1)")
    ep: int = Field(1, ge=1, description=(
        "expert-parallel ranks the stages' all-to-all times (a_f, a_b) hold for, folded into the data dimension "
        "(1: no expert parallelism)"))

    @property
    def world(self) -> int:
        """Ranks the mesh has."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    def describe(self) -> str:
        """E.g. ``pp 4 x dp_replicate 2 x tp 2`` (sizes of 1 left out, except the pipeline's)."""
        parts = [f"pp {self.pp}"] + [f"{n} {getattr(self, n)}" for n in MESH_DIMS[1:] if getattr(self, n) > 1]
        notes = ["sequence parallel"] * (self.sequence_parallel and self.tp > 1) + [f"ep {self.ep}"] * (self.ep > 1)
        return " x ".join(parts) + (f" ({', '.join(notes)})" if notes else "")

    def tp_bandwidth_gbs(self) -> float | None:
        """The bus bandwidth per rank (GB/s) the tensor-parallel all-reduce's median time implies,
        as a ring moves 2(N-1)/N of the bytes through each rank; None where none was timed."""
        link = self.tp_link
        if link is None or self.tp < 2 or not link.all_reduce_ms.median > 0:
            return None
        return 2 * (self.tp - 1) / self.tp * link.bytes / (link.all_reduce_ms.median * 1e-3) / 1e9
