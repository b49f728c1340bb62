"""Optimizer post-validation: bit-for-bit equal to a synchronous clip_grad_norm_ + skip loop.

The multi-rank tests run every schedule kind through PipelineRuntime on 4 gloo ranks (one
spawn for all scenarios) and compare each step's parameters and decisions with a
single-process reference on the whole model: ``clip_grad_norm_``, a GradScaler-style skip on
NaN/Inf, and ``torch.amp.GradScaler`` itself in the loss-scaling scenario.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import struct
import time
from collections import Counter

import pytest
import torch
from torch import nn

from zbsearch import Profile, StageCost, build_classic
from zbsearch.distributed import run_local

P, M, D, BATCH, STEPS = 4, 4, 6, 8, 6
MAX_NORM = 2.0
TARGET_SCALE = [1.0, 30.0, 1.0, 1.0, 30.0, 1.0]  # steps 1 and 4 clip, the others do not
NAN_STEP, NAN_STAGE = 3, 1
GAMMA = 0.8  # ExponentialLR after every step: a late step must use the step's own lr
SCALER = dict(init_scale=2.0**10, growth_interval=2)  # growth and a backoff within 6 steps
# (name, schedule kind, optimizer, mode, GradScaler); mode: "validate" (validate() before each
# iteration), "defer" (defer=True, replay when told) or "sync" (SyncClippedOptimizer)
SCENARIOS = [
    ("1f1b-sgd", "1f1b", "sgd", "validate", False),
    ("zb-h1-adam", "zb-h1", "adam", "validate", False),
    ("zb-h2-adamw", "zb-h2", "adamw", "validate", False),
    ("zb-v-adamw", "zb-v", "adamw", "validate", False),
    ("interleaved-sgd", "interleaved-1f1b", "sgd", "validate", False),
    ("gpipe-adam-sync", "gpipe", "adam", "sync", False),
    ("zb-v-adam-scaler", "zb-v", "adam", "validate", True),
    ("zb-h1-sgd-defer", "zb-h1", "sgd", "defer", False),
    ("zb-v-adamw-defer", "zb-v", "adamw", "defer", False),
    ("zb-h2-adam-scaler-defer", "zb-h2", "adam", "defer", True),
]


def make_stage(s: int) -> nn.Module:
    torch.manual_seed(100 + s)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh())


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(BATCH, D, generator=g), TARGET_SCALE[k] * torch.randn(BATCH, D, generator=g)


def num_stages(kind: str) -> int:
    return 2 * P if kind in ("zb-v", "interleaved-1f1b") else P


# ---------------------------------------------------------------------------------------------
# single-process reference on the whole model


def reference(kind: str, opt_kind: str, use_scaler: bool):
    """Per step, the parameters before it and (found_inf, total_norm, clipped); then the final
    parameters; and the final loss scale."""
    stages = [make_stage(s) for s in range(num_stages(kind))]
    model = nn.Sequential(*stages)
    opt = make_optimizer(opt_kind, model.parameters())
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, GAMMA)
    scaler = torch.amp.GradScaler("cpu", **SCALER) if use_scaler else None
    params, decisions = [], []
    for k in range(STEPS):
        params.append([[p.detach().clone() for p in st.parameters()] for st in stages])
        x, y = batch(k)
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = nn.functional.mse_loss(model(xm), ym)
            loss = scaler.scale(loss) if scaler else loss
            (loss / M).backward()
        if k == NAN_STEP:
            next(stages[NAN_STAGE].parameters()).grad[0, 0] = float("nan")
        if scaler:
            scaler.unscale_(opt)
        found = not all(torch.isfinite(p.grad).all() for p in model.parameters())
        total = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        decisions.append((found, float(total), bool(MAX_NORM / (total + 1e-6) < 1.0)))
        if scaler:
            scaler.step(opt)
            scaler.update()
        elif not found:
            opt.step()
        opt.zero_grad()
        sched.step()
    params.append([[p.detach().clone() for p in st.parameters()] for st in stages])
    return params, decisions, float(scaler.get_scale()) if scaler else None


# ---------------------------------------------------------------------------------------------
# 4 ranks through PipelineRuntime


def _worker(rank: int, world: int, send, out: str) -> None:
    from zbsearch.runtime import PipelineRuntime
    from zbsearch.runtime.post_validation import PostValidatedOptimizer, SyncClippedOptimizer

    profile = Profile(
        name="unit", memory_unit="activations", t_comm=0.0,
        stages=[StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5)] * P,
    )
    for name, kind, opt_kind, mode, use_scaler in SCENARIOS:
        schedule = build_classic(kind, profile, M)
        last = schedule.num_stages - 1
        stages = {s: make_stage(s) for s, r in enumerate(schedule.stage_to_rank) if r == rank}
        scaler = torch.amp.GradScaler("cpu", **SCALER) if use_scaler else None

        def loss_fn(out, y, scaler=scaler):
            loss = nn.functional.mse_loss(out, y)
            return scaler.scale(loss) if scaler else loss

        runtime = PipelineRuntime(schedule, stages, loss_fn if last in stages else None)
        params = [p for s in sorted(stages) for p in stages[s].parameters()]
        inner = make_optimizer(opt_kind, params)
        sched = torch.optim.lr_scheduler.ExponentialLR(inner, GAMMA)
        where = None if kind == "1f1b" else stages  # one stage per rank: the default order is right
        if mode == "sync":
            opt = SyncClippedOptimizer(inner, MAX_NORM, stages=where, scaler=scaler)
        else:
            opt = PostValidatedOptimizer(inner, MAX_NORM, stages=where, scaler=scaler, defer=mode == "defer")
        step = [0]

        def inject(stage: int, step=step, stages=stages) -> None:
            if step[0] == NAN_STEP and stage == NAN_STAGE:
                next(stages[stage].parameters()).grad[0, 0] = float("nan")
            # stage 0 finishing late makes every other rank step before the global numbers are in
            if TARGET_SCALE[step[0]] > 1 and stage == 0:
                time.sleep(0.3)

        runtime.on_stage_done(inject)
        if mode != "sync":
            opt.attach(runtime)

        def params_now(stages=stages):
            return {s: [p.detach().clone() for p in m.parameters()] for s, m in stages.items()}

        seen, verdicts, replays = [], [], 0
        for k in range(STEPS):
            if mode == "validate":
                verdicts.append(opt.validate())
            x, y = batch(k)
            while True:
                # with defer=True, the parameters of the iteration that is not replayed are final
                before = params_now()
                runtime.step(x, y)
                if mode == "defer" and opt.last is not None and all(v is not opt.last for v in verdicts):
                    verdicts.append(opt.last)
                if not (mode == "defer" and opt.replay):
                    break
                replays += 1
            seen.append(before)
            if mode == "sync":
                verdicts.append(opt.step())
                opt.zero_grad()
            sched.step()
            step[0] += 1
        if mode != "sync":
            verdicts.append(opt.validate())
        seen.append(params_now())
        verdicts = [v for v in verdicts if v is not None]
        scale = float(scaler.get_scale()) if scaler else None
        counts = getattr(opt, "counts", Counter())
        snap = getattr(opt, "peak_snapshot_bytes", 0)
        torch.save(dict(seen=seen, verdicts=[dataclasses.astuple(v) for v in verdicts], counts=dict(counts),
                        scale=scale, snapshot_bytes=snap, replays=replays), os.path.join(out, f"{name}-{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("post_validation"))
    run_local(_worker, P, out)
    return {name: [torch.load(os.path.join(out, f"{name}-{r}.pt")) for r in range(P)] for name, *_ in SCENARIOS}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_equal_to_synchronous_reference(runs, scenario):
    name, kind, opt_kind, mode, use_scaler = scenario
    ref_params, ref_decisions, ref_scale = reference(kind, opt_kind, use_scaler)
    clipped = [d[2] for d in ref_decisions]
    assert any(clipped) and not all(clipped) and ref_decisions[NAN_STEP][0]  # the test means something
    ranks = runs[name]
    for k in range(STEPS + 1):
        for r in ranks:
            for s, tensors in r["seen"][k].items():
                for got, want in zip(tensors, ref_params[k][s]):
                    assert torch.equal(got, want), f"{name}: step {k} stage {s} differs"
    for r in ranks:
        # same skip and clip decisions and the same global norm, to the bit, as clip_grad_norm_
        assert [_bits(v[:3]) for v in r["verdicts"]] == [_bits(d) for d in ref_decisions]
    # the NaN step changed no parameter anywhere
    for s in range(num_stages(kind)):
        for before, after in zip(ref_params[NAN_STEP][s], ref_params[NAN_STEP + 1][s]):
            assert torch.equal(before, after)
    assert all(r["scale"] == ref_scale for r in ranks)
    # defer=True: the iterations after the clipped steps and after the NaN step ran again
    want = sum(d[0] or d[2] for d in ref_decisions[:-1]) if mode == "defer" else 0
    assert all(r["replays"] == want for r in ranks)


def _bits(decision):
    """NaN-proof comparison key (the NaN step's norm is NaN)."""
    return tuple(struct.pack("d", v) if isinstance(v, float) else v for v in decision)


@pytest.mark.slow
def test_every_path_taken_and_snapshot_only_when_optimistic(runs):
    counts = Counter()
    for name, *_ in SCENARIOS:
        for r in runs[name]:
            counts.update(r["counts"])
            if not r["counts"].get("committed") and not r["counts"].get("rolled_back"):
                assert r["snapshot_bytes"] == 0
    assert {"exact", "committed", "rolled_back", "deferred"} <= set(counts), counts


# ---------------------------------------------------------------------------------------------
# single process


@pytest.mark.parametrize("opt_kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh-state", "warm-state"])
def test_rollback_restores_parameters_and_state_exactly(opt_kind, warm):
    from zbsearch.runtime.post_validation import _Snapshot

    model = nn.Sequential(make_stage(0), make_stage(1))
    opt = make_optimizer(opt_kind, model.parameters())

    def grads(seed):
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)

    if warm:
        grads(1)
        opt.step()
    before_params = copy.deepcopy(list(model.parameters()))
    before_state = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy((model, opt))
    grads(2)
    snap = _Snapshot(opt, list(model.parameters()))
    opt.step()
    snap.restore()
    for p, q in zip(model.parameters(), before_params):
        assert torch.equal(p, q)
    after = opt.state_dict()
    assert after["state"].keys() == before_state["state"].keys()
    for i, st in before_state["state"].items():
        assert after["state"][i].keys() == st.keys()
        for key, v in st.items():
            assert torch.equal(after["state"][i][key], v) if torch.is_tensor(v) else after["state"][i][key] == v
    # and the redo after the restore is the step the untouched twin takes
    grads(3)
    opt.step()
    tmodel, topt = twin
    g = torch.Generator().manual_seed(3)
    for p in tmodel.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    topt.step()
    for p, q in zip(model.parameters(), tmodel.parameters()):
        assert torch.equal(p, q)
    per_param = {"sgd": 8, "adam": 12, "adamw": 12}[opt_kind]
    n = sum(p.numel() for p in model.parameters())
    steps = 4 * len(before_params) if warm and opt_kind != "sgd" else 0  # Adam's step counters
    assert snap.nbytes == (per_param * n if warm else 4 * n) + steps


