"""A plan as torchtitan runs it: command-line overrides and the schedule CSV (no torch).

torchtitan reads the cut as ``parallelism.module_fqns_per_model_part`` (module names per
model part, in stage order), the per-rank order of passes from
``parallelism.pipeline_parallel_schedule_csv`` (torch's compute-only CSV, ``zbsearch export
--to torch-csv``), and decides which rank holds which stage from the *name* of
``parallelism.pipeline_parallel_schedule``: ``ZBVZeroBubble`` (and ``DualPipeV``) place two
stages per rank in a V, any other multi-stage name loops, a single-stage name (``1F1B``) puts
stage r on rank r. So a V plan names ``ZBVZeroBubble`` and a plan with one stage per rank
``1F1B``: their placements are the plan's. Units map onto torchtitan's decoder modules:
``embedding`` to ``tok_embeddings``, the i-th decoder layer (counted from 0 in model order,
whatever its unit is named) to ``layers.i``, ``head`` to ``norm`` and ``lm_head``: torchtitan
keys its decoder layers by position, and keeps of each stage only the layers its names give,
silently none where they name no such key. Pipeline parallelism there also needs
``--training.disable_cuda_graphs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ZbError
from ..formats.schedule import Schedule
from ..formats.torch_csv import to_torch_csv

__all__ = ["TorchtitanExport", "torchtitan_export", "torchtitan_modules", "TORCHTITAN_MODULES"]

TORCHTITAN_MODULES = {"embedding": ["tok_embeddings"], "head": ["norm", "lm_head"]}


def torchtitan_modules(units: Sequence[str], kinds: Sequence[str]) -> dict[str, list[str]]:
    """Unit name -> torchtitan's module names for it, for a model's ``units`` of ``kinds`` in
    order: the embedding, the decoder layers by position (``layers.0`` the first), the head.

    Raises:
        ZbError: the units are not one embedding, then decoder layers, then one head: the shape
            of torchtitan's decoder.
    """
    shape = [k for i, k in enumerate(kinds) if k != "layer" or not i or kinds[i - 1] != "layer"]
    if shape != ["embedding", "layer", "head"]:
        odd = next((u for u, k in zip(units, kinds) if k not in ("embedding", "layer", "head")), None)
        if odd is not None:
            raise ZbError(f"unit {odd!r} is not an embedding, a decoder layer or a head: torchtitan's module names "
                          "for it are unknown")
        raise ZbError(f"the model's units are {', '.join(shape)}: torchtitan's decoder is one embedding, decoder layers "
                      "and one head, in that order")
    out: dict[str, list[str]] = {}
    position = 0
    for unit, kind in zip(units, kinds):
        if kind == "layer":
            out[unit] = [f"layers.{position}"]
            position += 1
        else:
            out[unit] = list(TORCHTITAN_MODULES[kind])
    return out


@dataclass(frozen=True)
class TorchtitanExport:
    """What torchtitan takes: ``args`` (command-line overrides), the CSV text, the module names
    per model part and the schedule name."""

    args: list[str]
    csv: str
    module_fqns_per_model_part: list[list[str]]
    schedule_name: str


def torchtitan_export(schedule: Schedule, csv_path: str = "schedule.csv") -> TorchtitanExport:
    """The overrides and CSV for a planned ``schedule`` (one with a ``partition``), the CSV to be
    written at ``csv_path`` (the path the overrides name).

    Raises:
        ZbError: no partition, units that are not one embedding, decoder layers and one head in
            that order, or a placement torchtitan's schedule names cannot express.
    """
    part = schedule.partition
    if part is None:
        raise ZbError("the schedule has no partition section: export a plan from zbsearch plan to torchtitan")
    modules = torchtitan_modules(part.units, part.kinds)
    fqns = [[name for unit in stage for name in modules[unit]] for stage in part.stages]
    P = schedule.num_ranks
    expected = list(range(P)) if part.placement == "one" else [*range(P), *range(P - 1, -1, -1)]
    if schedule.stage_to_rank != expected:
        raise ZbError(f"the schedule's placement {schedule.stage_to_rank} is neither one stage per rank nor a V")
    name = "ZBVZeroBubble" if part.placement == "v" else "1F1B"
    b = schedule.profile.microbatch_size or 1
    args = [
        "--parallelism.pipeline_parallel_degree", str(P),
        "--parallelism.pipeline_parallel_schedule", name,
        "--parallelism.pipeline_parallel_schedule_csv", csv_path,
        "--parallelism.pipeline_parallel_microbatch_size", str(b),
        "--training.local_batch_size", str(b * schedule.num_microbatches),
        "--training.disable_cuda_graphs",
        "--parallelism.module_fqns_per_model_part", *[",".join(f) for f in fqns],
    ]
    return TorchtitanExport(args, to_torch_csv(schedule), fqns, name)
