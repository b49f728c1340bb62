"""Runtime faults: a representative subset of the fault matrix (the whole one is bench/faults.py),
timeout validation, stage errors wrapped with stage and microbatch, and rebuilding after a failure."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zbsearch as zb
from tests.helpers.faults import Case, run_case
from tests.helpers.toy import toy_batch, toy_loss, toy_stages
from zbsearch.distributed import run_local
from zbsearch.runtime import PipelineError, PipelineRuntime

_COMM = re.compile(
    r"rank (\d+): (?:\d+(?:F|B|W|BW)\d+|end of step): (?:receiving|sending) (?:activations|gradient) of stage \d+ microbatch \d+ "
    r"(?:from|to) rank (\d+) (failed|timed out) after [0-9.e+-]+s \((?:timeout \d+s|when posted)\): \S"
)


def _uniform(p: int) -> zb.Profile:
    return zb.Profile(name="unit", memory_unit="activations",
                      stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)] * p)


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    Case(2, "kill", 1, "F", 1),
    Case(4, "kill", 1, "B", 1),
    Case(2, "hang", 1, "W", 1),
    Case(4, "raise", 3, "F", 1),
    Case(4, "raise", 1, "W", 1),
])
def test_every_other_rank_fails_with_a_named_error(case):
    # a dead or raising rank is noticed at once; the timeout only has to outlast a slow first step
    res = run_case(case, timeout=3.0 if case.fault == "hang" else 20.0)
    assert res["fault_injected"]
    for rank, rep in enumerate(res["ranks"]):
        if rank == case.rank and case.fault in ("kill", "hang"):
            assert rep is None  # dead, or still asleep
            continue
        assert rep is not None and rep["outcome"] == "error", (rank, rep)
        assert rep["refuses_next_step"], rep
        if rank == case.rank:  # the rank whose stage raised: its own error, with stage and microbatch
            # The fault in W sits in a custom autograd Function on the weight. The fast split
            # defers only Linear/Embedding weight gradients; any other use of a parameter gets
            # its gradient in B's one autograd call, so that user code runs (and raises) in B.
            action = f"{rank}B{case.mb}" if case.op == "W" else case.action
            expected = f"rank {rank}: {action}: stage {rank} microbatch {case.mb} raised RuntimeError: injected fault"
            assert rep["message"] == expected
            assert rep["cause"] == "RuntimeError"
            continue
        m = _COMM.match(rep["message"])
        assert m, rep["message"]
        assert int(m.group(1)) == rank and int(m.group(2)) != rank
        # a hung neighbour is a timeout; a dead one (or one that gave up) fails the wait at once
        hung_neighbour = case.fault == "hang" and int(m.group(2)) == case.rank
        assert m.group(3) == ("timed out" if hung_neighbour else "failed"), rep["message"]


@pytest.mark.slow
@pytest.mark.parametrize("op", ["F", "B"])
def test_nan_passes_through_a_step_for_post_validation_to_catch(op):
    res = run_case(Case(2, "nan", 1, op, 1), timeout=20.0)
    ranks = res["ranks"]
    assert all(r["outcome"] == "finished" for r in ranks), ranks
    assert ranks[1]["nan_grad"]  # the NaN reaches the gradients the optimizer would see
    assert ranks[1]["nan_loss"] is (op == "F")


def _fail_then_rebuild(rank: int, world: int, send) -> list[float]:
    sched = zb.build_classic("1f1b", _uniform(world), 4)
    ids, targets = toy_batch(8)
    args = (ids if rank == 0 else None, targets if rank == world - 1 else None)
    stages = toy_stages(world)
    if rank == 1:
        stages[1].forward = lambda *a: (_ for _ in ()).throw(ValueError("bad stage"))
    runtime = PipelineRuntime(sched, {rank: stages[rank]}, toy_loss if rank == world - 1 else None, timeout=3)
    with pytest.raises(PipelineError) as err:
        runtime.step(*args)
    if rank == 1:
        assert "stage 1 microbatch 0 raised ValueError: bad stage" in str(err.value)
        assert isinstance(err.value.__cause__, ValueError)
    runtime.close()
    group = dist.new_group(list(range(world)))  # gloo closed the timed-out pairs of the old one
    stages = toy_stages(world)
    with PipelineRuntime(sched, {rank: stages[rank]}, toy_loss if rank == world - 1 else None, group=group, timeout=30) as again:
        losses = again.step(*args)
    return [] if losses is None else losses.tolist()


@pytest.mark.slow
def test_runtime_is_rebuilt_after_a_failed_step():
    out = run_local(_fail_then_rebuild, 2, timeout=120)
    assert len(out[1]) == 4 and all(math.isfinite(x) for x in out[1])


# -- one process ----------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, "5", True])
def test_timeout_must_be_positive_and_finite(one_rank, timeout):
    sched = zb.build_classic("1f1b", _uniform(1), 2)
    with pytest.raises(PipelineError, match="timeout must be a positive finite number of seconds"):
        PipelineRuntime(sched, {0: toy_stages(1)[0]}, toy_loss, timeout=timeout)
    runtime = PipelineRuntime(sched, {0: toy_stages(1)[0]}, toy_loss, timeout=5)
    with pytest.raises(PipelineError, match="timeout must be a positive finite number of seconds"):
        runtime.timeout = timeout
    assert runtime.timeout == 5.0


class _Boom(nn.Module):
    def __init__(self, inner: nn.Module, when: str) -> None:
        super().__init__()
        self.inner, self.when = inner, when
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        if self.when == "forward" and self.calls == 2:
            raise KeyError("no such token")
        out = self.inner(*args)
        if self.when == "backward":
            out = _RaiseInBackward.apply(out)
        return out


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("overflow in backward")


@pytest.mark.parametrize("when, words, cause", [
    ("forward", "0F1: stage 0 microbatch 1 raised KeyError: 'no such token'", KeyError),
    # a first stage's whole backward is W's (its B has no gradient to send)
    ("backward", "0W0: stage 0 microbatch 0 raised ArithmeticError: overflow in backward", ArithmeticError),
])
def test_errors_in_stage_code_name_stage_and_microbatch(one_rank, when, words, cause):
    sched = zb.build_classic("zb-h1", _uniform(1), 2)
    stage = _Boom(toy_stages(1)[0], when)
    ids, targets = toy_batch(4)
    runtime = PipelineRuntime(sched, {0: stage}, toy_loss)
    with pytest.raises(PipelineError) as err:
        runtime.step(ids, targets)
    assert str(err.value) == f"rank 0: {words}" and isinstance(err.value.__cause__, cause)
    with pytest.raises(PipelineError, match="unusable after a failed step .*build a new PipelineRuntime"):
        runtime.step(ids, targets)
    runtime.close()
    with pytest.raises(PipelineError, match="this runtime is closed"):
        runtime.step(ids, targets)
    with PipelineRuntime(sched, {0: toy_stages(1)[0]}, toy_loss) as fresh:  # same group: no communication failed
        assert fresh.step(ids, targets).shape == (2,)
