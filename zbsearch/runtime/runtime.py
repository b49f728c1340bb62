"""PipelineRuntime: one rank's replay of a schedule file in torch.distributed.

Each rank runs its action list in order. F receives the previous stage's activations (from
another rank, or handed over locally when the previous stage lives on this rank, as in V
placement), runs the stage and passes its outputs on; the last stage applies the loss. B and
BW receive the gradient of the stage outputs and pass back the gradient of the stage inputs;
W finishes the weight gradients (``split``). Transfers follow ``p2p``'s plan. Where the schedule
recomputes a microbatch (an R pass), its F runs checkpointed and R rebuilds its activations
before its backward (``recompute``); where it recomputes selectively (RS), its F leaves out what
the stage's selected modules save and RS rebuilds that (``selective``).

Loss scaling: the last stage computes ``loss_fn(output, target)`` per microbatch and backward
starts from ``1/m`` of it, so after ``step`` every ``param.grad`` holds the gradient of the
mean of the m microbatch losses. With equal microbatches and a loss that averages over its
batch that is exactly the gradient of the loss on the whole batch, as ``loss.backward()``
would give. Like ``backward``, ``step`` adds to ``.grad``: zero it between steps.
With padding, microbatches hold different numbers of tokens and the usual loss is the mean
over all tokens of the batch instead: ``loss_normalization="tokens"`` takes ``loss_fn`` to
return a microbatch's token SUM and starts backward from ``1/N``, N the batch's token count
(``count_tokens(target)`` summed over microbatches; default: labels other than -100).

Everything that can be checked without talking to other ranks is checked in the constructor
(schedule valid, world size, stages held, loss function); then each pair of neighbouring ranks
exchanges a fingerprint of the schedule, so ranks that loaded different files stop at once,
and the ranks align their trace clocks (``trace.clock_offset``).

No barrier starts a step: each rank starts the next step as soon as it has finished its own
part of this one, and waits only for the messages its actions need (``p2p``), so no global
synchronisation puts the makespan back between iterations.

Faults: every failure inside ``step`` is a PipelineError naming the rank and action: a
communication failure also names the peer and the time waited (``errors``), an exception in a
stage's forward or backward, or in ``loss_fn``, names the stage and microbatch and keeps the
original as ``__cause__``. A step that failed leaves this rank's messages out of step with its
peers (and gloo closes the pairs of a timed-out wait), so the runtime refuses further steps:
``close()`` it and build a new one, on a new process group when communication failed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..actions import Action, Op
from ..dependencies import remote_input
from ..distributed import heap
from ..distributed.mesh import mesh_sizes
from ..distributed.timeouts import PEER_TIMEOUT_S
from ..formats.schedule import Schedule, pairs_problem
from ..formats.trace import Trace
from ..validator import find_problem
from .data_parallel import DEFAULT_BUCKET_BYTES, GradientReducer, Reductions, check_replicas, refuse_wrapped, replica_sum
from .emulation import EmulatedStage
from .errors import PipelineError, first_line, post, wait
from .identity import check_batch, check_stage
from .memory import ActivationMeter, own_storage
from .p2p import ACT, GRAD, P2P, comm_plan, plain, refuse_subclass
from .recompute import Checkpoint, checkpointed_forward, recompute
from .selective import Selection, recompute_selected, selected_modules
from .sharded import ShardedStages, fsdp_modules
from .split import ForwardPass, WeightPass, backward_full, backward_input, backward_weight, compiled, forward_pass
from .tied import TiedParameters
from .trace import StepTimer, clock_offset, gather_trace

__all__ = ["PipelineRuntime"]

# Each action posts the receives of the next this many messages its rank will wait for, however
# many actions away: counted in actions (as before), a receive behind a run of W passes was
# posted only a pass or two before it was needed, and with gloo a transfer starts only once its
# receive is posted (bench/real.py: ZB-V's and ZB-2p's waits for links fell by about half).
# Counted in messages, the buffers posted ahead stay bounded.
_LOOKAHEAD = 3


class PipelineRuntime:
    """Replays ``schedule`` on this rank.

    ``stages`` maps each stage index this rank holds (``schedule.stage_to_rank``) to its module.
    A stage's forward takes the previous stage's outputs as positional arguments and returns a
    tensor or a tuple of tensors; the first stage takes the microbatch of ``inputs``.
    ``loss_fn(output, target)`` is required on the rank holding the last stage. ``timeout``
    (seconds, positive and finite) bounds every wait for another rank. A context manager:
    ``with PipelineRuntime(...) as rt:`` closes it on the way out. ``tied``: groups of
    stage-qualified names of one weight used by several stages, e.g.
    ``[("0.wte.weight", "3.lm_head.weight")]``; their gradients are summed across stages and
    ranks in every step (``tied``).
    ``loss_normalization``: ``"mean"`` of the microbatch losses, or ``"tokens"`` (module docstring).
    ``keep_heap``: keep freed host memory in the process, as the profiler does by default
    (``zbsearch.distributed.heap``: otherwise passes pay page faults that depend on the schedule).
    ``check_model``: refuse stages, or microbatch inputs and targets, other than those the
    schedule's profile measured (``identity``); profiles that recorded none are not checked.
    Expert parameters (``data_parallel.mark_expert``: a MoE layer's, ``zbsearch.models.moe``)
    are left out of the data-parallel reduction: each rank of an expert group holds its own;
    where experts have several copies (expert groups smaller than the data dimension),
    ``expert_data_group`` is this rank's copies' group (``distributed.mesh.expert_data_group``),
    over which their gradients are summed. A schedule's overlapped pairs (``Schedule.overlapped``)
    run their forward and backward at once, in two threads.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        loss_fn: Callable | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        timeout: float = PEER_TIMEOUT_S,
        tied: Sequence[Sequence[str]] = (),
        loss_normalization: str = "mean",
        count_tokens: Callable[[torch.Tensor], int | torch.Tensor] | None = None,
        keep_heap: bool = True,
        check_model: bool = True,
        mesh: DeviceMesh | None = None,
        data_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        expert_data_group: dist.ProcessGroup | None = None,
    ) -> None:
        if loss_normalization not in ("mean", "tokens"):
            raise PipelineError(
                "loss_normalization must be 'mean' (of microbatch losses) or 'tokens' (sum / token count), "
                f"not {loss_normalization!r}"
            )
        self._p2p: P2P | None = None
        self.timeout = timeout  # checked by the setter
        problem = find_problem(schedule)
        if problem:
            raise PipelineError(f"invalid schedule: {problem}")
        self._failure: str | None = None  # why the runtime cannot step any more (set by a failed step or close)
        self.schedule = schedule
        data_groups = [data_group] if data_group is not None else []
        if mesh is not None:
            group, data_groups = _mesh_groups(mesh, group, data_group)
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        if world != schedule.num_ranks:
            raise PipelineError(
                f"schedule {schedule.kind!r} is for {schedule.num_ranks} ranks but the process group has {world}"
            )
        mine = [s for s, r in enumerate(schedule.stage_to_rank) if r == self.rank]
        if sorted(stages) != mine:
            raise PipelineError(f"rank {self.rank} holds stages {mine} in the schedule but was given stages {sorted(stages)}")
        if not all(isinstance(m, nn.Module) for m in stages.values()):
            raise PipelineError("stages must be torch.nn.Module instances")
        for s, module in sorted(stages.items()):
            refuse_wrapped(s, module)
        # the model the profile measured: these stages, these microbatch shapes (``identity``);
        # emulated stages stand for the profiled ones by design
        emulated = any(isinstance(m, EmulatedStage) for m in stages.values())
        self._identity = (schedule.profile.model or {}).get("identity") if check_model and not emulated else None
        for s, module in sorted(stages.items()):
            check_stage(self._identity, s, module, schedule.profile.name)
        if not emulated:
            _check_tensor_parallel(schedule, stages, mesh, self.rank)
        self.last = schedule.num_stages - 1
        if self.last in stages and loss_fn is None:
            raise PipelineError(f"rank {self.rank} holds the last stage ({self.last}) and needs a loss_fn")
        if device is None:
            nccl = "nccl" in dist.get_backend(group)
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        self.meter = ActivationMeter()
        self._actions = schedule.rank_actions[self.rank]
        self._pairs = _pairs(schedule, self.rank)
        self._worker: ThreadPoolExecutor | None = None  # runs the forward of each overlapped pair
        self._fused = {(a.stage, a.mb) for a in self._actions if a.op is Op.BW}
        self._recomputed = {(a.stage, a.mb) for a in self._actions if a.op is Op.R}
        whole = sorted(s for s in {a.stage for a in self._actions if a.op is Op.W} if compiled(self.stages[s]))
        if whole:
            warnings.warn(
                f"rank {self.rank}: stages {whole} are compiled with their parameters (torch.compile), so each runs its whole "
                "backward in B and its W passes have nothing to do; profile the compiled stages so that the schedule prices "
                "B and W as they run, or use a schedule with fused backwards (1f1b, interleaved-1f1b)",
                stacklevel=2,
            )
        self._selective = {(a.stage, a.mb) for a in self._actions if a.op is Op.RS}
        # per stage recomputed selectively, the modules it declares in the mode the profile measured (``selective``)
        mode = schedule.profile.selective
        self._selected = {s: selected_modules(self.stages[s], mode) for s in sorted({s for s, _ in self._selective})}
        for s, chosen in self._selected.items():
            if not chosen:
                what = (f"no module for the mode its profile measured ({mode!r}: set selective_recompute = {mode!r} on "
                        f"the modules to recompute)" if mode is not None else
                        "no module in every mode, and the schedule's profile does not say which modules its selective "
                        "costs recompute (set its 'selective' to 'attention' or 'mlp', or profile again)")
                raise PipelineError(
                    f"rank {self.rank}: the schedule recomputes stage {s} selectively (RS), but stage {s} declares {what}"
                )
        # how the first stage's W runs, as the profile measured it (the faster way)
        self._deferred_first = schedule.profile.stages[0].deferred_first
        self._owner = schedule.stage_to_rank
        # each stage's last backward action, where its gradients are complete: position -> stage
        last_backward = {a.stage: i for i, a in enumerate(self._actions) if a.op in (Op.W, Op.BW)}
        self._done_at = {i: s for s, i in last_backward.items()}
        self._hooks: list[Callable[[int], None]] = []
        if keep_heap:  # process-wide: only once the arguments are known to be good
            heap.keep_heap()
        self._p2p = P2P(comm_plan(schedule), self.rank, group, self.device, self.timeout)
        # the message each action waits for from another rank, if any
        self._ahead = _receives_ahead([t.key if (t := remote_input(a, self._owner)) else None for a in self._actions])
        self._handshake()
        data_groups = [g for g in data_groups if dist.get_world_size(g) > 1]
        self.data_group = data_groups[0] if len(data_groups) == 1 else None  # one group: the replicas'
        self._data_groups = data_groups
        self.replicas = math.prod(dist.get_world_size(g) for g in data_groups)
        sharded = any(fsdp_modules(m) for m in self.stages.values())
        shards = mesh_sizes(mesh).dp_shard if mesh is not None else 1
        if shards > 1 and not sharded:
            raise PipelineError(
                f"the mesh shards data parallelism over {shards} ranks (dp_shard), but rank "
                f"{self.rank}'s stages are not sharded: apply fully_shard(stage, mesh=mesh['dp_shard']) to each stage "
                f"(its layers first), or put the replicas in dp_replicate"
            )
        for g in data_groups:
            check_replicas(g, self.schedule, self.stages, self.rank, timeout)
        self._dp: GradientReducer | Reductions | ShardedStages | None = None
        # FSDP reduces (sums) across the whole data-parallel dimension, driven by the runtime
        self._sharded = ShardedStages(self.stages, self.replicas) if sharded else None
        if self._sharded is not None:
            self._dp = self._sharded
        elif data_groups:
            if len(data_groups) > 1:
                raise PipelineError("replicated stages take one data-parallel group (data_group=), not several")
            order = [s for _, s in sorted((i, s) for i, s in self._done_at.items())]
            self._dp = GradientReducer(self.stages, order, data_groups[0], timeout, bucket_bytes)
            if expert_data_group is not None and dist.get_world_size(expert_data_group) > 1:
                self._dp = Reductions([self._dp, GradientReducer(self.stages, order, expert_data_group, timeout,
                                                                 bucket_bytes, experts=True)])
        # each stage's first action, where a sharded stage needs its gathered parameters: position -> stage
        first: dict[int, int] = {}
        for i, a in enumerate(self._actions):
            first.setdefault(a.stage, i)
        self._first_at = {i: s for s, i in first.items()}
        self.loss_normalization = loss_normalization
        self._count_tokens = count_tokens or _labelled_tokens
        # d(step loss)/d(microbatch loss): the mean over every replica's microbatches
        self._seed = 1.0 / (schedule.num_microbatches * self.replicas)
        self.tied = [tuple(g) for g in tied]
        # the holders of tied copies by global rank: the private groups of the sums span the world
        owners = [dist.get_global_rank(group, r) if group is not None else r for r in self._owner]
        self._tied = TiedParameters(self.tied, self.stages, owners, timeout) if self.tied else None
        self._timer = StepTimer(self.device, clock_offset(self.rank, world, group, timeout))

    # -- public --------------------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        """Seconds any wait for another rank may take; may be changed between steps."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        """Refuse anything but a positive finite number of seconds; the P2P layer follows."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
            raise PipelineError(f"timeout must be a positive finite number of seconds, not {seconds!r}")
        self._timeout = float(seconds)
        if self._p2p is not None:
            self._p2p.timeout = self._timeout

    @property
    def _comm(self) -> P2P:
        assert self._p2p is not None  # made in __init__ (None only until then, for the timeout setter)
        return self._p2p

    def on_stage_done(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(stage)`` during ``step`` as soon as that stage's gradients are complete
        (right after its last W or BW), e.g. to step its optimizer early."""
        self._hooks.append(hook)

    def close(self) -> None:
        """Release what this runtime holds (its extra process group on NCCL, the private gloo
        groups of tied parameters); it cannot step after. Call it after a failed step, then
        build a new runtime (on a new process group if communication failed). Idempotent."""
        if self._failure == "closed":
            return
        self._failure = "closed"
        if self._tied is not None:
            self._tied.close()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if isinstance(self._dp, (GradientReducer, Reductions)):
            self._dp.close()
        self._comm.close()

    def __enter__(self) -> PipelineRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, inputs=None, targets=None) -> torch.Tensor | None:
        """One iteration: all m microbatches through the schedule.

        ``inputs`` (rank of stage 0) and ``targets`` (rank of the last stage) are whole batches,
        a tensor or a tuple of tensors, split into m equal microbatches along dim 0. Returns the
        m microbatch losses on the rank holding the last stage, None elsewhere.
        """
        if self._failure is not None:
            raise PipelineError(
                f"rank {self.rank}: this runtime is {self._failure}; build a new PipelineRuntime "
                f"(on a new process group if communication failed)"
            )
        mb_inputs = self._split(inputs, "inputs") if 0 in self.stages else None
        mb_targets = self._split(targets, "targets") if self.last in self.stages else None
        if mb_targets is not None and self.loss_normalization == "tokens":
            total = sum(float(self._count_tokens(t)) for t in mb_targets)
            for g in self._data_groups:  # the global batch's tokens: every replica's last stage counts its own
                total = replica_sum(total, g, self.device, self.timeout)
            if total <= 0:
                raise PipelineError("loss_normalization='tokens': the batch has no token to count (all labels ignored?)")
            self._seed = 1.0 / total
        try:
            return self._step(mb_inputs, mb_targets)
        except BaseException as err:  # incl. KeyboardInterrupt: the peers are out of step either way
            if self._sharded is not None:
                self._sharded.abort()
            self._failure = f"unusable after a failed step ({first_line(err)})"
            raise

    def _step(self, mb_inputs, mb_targets) -> torch.Tensor | None:
        m = self.schedule.num_microbatches
        self._comm.start_step()
        self._timer.start()
        self.meter.reset_peak()
        losses: list[torch.Tensor | None] = [None] * m
        passes: dict[tuple[int, int], ForwardPass] = {}  # F done, B to come
        weights: dict[tuple[int, int], WeightPass] = {}  # B done, W to come
        ckpts: dict[tuple[int, int], Checkpoint] = {}  # F done checkpointed, R to come
        selections: dict[tuple[int, int], Selection] = {}  # F done selectively checkpointed, RS to come
        local: dict[tuple[str, int, int], list] = {}
        sharded = self._sharded
        if sharded is not None:  # gather every sharded stage's parameters, kept until its last backward
            sharded.begin_step()
        paired = -1  # the position of a pair's backward, run with its forward
        for pos, a in enumerate(self._actions):
            if pos != paired:
                self._comm.action = self.schedule.actions[self.rank][pos]
                self._comm.reap()
                for at in (pos, pos + 1) if pos in self._pairs else (pos,):
                    for key in self._ahead[at]:
                        self._comm.prepost(*key)
                    if sharded is not None and at in self._first_at:
                        sharded.before(self._first_at[at])
            if pos == paired:
                pass  # ran with the forward before it
            elif pos in self._pairs:
                paired = pos + 1
                self._pair(a, self._actions[paired], passes, ckpts, selections, weights, local, mb_inputs, mb_targets,
                           losses)
            elif a.op is Op.F:
                self._forward(a, passes, ckpts, selections, local, mb_inputs, mb_targets, losses)
            elif a.op is Op.R:
                self._timer.begin()
                post = functools.partial(self._loss, mb_targets[a.mb]) if a.stage == self.last else None
                passes[(a.stage, a.mb)] = self._run_stage(
                    a, recompute, ckpts.pop((a.stage, a.mb)), self.stages[a.stage], split=(a.stage, a.mb) not in self._fused,
                    post=post, meter=self.meter, deferred_first=a.stage == 0 and self._deferred_first)
                self._timer.end(a, self.meter.bytes)
            elif a.op is Op.RS:
                self._timer.begin()
                self._run_stage(a, recompute_selected, selections.pop((a.stage, a.mb)), passes[(a.stage, a.mb)].saved)
                self._timer.end(a, self.meter.bytes)
            elif a.op is Op.W:
                self._timer.begin()
                self._run_stage(a, backward_weight, weights.pop((a.stage, a.mb)))
                self._timer.end(a, self.meter.bytes)
            else:
                self._backward(a, passes, weights, local)
            if pos in self._done_at and not (self._tied and self._done_at[pos] in self._tied.stages):
                self._stage_done(self._done_at[pos])
            elif self._dp is not None:
                self._dp.poll()
        self._comm.action = "end of step"
        self._comm.finish_step()
        if self._tied:  # after every transfer of this rank was posted: it cannot block a peer
            self._tied.reduce()
            for s in sorted(self._tied.stages):
                self._stage_done(s)
        if self._dp is not None:  # the reductions started as stages finished: wait for them only now
            for s in self._dp.finish():
                for hook in self._hooks:
                    hook(s)
        self._timer.finish()
        if mb_targets is None:
            return None
        assert all(x is not None for x in losses)  # the last stage ran every microbatch's forward
        return torch.stack(cast(list[torch.Tensor], losses))

    def trace(self) -> Trace | None:
        """Collective: the last step's per-action timeline of all ranks (on rank 0; None elsewhere)."""
        lane = gathered = None
        off = self._timer.offset  # perf_counter seconds -> microseconds of rank 0's clock, as the passes
        if self._dp is not None:
            lane = [(s, (b - off) * 1e6, (e - off) * 1e6) for s, b, e in self._dp.last_step]
        if self._sharded is not None:
            gathered = [(s, (b - off) * 1e6, (e - off) * 1e6, n) for s, b, e, n in self._sharded.last_gathers]
        return gather_trace(
            self._timer.rows, self.rank, self.schedule.num_ranks, self.schedule.kind, self.group, self.device,
            self.timeout, reductions=lane, gathers=gathered, num_microbatches=self.schedule.num_microbatches,
            num_stages=self.schedule.num_stages,
        )

    @property
    def peak_activation_bytes(self) -> int:
        """Peak live activation bytes on this rank during the last step."""
        return self.meter.peak

    @property
    def reductions(self) -> list[tuple[int, float, float]]:
        """The last step's data-parallel reductions on this rank: (stage, start, end), in seconds
        of ``time.perf_counter`` (end: when it completed, ``GradientReducer``: on the host as gloo
        completes it, on a device when the rank first saw it complete, between passes)."""
        return [] if self._dp is None else list(self._dp.last_step)

    @property
    def gathers(self) -> list[tuple[int, float, float, float]]:
        """The last step's parameter gathers of this rank's sharded stages: (stage, start, end,
        bytes), in seconds of ``time.perf_counter`` (start: issued at the step's start; end: when
        first seen complete, between passes or before the stage's first pass); empty unsharded."""
        return [] if self._sharded is None else list(self._sharded.last_gathers)

    # -- actions -------------------------------------------------------------------------------
    def _stage_done(self, stage: int) -> None:
        """A stage's gradients are complete on this rank: reduce them across the replicas, or,
        with no replicas, tell the hooks (with replicas they hear once the reduction is done)."""
        if self._dp is not None:
            self._dp.start(stage)
            return
        for hook in self._hooks:
            hook(stage)

    def _pair(self, f: Action, b: Action, passes, ckpts, selections, weights, local, mb_inputs, mb_targets,
              losses) -> None:
        """An overlapped pair: F's and B's (or BW's) inputs received, then both computed at once,
        F in the worker thread, so that one's expert all-to-all is in flight while the other
        computes (each pass's collectives on its own expert group: ``zbsearch.models.moe``);
        then both outputs sent, F's first."""
        args = self._forward_args(f, local, mb_inputs)
        fp, grads = self._backward_grads(b, passes, local)
        inputs = fp.inputs  # (the backward lets go of them)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"zbsearch-pair-r{self.rank}")
        context = contextvars.copy_context()  # the passes see this thread's context, grad mode included
        grad_mode = torch.is_grad_enabled()

        def forward() -> tuple:
            with torch.set_grad_enabled(grad_mode), _on_device(self.device):
                return self._forward_compute(f, args, passes, ckpts, selections, mb_targets)

        self._timer.begin()
        running = self._worker.submit(context.run, forward)
        try:
            input_grads = self._backward_compute(b, fp, grads, weights)
        finally:
            outputs = running.result()  # (F's error, if it raised, wins over B's: it came first in the schedule)
        self._timer.end(f, self.meter.bytes)
        self._timer.end(b, self.meter.bytes)
        self._forward_deliver(f, outputs, local, losses)
        self._backward_deliver(b, inputs, input_grads, local)

    def _forward(self, a: Action, passes, ckpts, selections, local, mb_inputs, mb_targets, losses) -> None:
        args = self._forward_args(a, local, mb_inputs)
        self._timer.begin()
        outputs = self._forward_compute(a, args, passes, ckpts, selections, mb_targets)
        self._timer.end(a, self.meter.bytes)
        self._forward_deliver(a, outputs, local, losses)

    def _forward_args(self, a: Action, local, mb_inputs) -> Sequence:
        """F's inputs: the microbatch on the first stage, else the previous stage's outputs."""
        s, j = a.stage, a.mb
        if s == 0:
            return mb_inputs[j] if isinstance(mb_inputs[j], tuple) else (mb_inputs[j],)
        if self._owner[s - 1] == self.rank:
            return [_leaf(t, t.requires_grad) for t in local.pop((ACT, s - 1, j))]
        got = cast("list[torch.Tensor]", self._comm.recv(ACT, s - 1, j))  # activations are never None
        return [_leaf(t, meta.requires_grad) for t, meta in zip(got, self._comm.meta[s - 1])]

    def _forward_compute(self, a: Action, args, passes, ckpts, selections, mb_targets) -> tuple:
        """F's compute: the stage (and the loss on the last stage); its outputs."""
        s, j = a.stage, a.mb
        post = functools.partial(self._loss, mb_targets[j]) if s == self.last else None
        if (s, j) in self._recomputed:  # checkpointed: R rebuilds the activations before the backward
            outputs, ckpts[(s, j)] = self._run_stage(a, checkpointed_forward, self.stages[s], args, post=post,
                                                     meter=self.meter, device=self.device)
        else:
            select = None
            if (s, j) in self._selective:  # the selected modules' activations: RS rebuilds them before the backward
                select = selections[(s, j)] = Selection(self.stages[s], self._selected[s], self.meter, self.device)
            fp = self._run_stage(a, forward_pass, self.stages[s], args, split=(s, j) not in self._fused, post=post,
                                 meter=self.meter, deferred_first=s == 0 and self._deferred_first, select=select)
            passes[(s, j)] = fp
            outputs = fp.outputs
        return outputs

    def _forward_deliver(self, a: Action, outputs, local, losses) -> None:
        """F's outputs to the next stage (or its loss kept, on the last stage)."""
        s, j = a.stage, a.mb
        if s == self.last:
            loss = outputs[0].detach()
            losses[j] = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # a DTensor (loss parallel): its value
            return
        refuse_subclass(list(outputs), f"rank {self.rank}: {a}: stage {s} output")
        if self._owner[s + 1] == self.rank:
            local[(ACT, s, j)] = list(outputs)
        else:
            self._comm.send(ACT, s, j, list(outputs))

    def _backward(self, a: Action, passes, weights, local) -> None:
        fp, grads = self._backward_grads(a, passes, local)
        inputs = fp.inputs  # (the backward lets go of them)
        self._timer.begin()
        input_grads = self._backward_compute(a, fp, grads, weights)
        self._timer.end(a, self.meter.bytes)
        self._backward_deliver(a, inputs, input_grads, local)

    def _backward_grads(self, a: Action, passes, local) -> tuple[ForwardPass, list[torch.Tensor | None]]:
        """B's forward pass and the gradients of its outputs (the loss seed on the last stage)."""
        s, j = a.stage, a.mb
        fp = passes.pop((s, j))
        if s == self.last:
            return fp, [torch.full_like(fp.outputs[0], self._seed)]
        if self._owner[s + 1] == self.rank:
            return fp, local.pop((GRAD, s, j))
        got = iter(self._comm.recv(GRAD, s, j))
        return fp, [next(got) if meta.requires_grad else None for meta in self._comm.meta[s]]

    def _backward_compute(self, a: Action, fp: ForwardPass, grads, weights) -> list[torch.Tensor | None]:
        """B's (or BW's) compute: the input gradients; B leaves W's work in ``weights``."""
        if a.op is Op.BW:
            return self._run_stage(a, backward_full, fp, grads)
        input_grads, weights[(a.stage, a.mb)] = self._run_stage(a, backward_input, fp, grads)
        return input_grads

    def _backward_deliver(self, a: Action, inputs, input_grads, local) -> None:
        """B's input gradients to the previous stage."""
        s, j = a.stage, a.mb
        if s == 0:
            return
        if self._owner[s - 1] == self.rank:
            local[(GRAD, s - 1, j)] = [None if g is None else plain(g) for g in input_grads]
        else:
            pairs = [(x, g) for x, g in zip(inputs, input_grads) if x.requires_grad]
            self._comm.send(GRAD, s - 1, j, [g for _, g in pairs], like=[x for x, _ in pairs])

    # -- helpers -------------------------------------------------------------------------------
    def _run_stage(self, a: Action, fn: Callable, *args, **kw):
        """``fn(*args)``: a pass through user code (stage, loss); what it raises is wrapped."""
        try:
            return fn(*args, **kw)
        except PipelineError:
            raise
        except Exception as err:
            raise PipelineError(
                f"rank {self.rank}: {a}: stage {a.stage} microbatch {a.mb} raised {type(err).__name__}: {first_line(err)}"
            ) from err

    def _loss(self, target, output) -> torch.Tensor:
        assert self.loss_fn is not None  # checked in __init__ for the rank holding the last stage
        loss = self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipelineError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
        return loss

    def _split(self, batch, what: str) -> list:
        """The m microbatches of a batch given as a tensor (a list of tensors) or a tuple (of tuples)."""
        m = self.schedule.num_microbatches
        if batch is None:
            raise PipelineError(
                f"rank {self.rank} holds stage {0 if what == 'inputs' else self.last} and must pass {what} to step()"
            )
        if isinstance(batch, Mapping):
            raise PipelineError(
                f"{what}: a dict ({', '.join(map(str, batch))}) is not taken; "
                "pass a tuple in the order the stage's forward takes them"
            )
        tensors = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] % m:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise PipelineError(
                    f"{what}[{i}]: expected a tensor whose first dimension splits into {m} equal microbatches, got {got}"
                )
            if what == "inputs" and t.requires_grad:
                raise PipelineError(
                    f"inputs[{i}] requires grad, but the pipeline gives stage 0's inputs no gradient; "
                    "detach it, or make it a parameter of stage 0"
                )
        planned = self.schedule.profile.microbatch_size
        if planned is not None and tensors[0].shape[0] != m * planned:
            raise PipelineError(
                f"{what}: microbatches of {tensors[0].shape[0] / m:g} (batch {tensors[0].shape[0]} / {m}) but the "
                f"schedule's profile was measured with microbatches of {planned}"
            )
        # each microbatch its own storage: the meter charges what a saved slice's storage holds
        chunks = [[own_storage(c) for c in t.to(self.device).chunk(m)] for t in tensors]
        out = list(zip(*chunks)) if isinstance(batch, (tuple, list)) else list(chunks[0])
        check_batch(self._identity, "inputs" if what == "inputs" else "target", out[0], self.schedule.profile.name)
        return out

    def _handshake(self) -> None:
        """Neighbouring ranks check they run the same schedule (pairs in one global order)."""
        digest = hashlib.sha256(
            repr((self.schedule.stage_to_rank, self.schedule.num_microbatches, self.schedule.actions)).encode()
        ).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=self.device)
        for peer in self._comm.peers:  # ascending: each pair meets when both reach it
            theirs = torch.zeros_like(mine)
            dst = dist.get_global_rank(self.group, peer) if self.group is not None else peer
            ops = [(dist.isend, mine, self._comm.group_to(peer)), (dist.irecv, theirs, self._comm.group_from(peer))]
            what = f"rank {self.rank}: checking the schedule with rank {peer}"
            for op, t, g in ops if self.rank < peer else ops[::-1]:  # also sets up both directions
                wait(post(functools.partial(op, t, dst, group=g), what), self.timeout, what)
            if theirs.item() != mine.item():
                raise PipelineError(f"rank {self.rank} and rank {peer} were given different schedules")


