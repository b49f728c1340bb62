"""Fault injection for the runtime: one rank dies (SIGKILL), hangs, raises or computes NaN at a
chosen action of a step, and every rank reports what it saw and when.

Shared by ``tests/runtime/test_faults.py`` (a representative subset) and ``bench/faults.py``
(the whole matrix, with the time from the fault to each rank's error). The ranks run a real
``PipelineRuntime`` on small Linear stages: one good step (connections and shapes set up),
then the step with the fault. Faults are injected from inside the stage's own code, where a
user's bug would be: in F by the forward, in B by the backward through the stage's activation,
in W by the backward through its weight, each only for the chosen microbatch.
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import queue
import signal
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["FAULTS", "Case", "run_case", "matrix"]

FAULTS = ("kill", "hang", "raise", "nan")
_WIDTH, _M = 8, 4


@dataclass(frozen=True)
class Case:
    world: int
    fault: str  # one of FAULTS
    rank: int  # the faulty rank (it holds stage ``rank``)
    op: str  # "F", "B" or "W"
    mb: int  # microbatch of the faulty pass
    kind: str = "zb-h1"

    @property
    def action(self) -> str:
        return f"{self.rank}{self.op}{self.mb}"


def matrix() -> list[Case]:
    """Every fault at F, B and W of a middle microbatch on the second and last rank, p=2 and 4."""
    return [Case(world, fault, rank, op, 1) for world in (2, 4) for rank in sorted({1, world - 1})
            for fault in FAULTS for op in "FBW"]


class _Tap(torch.autograd.Function):
    """Identity whose backward runs ``hook(grad)``: a fault point inside B (on an activation) or
    W (on a weight)."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.hook(grad), None


class _Stage(nn.Module):
    def __init__(self, seed: int, fault=None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(_WIDTH, _WIDTH)
        self.fault = fault  # (case, inject) on the faulty rank during the faulty step
        self.calls = 0

    def forward(self, x):
        mb, self.calls = self.calls % _M, self.calls + 1
        case, inject = self.fault if self.fault is not None else (None, None)
        hit = case is not None and mb == case.mb
        weight = _Tap.apply(self.lin.weight, inject) if hit and case.op == "W" else self.lin.weight
        out = torch.tanh(nn.functional.linear(inject(x) if hit and case.op == "F" else x, weight, self.lin.bias))
        return _Tap.apply(out, inject) if hit and case.op == "B" else out  # its gradient flows in B


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _injector(case: Case, stamp, hold: float):
    def inject(t: torch.Tensor) -> torch.Tensor:
        stamp.value = time.time()
        if case.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if case.fault == "hang":
            time.sleep(hold)
        if case.fault == "raise":
            raise RuntimeError("injected fault")
        return t * math.nan

    return inject


def _worker(rank: int, case: Case, port: int, timeout: float, hold: float, stamp, results) -> None:
    import zbsearch as zb
    from zbsearch.runtime import PipelineError, PipelineRuntime

    torch.set_num_threads(1)
    out: dict = {"rank": rank}
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=case.world)
        profile = zb.Profile(name="unit", memory_unit="activations", stages=[
            zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)] * case.world)
        sched = zb.build_classic(case.kind, profile, _M)
        stage = _Stage(rank)
        last = rank == case.world - 1
        # set-up and the first step on a busy machine may take long: the short timeout is for the fault
        runtime = PipelineRuntime(sched, {rank: stage}, _loss if last else None, timeout=60)
        x, y = torch.randn(2 * _M, _WIDTH), torch.randn(2 * _M, _WIDTH)
        args = (x if rank == 0 else None, y if last else None)
        runtime.step(*args)
        runtime.timeout = timeout
        if rank == case.rank:
            stage.fault = (case, _injector(case, stamp, hold))
        # A rank may finish the faulty step when it needs nothing more from the faulty rank;
        # then its next step must fail. A NaN is no fault of the runtime's: that step finishes.
        out["finished_steps"] = 0
        try:
            for _ in range(1 if case.fault == "nan" else 2):
                losses = runtime.step(*args)
                out["finished_steps"] += 1
            out.update(outcome="finished", nan_loss=None if losses is None else bool(torch.isnan(losses).any()),
                       nan_grad=any(bool(torch.isnan(p.grad).any()) for p in stage.parameters()))
        except PipelineError as err:
            out.update(outcome="error", at=time.time(), message=str(err), cause=type(err.__cause__).__name__)
            try:  # after a failed step the runtime must refuse to go on
                runtime.step(*args)
                out["refuses_next_step"] = False
            except PipelineError as again:
                out["refuses_next_step"] = "build a new PipelineRuntime" in str(again)
    except BaseException as err:  # anything else is a finding: report it rather than hang the harness
        out.update(outcome="other", message=f"{type(err).__name__}: {err}", at=time.time())
    results.put(out)
    results.close()
    results.join_thread()
    os._exit(0)  # skip process-group teardown, which can hang once a peer is gone


def run_case(case: Case, timeout: float = 2.0, limit: float = 90.0) -> dict:
    """Run ``case`` on ``case.world`` local processes; what each rank reported, with the seconds
    from the fault to its error (``elapsed_s``). The faulty rank of kill and hang reports
    nothing (it is dead, or still asleep when the others are done and is killed)."""
    ctx = mp.get_context("spawn")
    results, stamp = ctx.Queue(), ctx.Value("d", 0.0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    hold = limit  # a hung rank sleeps past the others' timeout; it is killed at the end
    procs = [ctx.Process(target=_worker, args=(r, case, store.port, timeout, hold, stamp, results), daemon=True)
             for r in range(case.world)]
    for pr in procs:
        pr.start()
    silent = {case.rank} if case.fault in ("kill", "hang") else set()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + limit
    try:
        while len(reports) < case.world - len(silent) and time.monotonic() < deadline:
            try:
                rep = results.get(timeout=0.5)
            except queue.Empty:
                if not any(pr.is_alive() for pr in procs):
                    break
                continue
            reports[rep["rank"]] = rep
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
            pr.join()
        results.close()
    for rep in reports.values():
        if "at" in rep and stamp.value:
            rep["elapsed_s"] = round(rep.pop("at") - stamp.value, 4)
    return {"case": asdict(case), "action": case.action, "fault_injected": stamp.value > 0,
            "timeout_s": timeout, "ranks": [reports.get(r) for r in range(case.world)]}
