"""Tune a whole training job's configuration for a cluster: the pipeline and data-parallel
degrees, the microbatch size and count, the placement, the recomputation and the cut, each
configuration planned (``zbsearch.planner``) and costed with its gradient reductions and
optimizer step, pruned by bounds, beside torchtitan's and Megatron-LM's defaults.

=====================  ============================================================
``tune``               the search (``search``)
``Tuned``              its result, the winner's schedule and profile
``TuneResult``         the ``zbsearch.tune`` file (``result``)
``Cluster``, ``Mesh``  ranks, nodes, memory, links; a pp x dp x tp layout (``cluster``)
``SizedLayers``        per-layer profiles at several microbatch sizes (``sizes``)
``OptimizerSetup``     the optimizer's bytes and step, replicated or sharded (``optimizer``)
``write_launch``       the winner's files and command lines (``launch``)
=====================  ============================================================

Torch-free, like the planner it calls.
"""

from .cluster import Cluster, Mesh
from .optimizer import OptimizerSetup
from .result import ConfigRow, TuneResult, load_tune, save_tune
from .search import Runnable, Tuned, tune
from .sizes import SizedLayers

__all__ = ["tune", "Tuned", "Runnable", "TuneResult", "ConfigRow", "load_tune", "save_tune", "Cluster", "Mesh", "SizedLayers",
           "OptimizerSetup"]
