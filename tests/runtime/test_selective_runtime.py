"""Selective recomputation (RS): the passes, the runtime and the profiler, with dropout on.

Every check compares against the same work without recomputation, run from the same weights
and generator state: gradients and losses must be equal bit for bit (RS replays the selected
modules' dropout masks, and no later pass draws other numbers than without recomputation), and
the activation bytes the meter reads after every pass must equal the cost model's prediction on
a profile the profiler measured on the same stages. The stages' selected module (an MLP with
dropout) holds Linears the split defers to W, so RS must rebuild what W reads as well as B.
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import zbsearch as zb
from zbsearch.actions import Action, Op
from zbsearch.costs import CostModel
from zbsearch.runtime.errors import PipelineError
from zbsearch.runtime.memory import ActivationMeter
from zbsearch.runtime.selective import Selection, recompute_selected, selected_modules
from zbsearch.runtime.split import backward_full, backward_input, backward_weight, forward_pass
from zbsearch.simulator import simulate

WIDTH, SEQ, MB = 16, 8, 2


class MLP(nn.Module):
    selective_recompute = True

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.down(F.gelu(self.drop(self.up(x)))))


class Stage(nn.Module):
    """LayerNorm, the selected MLP with a residual, a projection and dropout outside the selection."""

    def __init__(self, first: bool = False, last: bool = False) -> None:
        super().__init__()
        self.first = first
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = MLP()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(WIDTH, WIDTH) if last else None

    def forward(self, x):
        h = torch.tanh(x) if self.first else x
        h = h + self.mlp(self.norm(h))
        h = self.drop(self.proj(h))
        return self.head(h) if self.head is not None else h


def build(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Stage(s == 0, s == num_stages - 1) for s in range(num_stages)]


def loss_fn(out, targets):
    return ((out - targets) ** 2).mean()


def batch(m: int):
    g = torch.Generator().manual_seed(7)
    return torch.randn(MB * m, SEQ, WIDTH, generator=g), torch.randn(MB * m, SEQ, WIDTH, generator=g)


# -- the passes, in one process -------------------------------------------------------------------

def _passes(stage: nn.Module, xs: list, selective: bool, way: str, first: bool, seed: int = 5, mode: str = "mlp"):
    """F (selectively checkpointed in ``mode``, or not) of every microbatch, RS and the backward
    of each in turn, other draws from the generator in between; the gradients and the meter after
    each pass (whose peak inside any pass is never above what it reads after one)."""
    meter = ActivationMeter(replay=True)
    log: list[tuple[str, int]] = []
    torch.manual_seed(seed)
    fps, sels = [], []
    for x in xs:  # a tensor or a tuple of them; float ones need gradients past the first stage
        ins = [t if first or not t.is_floating_point() else t.detach().requires_grad_()
               for t in (x if isinstance(x, tuple) else (x,))]
        sel = Selection(stage, selected_modules(stage, mode), meter) if selective else None
        fps.append(forward_pass(stage, ins, split=way != "fused", meter=meter, deferred_first=way == "deferred",
                                select=sel))
        sels.append(sel)
        log.append(("F", meter.bytes))
        torch.rand(3)  # another pass's draw
    for fp, sel in zip(fps, sels):
        if sel is not None:
            recompute_selected(sel, fp.saved)
        log.append(("after RS" if sel is not None else "no RS", meter.bytes))
        grads = [torch.ones_like(o) if o.is_floating_point() else None for o in fp.outputs]
        if way == "fused":
            backward_full(fp, grads)
        else:
            _, w = backward_input(fp, grads)
            log.append(("B", meter.bytes))
            torch.rand(2)
            backward_weight(w)
        log.append(("W", meter.bytes))
    assert meter.peak == max(b for _, b in log)  # RS lets go of what its F kept before it saves anew
    return {n: p.grad.clone() for n, p in stage.named_parameters()}, log


@pytest.mark.parametrize("first,way", [(False, "split"), (False, "fused"), (True, "split"), (True, "deferred"),
                                       (True, "fused")])
def test_selective_passes_give_the_gradients_and_memory_of_plain_ones(first, way):
    torch.manual_seed(0)
    base = Stage(first=first)
    xs = [torch.randn(MB, SEQ, WIDTH) for _ in range(3)]  # the first microbatch learns the split's verdict
    want, plain_log = _passes(copy.deepcopy(base), xs, False, way, first)
    got, log = _passes(copy.deepcopy(base), xs, True, way, first)
    for name, g in want.items():
        assert torch.equal(got[name], g), name
    # each selective F keeps less; its RS allocates the rest; the backward passes free what they would
    n = len(xs)
    delta, plain = _deltas(log), _deltas(plain_log)
    assert all(0 < delta[j] < plain[j] for j in range(n))
    rs = [i for i, (what, _) in enumerate(log) if what == "after RS"]
    assert [delta[j] + delta[i] for j, i in enumerate(rs)] == plain[:n]
    assert [d for i, d in enumerate(delta) if i >= n and i not in rs] == [d for i, d in enumerate(plain)
                                                                          if i >= n and i not in rs]
    assert log[-1][1] == 0
    # dropout matters here: another seed gives other gradients
    other, _ = _passes(copy.deepcopy(base), xs, False, way, first, seed=6)
    assert not all(torch.equal(other[n], g) for n, g in want.items())


def _builtin(kind: str) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """Two stages of a built-in model and three microbatches of its inputs."""
    from zbsearch.models import GPTConfig, ViTConfig, gpt_batch, gpt_stages, image_batch, llama_stages, vit_stages

    if kind == "vit":
        cfg = ViTConfig(image=8, patch=4, hidden=16, heads=2, layers=2, classes=4, microbatch_size=MB, stages=2)
        images, _ = image_batch(cfg.image, cfg.channels, cfg.classes, 3 * MB, seed=2)
        return vit_stages(cfg), list(images.split(MB))
    cfg = GPTConfig(layers=2, hidden=16, heads=2, seq=SEQ, vocab=32, microbatch_size=MB, stages=2)
    ids, _ = gpt_batch(cfg, 3, seed=2)
    return (gpt_stages if kind == "gpt" else llama_stages)(cfg), list(ids.split(MB))


@pytest.mark.parametrize("kind", ["gpt", "llama", "vit"])
@pytest.mark.parametrize("mode", ["attention", "mlp"])
def test_the_builtin_models_declare_their_attention_cores_and_mlps_and_recompute_them_exactly(kind, mode):
    """Each layer's attention core (mode attention) or MLP (mode mlp) is selected, and only it;
    on both stages (the first fed the model's inputs, the last ending in the head), selective
    passes give the gradients of plain ones and keep less."""
    stages, xs = _builtin(kind)
    layers = [sum(type(m).__name__ in ("Block", "LlamaBlock", "EncoderBlock") for m in st.modules()) for st in stages]
    names = {"attention": ("CoreAttention",), "mlp": ("MLP", "SwiGLU")}[mode]
    for stage, n in zip(stages, layers):
        chosen = selected_modules(stage, mode)
        assert len(chosen) == n > 0 and all(type(m).__name__ in names for m in chosen)
    _check_stage_by_stage(stages, [(x,) for x in xs], mode)


def _check_stage_by_stage(stages: list[nn.Module], xs: list[tuple], mode: str) -> None:
    """Each stage fed the one before's outputs: selective passes in ``mode`` (split and fused
    backward) give the gradients of plain ones, each F keeps less, and nothing is left."""
    for s, stage in enumerate(stages):
        if s > 0:
            with torch.no_grad():
                xs = [stages[s - 1](*x) for x in xs]
                xs = [x if isinstance(x, tuple) else (x,) for x in xs]
        for way in ("split", "fused"):
            want, plain_log = _passes(copy.deepcopy(stage), xs, False, way, first=s == 0)
            got, log = _passes(copy.deepcopy(stage), xs, True, way, first=s == 0, mode=mode)
            assert all(torch.equal(got[n], g) for n, g in want.items()), (s, way)
            delta, plain = _deltas(log), _deltas(plain_log)
            assert all(0 < delta[j] < plain[j] for j in range(len(xs))), (s, way)
            assert log[-1][1] == 0


def _deltas(log: list[tuple[str, int]]) -> list[int]:
    """What each pass of a ``_passes`` log allocated (bytes; negative: freed)."""
    return [b - a for a, b in zip([0] + [x for _, x in log], [x for _, x in log])]


class Gate(nn.Module):
    """Saves its input (the Linear's), a wide activation (tanh's output, the product's input) and
    its output (sigmoid saves what it returns, and the stage's next Linear saves it too)."""

    selective_recompute = True

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return torch.sigmoid(self.down(torch.tanh(self.up(x))))


@pytest.mark.parametrize("split", [True, False])
def test_what_a_selected_module_shares_with_its_inputs_and_outputs_is_kept_not_copied(split):
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(WIDTH, WIDTH), Gate(), nn.Linear(WIDTH, WIDTH))
    x = torch.randn(MB, WIDTH, requires_grad=True)
    runs = []
    for selective in (False, True):
        model = copy.deepcopy(stage)
        meter = ActivationMeter(replay=False)
        sel = Selection(model, selected_modules(model, "mlp"), meter) if selective else None
        fp = forward_pass(model, [x], split=split, meter=meter, select=sel)
        kept = meter.bytes
        if sel is not None:
            recompute_selected(sel, fp.saved)
        rebuilt = meter.bytes
        grads = [torch.ones_like(o) if o.is_floating_point() else None for o in fp.outputs]
        if split:
            _, w = backward_input(fp, grads)
            backward_weight(w)
        else:
            backward_full(fp, grads)
        runs.append((kept, rebuilt, meter.bytes, [p.grad for p in model.parameters()]))
    (plain, _, _, want), (kept, rebuilt, left, got) = runs
    # dropped: what tanh saves, its output (the product's input, 4x wide); kept: the rest
    assert plain - kept == MB * 4 * WIDTH * 4
    assert rebuilt == plain and left == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_backward_before_rs_and_a_second_rs_are_refused():
    stage = Stage()
    x = torch.randn(MB, SEQ, WIDTH, requires_grad=True)
    sel = Selection(stage, selected_modules(stage, "mlp"), ActivationMeter())
    fp = forward_pass(stage, [x], select=sel)
    with pytest.raises(PipelineError, match=r"run its recompute pass \(RS\) first"):
        backward_input(fp, [torch.ones_like(fp.outputs[0])])
    sel2 = Selection(stage, selected_modules(stage, "mlp"), ActivationMeter())
    fp2 = forward_pass(stage, [x], select=sel2)
    recompute_selected(sel2, fp2.saved)
    with pytest.raises(PipelineError, match="already been recomputed"):
        recompute_selected(sel2, fp2.saved)


def test_a_selected_module_that_runs_otherwise_in_rs_is_refused():
    class Moody(nn.Module):
        selective_recompute = True

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.lin(x)
            return torch.sigmoid(h) if self.calls == 1 else torch.sigmoid(torch.tanh(h))  # saves one more in RS

    stage = nn.Sequential(nn.Linear(WIDTH, WIDTH), Moody())
    x = torch.randn(MB, WIDTH, requires_grad=True)
    sel = Selection(stage, selected_modules(stage, "mlp"), ActivationMeter())
    fp = forward_pass(stage, [x], select=sel)
    with pytest.raises(PipelineError, match="saved more tensors than the checkpointed forward"):
        recompute_selected(sel, fp.saved)


def test_a_selected_module_that_changes_its_input_in_place_is_refused():
    class InPlace(nn.Module):
        selective_recompute = True

        def forward(self, x):
            return x.mul_(2).sigmoid()

    stage = nn.Sequential(nn.Linear(WIDTH, WIDTH), InPlace())
    sel = Selection(stage, selected_modules(stage, "mlp"), ActivationMeter())
    with pytest.raises(PipelineError, match="changed one of its inputs in place"):
        forward_pass(stage, [torch.randn(MB, WIDTH, requires_grad=True)], select=sel)


def test_which_modules_a_stage_selects():
    stage = Stage()
    assert selected_modules(stage, "mlp") == [stage.mlp]  # declared True: in every mode
    assert selected_modules(stage, None) == [stage.mlp]
    stage.mlp.up.selective_recompute = True  # inside a selected one: part of it
    assert selected_modules(stage, "mlp") == [stage.mlp]
    stage.mlp.selective_recompute = "mlp"  # in its mode only
    stage.proj.selective_recompute = "attention"
    assert selected_modules(stage, "mlp") == [stage.mlp]
    assert selected_modules(stage, "attention") == [stage.mlp.up, stage.proj]
    assert selected_modules(stage, None) == [stage.mlp.up]
    stage.proj.selective_recompute = "attn"
    with pytest.raises(PipelineError, match="declares selective_recompute = 'attn': give a mode"):
        selected_modules(stage, "mlp")
    plain = nn.Sequential(nn.Linear(2, 2))
    assert selected_modules(plain, "mlp") == []
    plain.selective_recompute = True  # the whole stage
    assert selected_modules(plain, "mlp") == [plain]
    with pytest.raises(PipelineError, match="at least one module"):
        Selection(nn.Linear(2, 2), [])


# -- the profiler ---------------------------------------------------------------------------------

def _inputs(first: bool, last: bool):
    """A stage's microbatch as the profiler is given it, and the loss bound to its targets."""
    ids, targets = batch(1)
    x = (ids,) if first else (torch.randn(MB, SEQ, WIDTH, requires_grad=True),)
    return x, functools.partial(lambda t, out: loss_fn(out, t), targets) if last else None


def _measure(stage: nn.Module, first: bool, last: bool):
    from zbsearch.profiler.measure import measure_stage

    return measure_stage(stage, *_inputs(first, last), torch.device("cpu"), 1, 2, recompute_too=True)


def test_the_profiler_measures_what_a_real_rs_pass_keeps_and_rebuilds():
    stage = Stage(last=True)
    cost = _measure(stage, False, True).cost()
    assert cost.t_fs and cost.t_rs and cost.m_fs is not None and 0 < cost.m_fs < cost.m_f
    meter = ActivationMeter()
    x, post = _inputs(False, True)
    sel = Selection(stage, selected_modules(stage, "mlp"), meter)
    fp = forward_pass(stage, x, post=post, meter=meter, select=sel)
    assert meter.bytes == cost.m_fs
    recompute_selected(sel, fp.saved)
    assert meter.bytes == cost.m_f
    # a stage that selects nothing has no selective costs
    bare = _measure(nn.Sequential(nn.Linear(WIDTH, 16 * WIDTH), nn.GELU(), nn.Linear(16 * WIDTH, WIDTH)), False, False)
    assert bare.cost().t_fc is not None and (bare.cost().t_fs, bare.cost().t_rs, bare.cost().m_fs) == (None, None, None)
    # one whose checkpointed forward keeps more than its plain one (the generators' state outweighs
    # its activations) is offered no recomputation, and the profile says why
    from zbsearch.profiler.measure import disturbances

    tiny = _measure(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()), False, False)
    assert tiny.m_fc is not None and tiny.m_fc > tiny.m_f and (tiny.cost().t_r, tiny.cost().m_fc) == (None, None)
    assert any("full recomputation is not offered there" in w for w in disturbances([tiny], torch.device("cpu"), 1, 1))
    assert not any("not offered" in w for w in disturbances([bare], torch.device("cpu"), 1, 1))


