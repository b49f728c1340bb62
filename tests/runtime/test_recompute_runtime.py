"""Checkpointed forwards and recompute passes (R) on gloo ranks, with dropout on.

Every schedule is run twice from the same weights and generator state: as it is, and with its
R passes taken out (every F then plain). The gradients and losses must be equal bit for bit (R
replays the checkpointed F's dropout masks, and no later pass draws other numbers than without
recomputation). The activation memory each rank's meter reads after every pass must equal the
simulator's prediction on a profile measured by the profiler on the same stages (bytes), and
each rank ends the step holding nothing. Schedules: classic full recomputation (1F1B, ZB-H1),
the solver's ``recompute="auto"`` at a tight limit, and random R placements (anywhere between a
microbatch's F and its backward) on classic orders, one chunk and V, split and fused backwards.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import zbsearch as zb
from zbsearch.actions import Action, Op
from zbsearch.costs import CostModel
from zbsearch.distributed import run_local
from zbsearch.simulator import simulate

WIDTH, SEQ, MB = 32, 16, 2


class Stage(nn.Module):
    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first = first
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(WIDTH, WIDTH) if last else None

    def forward(self, x):
        h = torch.tanh(x) if self.first else x
        h = h + self.drop(self.down(F.gelu(self.drop(self.up(self.norm(h))))))
        return self.head(h) if self.head is not None else h


def build(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Stage(s == 0, s == num_stages - 1) for s in range(num_stages)]


def loss_fn(out, targets):
    return ((out - targets) ** 2).mean()


def batch(m: int):
    g = torch.Generator().manual_seed(7)
    return torch.randn(MB * m, SEQ, WIDTH, generator=g), torch.randn(MB * m, SEQ, WIDTH, generator=g)


def measured_profile(num_stages: int, ranks: int) -> zb.Profile:
    """The profiler's measurement of each stage (bytes as the runtime's meter counts them); a V
    placement's pieces where there are more stages than ranks."""
    from zbsearch.profiler.measure import measure_stage

    stages = build(num_stages)
    ids, targets = batch(1)
    costs = []
    for s, st in enumerate(stages):
        x = (ids,) if s == 0 else (torch.randn(MB, SEQ, WIDTH, requires_grad=True),)  # the first stage's: data
        post = functools.partial(lambda t, out: loss_fn(out, t), targets) if s == num_stages - 1 else None
        costs.append(measure_stage(st, x, post, torch.device("cpu"), 1, 2, recompute_too=True).cost())
    placement = None if num_stages == ranks else zb.placement(ranks, num_stages // ranks, "v")
    return zb.Profile(name="tiny-measured", memory_unit="bytes", stages=costs, microbatch_size=MB, placement=placement)


def random_recompute(rows: list[list[Action]], rng: random.Random, share: float) -> list[list[Action]]:
    """``rows`` with about ``share`` of the (stage, microbatch) pairs recomputed, each R put at a
    random place between its F and its backward on the rank."""
    out = []
    for row in rows:
        row = list(row)
        forwards = [a for a in row if a.op is Op.F]
        chosen = [a for a in forwards if rng.random() < share] or forwards[:1]  # at least one per rank
        for a in chosen:
            f = row.index(a)
            back = next(i for i, b in enumerate(row) if b.stage == a.stage and b.mb == a.mb and b.op in (Op.B, Op.BW))
            row.insert(rng.randint(f + 1, back), Action(a.stage, Op.R, a.mb))
        out.append(row)
    return out


def fuse_some(rows: list[list[Action]], rng: random.Random) -> list[list[Action]]:
    """``rows`` with some B, W pairs fused into a BW at the B's place."""
    out = []
    for row in rows:
        fused = {(a.stage, a.mb) for a in row if a.op is Op.B and rng.random() < 0.4}
        out.append([Action(a.stage, Op.BW, a.mb) if a.op is Op.B and (a.stage, a.mb) in fused else a
                    for a in row if not (a.op is Op.W and (a.stage, a.mb) in fused)])
    return out


def schedules(profile: zb.Profile, p: int) -> list[zb.Schedule]:
    from zbsearch.solver import solve

    m = 2 * p
    out = [zb.build_classic(k, profile, m) for k in ("1f1b-recompute", "zb-h1-recompute")]
    for limit in ("0.5p", "0.6p", "0.75p"):  # what it recomputes depends on the measured times
        out.append(solve(profile, m, limit, recompute="auto", time_limit=2, milp=False).schedule)
    rng = random.Random(p)
    for kind, seed in (("zb-h1", 0), ("1f1b", 1), ("zb-v", 2), ("zb-v", 3), ("zb-h2", 4)):
        base = zb.build_classic(kind, profile if kind != "zb-v" else _PROFILES[2 * p], m)  # the V: its 2p pieces
        rows = base.rank_actions if seed % 2 == 0 else fuse_some(base.rank_actions, rng)
        rows = random_recompute(rows, rng, 0.6)
        out.append(zb.Schedule.build(f"{kind}-random-r{seed}", base.profile, m, list(base.stage_to_rank), rows))
    return out


_PROFILES: dict[int, zb.Profile] = {}  # stage count -> measured profile (p stages, or 2p pieces of a V)


def _plain(sched: zb.Schedule) -> zb.Schedule:
    rows = [[a for a in row if a.op is not Op.R] for row in sched.rank_actions]
    return zb.Schedule.build(sched.kind + "-plain", sched.profile, sched.num_microbatches, list(sched.stage_to_rank), rows)


def _tiny(num_stages: int, m: int):
    """The test's own stages, a batch of m microbatches and the loss."""
    return build(num_stages), *batch(m), loss_fn


# The built-in GPT, cut in two, as small as the profiler and the runtime take it.
_GPT = dict(layers=2, hidden=32, heads=2, seq=16, vocab=64, microbatch_size=2, stages=2)


def _gpt(num_stages: int, m: int):
    """The built-in GPT's stages, its synthetic batch of m microbatches and its loss."""
    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages

    cfg = GPTConfig(**_GPT)
    assert cfg.stages == num_stages
    torch.manual_seed(0)
    return gpt_stages(cfg), *gpt_batch(cfg, m, seed=3), gpt_loss


def _run(sched: zb.Schedule, rank: int, model=_tiny):
    """One step on fresh stages; this rank's gradients, losses and trace."""
    from zbsearch.runtime import PipelineRuntime

    stages, ids, targets, loss = model(sched.num_stages, sched.num_microbatches)
    mine = {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank}
    last = sched.num_stages - 1
    with PipelineRuntime(sched, mine, loss, timeout=60) as rt:
        torch.manual_seed(1234)  # the same draws in both runs
        for _ in range(2):  # the second step's memory: the split knows each stage's passes by then
            losses = rt.step(ids if 0 in mine else None, targets if last in mine else None)
            trace = rt.trace()
        left = rt.meter.bytes
    grads = {(s, n): q.grad for s, st in mine.items() for n, q in st.named_parameters()}
    return grads, losses, trace, left


def _check(rank: int, world: int, send, texts: list[str], model=_tiny) -> list[str]:
    problems = []
    for text in texts:
        sched = zb.Schedule.model_validate_json(text)
        plain = _plain(sched)
        want, want_losses, _, _ = _run(plain, rank, model)
        got, got_losses, trace, left = _run(sched, rank, model)
        for key, g in got.items():
            if g is None or want[key] is None or not torch.equal(g, want[key]):
                problems.append(f"{sched.kind} rank {rank} stage {key[0]} {key[1]}: gradient differs")
        if want_losses is not None and not torch.equal(got_losses, want_losses):
            problems.append(f"{sched.kind}: losses differ")
        if left:
            problems.append(f"{sched.kind} rank {rank}: {left} bytes of activations left after the step")
        if trace is None:
            continue
        cost = CostModel.from_profile(sched.profile, list(sched.stage_to_rank))
        predicted = simulate(sched.rank_actions, cost).memory
        for r, events in enumerate(trace.rank_events()):
            measured = [e.args.activations for e in events]
            acts = [f"{e.args.stage}{e.args.op}{e.args.mb}" for e in events]
            if acts != [str(a) for a in sched.rank_actions[r]]:
                problems.append(f"{sched.kind} rank {r}: the trace's actions are not the schedule's")
                continue
            bad = [(a, x, y) for a, x, y in zip(acts, measured, predicted[r]) if x != pytest.approx(y, abs=0.5)]
            if bad:
                problems.append(f"{sched.kind} rank {r}: measured != predicted activation bytes after {bad[:4]}")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("p", [2])
def test_recompute_schedules_are_exact_and_follow_the_memory_model(p):
    for n in (p, 2 * p):
        _PROFILES.setdefault(n, measured_profile(n, p))
    scheds = [s for s in schedules(_PROFILES[p], p) if any(a.op is Op.R for row in s.rank_actions for a in row)]
    assert len(scheds) >= 7
    problems = run_local(_check, p, [s.model_dump_json() for s in scheds], timeout=600)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


def _check_gpt(rank: int, world: int, send, texts: list[str]) -> list[str]:
    return _check(rank, world, send, texts, _gpt)


@pytest.mark.slow
def test_builtin_gpt_activation_bytes_are_the_prediction_after_every_pass():
    """The built-in GPT saves its microbatch's token ids (stage 0's embedding) and labels (the
    last stage's loss): each microbatch is charged its own bytes, as the profiler measured
    them, with and without recomputation."""
    from zbsearch.models import GPTConfig
    from zbsearch.profiler import Settings, builtin_gpt, profile_model
    from zbsearch.solver import solve

    prof = profile_model(builtin_gpt(GPTConfig(**_GPT)), Settings(warmup=1, repeat=3, rounds=1, threads=1,
                                                                    recompute=True))
    assert prof is not None
    m = 4
    scheds = [zb.build_classic(k, prof, m) for k in ("zb-h1", "1f1b", "1f1b-recompute", "zb-h1-recompute")]
    scheds.append(solve(prof, m, "0.75p", recompute="auto", time_limit=2, milp=False).schedule)
    problems = run_local(_check_gpt, 2, [s.model_dump_json() for s in scheds], timeout=600)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


def test_an_emulated_stage_sleeps_the_checkpointed_and_recompute_times(monkeypatch):
    """F checkpointed sleeps t_fc, R t_r, the backward passes what they sleep without
    recomputation (the sleeps asked for, recorded: no clock read)."""
    from zbsearch.runtime import emulation
    from zbsearch.runtime.recompute import checkpointed_forward, recompute
    from zbsearch.runtime.split import backward_input, backward_weight

    asked: list[float] = []
    monkeypatch.setattr(emulation, "_sleep", asked.append)
    st = emulation.EmulatedStage(1.0, 2.0, 3.0, t_fc=1.5, t_r=0.75)
    x = torch.randn(2, 16, requires_grad=True)
    outs, ckpt = checkpointed_forward(st, [x])
    fp = recompute(ckpt, st)
    _, w = backward_input(fp, [torch.ones_like(outs[0])])
    backward_weight(w)
    assert [t for t in asked if t] == [1.5, 0.75, 2.0, 3.0]
    with pytest.raises(zb.ZbError, match="already been recomputed"):
        recompute(ckpt, st)


def test_a_profile_with_recompute_costs_gives_emulated_stages_its_times():
    from zbsearch.runtime.emulation import emulated_stages

    prof = zb.Profile(name="u", memory_unit="activations", stages=[
        zb.StageCost(t_f=2.0, t_b=2.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5, t_fc=2.5, t_r=1.5, m_fc=0.1)] * 2)
    st = emulated_stages(prof, [0, 1])
    assert [(s.t_fc, s.t_r) for s in st] == [(2.5e-3, 1.5e-3)] * 2
    bare = zb.StageCost(t_f=2.0, t_b=2.0, t_w=1.0, m_f=1.0, m_b=-0.5, m_w=-0.5)
    plain = emulated_stages(prof.model_copy(update={"stages": [bare] * 2}), [0, 1])
    assert [(s.t_fc, s.t_r) for s in plain] == [(2e-3, 2e-3)] * 2
