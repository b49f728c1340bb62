"""The cluster a configuration runs on, and what its mesh makes of the links.

A cluster is ``ranks`` accelerators, ``ranks_per_node`` to a node, each with ``memory_bytes``
for everything it holds, links of ``intra_node_gbs`` GB/s per rank inside a node and
``inter_node_gbs`` between nodes, and (optionally) ``memory_gbs``, the device memory bandwidth
an optimizer step streams its state at.

A mesh ``pp x dp x tp`` lays the ranks out as ``build_mesh`` does: the tensor dimension
innermost, then the data-parallel replicas, the pipeline outermost, so global rank
``(p * dp + d) * tp + t`` is pipeline rank p of replica d, tensor rank t. Then:

* a stage's data-parallel group (its replicas, one tensor rank) runs at the intra-node bandwidth
  where every such group lies inside one node, else at the inter-node bandwidth: a ring is as
  fast as its slowest link;
* a pipeline's messages between neighbouring ranks take the intra-node bandwidth where every
  pair of neighbours shares a node, else the inter-node bandwidth; the latency is the
  cluster's ``link_latency_ms`` where given, else the per-layer profile's;
* the reductions of the pipeline ranks one node holds share its link at the cluster's
  ``dp_share`` (``zbsearch.reductions.share_rate``), where each node holds whole pipeline
  ranks (its ranks a multiple of a pipeline rank's, dp x tp); otherwise each lane is priced
  alone on its link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ZbError
from ..formats.fileio import validation_message
from ..formats.profile import MAX_SLOWDOWN, LaneSharing

__all__ = ["Cluster", "Mesh"]


class Cluster(BaseModel):
    """Ranks, nodes, memory and links (see the module)."""

    model_config = ConfigDict(extra="forbid")

    ranks: int = Field(ge=1, description="accelerators in all")
    ranks_per_node: int = Field(ge=1, description="accelerators in one node")
    memory_bytes: float | None = Field(None, gt=0, description="bytes per rank for everything it holds (None: unlimited)")
    intra_node_gbs: float = Field(gt=0, description="GB/s per rank between ranks of one node")
    inter_node_gbs: float = Field(gt=0, description="GB/s per rank between nodes")
    link_latency_ms: float | None = Field(None, ge=0, description=(
        "latency of a pipeline message (ms); None: the per-layer profile's link latency"))
    memory_gbs: float | None = Field(None, gt=0, description=(
        "device memory bandwidth for the optimizer step (GB/s); None: the optimizer step is not priced"))
    dp_share: float = Field(0.0, ge=0, le=MAX_SLOWDOWN, description=(
        "how the reductions of pipeline ranks on one node slow each other: k at once each at 1 / (1 + share (k - 1)) "
        "of their speed alone; 0: not at all"))

    @classmethod
    def checked(cls, **fields: Any) -> Cluster:
        """A cluster of ``fields``; one ZbError line naming the first bad one."""
        try:
            return cls.model_validate(fields)
        except ValidationError as err:
            raise ZbError(f"cluster: {validation_message(err).removeprefix('(top level): ')}") from None

    @model_validator(mode="after")
    def _nodes(self) -> Cluster:
        if self.ranks > self.ranks_per_node and self.ranks % self.ranks_per_node:
            raise ValueError(f"{self.ranks} ranks are not whole nodes of {self.ranks_per_node}")
        return self

    @property
    def nodes(self) -> int:
        """Nodes in use (the last may be partly used where the ranks fill less than one)."""
        return max(1, -(-self.ranks // self.ranks_per_node))

    def node(self, rank: int) -> int:
        """The node of a global rank."""
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class Mesh:
    """``pp`` pipeline ranks x ``dp`` data-parallel replicas x ``tp`` tensor-parallel ranks."""

    pp: int
    dp: int
    tp: int

    @property
    def size(self) -> int:
        """Ranks in the mesh."""
        return self.pp * self.dp * self.tp

    def rank(self, p: int, d: int, t: int) -> int:
        """The global rank of pipeline rank p, replica d, tensor rank t."""
        return (p * self.dp + d) * self.tp + t

    def dp_within_nodes(self, cluster: Cluster) -> bool:
        """Whether every data-parallel group lies inside one node."""
        return all(len({cluster.node(self.rank(p, d, t)) for d in range(self.dp)}) == 1
                   for p in range(self.pp) for t in range(self.tp))

    def pp_within_nodes(self, cluster: Cluster) -> bool:
        """Whether every pair of neighbouring pipeline ranks shares a node."""
        return all(cluster.node(self.rank(p, d, t)) == cluster.node(self.rank(p + 1, d, t))
                   for p in range(self.pp - 1) for d in range(self.dp) for t in range(self.tp))

    def dp_bandwidth(self, cluster: Cluster) -> float:
        """GB/s per rank of the stages' data-parallel reductions."""
        return cluster.intra_node_gbs if self.dp_within_nodes(cluster) else cluster.inter_node_gbs

    def dp_sharing(self, cluster: Cluster) -> LaneSharing | None:
        """How the reductions of the pipeline ranks on one node slow each other (``LaneSharing``,
        see the module): None where the share is 0 or no node holds two whole pipeline ranks."""
        group = self.dp * self.tp
        per = cluster.ranks_per_node // group if cluster.ranks_per_node % group == 0 else 1
        if cluster.dp_share <= 0 or per < 2 or self.pp < 2:
            return None
        from ..reductions import given_sharing

        return given_sharing(cluster.dp_share, per if per < self.pp else None)

    def pp_bandwidth(self, cluster: Cluster) -> float:
        """GB/s of the pipeline's messages."""
        return cluster.intra_node_gbs if self.pp_within_nodes(cluster) else cluster.inter_node_gbs

    def __str__(self) -> str:
        return f"pp{self.pp} x dp{self.dp} x tp{self.tp}"
