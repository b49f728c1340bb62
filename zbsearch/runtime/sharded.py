"""Sharded data parallelism: stages under torch's ``fully_shard`` (FSDP2), driven by the pipeline.

FSDP2 gathers a module's parameters in a hook before its forward, and reduce-scatters the
gradients and frees the gathered parameters in hooks that fire when autograd's backward
through the module ends. Under a pipeline schedule both go wrong: the split backward's B ends
before W has computed the weight gradients (which FSDP would then have reduced without, and
freed the parameters W needs), and one step runs many forwards and backwards of each stage,
interleaved across microbatches. So the runtime takes those moments over, as torch's own
pipelining schedules do:

* when a step starts, every FSDP module of this rank's sharded stages is told that no
  backward in the step is the last one (no gradient sync, no reshard after backward or after
  forward), and its parameters are gathered asynchronously; a stage's first pass waits for its
  own gather. Gathered once per step and kept until the stage's last backward: a split pass
  records the parameters it uses when it starts, so they must be the gathered ones throughout;
* right after a stage's last W (or BW) of the step on this rank, FSDP's post-backward runs for
  each of its modules: the gradients are reduce-scattered across the data-parallel ranks (on
  CUDA on FSDP's own stream, overlapped with the passes still to run) and the gathered
  parameters freed;
* before the optimizer step (``finish``) FSDP's end-of-backward callback waits for the
  reductions and resets its state.

Each step's gathers are timed for the trace (``last_gathers``): a stage's gather from the moment
its first all-gather is issued to the moment the rank first sees all of them complete (polled
between passes, or waited for before its first pass), with the bytes it gathers.

FSDP's collectives wait as long as the process group allows (``init_process_group(timeout=)``),
not the runtime's ``timeout``: on the host's gloo a reduce-scatter blocks until it is done.

FSDP reduces with a plain sum here (divide factor 1, sum-only collectives): the runtime seeds
each backward with ``1/(m * replicas)`` (or ``1/N`` tokens), so the sum is the global batch's
gradient, exactly as with replicated stages. Parameters unused on some replica take part as
zeros (``set_reduce_scatter_unused_params``), so every rank reduce-scatters the same buffers.

Every trainable parameter of a sharded stage must be managed by FSDP (apply ``fully_shard`` to
the layers, then to the stage itself, as torchtitan does), and FSDP's mesh must span the whole
data-parallel dimension (``dp_shard``, or ``dp_replicate`` x ``dp_shard`` for hybrid sharding):
otherwise one line says what to do.

Tensor-parallel stages sharded on top (PP x DP_shard x TP) run the same way: FSDP gathers each
rank's tensor-parallel shares. A parameter split with a strided layout (a fused projection)
that FSDP shards again is refused: torch cannot gather that nesting into full tensors, so
``zbsearch.models.tensor_parallel.fully_shard_layout`` must lay it out first (``shard_stage``
does).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from torch import nn

from .errors import PipelineError

__all__ = ["ShardedStages", "fsdp_modules"]


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` (itself included) that ``fully_shard`` was applied to."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch before fully_shard
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _groups(m: nn.Module) -> list:
    """FSDP's parameter groups of one module (those of its own parameters)."""
    return list(m._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]


