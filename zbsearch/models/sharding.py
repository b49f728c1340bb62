"""Sharded data parallelism for a pipeline stage: ``fully_shard`` (FSDP2) as the runtime needs it.

``shard_stage(stage, mesh)`` shards each child module that holds parameters (a layer, the
embedding, the head), then the stage itself, over ``mesh``: the data-parallel dimension
(``mesh["dp_shard"]``, or ``mesh["dp_replicate", "dp_shard"]`` for hybrid sharding). Every
trainable parameter is then FSDP's, as the runtime requires (``zbsearch.runtime.sharded``);
each layer's parameters are one all-gather and one reduce-scatter. A stage parallelized with
``parallelize_stage`` first has its fused projections laid out for ``fully_shard``
(``zbsearch.models.tensor_parallel.fully_shard_layout``), so that tensor parallelism and
sharding compose (PP x DP_shard x TP, as torchtitan runs).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["shard_stage"]


def shard_stage(stage: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``stage`` with its children holding parameters, then itself, under ``fully_shard`` over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    from .tensor_parallel import fully_shard_layout

    fully_shard_layout(stage)
    for child in stage.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(stage, mesh=mesh)
    return stage
