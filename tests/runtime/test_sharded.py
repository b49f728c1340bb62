"""Sharded data parallelism: stages under fully_shard (FSDP2), PP2 x DP2 on 4 gloo processes,
equal to one process on the global batch under the split backward, with AdamW steps; the
optimizer state and the parameters between steps are each rank's shard only."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import zbsearch as zb
from tests.helpers.toy import copy_stages, toy_loss, uniform_profile
from tests.runtime.test_data_parallel import _model, _schedules, _sum_loss, step_both
from zbsearch.distributed import run_local
from zbsearch.distributed.mesh import build_mesh
from zbsearch.runtime import PipelineError, PipelineRuntime

PP, DP = 2, 2


def _shard(stage: nn.Module, mesh) -> None:
    """torchtitan's recipe: each layer, then the stage itself."""
    from torch.distributed.fsdp import fully_shard

    for m in list(stage.modules()):
        if m is not stage and type(m).__name__ == "Block":
            fully_shard(m, mesh=mesh)
    fully_shard(stage, mesh=mesh)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(rank: int, world: int, send, schedules: list[str], steps: int,
         dims: tuple[int, int]) -> tuple[list[str], list[list[str]]]:
    """Every schedule with sharded stages, against one process on the global batch; and each
    step's trace, per schedule, on each pipeline's first rank (none elsewhere)."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    replicate, shard = dims
    mesh = build_mesh(pp=PP, dp_replicate=replicate, dp_shard=shard)
    pp_rank = mesh["pp"].get_local_rank()
    replica = mesh["dp_replicate"].get_local_rank() * shard + mesh["dp_shard"].get_local_rank()
    data = mesh["dp_shard"] if replicate == 1 else mesh["dp_replicate", "dp_shard"]
    done, traces = [], []
    for i, text in enumerate(schedules):
        sched = zb.Schedule.model_validate_json(text)
        traces.append([])
        tokens = i % 2 == 1
        full = _model(sched.num_stages)
        ref, ours = copy_stages(full), copy_stages(full)
        mine = {s: ours[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == pp_rank}
        for st in mine.values():
            _shard(st, data)
        ref_opt = torch.optim.AdamW([p for st in ref for p in st.parameters() if p.requires_grad], lr=0.01)
        trained = [p for st in mine.values() for p in st.parameters() if p.requires_grad]
        our_opt = torch.optim.AdamW(trained, lr=0.01)  # on the shards: its state is this rank's share
        last = sched.num_stages - 1
        loss_fn = (_sum_loss if tokens else toy_loss) if last in mine else None
        runtime = PipelineRuntime(sched, mine, loss_fn, mesh=mesh, timeout=60,
                                  loss_normalization="tokens" if tokens else "mean")
        for step in range(steps):
            step_both(runtime, ref, mine, (ref_opt, our_opt), step, tokens, replica, replicate * shard)
            assert sorted(s for s, *_ in runtime.gathers) == sorted(mine)  # each stage gathered once in the step
            trace = runtime.trace()
            if trace is not None:
                traces[-1].append(trace.model_dump_json())
            for s, st in mine.items():
                for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                    where = f"{sched.kind} step {step} stage {s} {name}"
                    assert q is not None and hasattr(q, "to_local"), f"{where}: not sharded after the step"
                    if p.grad is None:  # no replica used it: FSDP reduces zeros
                        assert q.grad is None or not _full(q.grad).any(), where
                        continue
                    torch.testing.assert_close(_full(q.grad), p.grad, rtol=1e-5, atol=1e-6,
                                               msg=lambda e, w=where: f"{w}: {e}")
            ref_opt.step()
            our_opt.step()
        for s, st in mine.items():  # parameters after the AdamW steps
            for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                q, p = _full(q.detach()).clone(), p.detach().clone()
                if name.endswith("attn.in_proj_bias"):  # see test_data_parallel._run
                    key = slice(p.numel() // 3, 2 * p.numel() // 3)
                    assert (q[key] - p[key]).abs().max() <= 0.01 * steps * 1.01, name
                    q[key] = p[key]
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda e, n=f"{sched.kind} {name}": f"{n}: {e}")
        held = sum(p.numel() for p in trained)  # global sizes
        kept = sum(p.to_local().numel() for p in trained)
        state = sum(v.to_local().numel() for st in our_opt.state.values() for k, v in st.items() if k != "step")
        assert kept < held and state == 2 * kept, (held, kept, state)
        assert {s for s, _, _ in runtime.reductions} == set(mine)
        done.append(sched.kind)
        runtime.close()
    return done, traces


def _check_gathers(sched: zb.Schedule, traces: list[str], steps: int) -> None:
    """Each step's trace holds one gather per stage, on the stage's rank, complete before the
    stage's first pass, of the stage's parameter bytes (counted here from the model, float32);
    ``compare_gathers`` reads them, as ``simulate --measured`` does."""
    from zbsearch.formats.trace import Trace
    from zbsearch.reduction_times import compare_gathers, compare_lane_ends

    got = [Trace.model_validate_json(t) for t in traces]
    assert len(got) == steps
    held = [4.0 * sum(p.numel() for p in st.parameters()) for st in _model(sched.num_stages)]
    count = 0
    for trace in got:
        lanes = trace.zbsearch.gathers
        assert lanes is not None and len(lanes) == sched.num_ranks
        rows = trace.rank_events()
        for r, lane in enumerate(lanes):
            assert sorted(s for s, *_ in lane) == [s for s in range(sched.num_stages) if sched.stage_to_rank[s] == r]
            for s, start, end, nbytes in lane:
                first = min(ev.ts for ev in rows[r] if ev.args.stage == s)
                assert start <= end <= first + 1.0, (sched.kind, r, s, start, end, first)  # (1 us: the clocks' rounding)
                assert nbytes == held[s], (sched.kind, s, nbytes, held[s])
            count += len(lane)
    assert count == sched.num_stages * steps  # every stage gathered once per step
    rows = compare_gathers(sched, got)
    assert sorted((x.rank, x.stage) for x in rows) == sorted((sched.stage_to_rank[s], s) for s in range(sched.num_stages))
    assert all(x.count == steps and x.measured_ms >= 0 and x.measured_slack_ms >= -1e-3 for x in rows)
    ends = compare_lane_ends(sched, got)
    assert len(ends) == sched.num_ranks + 1 and all(x.measured_ms > 0 for x in ends)


def test_pp2_dp2_sharded_stages_equal_one_process():
    """The fast suite's share: a zero-bubble split schedule and a V placement, mean and tokens."""
    sched = [zb.build_classic(k, uniform_profile(PP), 4) for k in ("zb-h1", "zb-v")]
    got = run_local(_run, PP * DP, [s.model_dump_json() for s in sched], 2, (1, DP))
    assert got[3][0] == ["zb-h1", "zb-v"]
    firsts = [traces for _, traces in got if traces[0]]  # each replica's pipeline's first rank
    assert len(firsts) == DP
    for traces in firsts:
        for s, t in zip(sched, traces):
            _check_gathers(s, t, 2)