def _pairs(schedule: Schedule, rank: int) -> set[int]:
    """The positions of ``rank``'s overlapped pairs (their F; the B or BW follows), checked for
    what running them needs: the schedule's rule for pairs (``pairs_problem``) and, since a pair
    runs its two passes at once, a backward of another microbatch than its forward's."""
    if schedule.overlapped is None:
        return set()
    problem = pairs_problem(schedule.actions, schedule.overlapped)
    if problem:
        raise PipelineError(problem)
    actions = schedule.rank_actions[rank]
    for pos in schedule.overlapped[rank]:
        f, b = actions[pos], actions[pos + 1]
        if f.mb == b.mb:
            raise PipelineError(f"rank {rank}: overlapped pair {f}+{b}: the backward of a microbatch needs its forward")
    return set(schedule.overlapped[rank])


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """This thread's current CUDA device set to ``device`` (a new thread starts on device 0)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def _labelled_tokens(target) -> torch.Tensor:
    """Tokens a causal LM loss counts: labels other than -100 (the ignore index)."""
    return (target != -100).sum()


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    x = plain(t).detach()
    return x.requires_grad_(requires_grad and (x.is_floating_point() or x.is_complex()))


def _receives_ahead(needs: list, count: int = _LOOKAHEAD) -> list[list]:
    """Per action, the next ``count`` messages waited for from that action on (``needs``: the
    message each action waits for, or None)."""
    ahead: list[list] = []
    upcoming: list = []
    for key in reversed(needs):
        if key is not None:
            upcoming = [key, *upcoming[: count - 1]]
        ahead.append(upcoming)
    return ahead[::-1]


def tensor_parallel_degree(stages: Mapping[int, nn.Module], mesh: DeviceMesh | None) -> int | None:
    """The tensor-parallel degree this rank's stages run at: the mesh's ``tp`` size, else that of
    the ``tp`` dimension of the meshes their DTensor parameters live on (``parallelize_stage``
    on ``mesh["tp"]``), 1 for stages of plain parameters; None where it cannot be told (DTensor
    parameters on meshes with no dimension named ``tp``)."""
    if mesh is not None:
        return mesh_sizes(mesh).tp
    sizes = set()
    for module in stages.values():
        for p in module.parameters():
            m = getattr(p, "device_mesh", None)
            if m is None:
                continue
            names = m.mesh_dim_names or ()
            if "tp" not in names:
                return None
            sizes.add(m.size(names.index("tp")))
    return max(sizes) if sizes else 1


def _check_tensor_parallel(schedule: Schedule, stages: Mapping[int, nn.Module], mesh: DeviceMesh | None, rank: int) -> None:
    """Refuse, in one line, stages split at another tensor-parallel degree than the one the
    schedule's profile measured them at (its ``mesh`` section; a profile without one is not
    checked, as it does not say)."""
    made = schedule.profile.mesh
    have = tensor_parallel_degree(stages, mesh)
    if made is None or have is None or have == made.tp:
        return
    raise PipelineError(
        f"rank {rank}: schedule {schedule.kind!r} was made for tensor-parallel degree {made.tp} (profile "
        f"{schedule.profile.name!r} measured the stages at tp {made.tp}), but this rank's stages run at tp {have}: run "
        f"it at tp {made.tp}, or profile the stages with --tp {have} and make the schedule from that profile"
    )


def _mesh_groups(mesh: DeviceMesh, group, data_group) -> tuple[dist.ProcessGroup, list[dist.ProcessGroup]]:
    """The pipeline group and the data-parallel groups of a mesh (``distributed.mesh``):
    replicated, then sharded, each where its size is above one."""
    if group is not None or data_group is not None:
        raise PipelineError("give either mesh= or the groups (group=, data_group=), not both")
    sizes = mesh_sizes(mesh)
    names = mesh.mesh_dim_names or ()
    if "pp" not in names:
        raise PipelineError(f"the mesh has no 'pp' dimension (its dimensions: {', '.join(names) or 'unnamed'})")
    pp = mesh["pp"].get_group()
    data = [mesh[d].get_group() for d in ("dp_replicate", "dp_shard") if getattr(sizes, d) > 1]
    return pp, data

