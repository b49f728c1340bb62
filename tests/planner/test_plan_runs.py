"""A plan that recomputes, run end to end on CPU: the built-in GPT measured unit by unit with
recomputation, planned with ``recompute="full"``, built with the plan's cut and run by the
runtime on two gloo ranks.

The gradients and losses must equal those of the same schedule with its R passes taken out, bit
for bit (R replays the checkpointed forward), and the activation bytes each rank's meter reads
after every pass must be, to the byte, what the simulator predicts on the plan's stage costs, composed from
the units measured apart (a checkpointed stage keeps its input and RNG state).
"""

from __future__ import annotations

import pytest
import torch

import zbsearch as zb
from zbsearch.actions import Op
from zbsearch.costs import CostModel
from zbsearch.distributed import run_local
from zbsearch.simulator import simulate

pytestmark = pytest.mark.slow

_GPT = dict(layers=3, hidden=32, heads=2, seq=16, vocab=64, microbatch_size=2)


def _run(sched: zb.Schedule, rank: int):
    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages
    from zbsearch.runtime import PipelineRuntime

    part = sched.partition
    assert part is not None
    cfg = GPTConfig(**_GPT, stages=sched.num_stages, cut=tuple(part.layers_per_stage))
    torch.manual_seed(0)
    stages = gpt_stages(cfg)
    ids, targets = gpt_batch(cfg, sched.num_microbatches, seed=3)
    mine = {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank}
    last = sched.num_stages - 1
    with PipelineRuntime(sched, mine, gpt_loss, timeout=60) as rt:
        torch.manual_seed(1234)
        for _ in range(2):  # the second step's memory: the split knows each stage's passes by then
            losses = rt.step(ids if 0 in mine else None, targets if last in mine else None)
            trace = rt.trace()
    grads = {(s, n): q.grad for s, st in mine.items() for n, q in st.named_parameters()}
    return grads, losses, trace


def _check(rank: int, world: int, send, text: str) -> list[str]:
    sched = zb.Schedule.model_validate_json(text)
    rows = [[a for a in row if a.op is not Op.R] for row in sched.rank_actions]
    plain = zb.Schedule.build("plain", sched.profile, sched.num_microbatches, list(sched.stage_to_rank), rows)
    plain = plain.model_copy(update={"partition": sched.partition})
    want, want_losses, _ = _run(plain, rank)
    got, got_losses, trace = _run(sched, rank)
    problems = [f"rank {rank} stage {k[0]} {k[1]}: gradient differs" for k, g in got.items()
                if g is None or want[k] is None or not torch.equal(g, want[k])]
    if want_losses is not None and not torch.equal(got_losses, want_losses):
        problems.append("losses differ")
    if trace is not None:
        predicted = simulate(sched.rank_actions, CostModel.from_profile(sched.profile, list(sched.stage_to_rank))).memory
        for r, events in enumerate(trace.rank_events()):
            measured = [e.args.activations for e in events]
            bad = [(str(a), x, y) for a, x, y in zip(sched.rank_actions[r], measured, predicted[r])
                   if x != pytest.approx(y, abs=0.5)]
            if bad:
                problems.append(f"rank {r}: measured != predicted activation bytes after {bad[:4]}")
    return problems


def test_a_planned_schedule_that_recomputes_runs_exactly_and_as_predicted():
    from zbsearch.models import GPTConfig
    from zbsearch.planner import plan
    from zbsearch.profiler import LinkModel, Settings, builtin_gpt, profile_layers, unit_kinds

    u = GPTConfig(**_GPT, stages=2).units()
    layers = profile_layers(builtin_gpt(u), Settings(warmup=1, repeat=3, rounds=1, threads=1, recompute=True),
                            kinds=unit_kinds(list(u.cut or ())), link=LinkModel(0.01, 10.0, "given"))
    assert all(x.t_r is not None and x.m_fc is not None for x in layers.units)
    res = plan(layers, 2, 4, None, placement="one", recompute="full", time_limit=3, milp=False)
    sched = res.schedule
    recomputed = sum(a.op is Op.R for row in sched.rank_actions for a in row)
    assert recomputed == sched.num_stages * sched.num_microbatches  # full: every microbatch on every stage
    # a checkpointed stage keeps what its first unit keeps (its input and the generators' state);
    # the first stage, whose input is the batch, the generators' state only, which the embedding
    # measured alone cannot record (it keeps less than that in a plain forward)
    firsts = [names[0] for names in res.partition.stages]
    by_name = {x.name: x for x in layers.units}
    kept = [st.m_fc for st in sched.profile.stages]
    assert kept[1:] == [by_name[n].m_fc for n in firsts[1:]]
    assert kept[0] == layers.checkpoint_state_bytes == torch.get_rng_state().nbytes > by_name["embedding"].m_fc
    problems = run_local(_check, 2, sched.model_dump_json(), timeout=600)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])
