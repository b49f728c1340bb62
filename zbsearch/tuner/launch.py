"""The winner of ``tune`` as files to run it: its schedule, the mesh sizes and command lines.

Into an output folder:

* ``schedule.json``: the winner's schedule, with its ``partition`` (the cut) where it was
  planned; its profile carries the reductions and optimizer steps it was costed with;
* ``tune.json``: every configuration and the bound (``zbsearch.tune``);
* ``launch.json`` (``zbsearch.launch``): the mesh sizes, microbatches, cut and the commands;
* ``run.sh``: the ``torchrun`` command line for the example trainer that runs the profiled
  model (``examples/train_gpt.py`` for the built-in GPT, ``examples/train_hf.py`` for a
  Hugging Face model), started on every node; its arguments go on to the trainer;
* ``torchtitan/``: ``schedule.csv`` and ``args.txt``, torchtitan's overrides for the plan and
  its mesh (``zbsearch.planner.torchtitan``), where torchtitan can express it; for a
  torchtitan baseline, ``args.txt`` alone: torchtitan's own schedule and cut at its mesh;
* ``baselines/NAME/``: ``schedule.json``, ``launch.json`` and ``run.sh`` of the best
  configuration of each baseline costed (``torchtitan-1f1b``, ``megatron-interleaved``...), its
  cut given to the trainer (``--layers-per-stage``): run it beside the winner to measure the
  speed-up tune predicts on your own cluster.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ZbError
from ..formats.fileio import check_writable, write_model, write_text
from ..formats.layers import LayerProfile
from ..formats.schedule import Schedule
from ..planner.torchtitan import torchtitan_export
from .result import ConfigRow, TuneResult

if TYPE_CHECKING:
    from .search import Runnable

# torchtitan's baselines: its schedule's name (``parallelism.pipeline_parallel_schedule``)
_TORCHTITAN = {"torchtitan 1F1B": "1F1B", "torchtitan interleaved": "Interleaved1F1B"}

__all__ = ["Launch", "launch_of", "write_launch", "check_folder", "baseline_folder"]


class Launch(BaseModel):
    """How to run the winner (see the module)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["zbsearch.launch"] = "zbsearch.launch"
    version: Literal[1] = 1
    pp: int
    dp: int
    tp: int
    ep: int = Field(1, ge=1, description=(
        "expert-parallel degree: expert groups of ep data-parallel peers of each pipeline rank (1: none)"))
    microbatch_size: int
    microbatches: int = Field(description="per replica and iteration")
    global_batch: int
    placement: str
    recompute: str
    layers_per_stage: list[int] | None
    nodes: int
    ranks_per_node: int
    schedule: str = Field(description="the schedule file, in this folder")
    commands: list[str] = Field(description="run on every node (empty where no example trainer runs the model)")
    torchtitan_args: list[str] | None = Field(None, description="torchtitan's overrides, where it can run the plan")
    notes: list[str] = Field(default_factory=list)


def _trainer(layers: LayerProfile, row: ConfigRow, schedule: str, shard: bool,
             cut: list[int] | None) -> tuple[list[str] | None, str | None]:
    """The example trainer's arguments for the profiled model, or why there is none; ``cut``:
    the layers of each stage, for a schedule that does not carry its plan's."""
    model = layers.model or {}
    source = str(model.get("model", ""))
    given = ["--layers-per-stage", ",".join(map(str, cut))] if cut else []
    if source == "builtin gpt":
        args = ["examples/train_gpt.py", schedule, "--dp", str(row.dp), "--tp", str(row.tp),
                "-b", str(row.microbatch_size)]
        for key in ("layers", "hidden", "heads", "seq", "vocab"):
            if isinstance(model.get(key), int):
                args += [f"--{key}", str(model[key])]
        return args + given + (["--shard"] if shard else []), None
    if source.startswith("hf ") or source == "zbsearch.models.hf:build":
        if row.tp > 1:
            return None, "examples/train_hf.py runs no tensor parallelism: launch the plan from your own trainer"
        if shard:
            return None, ("examples/train_hf.py holds its stages whole: shard them with "
                          "zbsearch.models.sharding.shard_stage in your own trainer")
        return ["examples/train_hf.py", schedule, "--dp", str(row.dp), "-b", str(row.microbatch_size), *given], None
    return None, (f"no example trainer runs the model of per-layer profile {layers.name!r} ({source or 'unnamed'}): "
                  "build its stages from the schedule's partition in your trainer")