# -- the runtime ----------------------------------------------------------------------------------

_TIMES = dict(t_f=1.0, t_b=1.0, t_w=1.0, t_bw=1.9, t_ff=1.0, t_fs=1.0, t_rs=0.25)


def measured_profile(num_stages: int, ranks: int) -> zb.Profile:
    """The profiler's measurement of each stage's memory, offering selective recomputation only."""
    stages = build(num_stages)
    costs = [_measure(st, s == 0, s == num_stages - 1).cost() for s, st in enumerate(stages)]
    placement = None if num_stages == ranks else zb.placement(ranks, num_stages // ranks, "v")
    return selective_only(zb.Profile(name="tiny-selective", memory_unit="bytes", stages=costs, microbatch_size=MB,
                                     placement=placement))


def selective_only(prof: zb.Profile) -> zb.Profile:
    """``prof`` offering selective recomputation only, its measured memory with set times, under
    which recomputing to run two microbatches at once pays (measured times on a busy machine
    would make the solver's choice a matter of chance)."""
    stages = [st.model_copy(update={"t_fc": None, "t_r": None, "t_rf": None, "m_fc": None, **_TIMES}) for st in prof.stages]
    return prof.model_copy(update={"stages": stages})


def random_selective(rows: list[list[Action]], rng: random.Random, share: float, fuse: bool) -> list[list[Action]]:
    """``rows`` with about ``share`` of the (stage, microbatch) pairs recomputed selectively, each
    RS at a random place between its F and its backward; with ``fuse``, some B, W pairs fused."""
    out = []
    for row in rows:
        fused = {(a.stage, a.mb) for a in row if a.op is Op.B and fuse and rng.random() < 0.4}
        row = [Action(a.stage, Op.BW, a.mb) if a.op is Op.B and (a.stage, a.mb) in fused else a
               for a in row if not (a.op is Op.W and (a.stage, a.mb) in fused)]
        forwards = [a for a in row if a.op is Op.F]
        for a in [a for a in forwards if rng.random() < share] or forwards[:1]:
            f = row.index(a)
            back = next(i for i, b in enumerate(row) if b.stage == a.stage and b.mb == a.mb and b.op in (Op.B, Op.BW))
            row.insert(rng.randint(f + 1, back), Action(a.stage, Op.RS, a.mb))
        out.append(row)
    return out


def _plain(sched: zb.Schedule) -> zb.Schedule:
    rows = [[a for a in row if a.op not in (Op.R, Op.RS)] for row in sched.rank_actions]
    return zb.Schedule.build(sched.kind + "-plain", sched.profile, sched.num_microbatches, list(sched.stage_to_rank), rows)


def _tiny(num_stages: int, m: int):
    return build(num_stages), *batch(m), loss_fn


_GPT = dict(layers=2, hidden=32, heads=2, seq=16, vocab=64, microbatch_size=2, stages=2)


def _gpt(num_stages: int, m: int):
    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages

    cfg = GPTConfig(**_GPT)
    torch.manual_seed(0)
    return gpt_stages(cfg), *gpt_batch(cfg, m, seed=3), gpt_loss


def _run(sched: zb.Schedule, rank: int, model=_tiny):
    from zbsearch.runtime import PipelineRuntime

    stages, ids, targets, loss = model(sched.num_stages, sched.num_microbatches)
    mine = {s: stages[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank}
    last = sched.num_stages - 1
    with PipelineRuntime(sched, mine, loss, timeout=60) as rt:
        torch.manual_seed(1234)
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
        want, want_losses, _, _ = _run(_plain(sched), rank, model)
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
        predicted = simulate(sched.rank_actions, CostModel.from_profile(sched.profile, list(sched.stage_to_rank))).memory
        for r, events in enumerate(trace.rank_events()):
            acts = [f"{e.args.stage}{e.args.op}{e.args.mb}" for e in events]
            if acts != [str(a) for a in sched.rank_actions[r]]:
                problems.append(f"{sched.kind} rank {r}: the trace's actions are not the schedule's")
                continue
            measured = [e.args.activations for e in events]
            bad = [(a, x, y) for a, x, y in zip(acts, measured, predicted[r]) if x != pytest.approx(y, abs=0.5)]
            if bad:
                problems.append(f"{sched.kind} rank {r}: measured != predicted activation bytes after {bad[:4]}")
    return problems


def _selective_schedules(prof: zb.Profile, m: int, seed: int) -> list[zb.Schedule]:
    from zbsearch.solver import solve
    from zbsearch.solver.feasibility import smallest_feasible_limit

    classic = zb.build_classic("zb-v" if prof.placement is not None else "1f1b", prof, m)
    cost = CostModel.from_profile(prof, list(classic.stage_to_rank))
    least = smallest_feasible_limit(cost, m, "auto")  # one microbatch at a time, recomputed where that helps
    peak = [max(row) for row in simulate(classic.rank_actions, cost).memory]
    out = []
    for share in (0.55, 0.8):  # room for a second microbatch in flight only if one is recomputed
        limit = [a + share * (b - a) for a, b in zip(least, peak)]
        out.append(solve(prof, m, limit, chunks=prof.chunks, recompute="auto", time_limit=1, milp=False).schedule)
    rng = random.Random(seed)
    kinds = ("zb-v", "zb-v") if prof.placement is not None else ("zb-h1", "1f1b")
    for k, kind in enumerate(kinds):
        base = zb.build_classic(kind, prof, m)
        rows = random_selective(base.rank_actions, rng, 0.6, fuse=k % 2 == 1)
        out.append(zb.Schedule.build(f"{kind}-random-rs{k}", base.profile, m, list(base.stage_to_rank), rows))
    return [s for s in out if any(a.op is Op.RS for row in s.rank_actions for a in row)]


def test_one_rank_v_with_selective_recomputation_is_exact_and_follows_the_memory_model(one_rank):
    """Two stages on one rank (a V: the first stage and the last with the loss, handed over
    locally), split and fused backwards, the solver's schedules and random RS placements."""
    prof = measured_profile(2, 1)
    scheds = _selective_schedules(prof, 3, seed=1)
    assert len(scheds) >= 3 and any(s.kind.endswith("solver") for s in scheds)
    problems = _check(0, 1, None, [s.model_dump_json() for s in scheds])
    assert not problems, "\n".join(problems[:20])


def test_a_schedule_recomputing_a_stage_that_selects_nothing_is_refused(one_rank):
    from zbsearch.runtime import PipelineRuntime

    prof = measured_profile(2, 1)
    base = zb.build_classic("zb-v", prof, 2)
    sched = zb.Schedule.build("rs", prof, 2, list(base.stage_to_rank),
                              random_selective(base.rank_actions, random.Random(0), 1.0, fuse=False))
    stages = build(2)
    stages[1].mlp.selective_recompute = False
    with pytest.raises(PipelineError, match="recomputes stage 1 selectively .* stage 1 declares no module in every "
                                            "mode, and the schedule's profile does not say"):
        PipelineRuntime(sched, dict(enumerate(stages)), loss_fn)
    # the mode the profile measured, and the stages declare another: refused, naming it
    for st in stages:
        st.mlp.selective_recompute = "mlp"
    named = zb.Schedule.build("rs", prof.model_copy(update={"selective": "attention"}), 2, list(base.stage_to_rank),
                              sched.rank_actions)
    with pytest.raises(PipelineError, match=r"stage 0 declares no module for the mode its profile measured \('attention'"):
        PipelineRuntime(named, dict(enumerate(stages)), loss_fn)
    PipelineRuntime(sched.model_copy(update={"profile": prof.model_copy(update={"selective": "mlp"})}),
                    dict(enumerate(stages)), loss_fn).close()  # the mode they declare


@pytest.mark.slow
def test_two_ranks_with_selective_recomputation_are_exact_and_follow_the_memory_model():
    from zbsearch.distributed import run_local

    prof = measured_profile(2, 2)
    scheds = _selective_schedules(prof, 4, seed=2)
    assert len(scheds) >= 3 and any(s.kind.endswith("solver") for s in scheds)
    problems = run_local(_check, 2, [s.model_dump_json() for s in scheds], timeout=600)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


def _check_gpt(rank: int, world: int, send, texts: list[str]) -> list[str]:
    return _check(rank, world, send, texts, _gpt)


@pytest.mark.slow
def test_builtin_gpt_profiled_with_recompute_runs_the_solvers_selective_schedule_exactly():
    """``profile --recompute --selective mlp`` on the built-in GPT measures its MLPs' selective
    costs; the solver's schedule on them (selective only offered) runs exact and as predicted on
    2 ranks, RS recomputing the MLPs (the attention cores: ``test_recompute_peak``)."""
    from zbsearch.distributed import run_local
    from zbsearch.models import GPTConfig
    from zbsearch.profiler import Settings, builtin_gpt, profile_model

    prof = profile_model(builtin_gpt(GPTConfig(**_GPT)), Settings(warmup=1, repeat=3, rounds=1, threads=1,
                                                                    recompute=True, selective="mlp"))
    assert prof is not None and prof.selective == "mlp"
    assert all(st.m_fs is not None and st.m_fs < st.m_f for st in prof.stages)
    scheds = _selective_schedules(selective_only(prof), 4, seed=3)
    assert any(s.kind.endswith("solver") for s in scheds)
    problems = run_local(_check_gpt, 2, [s.model_dump_json() for s in scheds], timeout=600)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


@pytest.mark.parametrize("preset,mode", [("gpt2-tiny", "attention"), ("llama-tiny", "attention"), ("tiny:qwen2_moe", "mlp"),
                                         ("tiny:mixtral", "mlp")])
def test_hugging_face_stages_recompute_the_modules_of_the_mode_declared(preset, mode):
    """``hf_stages(selective=mode)`` declares each decoder layer's attention core or MLP (a
    mixture of experts here), which RS recomputes on its stages: the gradients of plain passes,
    less kept by each F; the stages' logits are still the model's (``hf_stages`` checks)."""
    pytest.importorskip("transformers")
    from zbsearch.models.hf import hf_batch, hf_config, hf_model, hf_stages

    stages = hf_stages(hf_model(hf_config(preset)), 2, selective=mode).stages
    (ids, mask), _ = hf_batch(hf_config(preset), 3 * MB, SEQ, seed=5)
    xs = list(zip(ids.split(MB), mask.split(MB)))
    names = {"attention": "HFCoreAttention", "mlp": "SparseMoeBlock"}
    for stage in stages:
        chosen = selected_modules(stage, mode)
        assert len(chosen) == len(stage.layers) > 0 and all(type(m).__name__.endswith(names[mode]) for m in chosen)
        assert not selected_modules(stage, "mlp" if mode == "attention" else "attention")
    _check_stage_by_stage(stages, xs, mode)


def _hf(num_stages: int, m: int):
    """GPT-2 (attention dropout on, in training mode) cut in two, each layer's attention core
    declared (a fresh copy of one cut); a batch of m microbatches, the causal LM loss."""
    from zbsearch.models.hf import hf_batch, hf_loss

    config, stages = _hf_cut(num_stages)
    (ids, mask), labels = hf_batch(config, m * MB, SEQ, seed=5)
    return copy.deepcopy(stages), (ids, mask), labels, hf_loss


@functools.cache
def _hf_cut(num_stages: int):
    from zbsearch.models.hf import hf_config, hf_model, hf_stages

    config = hf_config("gpt2-tiny", attn_pdrop=0.1, n_layer=4)
    return config, hf_stages(hf_model(config).train(), num_stages, selective="attention").stages


def test_one_rank_v_recomputing_hugging_face_attention_cores_is_exact_and_follows_the_memory_model(one_rank):
    """GPT-2's two stages on one rank (a V), RS recomputing their attention cores (with
    dropout), split and fused backwards: gradients and losses bit for bit those of the schedule
    without RS, the bytes after every pass and the meter's peak the prediction on a profile the
    profiler measured in the mode ``"attention"``."""
    pytest.importorskip("transformers")
    from zbsearch.profiler.measure import measure_stage

    stages, (ids, mask), labels, loss = _hf(2, 1)
    x: tuple = (ids, mask)
    costs = []
    for s, st in enumerate(stages):
        post = functools.partial(loss, labels=labels) if s == 1 else None
        costs.append(measure_stage(st, x, post, torch.device("cpu"), 1, 2, recompute_too=True, selective="attention").cost())
        with torch.no_grad():
            x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in st(*x))
    prof = selective_only(zb.Profile(name="gpt2-attention", memory_unit="bytes", stages=costs, microbatch_size=MB,
                                     placement=zb.placement(1, 2, "v"), selective="attention"))
    assert all(0 < st.m_fs < st.m_f for st in prof.stages)
    rng = random.Random(5)
    scheds = []
    for k in range(2):
        base = zb.build_classic("zb-v", prof, 3)
        rows = random_selective(base.rank_actions, rng, 0.6, fuse=k == 1)
        scheds.append(zb.Schedule.build(f"zb-v-rs{k}", prof, 3, list(base.stage_to_rank), rows))
    problems = _check(0, 1, None, [s.model_dump_json() for s in scheds], _hf)
    assert not problems, "\n".join(problems[:20])
