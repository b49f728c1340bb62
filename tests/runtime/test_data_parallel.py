"""Data parallelism around the pipeline: PP2 x DP2 on 4 gloo processes equals one process on the
global batch, for every schedule kind, with AdamW steps; wrong set-ups stop in one line."""

from __future__ import annotations

import os
import re
import time
from typing import cast

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import zbsearch as zb
from tests.helpers.toy import VOCAB, copy_stages, toy_loss, toy_stages, uniform_profile
from zbsearch.distributed import run_local
from zbsearch.distributed.mesh import MeshSizes, build_mesh
from zbsearch.layout import placement
from zbsearch.runtime import PipelineError, PipelineRuntime

PP, DP = 2, 2


def _profile_with_recompute(p: int) -> zb.Profile:
    st = zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.6, m_w=-0.4, t_r=1.0, m_fc=0.1)
    return zb.Profile(name="unit-r", memory_unit="activations", stages=[st] * p)


def _schedules(m: int) -> list[zb.Schedule]:
    prof = uniform_profile(PP)
    out = [zb.build_classic(k, prof, m) for k in ("gpipe", "1f1b", "1f1b-split", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b")]
    out.append(zb.build_classic("1f1b-recompute", _profile_with_recompute(PP), m))
    from zbsearch.solver import solve

    skew = zb.Profile(
        name="skew", memory_unit="activations",
        stages=[zb.StageCost(t_f=1 + r, t_b=2, t_w=0.5 + r / 2, m_f=1, m_b=-0.6, m_w=-0.4) for r in range(PP)],
    )
    out.append(solve(skew, m, "2p", time_limit=5).schedule)
    out.append(solve(skew, m, "2p", chunks=2, time_limit=5).schedule)
    assert placement(PP, 2, "v") in [s.stage_to_rank for s in out]
    return out


class _Rare(nn.Module):
    """The toy's first stage, plus a parameter used only by microbatches holding token 0 (one
    replica's, in these batches), a frozen one, and one never used."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.rare = nn.Parameter(torch.full((1, 5, 8), 0.1))
        self.frozen = nn.Parameter(torch.ones(8), requires_grad=False)
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, ids):
        h, skip, ids = self.inner(ids)
        h = h * self.frozen
        if bool((ids == 0).any()):
            h = h + self.rare
        return h, skip, ids


def _model(num_stages: int) -> list[nn.Module]:
    stages = toy_stages(num_stages)
    stages[0] = _Rare(stages[0])
    return stages


def _global_batch(m: int, step: int, pad: bool, replicas: int = DP) -> tuple[torch.Tensor, torch.Tensor]:
    """``replicas`` * 2m sequences; token 0 only in replica 0's first microbatch; with ``pad``, replicas
    with different numbers of ignored labels (-100)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (replicas * 2 * m, 5), generator=g)
    ids[0, 0] = 0
    targets = torch.randint(0, VOCAB, (replicas * 2 * m, 5), generator=g)
    if pad:
        targets[: 2 * m, 3:] = -100  # replica 0: 2 of 5 labels ignored
        targets[2 * m + 1, 1:] = -100
    return ids, targets


def _sum_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum", ignore_index=-100)


def _reference(stages: list[nn.Module], ids, targets, tokens: bool) -> None:
    """One process, microbatch by microbatch (a stage may branch on its microbatch's data), on
    the global batch: the mean of the microbatch losses, or the token sum over the token count."""
    count = (targets != -100).sum()
    for mb_ids, mb_targets in zip(ids.split(2), targets.split(2)):
        x = (mb_ids,)
        for st in stages:
            x = st(*x)
            x = x if isinstance(x, tuple) else (x,)
        loss = _sum_loss(x[0], mb_targets) / count if tokens else toy_loss(x[0], mb_targets) / (len(ids) // 2)
        loss.backward()


def step_both(runtime, ref, mine, optimizers, step: int, tokens: bool, replica: int, replicas: int = DP) -> None:
    """One step of the pipeline on this replica's share of a global batch, and of the one-process
    model on all of it, the optimizers' gradients zeroed first."""
    m = runtime.schedule.num_microbatches
    ids, targets = _global_batch(m, step, pad=tokens, replicas=replicas)
    part = slice(replica * 2 * m, (replica + 1) * 2 * m)
    for opt in optimizers:
        opt.zero_grad()
    _reference(ref, ids, targets, tokens)
    last = runtime.schedule.num_stages - 1
    runtime.step(ids[part] if 0 in mine else None, targets[part] if last in mine else None)


def _check_trace(trace, sched: zb.Schedule) -> None:
    """The last step's trace (on each pipeline's first rank) records every stage's reduction on
    its rank, started after the stage's last W or BW; ``compare_reductions`` reads them."""
    if trace is None:
        return
    from zbsearch.reduction_times import compare_reductions

    lanes = trace.zbsearch.reductions
    assert lanes is not None and len(lanes) == sched.num_ranks
    rows = trace.rank_events()
    for r, lane in enumerate(lanes):
        assert sorted(s for s, _, _ in lane) == [s for s in range(sched.num_stages) if sched.stage_to_rank[s] == r]
        for s, start, end in lane:
            ready = max(ev.ts + ev.dur for ev in rows[r] if ev.args.stage == s and ev.args.op.value in ("W", "BW"))
            assert ready - 1.0 <= start <= end, (sched.kind, r, s, ready, start, end)  # (1 us: the clocks' rounding)
    got = compare_reductions(sched, [trace])
    assert sorted((x.rank, x.stage) for x in got) == sorted((r, s) for r, lane in enumerate(lanes) for s, _, _ in lane)
    assert all(x.count == 1 and x.measured_delay_ms >= -1e-3 and x.predicted_ms is None for x in got)


def _run(rank: int, world: int, send, schedules: list[str], steps: int) -> list[str]:
    """Every schedule under PP2 x DP2, with AdamW, against one process on the global batch."""
    mesh = build_mesh(pp=PP, dp_replicate=DP)
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    done = []
    for i, text in enumerate(schedules):
        sched = zb.Schedule.model_validate_json(text)
        tokens = i % 3 == 1  # some schedules normalise by tokens
        full = _model(sched.num_stages)
        ref, ours = copy_stages(full), copy_stages(full)
        mine = {s: ours[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == pp_rank}
        ref_opt = torch.optim.AdamW([p for st in ref for p in st.parameters() if p.requires_grad], lr=0.01)
        ours_trained = [p for st in mine.values() for p in st.parameters() if p.requires_grad]
        # every other schedule shards the optimizer state over the replicas (torch's ZeRO-1
        # optimizer on the data-parallel group, after the runtime's reductions)
        zero = i % 2 == 1
        our_opt = (ZeroRedundancyOptimizer(ours_trained, optimizer_class=torch.optim.AdamW, lr=0.01,
                                           process_group=mesh["dp_replicate"].get_group()) if zero
                   else torch.optim.AdamW(ours_trained, lr=0.01))
        last = sched.num_stages - 1
        loss_fn = (_sum_loss if tokens else toy_loss) if last in mine else None
        runtime = PipelineRuntime(sched, mine, loss_fn, mesh=mesh, timeout=60,
                                  loss_normalization="tokens" if tokens else "mean", bucket_bytes=600)
        for step in range(steps):
            step_both(runtime, ref, mine, (ref_opt, our_opt), step, tokens, replica)
            for s, st in mine.items():
                for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                    where = f"{sched.kind} step {step} stage {s} {name}"
                    if p.grad is None:
                        assert q.grad is None, where
                        continue
                    torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda e, w=where: f"{w}: {e}")
            ref_opt.step()
            our_opt.step()
        _check_trace(runtime.trace(), sched)
        for s, st in mine.items():  # parameters after the AdamW steps
            for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                q, p = q.detach().clone(), p.detach().clone()
                if name.endswith("attn.in_proj_bias"):
                    # attention's key bias has a gradient that is zero but for rounding, which Adam
                    # turns into steps of either sign: it only stays within Adam's step bound
                    key = slice(p.numel() // 3, 2 * p.numel() // 3)
                    assert (q[key] - p[key]).abs().max() <= 0.01 * steps * 1.01, name
                    q[key] = p[key]
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda e, n=f"{sched.kind} {name}": f"{n}: {e}")
        assert {s for s, _, _ in runtime.reductions} == set(mine)
        if zero:  # each replica holds the AdamW state of its share of the parameters only
            held = sum(p.numel() for p in ours_trained)
            kept = sum(p.numel() for p in cast(ZeroRedundancyOptimizer, our_opt).optim.state)
            assert 0 < kept < held, (held, kept)
        done.append(sched.kind)
        runtime.close()
    return done


@pytest.mark.slow
def test_every_schedule_kind_under_pp2_dp2_equals_one_process():
    schedules = _schedules(4)
    kinds = run_local(_run, PP * DP, [s.model_dump_json() for s in schedules], 2)
    assert kinds[0] == [s.kind for s in schedules]


def test_pp2_dp2_core_kinds_equal_one_process():
    """The fast suite's share: a split zero-bubble schedule and a V placement, tokens and mean."""
    sched = [zb.build_classic(k, uniform_profile(PP), 4) for k in ("zb-h1", "zb-v")]
    kinds = run_local(_run, PP * DP, [s.model_dump_json() for s in sched], 2)
    assert kinds[3] == ["zb-h1", "zb-v"]


def _clipped(rank: int, world: int, send, kind: str, steps: int) -> float:
    """Post-validated clipping under PP2 x DP2: the global norm is the one-process model's."""
    from zbsearch.runtime import PostValidatedOptimizer

    mesh = build_mesh(pp=PP, dp_replicate=DP)
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    sched = zb.build_classic(kind, uniform_profile(PP), 4)
    full = _model(sched.num_stages)
    ref, ours = copy_stages(full), copy_stages(full)
    mine = {s: ours[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == pp_rank}
    last = sched.num_stages - 1
    runtime = PipelineRuntime(sched, mine, toy_loss if last in mine else None, mesh=mesh, timeout=60)
    ref_params = [p for st in ref for p in st.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(ref_params, lr=0.01)
    inner = torch.optim.AdamW([p for st in mine.values() for p in st.parameters() if p.requires_grad], lr=0.01)
    opt = PostValidatedOptimizer(inner, max_norm=0.05, group=runtime.group, stages=mine, timeout=60)
    opt.attach(runtime)
    norms = []
    for step in range(steps):
        ids, targets = _global_batch(4, step, pad=False)
        part = slice(replica * 8, (replica + 1) * 8)
        opt.validate()
        runtime.step(ids[part] if 0 in mine else None, targets[part] if last in mine else None)
        verdict = opt.validate()
        ref_opt.zero_grad()
        _reference(ref, ids, targets, tokens=False)
        norm = nn.utils.clip_grad_norm_(ref_params, 0.05)
        ref_opt.step()
        assert verdict is not None and verdict.clipped
        torch.testing.assert_close(torch.tensor(verdict.total_norm), norm, rtol=1e-5, atol=0)
        norms.append(float(norm))
    for s, st in mine.items():
        for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
            q, p = q.detach().clone(), p.detach().clone()
            if name.endswith("attn.in_proj_bias"):  # see _run
                key = slice(p.numel() // 3, 2 * p.numel() // 3)
                assert (q[key] - p[key]).abs().max() <= 0.01 * steps * 1.01, name
                q[key] = p[key]
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda e, n=name: f"{n}: {e}")
    return norms[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zb-h1", "zb-v"])
def test_post_validated_clipping_under_pp2_dp2_uses_the_global_norm(kind):
    norms = run_local(_clipped, PP * DP, kind, 3)
    assert len(set(norms)) == 1  # every rank of the mesh agreed


def _tied(rank: int, world: int, send, kinds: list[str], steps: int, sharded: bool = False) -> list[str]:
    """A tied embedding and head (on two ranks, or on one with a V) under PP2 x DP2: summed over
    the stages and the replicas, once each; ``sharded``: the stages under fully_shard."""
    from tests.runtime.test_tied import BATCH, loss_fn, model, tie

    dim = "dp_shard" if sharded else "dp_replicate"
    mesh = build_mesh(pp=PP, **{dim: DP})
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh[dim].get_local_rank()
    done = []
    for kind in kinds:
        sched = zb.build_classic(kind, uniform_profile(PP), 4)
        n = sched.num_stages
        ref, whole = model(n), model(n)
        mine = {s: whole[s] for s in range(n) if sched.stage_to_rank[s] == pp_rank}
        if sharded:
            from torch.distributed.fsdp import fully_shard

            for st in mine.values():
                fully_shard(st, mesh=mesh[dim])
        runtime = PipelineRuntime(sched, mine, loss_fn if n - 1 in mine else None, mesh=mesh, tied=tie(n), timeout=60)
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 11, (DP * BATCH, 4), generator=g)
            y = torch.randint(0, 11, (DP * BATCH, 4), generator=g)
            part = slice(replica * BATCH, (replica + 1) * BATCH)
            for st in [*ref, *mine.values()]:
                st.zero_grad()
            for mb_ids, mb_y in zip(ids.split(2), y.split(2)):
                x = mb_ids
                for st in ref:
                    x = st(x)
                (loss_fn(x, mb_y) / (len(ids) // 2)).backward()
            runtime.step(ids[part] if 0 in mine else None, y[part] if n - 1 in mine else None)
            for s, st in mine.items():
                for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                    where = f"{kind} {name}"
                    got = q.grad.full_tensor() if sharded else q.grad
                    torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6, msg=lambda e, w=where: f"{w}: {e}")
            with torch.no_grad():  # the same plain step on both
                for p in {id(p): p for st in [*ref, *mine.values()] for p in st.parameters()}.values():
                    p -= 0.1 * p.grad
        runtime.close()
        done.append(kind)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_tied_weights_under_pp2_dp2_equal_one_process(sharded):
    assert run_local(_tied, PP * DP, ["zb-h1", "zb-v"], 2, sharded)[0] == ["zb-h1", "zb-v"]


# -- wrong set-ups: one line on every rank ---------------------------------------------------------
def _bad(rank: int, world: int, send, how: str) -> str:
    sched = zb.build_classic("zb-h1", uniform_profile(PP), 4)
    mesh = build_mesh(pp=PP, dp_replicate=DP)
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    stages = {pp_rank: _model(PP)[pp_rank]}
    if how == "schedule" and replica == 1:
        sched = zb.build_classic("1f1b", uniform_profile(PP), 4)
    if how == "frozen" and replica == 1 and pp_rank == 0:
        stages[0].inner.emb.weight.requires_grad_(False)
    loss = toy_loss if pp_rank == PP - 1 else None
    if how == "pipeline-size":
        sched = zb.build_classic("zb-h1", uniform_profile(4), 4)
    runtime = PipelineRuntime(sched, stages, loss, mesh=mesh, timeout=5)
    if how == "die":
        from zbsearch.runtime import data_parallel

        start = data_parallel.GradientReducer.start

        def start_then_die(self, stage):
            start(self, stage)
            if rank == 1:
                os._exit(1)

        data_parallel.GradientReducer.start = start_then_die  # type: ignore[method-assign]
    ids, targets = _global_batch(4, 0, pad=False)
    runtime.step(ids[:8] if pp_rank == 0 else None, targets[:8] if pp_rank == PP - 1 else None)
    return "finished"


@pytest.mark.parametrize("how, message", [
    ("schedule", r"replicas were given different schedules"),
    pytest.param("frozen", r"replicas hold different stages: stage 0 parameter 'inner.emb.weight': requires_grad "
                  r"(True|False) on global rank \d, (True|False) on global rank \d", marks=pytest.mark.slow),
    pytest.param("pipeline-size", r"schedule 'zb-h1' is for 4 ranks but the process group has 2", marks=pytest.mark.slow),
])
def test_wrong_mesh_set_ups_stop_in_one_line(how, message):
    with pytest.raises(zb.ZbError, match=message) as err:
        run_local(_bad, PP * DP, how, timeout=120)
    assert "\n" not in str(err.value)


def test_mesh_sizes_that_do_not_make_the_world_are_refused(one_rank):
    with pytest.raises(zb.ZbError, match=r"mesh sizes pp 2 x dp_replicate 3 x dp_shard 1 x tp 1 make 6 ranks, but the job has 1"):
        build_mesh(pp=2, dp_replicate=3)


def test_a_stage_wrapped_in_ddp_is_refused_in_one_line(one_rank):
    import torch.distributed as dist

    sched = zb.build_classic("zb-h1", uniform_profile(1), 2)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2), process_group=dist.group.WORLD)
    with pytest.raises(PipelineError, match=r"stage 0 is wrapped in DistributedDataParallel, .*pass the module itself "
                                            r"\(ddp.module\)") as err:
        PipelineRuntime(sched, {0: ddp}, toy_loss)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_replica_that_dies_mid_reduction_stops_the_others():
    t0 = time.monotonic()
    with pytest.raises(zb.ZbError) as err:
        run_local(_bad, PP * DP, "die", timeout=120)
    assert time.monotonic() - t0 < 100
    assert re.match(r"rank 0: the data-parallel reduction of stage 0 \(2 replicas\) (failed|timed out) after", str(err.value)), (
        err.value
    )


def test_mesh_sizes_are_checked_before_any_group():
    with pytest.raises(zb.ZbError, match="mesh size tp must be a positive whole number"):
        MeshSizes(pp=2, tp=0)
    assert MeshSizes(pp=2, dp_replicate=4).describe() == "pp 2 x dp_replicate 4"
    assert MeshSizes(pp=2, dp_replicate=4, tp=2).world == 16


def _grads(step: int, rank: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor | None]:
    """One rank's random gradients at one step, some missing: what both ranks regenerate."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out: list[torch.Tensor | None] = []
    for shape in shapes:
        keep = bool(torch.rand((), generator=gen) < 0.7)
        out.append(torch.randn(shape, generator=gen) if keep else None)
    return out


def _reducer_steps(rank: int, world: int, send, steps: int) -> None:
    """A ``GradientReducer`` over several steps of random gradients (some missing, several
    buckets per stage) on a 2-process gloo group: each step's sums are the replicas' (from
    their seeds), its buckets' tensors kept from step to step, and a reduction's end the time
    it completed, even with the rank busy and not looking."""
    import torch.distributed as dist

    from zbsearch.runtime.data_parallel import GradientReducer

    stages = {0: nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)), 1: nn.Sequential(nn.Linear(3, 4, bias=False))}
    params = [p for s in (0, 1) for p in stages[s].parameters()]
    shapes = [tuple(p.shape) for p in params]
    group = dist.group.WORLD
    assert group is not None
    reducer = GradientReducer(stages, [0, 1], group, timeout=60, bucket_bytes=64)
    assert len(reducer._buckets[0]) >= 2  # several buckets in a stage
    kept = None
    for step in range(steps):
        for p, g in zip(params, _grads(step, rank, shapes)):
            p.grad = None if g is None else g.clone()
        reducer.start(1)
        reducer.start(0)
        assert reducer.finish() == [1, 0]
        both = [_grads(step, r, shapes) for r in range(world)]
        for i, p in enumerate(params):
            given = [g[i] for g in both if g[i] is not None]
            if not given:
                assert p.grad is None, (step, i)
            else:
                assert p.grad is not None, (step, i)
                torch.testing.assert_close(p.grad, sum(given[1:], given[0].clone()), rtol=1e-6, atol=1e-6)
        ptrs = [t.data_ptr() for s in (0, 1) for t in reducer._flats[s] if t is not None]
        assert kept is None or ptrs == kept, "the buckets' tensors are kept from step to step"
        kept = ptrs
    # rank 1 starts late; rank 0 starts at once, then is busy (no poll) well past the completion
    late, busy = 0.15, 0.6
    if rank == 1:
        time.sleep(late)
    issued = time.perf_counter()
    reducer.start(0)
    if rank == 0:
        time.sleep(busy)
    called = time.perf_counter()
    reducer.finish()
    starts: list = [None] * world
    dist.all_gather_object(starts, issued)
    (stage, began, ended), = reducer.last_step
    assert stage == 0 and began <= ended
    assert ended >= max(starts), "a collective completes once the later replica has joined it"
    if rank == 0:  # the host's clock is one for both processes; noted at completion, not at finish
        assert ended < called - busy / 2, (ended - issued, called - issued)


@pytest.mark.slow  # two processes: spawning them takes most of its 7-10 s
def test_reducer_keeps_its_buckets_and_times_each_reduction_to_its_completion():
    run_local(_reducer_steps, 2, 3, timeout=120)