def launch_of(result: TuneResult, schedule: Schedule, layers: LayerProfile, folder: Path,
              row: ConfigRow | None = None) -> Launch:
    """How to run the winner (or ``row``, a configuration costed with ``schedule``), its files
    in ``folder``."""
    row = row or result.winner
    if row is None:
        raise ZbError("no configuration was costed: nothing to launch")
    cluster = result.cluster
    sched_path = str(folder / "schedule.json")
    notes: list[str] = []
    fsdp = result.shard and row.dp > 1  # the stages sharded over more than one replica
    cut = row.layers_per_stage if schedule.partition is None else None
    args, why = _trainer(layers, row, sched_path, fsdp, cut)
    commands = []
    if args is not None:
        per_node = min(cluster.ranks, cluster.ranks_per_node)
        run = ["torchrun", "--nproc-per-node", str(per_node)]
        if cluster.nodes > 1:
            run += ["--nnodes", str(cluster.nodes), "--node-rank", "$NODE_RANK", "--rdzv-endpoint", "$MASTER_ADDR:29500"]
        commands.append(" ".join(shlex.quote(a) if not a.startswith("$") else f'"{a}"' for a in run + args))
        if cluster.nodes > 1:
            notes.append("set NODE_RANK (0 .. nodes - 1) and MASTER_ADDR (node 0's address) on every node")
    if why:
        notes.append(why)
    if result.ep > 1:
        notes.append(f"expert parallelism: each pipeline rank's experts over groups of {result.ep} of its {row.dp} "
                     "data-parallel peers (zbsearch.distributed.mesh.expert_groups, expert_data_group; docs/moe.md)")
    if args is not None and result.sharded and row.dp > 1:
        notes.append("the example trainers step a replicated optimizer: wrap it in torch's ZeroRedundancyOptimizer "
                     "(docs/mesh.md) to hold the memory costed")
    titan: list[str] | None = None
    replicate, shard = (1, row.dp) if result.shard else (row.dp, 1)
    mesh = ["--parallelism.data_parallel_replicate_degree", str(replicate), "--parallelism.data_parallel_shard_degree",
            str(shard), "--parallelism.tensor_parallel_degree", str(row.tp)]
    if row.source in _TORCHTITAN:  # torchtitan's own default at this mesh: its cut, its schedule
        titan = ["--parallelism.pipeline_parallel_degree", str(row.pp), "--parallelism.pipeline_parallel_schedule",
                 _TORCHTITAN[row.source], "--parallelism.pipeline_parallel_microbatch_size", str(row.microbatch_size),
                 "--training.local_batch_size", str(row.microbatch_size * row.microbatches), *mesh,
                 "--activation_checkpoint.mode", "full" if row.recompute == "full" else "none"]
    elif schedule.partition is None:
        notes.append("torchtitan: the schedule has no planned cut of the model's units to export")
    else:
        try:
            exported = torchtitan_export(schedule, str((folder / "torchtitan" / "schedule.csv").resolve()))
            titan = [*exported.args, *mesh]
            if schedule.num_pairs:
                notes.append("torchtitan: the overlapped pairs are torch's OVERLAP_F_B actions in the CSV, which torch's "
                             "schedule runtime runs one after the other unless an overlap function is registered for "
                             "them (register_custom_function); zbsearch's runtime overlaps them")
            if result.sharded:
                notes.append("torchtitan shards with FSDP, not the optimizer state alone: its memory and reductions "
                             "differ from what was costed")
            elif fsdp:
                notes.append("torchtitan's FSDP reshards parameters between passes by default; the costing holds them "
                             "gathered for the step, as zbsearch's runtime does")
        except ZbError as e:
            notes.append(f"torchtitan: {e}")
    return Launch(pp=row.pp, dp=row.dp, tp=row.tp, ep=result.ep, microbatch_size=row.microbatch_size,
                  microbatches=row.microbatches, global_batch=result.global_batch, placement=row.placement,
                  recompute=row.recompute,
                  layers_per_stage=row.layers_per_stage, nodes=cluster.nodes, ranks_per_node=cluster.ranks_per_node,
                  schedule="schedule.json", commands=commands, torchtitan_args=titan, notes=notes)


def check_folder(folder: Path) -> None:
    """One line, before any work, where ``folder`` cannot take the files."""
    if folder.exists() and not folder.is_dir():
        raise ZbError(f"{folder}: exists and is not a folder; -o names the folder for tune's files")
    check_writable(folder / "tune.json")


def write_launch(folder: Path, result: TuneResult, schedule: Schedule | None, layers: LayerProfile | None,
                 baselines: Mapping[str, Runnable] | None = None) -> list[Path]:
    """Write the files of the module into ``folder``; the paths written. ``baselines``: the
    best configuration of each baseline (``Tuned.baselines``)."""
    check_folder(folder)
    written = [write_model(result, folder / "tune.json")]
    if schedule is None or layers is None:
        return written
    written += _write_run(folder, result, schedule, layers, None)
    for name, base in sorted((baselines or {}).items()):
        written += _write_run(folder / "baselines" / baseline_folder(name), result, base.schedule, base.layers, base.row)
    return written


def baseline_folder(name: str) -> str:
    """The folder of a baseline's files: ``torchtitan 1F1B`` -> ``torchtitan-1f1b``."""
    return "-".join(name.lower().split())


def _write_run(folder: Path, result: TuneResult, schedule: Schedule, layers: LayerProfile,
               row: ConfigRow | None) -> list[Path]:
    """One configuration's schedule, launch.json, run.sh and torchtitan overrides in ``folder``."""
    written = []
    launch = launch_of(result, schedule, layers, folder, row)
    written.append(write_model(schedule, folder / "schedule.json"))
    written.append(write_model(launch, folder / "launch.json"))
    what = "the configuration zbsearch tune chose" if row is None else f"the best {row.source} configuration"
    lines = ["#!/bin/sh", f"# {what}; run from a zbsearch checkout, on every node", *(
        f"# {n}" for n in launch.notes), *(f'{c} "$@"' for c in launch.commands)]
    written.append(write_text(folder / "run.sh", "\n".join(lines) + "\n"))
    if launch.torchtitan_args is not None:
        if schedule.partition is not None:
            exported = torchtitan_export(schedule, str((folder / "torchtitan" / "schedule.csv").resolve()))
            written.append(write_text(folder / "torchtitan" / "schedule.csv", exported.csv))
        written.append(write_text(folder / "torchtitan" / "args.txt", shlex.join(launch.torchtitan_args) + "\n"))
    return written