def test_global_norm_mixed_dtypes_and_stage_order_match_clip_grad_norm(one_rank):
    """Stages out of order in the optimizer, bf16 and fp32 parameters, norms over six orders of
    magnitude: the norm and the step equal clip_grad_norm_ + step on the whole model, bit for
    bit (several of these seeds give other bits if the norms are summed in another order)."""
    from zbsearch.runtime.post_validation import PostValidatedOptimizer

    def build(seed):
        torch.manual_seed(seed)
        return [nn.Linear(5, 5).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(6)]

    for seed in range(16):
        mods, ref_mods = build(seed), build(seed)
        g = torch.Generator().manual_seed(seed)
        for m, r in zip(mods, ref_mods):
            for p, q in zip(m.parameters(), r.parameters()):
                scale = 10.0 ** torch.randint(-3, 3, (1,), generator=g).item()
                p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)
                q.grad = p.grad.clone()
        order = [p for i in (4, 1, 5, 0, 3, 2) for p in mods[i].parameters()]
        opt = PostValidatedOptimizer(torch.optim.SGD(order, lr=0.5), max_norm=1.0, stages=dict(enumerate(mods)))
        opt.step()
        verdict = opt.validate()
        ref_params = [p for m in ref_mods for p in m.parameters()]
        total = nn.utils.clip_grad_norm_(ref_params, 1.0)
        torch.optim.SGD(ref_params, lr=0.5).step()
        assert verdict.clipped and verdict.total_norm == float(total), seed
        for p, q in zip([p for m in mods for p in m.parameters()], ref_params):
            assert torch.equal(p, q), seed


