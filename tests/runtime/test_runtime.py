"""Runtime: the B/W split, P2P plan, traces, and whole steps on gloo equal to one process."""

from __future__ import annotations

import collections
import copy
import os
import random
import re
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zbsearch as zb
from tests.helpers.toy import (
    Block,
    First,
    copy_stages,
    reference_step,
    toy_batch,
    toy_loss,
    toy_stages,
    uniform_profile,
)
from zbsearch.actions import Op
from zbsearch.distributed import run_local
from zbsearch.formats.edit import updated
from zbsearch.formats.trace import load_trace, save_trace
from zbsearch.layout import placement
from zbsearch.runtime import (
    EmulatedStage,
    PipelineError,
    PipelineRuntime,
    backward_full,
    backward_input,
    backward_weight,
    forward_pass,
)
from zbsearch.runtime.memory import ActivationMeter
from zbsearch.runtime.p2p import ACT, GRAD, comm_plan


# -- split backward --------------------------------------------------------------------------------
class _Fn(torch.autograd.Function):
    """A custom op taking a parameter directly (no per-use view reaches inside it)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class Odd(nn.Module):
    """Parameters used in the awkward ways: derived and reused, inside a custom op, passed through."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.b = nn.Parameter(torch.randn(8))
        self.lin = nn.Linear(8, 8)
        self.m = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x, y):
        w2 = self.w * 2  # derived once, used twice
        h = torch.tanh(self.lin(x) * w2) * w2
        h = torch.tanh(h @ self.m.T) @ self.m.T  # used twice through a property
        h = _Fn.apply(torch.tanh(_Fn.apply(h, self.w)) + self.b, self.w) + self.b
        return h, y  # y passes through unchanged


def _leaves(tensors, grad):
    return [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in tensors]