class ShardedStages:
    """This rank's stages sharded with ``fully_shard``, driven through each pipeline step.

    ``stages``: this rank's stages (each fully sharded); ``data_size``: the ranks of the whole
    data-parallel dimension, over which FSDP's mesh must reduce.
    """

    def __init__(self, stages: Mapping[int, nn.Module], data_size: int) -> None:
        self._modules = {s: fsdp_modules(m) for s, m in stages.items()}
        for s, module in stages.items():
            mods = self._modules[s]
            trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            if not mods:
                if trainable:
                    raise PipelineError(
                        f"stage {s} is not sharded but the rank's other stages are (fully_shard): shard every stage of a "
                        f"rank, or none"
                    )
                continue
            managed = {id(fp.sharded_param): fp for m in mods for g in _groups(m) for fp in g.fsdp_params}
            loose = [n for n, p in trainable if id(p) not in managed]
            if loose:
                raise PipelineError(
                    f"stage {s}: parameter {loose[0]!r} is not sharded by fully_shard while others of the stage are: "
                    f"apply fully_shard to the stage module itself too (after its layers), so that FSDP reduces every "
                    f"gradient"
                )
            nested = next((n for n, p in trainable if _nested_strided(p, managed[id(p)])), None)
            if nested is not None:
                raise PipelineError(
                    f"stage {s}: parameter {nested!r} is split with a strided layout (a fused projection) and sharded "
                    f"again by fully_shard, a layout torch cannot gather into full tensors (full_tensor() and "
                    f"checkpoints would mix its rows up); lay it out first with "
                    f"zbsearch.models.tensor_parallel.fully_shard_layout, or shard with zbsearch.models.sharding.shard_stage"
                )
            for m in mods:
                for g in _groups(m):
                    mesh = g.mesh_info.mesh
                    if mesh.size() != data_size:
                        raise PipelineError(
                            f"stage {s} is sharded over {mesh.size()} ranks, but the data-parallel dimension has "
                            f"{data_size}: shard over all of it (mesh['dp_shard'], or mesh['dp_replicate', 'dp_shard'] "
                            f"for hybrid sharding)"
                        )
                m.set_gradient_divide_factor(1.0)  # type: ignore[operator]
                m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
                m.set_reduce_scatter_unused_params(True, recurse=False)  # type: ignore[operator]
        self._roots = {s: [m for m in mods if not any(m is not o and _inside(m, o) for o in mods)]
                       for s, mods in self._modules.items()}
        self._gathers: dict[int, list] = {}
        self._started: dict[int, float] = {}
        self._ended: dict[int, float] = {}
        self._on_host = all(g.device.type == "cpu" for mods in self._modules.values() for m in mods for g in _groups(m))
        self._reshard: dict[int, list] = {}
        self.last_step: list[tuple[int, float, float]] = []  # (stage, started, completed) in perf_counter seconds
        self._gathering: dict[int, float] = {}  # stage -> when its gather was issued, until seen complete
        self._gathered: dict[int, tuple[float, float]] = {}  # stage -> (issued, seen complete) this step
        self.last_gathers: list[tuple[int, float, float, float]] = []  # (stage, issued, completed, bytes), perf_counter s

    @property
    def stages(self) -> list[int]:
        """The stages whose gradients FSDP reduces."""
        return [s for s, mods in self._modules.items() if mods]

    def begin_step(self) -> None:
        """No sync nor reshard within the step; gather every sharded stage's parameters (async)."""
        for s in self.stages:
            self._reshard[s] = []
            for m in self._modules[s]:
                for g in _groups(m):
                    self._reshard[s].append((g, g.post_forward_mesh_info))
                    g.post_forward_mesh_info = None  # no reshard after forward: kept for the step
                m.set_is_last_backward(False)  # type: ignore[operator]
                m.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
                m.set_reshard_after_backward(False, recurse=False)  # type: ignore[operator]
            self._gathering[s] = time.perf_counter()
            self._gathers[s] = [m.unshard(async_op=True) for m in self._modules[s]]  # type: ignore[operator]

    def before(self, stage: int) -> None:
        """Wait for ``stage``'s gathered parameters (before its first pass of the step)."""
        self._poll_gathers()
        for handle in self._gathers.pop(stage, []):
            if handle is not None:
                handle.wait()
        if stage in self._gathering:  # not seen complete before: complete now
            self._gathered[stage] = (self._gathering.pop(stage), time.perf_counter())

    def _poll_gathers(self) -> None:
        """Note the time of gathers seen complete (no wait)."""
        now = None
        for s in list(self._gathering):
            if all(_gathered(g) for m in self._modules[s] for g in _groups(m)):
                now = now or time.perf_counter()
                self._gathered[s] = (self._gathering.pop(s), now)

    def gathered_bytes(self, stage: int) -> float:
        """Bytes a gather of ``stage`` brings to this rank: its parameters whole (this rank's
        tensor-parallel share), in the dtype FSDP gathers them in."""
        return float(sum(fp._orig_size.numel() * (getattr(fp, "param_dtype", None) or fp.sharded_param.dtype).itemsize
                         for m in self._modules[stage] for g in _groups(m) for fp in g.fsdp_params))

    def start(self, stage: int) -> None:
        """The stage's gradients are complete here: reduce-scatter them and free the gathered
        parameters (FSDP's post-backward, run for each of its modules)."""
        self._started[stage] = time.perf_counter()
        for m in self._modules[stage]:
            m.set_is_last_backward(True)  # type: ignore[operator]
            m.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]
            m.set_reshard_after_backward(True, recurse=False)  # type: ignore[operator]
        for g, mesh_info in self._reshard.pop(stage, []):
            g.post_forward_mesh_info = mesh_info
        for m in self._modules[stage]:
            for g in _groups(m):
                g.post_backward()
        self._ended[stage] = time.perf_counter()  # on the host's gloo the reduce-scatter has run by now

    def poll(self) -> None:
        """Note the gathers seen complete between passes (FSDP's reductions are waited for in ``finish``)."""
        self._poll_gathers()

    def finish(self) -> list[int]:
        """Wait for the reductions of this step (FSDP's end-of-backward callback per root) and
        return the stages in the order they were started."""
        from torch.distributed.fsdp import fully_shard

        done = sorted(self._started, key=self._started.__getitem__)
        for s in done:
            for root in self._roots[s]:
                fully_shard.state(root)._root_post_backward_final_callback()  # type: ignore[attr-defined]
        now = time.perf_counter()
        self.last_step = [(s, self._started[s], self._ended[s] if self._on_host else now) for s in done]
        self.last_gathers = [(s, a, b, self.gathered_bytes(s)) for s, (a, b) in sorted(self._gathered.items(),
                                                                                          key=lambda kv: kv[1])]
        self._started, self._ended, self._gathered = {}, {}, {}
        return done

    def abort(self) -> None:
        """After a failed step: put back what ``begin_step`` changed (FSDP's reshard policy)."""
        for items in self._reshard.values():
            for g, mesh_info in items:
                g.post_forward_mesh_info = mesh_info
        self._reshard, self._gathers, self._started, self._ended = {}, {}, {}, {}
        self._gathering, self._gathered = {}, {}


def _gathered(group) -> bool:
    """Whether an FSDP parameter group's all-gather has completed (or none is in flight)."""
    result = getattr(group, "_all_gather_result", None)
    work = None if result is None else result.all_gather_work
    return work is None or bool(work.is_completed())


def _nested_strided(p: nn.Parameter, fsdp_param) -> bool:
    """Whether FSDP sharded ``p`` on top of a tensor-parallel ``_StridedShard`` (the placements
    after FSDP's own mesh dimensions), on the dimension FSDP shards."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if not fsdp_param.is_dtensor:
        return False
    placements = getattr(p, "placements", ())
    own = fsdp_param.mesh_info.mesh.ndim
    dims = {q.dim for q in placements[:own] if hasattr(q, "dim")}
    return any(isinstance(q, _StridedShard) and q.dim in dims for q in placements[own:])


def _inside(m: nn.Module, outer: nn.Module) -> bool:
    return any(x is m for x in outer.modules())