# ---------------------------------------------------------------------------------------------
# a rank whose parameters are all frozen

FROZEN_STAGE = 1


def _frozen_stages(n: int) -> list[nn.Module]:
    stages = [make_stage(s) for s in range(n)]
    for p in stages[FROZEN_STAGE].parameters():
        p.requires_grad_(False)
    return stages


def _frozen_worker(rank: int, world: int, send, mode: str):
    from zbsearch.runtime import PipelineRuntime
    from zbsearch.runtime.post_validation import PostValidatedOptimizer, SyncClippedOptimizer

    profile = Profile(name="unit", memory_unit="activations",
                      stages=[StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5)] * world)
    schedule = build_classic("zb-h1", profile, M)
    all_stages = _frozen_stages(world)
    stages = {rank: all_stages[rank]}
    runtime = PipelineRuntime(schedule, stages, nn.functional.mse_loss if rank == world - 1 else None, timeout=30)
    trainable = [p for p in stages[rank].parameters() if p.requires_grad]
    inner = torch.optim.SGD(trainable, lr=0.1, momentum=0.9) if trainable else None  # torch refuses []
    cls = SyncClippedOptimizer if mode == "sync" else PostValidatedOptimizer
    opt = cls(inner, MAX_NORM, stages=stages, timeout=30)
    if mode != "sync":
        opt.attach(runtime)
    verdicts = []
    for k in range(3):
        if mode != "sync":
            verdicts.append(opt.validate())
        x, y = batch(k)
        runtime.step(x if rank == 0 else None, y if rank == world - 1 else None)
        if mode == "sync":
            verdicts.append(opt.step())
            opt.zero_grad()
    if mode != "sync":
        verdicts.append(opt.validate())
    # plain lists: tensors would travel through shared memory, which a finished worker takes along
    return [p.tolist() for p in stages[rank].parameters()], [dataclasses.astuple(v)[:3] for v in verdicts if v]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["validate", "sync"])
def test_a_rank_with_every_parameter_frozen_takes_part(mode):
    """Its optimizer is None (torch.optim refuses an empty parameter list); the others step
    as the synchronous loop on the whole model with that stage frozen, and nobody waits."""
    world = 3
    got = run_local(_frozen_worker, world, mode, timeout=300)
    stages = _frozen_stages(world)
    model = nn.Sequential(*stages)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    decisions = []
    for k in range(3):
        x, y = batch(k)
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (nn.functional.mse_loss(model(xm), ym) / M).backward()
        total = nn.utils.clip_grad_norm_(trainable, MAX_NORM)
        decisions.append((False, float(total), bool(MAX_NORM / (total + 1e-6) < 1.0)))
        opt.step()
        opt.zero_grad()
    assert any(d[2] for d in decisions)  # some step clipped
    for rank, (params, verdicts) in enumerate(got):
        assert verdicts == decisions, rank
        for p, q in zip(params, stages[rank].parameters()):
            assert torch.equal(torch.tensor(p, dtype=q.dtype), q), rank