@pytest.mark.slow
def test_every_schedule_kind_with_sharded_stages_equals_one_process():
    schedules = _schedules(4)
    kinds = run_local(_run, PP * DP, [s.model_dump_json() for s in schedules], 2, (1, DP))
    assert kinds[0][0] == [s.kind for s in schedules]
    for traces in (t for _, t in kinds if t[0]):  # every kind's gathers, on each replica's first rank
        for s, t in zip(schedules, traces):
            _check_gathers(s, t, 2)


@pytest.mark.slow
def test_hybrid_sharding_pp2_dp2x2_equals_one_process():
    sched = [zb.build_classic(k, uniform_profile(PP), 4) for k in ("zb-h1", "interleaved-1f1b")]
    kinds = run_local(_run, PP * 4, [s.model_dump_json() for s in sched], 2, (2, 2))
    assert kinds[0][0] == ["zb-h1", "interleaved-1f1b"]


# -- wrong set-ups: one line ---------------------------------------------------------------------
def test_a_stage_sharded_in_part_is_refused_in_one_line(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sched = zb.build_classic("zb-h1", uniform_profile(1), 2)
    whole = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(whole[1], mesh=init_device_mesh("cpu", (1,)))  # one layer sharded, the stage itself not
    with pytest.raises(PipelineError, match=r"stage 0: parameter '0.weight' is not sharded by fully_shard while others "
                                            r"of the stage are: apply fully_shard to the stage module itself") as err:
        PipelineRuntime(sched, {0: whole}, toy_loss)
    assert "\n" not in str(err.value)


def test_a_stage_wrapped_in_fsdp1_is_refused_in_one_line(one_rank):
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel

    sched = zb.build_classic("zb-h1", uniform_profile(1), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation and CPU notices
        wrapped = FullyShardedDataParallel(nn.Linear(2, 2), device_id=torch.device("cpu"))
    with pytest.raises(PipelineError, match=r"stage 0 is wrapped in FullyShardedDataParallel \(FSDP1\).*fully_shard") as err:
        PipelineRuntime(sched, {0: wrapped}, toy_loss)
    assert "\n" not in str(err.value)


def _bad(rank: int, world: int, send, how: str) -> str:
    if how == "tensor-parallel":  # PP1 x DP2 (sharded) x TP2: the built-in GPT's plan, then fully_shard by hand
        from torch.distributed.fsdp import fully_shard

        from zbsearch.models import GPTConfig, gpt_loss, gpt_stages
        from zbsearch.models.tensor_parallel import parallelize_stage

        mesh = build_mesh(pp=1, dp_shard=2, tp=2)
        stage = gpt_stages(GPTConfig(layers=1, hidden=16, heads=2, seq=8, vocab=16, microbatch_size=1, stages=1))[0]
        stage = parallelize_stage(stage, mesh["tp"])  # without fully_shard_layout: the fused qkv stays strided
        for child in stage.children():
            fully_shard(child, mesh=mesh["dp_shard"])
        fully_shard(stage, mesh=mesh["dp_shard"])
        PipelineRuntime(zb.build_classic("zb-h1", uniform_profile(1), 2), {0: stage}, gpt_loss, mesh=mesh, timeout=20)
        return "built"
    sched = zb.build_classic("zb-h1", uniform_profile(PP), 4)
    mesh = build_mesh(pp=PP, dp_replicate=2 if how == "partial-mesh" else 1, dp_shard=1 if how == "partial-mesh" else 2)
    pp_rank = mesh["pp"].get_local_rank()
    stage = _model(PP)[pp_rank]
    if how == "partial-mesh":
        _shard(stage, mesh["dp_shard"])  # over 1 rank of the 2 replicas
    PipelineRuntime(sched, {pp_rank: stage}, toy_loss if pp_rank == PP - 1 else None, mesh=mesh, timeout=20)
    return "built"


@pytest.mark.slow
@pytest.mark.parametrize("how, message", [
    ("partial-mesh", r"stage \d is sharded over 1 ranks, but the data-parallel dimension has 2: shard over all of it"),
    ("tensor-parallel", r"stage 0: parameter '1\.attn\.qkv\.weight' is split with a strided layout \(a fused projection\) "
                        r"and sharded again by fully_shard, .*fully_shard_layout"),
    ("unsharded", r"the mesh shards data parallelism over 2 ranks \(dp_shard\), but rank \d's stages are not sharded: "
                  r"apply fully_shard"),
])
def test_sharded_mesh_set_ups_that_cannot_work_stop_in_one_line(how, message):
    with pytest.raises(zb.ZbError, match=message) as err:
        run_local(_bad, PP * DP, how, timeout=120)
    assert "\n" not in str(err.value)


# -- memory: what a rank holds at the step's peak, measured against the planner's model ----------
WIDE = 8  # every dimension even: FSDP's shards are even, with no padding


class _Lin(nn.Module):
    def __init__(self, first: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDE, WIDE), nn.Linear(WIDE, WIDE)
        self.first = first

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _storages(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _memory(rank: int, world: int, send, kind: str) -> tuple[float, float]:
    """Peak bytes of parameters, gradients and AdamW state on this rank during a sharded step
    (every storage held, whole and sharded), and the planner's prediction for them."""
    from torch.distributed.fsdp import fully_shard

    from zbsearch.planner.memory import parameter_bytes
    from zbsearch.runtime.sharded import ShardedStages

    mesh = build_mesh(pp=PP, dp_shard=DP)
    pp_rank = mesh["pp"].get_local_rank()
    sched = zb.build_classic(kind, uniform_profile(PP), 4)
    torch.manual_seed(0)
    stages = [_Lin() for _ in range(sched.num_stages)]
    mine = {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == pp_rank}
    params = sum(p.numel() for st in mine.values() for p in st.parameters())
    for st in mine.values():
        for lin in (st.a, st.b):
            fully_shard(lin, mesh=mesh["dp_shard"])
        fully_shard(st, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW([p for st in mine.values() for p in st.parameters()], lr=0.01)
    last = sched.num_stages - 1
    runtime = PipelineRuntime(sched, mine, nn.functional.mse_loss if last in mine else None, mesh=mesh, timeout=60)
    peak = [0]
    start = ShardedStages.start

    def measured_start(self, stage):  # the gradients are complete and not yet reduce-scattered
        held = [t for st in mine.values() for p in st.parameters() for t in (p, p.grad)]
        held += [fp.sharded_param for st in mine.values() for m in st.modules() if hasattr(m, "_get_fsdp_state")
                 for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params]
        held += [v for state in opt.state.values() for k, v in state.items() if k != "step"]
        peak[0] = max(peak[0], _storages(held))
        start(self, stage)

    ShardedStages.start = measured_start  # type: ignore[method-assign]
    for step in range(2):  # AdamW's state exists from the first optimizer step on
        peak[0] = 0
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * DP * 2, WIDE, generator=g), torch.randn(4 * DP * 2, WIDE, generator=g)
        opt.zero_grad()
        runtime.step(x[:8] if 0 in mine else None, y[:8] if last in mine else None)
        opt.step()
    runtime.close()
    whole = 4.0 * params  # fp32
    return float(peak[0]), parameter_bytes(params, whole, "adamw", shard=DP), parameter_bytes(params, whole, "adamw")


@pytest.mark.parametrize("kind", ["zb-v"])
def test_sharded_static_bytes_at_the_peak_equal_the_planners_model(kind):
    got = run_local(_memory, PP * DP, kind)
    for measured, predicted, unsharded in got:
        assert measured == predicted < unsharded, got