@pytest.mark.parametrize(
    "make, inputs",
    [
        (Block, lambda: [torch.randn(3, 5, 8), torch.randn(3, 5, 8), torch.randint(0, 9, (3, 5))]),
        (First, lambda: [torch.randint(0, 13, (3, 5))]),
        (Odd, lambda: [torch.randn(3, 8), torch.randn(3, 8)]),
    ],
)
@pytest.mark.parametrize("needs_input_grad", [True, False])
@pytest.mark.parametrize("split", [True, False])
def test_split_backward_equals_autograd(make, inputs, needs_input_grad, split):
    torch.manual_seed(0)
    module, xs = make(), inputs()
    ours_module = copy.deepcopy(module)
    ref = _leaves(xs, needs_input_grad)
    outs = module(*ref)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) if o.requires_grad else None for o in outs]
    torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None], [g for g in grads if g is not None])

    ours = _leaves(xs, needs_input_grad)
    fp = forward_pass(ours_module, ours, split=split)
    if split:
        got, w = backward_input(fp, grads)
        backward_weight(w)
    else:
        got = backward_full(fp, grads)
    for x, g in zip(ref, got):
        if x.requires_grad:
            torch.testing.assert_close(g, x.grad)
        else:
            assert g is None
    for (name, p), q in zip(module.named_parameters(), ours_module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return self.lin(torch.relu(self.lin(self.ln(x))))


@pytest.mark.parametrize("needs_input_grad", [True, False])
def test_b_and_w_do_no_duplicated_work(needs_input_grad):
    """B + W run exactly the matrix products of one plain backward, even for a parameter used
    twice, whether ``.grad`` is created or added to. On a first
    stage (input needing no gradient) B has nothing to send and does nothing: W runs the plain
    backward."""
    torch.manual_seed(0)
    module, g = _Twice(), torch.randn(4, 8)

    def counted(split):
        fp = forward_pass(module, [torch.randn(4, 8, requires_grad=needs_input_grad)], split=split)
        with _CountOps() as b:
            if split:
                _, weight_pass = backward_input(fp, [g])
            else:
                backward_full(fp, [g])
        with _CountOps() as w:
            if split:
                backward_weight(weight_pass)
        return b.counts, w.counts

    def products(counts) -> int:
        return counts["mm"]

    for fresh in (True, False):  # .grad created, then added to
        if fresh:
            module.zero_grad(set_to_none=True)
        (full, _), (b, w) = counted(False), counted(True)
        assert products(b) + products(w) == products(full) == 4
        if needs_input_grad:
            assert products(b) == 2  # d(input) of both uses of the Linear
        else:
            assert not b and w["native_layer_norm_backward"] == 1


@pytest.mark.parametrize("needs_input_grad", [True, False])
def test_memory_follows_the_model(needs_input_grad):
    """F holds M_B; B frees M_B - M_W and W the rest, on a first stage too."""
    meter = ActivationMeter()
    st = EmulatedStage(0, 0, 0, b_bytes=6000, w_bytes=4000)
    x = torch.randn(2, 16, requires_grad=needs_input_grad)
    fp = forward_pass(st, [x], meter=meter)
    after_f = meter.bytes
    _, w = backward_input(fp, [torch.ones(2, 16)])
    after_b = meter.bytes
    backward_weight(w)
    assert after_f == 10000 and after_b == 4000
    assert meter.bytes == 0 and meter.peak == after_f
    assert st.weight.grad is not None


# -- plan and trace format ----------------------------------------------------------------------------
def test_plan_lists_each_senders_messages_in_its_action_order():
    p = 3
    sched = zb.build_classic("zb-v", uniform_profile(p), 6)
    plan = comm_plan(sched)
    assert [m.index for m in plan] == list(range(len(plan)))
    for m in plan:  # every message crosses ranks, from the stage's owner to its neighbour's
        src_stage, dst_stage = (m.stage, m.stage + 1) if m.kind == ACT else (m.stage + 1, m.stage)
        assert (m.src, m.dst) == (sched.stage_to_rank[src_stage], sched.stage_to_rank[dst_stage]) and m.src != m.dst
    assert {(m.src, m.dst) for m in plan if {m.src, m.dst} == {0, 1}} == {(0, 1), (1, 0)}  # both ways on a V link
    for r, row in enumerate(sched.rank_actions):
        producers = [a for a in row if (a.op is Op.F and a.stage < 2 * p - 1 and sched.stage_to_rank[a.stage + 1] != r)
                     or (a.op in (Op.B, Op.BW) and a.stage > 0 and sched.stage_to_rank[a.stage - 1] != r)]
        sent = [m for m in plan if m.src == r]
        assert [(a.mb, a.stage if a.op is Op.F else a.stage - 1) for a in producers] == [(m.mb, m.stage) for m in sent]


@pytest.mark.parametrize("p", [2, 3])
def test_what_each_action_receives_is_what_the_plan_sends(p):
    """The runtime's receives (``remote_input``) and the senders' plan (``comm_plan``) are the
    cross-rank dependency edges of the schedule, for every classic kind and solver output."""
    from zbsearch.dependencies import action_index, action_predecessors, remote_input
    from zbsearch.solver import solve

    m = 2 * p
    skew = zb.Profile(
        name="skew", memory_unit="activations",
        stages=[zb.StageCost(t_f=1 + r, t_b=2, t_w=0.5 + r / 2, m_f=1, m_b=-0.6, m_w=-0.4, t_r=1 + r, m_fc=0.1)
                for r in range(p)],
        t_comm=0.1,
    )
    schedules = [zb.build_classic(k, skew, m) for k in zb.CLASSIC_KINDS]  # recompute passes receive nothing
    schedules += [solve(skew, m, lim, chunks=c, time_limit=1, milp=False).schedule for lim in ("1p", "2p") for c in (1, 2)]
    for sched in schedules:
        rows, owner = sched.rank_actions, sched.stage_to_rank
        index = action_index(rows)
        plan = comm_plan(sched)
        for r, row in enumerate(rows):
            edges = [  # independent of the runtime: every dependency on a pass of another rank
                (ACT if op is Op.F else GRAD, min(s, a.stage), j, index[(s, op, j)][0])
                for a in row for s, op, j in action_predecessors(a, sched.num_stages) if index[(s, op, j)][0] != r
            ]
            received = [(t.kind, t.boundary, t.mb, owner[t.src_stage]) for a in row if (t := remote_input(a, owner))]
            planned = sorted((msg.kind, msg.stage, msg.mb, msg.src) for msg in plan if msg.dst == r)
            assert received == edges, sched.kind
            assert sorted(received) == planned, sched.kind


# -- whole steps ------------------------------------------------------------------------------------
def _schedules(p: int, m: int) -> list[zb.Schedule]:
    prof = uniform_profile(p)
    out = [zb.build_classic(k, prof, m) for k in ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b")]
    # orders no closed rule makes: greedy on unequal stages under a memory limit, V placement ...
    skew = zb.Profile(
        name="skew", memory_unit="activations",
        stages=[zb.StageCost(t_f=1 + r, t_b=2, t_w=0.5 + r / 2, m_f=1, m_b=-0.6, m_w=-0.4) for r in range(p)],
    )
    cost = zb.CostModel.from_profile(skew, placement(p, 2, "v"))
    from zbsearch.solver.heuristic import Policy, list_schedule
    from zbsearch.solver.problem import Problem

    actions, _ = list_schedule(Problem(cost, m, tuple(1.5 * p * cost.activation_unit(r) for r in range(p))), Policy())
    out.append(zb.Schedule.build("greedy-v", skew, m, placement(p, 2, "v"), actions))
    try:  # ... and the solver's, when it is installed
        from zbsearch.solver import solve
    except ImportError:
        return out
    return out + [solve(skew, m, "2p", chunks=c, time_limit=10).schedule for c in (1, 2)]


def _check_schedules(rank: int, world: int, send, schedules: list[str], steps: int) -> list[str]:
    """On every rank: each schedule, ``steps`` optimizer steps, equal to the one-process model."""
    done = []
    for text in schedules:
        sched = zb.Schedule.model_validate_json(text)
        m = sched.num_microbatches
        full = toy_stages(sched.num_stages)
        ref, ours = copy_stages(full), copy_stages(full)
        mine = {s: ours[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank}
        ref_opt = torch.optim.SGD([p for st in ref for p in st.parameters()], lr=0.1, momentum=0.9)
        our_opt = torch.optim.SGD([p for st in mine.values() for p in st.parameters()], lr=0.1, momentum=0.9)
        runtime = PipelineRuntime(sched, mine, toy_loss, timeout=60)
        for step in range(steps):
            ids, targets = toy_batch(2 * m, seed=step)
            ref_opt.zero_grad()
            our_opt.zero_grad()
            ref_loss = reference_step(ref, ids, targets)
            losses = runtime.step(ids if 0 in mine else None, targets if sched.num_stages - 1 in mine else None)
            if losses is not None:
                assert losses.shape == (m,)
                torch.testing.assert_close(losses.mean(), ref_loss, rtol=1e-5, atol=1e-6)
            for s, st in mine.items():
                for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                    where = f"{sched.kind} stage {s} {name}"
                    torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda e, where=where: f"{where}: {e}")
            ref_opt.step()
            our_opt.step()
        trace = runtime.trace()
        if rank == 0:
            assert sorted(e.name for e in trace.traceEvents) == sorted(a for row in sched.actions for a in row)
        done.append(sched.kind)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("world, m", [(2, 4), (4, 8)])
def test_every_schedule_kind_matches_one_process(world, m):
    schedules = _schedules(world, m)
    kinds = run_local(_check_schedules, world, [s.model_dump_json() for s in schedules], 3)
    assert kinds[0] == [s.kind for s in schedules]
    assert {"1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"} <= set(kinds[0])


def _die_or_hang(rank: int, world: int, send, how: str) -> str:
    sched = zb.build_classic("zb-h1", uniform_profile(world), 4)
    stages = toy_stages(world)
    if rank == 1:
        inner = stages[1].forward

        def forward(*args):
            if how == "die":
                os._exit(1)
            time.sleep(60)
            return inner(*args)

        stages[1].forward = forward
    runtime = PipelineRuntime(sched, {rank: stages[rank]}, toy_loss if rank == world - 1 else None, timeout=4)
    ids, targets = toy_batch(8)
    runtime.step(ids if rank == 0 else None, targets if rank == world - 1 else None)
    return "finished"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["die", "hang"])
def test_dead_or_hung_rank_fails_the_others_with_a_named_error(how):
    t0 = time.monotonic()
    with pytest.raises(zb.ZbError) as err:  # rank 0's PipelineError, raised here
        run_local(_die_or_hang, 2, how, timeout=60)
    assert time.monotonic() - t0 < 50  # the runtime's timeout is 4 s; process start-up is the rest
    assert re.match(r"rank 0: 0(F|B|W)\d+: .* from rank 1 (failed|timed out) after [0-9.]+s \(timeout 4s\)", str(err.value)), (
        err.value
    )


# -- one process (world size 1): rejections, local hand-over, trace --------------------------------------


def test_schedule_for_another_world_size_is_rejected(one_rank):
    sched = zb.build_classic("1f1b", uniform_profile(2), 4)
    with pytest.raises(PipelineError, match="2 ranks but the process group has 1"):
        PipelineRuntime(sched, {0: nn.Linear(2, 2)}, toy_loss)


def test_wrong_stages_and_missing_loss_are_rejected(one_rank):
    sched = zb.build_classic("interleaved-1f1b", uniform_profile(1), 2)
    with pytest.raises(PipelineError, match=r"holds stages \[0, 1\] in the schedule but was given stages \[0\]"):
        PipelineRuntime(sched, {0: nn.Linear(2, 2)}, toy_loss)
    with pytest.raises(PipelineError, match="needs a loss_fn"):
        PipelineRuntime(sched, {0: nn.Linear(2, 2), 1: nn.Linear(2, 2)})
    bad = updated(sched, actions=[sched.actions[0][1:]])
    with pytest.raises(PipelineError, match="invalid schedule: .*missing"):
        PipelineRuntime(bad, {0: nn.Linear(2, 2), 1: nn.Linear(2, 2)}, toy_loss)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"])
def test_one_rank_with_local_hand_over_matches_one_process(one_rank, kind, tmp_path):
    sched = zb.build_classic(kind, uniform_profile(1), 4)
    full = toy_stages(sched.num_stages)
    ref, ours = copy_stages(full), copy_stages(full)
    ids, targets = toy_batch(8)
    ref_loss = reference_step(ref, ids, targets)
    runtime = PipelineRuntime(sched, dict(enumerate(ours)), toy_loss)
    seen = []
    runtime.on_stage_done(seen.append)
    losses = runtime.step(ids, targets)
    torch.testing.assert_close(losses.mean(), ref_loss, rtol=1e-5, atol=1e-6)
    for r, o in zip(ref, ours):
        for (name, p), q in zip(r.named_parameters(), o.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert sorted(seen) == list(range(sched.num_stages))
    assert runtime.peak_activation_bytes > 0
    trace = runtime.trace()
    path = save_trace(trace, tmp_path / "t.json")
    back = load_trace(path)
    assert len(back.traceEvents) == sum(len(r) for r in sched.actions)
    assert all(e.dur >= 0 and e.args.activations is not None for e in back.traceEvents)
    assert back.zbsearch.schedule_kind == kind and back.makespan_ms() > 0


def test_the_first_stage_runs_its_w_as_the_profile_says(one_rank, monkeypatch):
    """A profile that found the deferred way faster for the first stage's W: the runtime runs
    the first stage's split passes that way (B leaves all to W, W takes the fast path), no
    other stage's, and the gradients are those of one process."""
    from zbsearch.runtime import runtime as runtime_module

    prof = uniform_profile(1)
    prof = updated(prof, stages=[updated(prof.stages[0], deferred_first=True)])
    sched = zb.build_classic("zb-v", prof, 4)
    seen = []
    real = runtime_module.forward_pass

    def spy(module, inputs, **kw):
        fp = real(module, inputs, **kw)
        seen.append((kw["split"], fp.whole_in_w, fp.fast))
        return fp

    monkeypatch.setattr(runtime_module, "forward_pass", spy)
    full = toy_stages(sched.num_stages)
    ref, ours = copy_stages(full), copy_stages(full)
    ids, targets = toy_batch(8)
    ref_loss = reference_step(ref, ids, targets)
    runtime = PipelineRuntime(sched, dict(enumerate(ours)), toy_loss)
    torch.testing.assert_close(runtime.step(ids, targets).mean(), ref_loss, rtol=1e-5, atol=1e-6)
    for r, o in zip(ref, ours):
        for (name, p), q in zip(r.named_parameters(), o.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    first = [s for s in seen if s[1]]
    # stage 0: deferred once the first microbatch's W has checked how its signature may be split
    fast = [f for _, _, f in first]
    assert len(first) == 4 and not fast[0] and fast[-1] and fast == sorted(fast)
    assert len(seen) == 4 * sched.num_stages


def test_batch_that_does_not_split_is_rejected(one_rank):
    sched = zb.build_classic("1f1b", uniform_profile(1), 3)
    runtime = PipelineRuntime(sched, {0: toy_stages(1)[0]}, toy_loss)
    ids, targets = toy_batch(4)
    with pytest.raises(PipelineError, match="3 equal microbatches"):
        runtime.step(ids, targets)


@pytest.mark.parametrize("seed", range(20))
def test_receives_are_posted_a_number_of_messages_ahead_however_far(seed: int) -> None:
    """Each action posts the receives of the next few messages its rank waits for, even behind a
    long run of actions that wait for nothing (W passes)."""
    from zbsearch.runtime.runtime import _receives_ahead

    rng = random.Random(seed)
    needs = [("act", rng.randrange(8), i) if rng.random() < 0.3 else None for i in range(rng.randrange(1, 40))]
    count = rng.randrange(1, 5)
    ahead = _receives_ahead(needs, count)
    assert len(ahead) == len(needs)
    for pos in range(len(needs)):
        assert ahead[pos] == [k for k in needs[pos:] if k is not None][:count]
