"""Tied weights across stages and ranks, and post-validation next to other process groups.

A GPT-2-style model whose LM head reuses the token embedding is cut into stages; every rank
builds the whole one-process model (one shared Parameter) and keeps its stages, so copies on
different ranks are separate Parameters and the runtime must sum their gradients. Checked
against the one-process model: the gradients of one step (every schedule kind, p=2 and p=4,
V and interleaved placement), and the parameters and the global norm of clipped AdamW steps
through PostValidatedOptimizer and SyncClippedOptimizer (clip_grad_norm_ on the one-process
model counts the shared weight once).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.toy import uniform_profile
from zbsearch import build_classic
from zbsearch.distributed import run_local
from zbsearch.errors import ZbError

VOCAB, WIDTH, SEQ, BATCH, M = 11, 6, 4, 8, 4
MAX_NORM = 0.05  # small enough that every step clips
STEPS = 3


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        return torch.tanh(self.lin(self.wte(ids)))


class Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class Head(nn.Module):
    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = wte.weight  # the tie

    def forward(self, h):
        return self.lm_head(self.ln(h))


def model(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    first = Embed()
    return [first] + [Mid() for _ in range(num_stages - 2)] + [Head(first.wte)]


def tie(num_stages: int) -> list[tuple[str, str]]:
    return [("0.wte.weight", f"{num_stages - 1}.lm_head.weight")]


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batch(k: int):
    g = torch.Generator().manual_seed(k)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def reference(num_stages: int, steps: int, opt_kind: str | None):
    """Per step: the gradients of every stage's parameters (by stage and name), the global norm
    of clip_grad_norm_, and the parameters after the step."""
    stages = model(num_stages)
    whole = nn.ModuleList(stages)
    opt = torch.optim.AdamW(whole.parameters(), lr=0.05) if opt_kind else None
    out = []
    for k in range(steps):
        x, y = batch(k)
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            h = xm
            for st in stages:
                h = st(h)
            (loss_fn(h, ym) / M).backward()
        grads = {s: {n: p.grad.clone() for n, p in st.named_parameters(remove_duplicate=False)} for s, st in enumerate(stages)}
        total = float(nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM)) if opt else None
        if opt:
            opt.step()
            opt.zero_grad()
        params = {
            s: {n: p.detach().clone() for n, p in st.named_parameters(remove_duplicate=False)} for s, st in enumerate(stages)
        }
        out.append((grads, total, params))
    return out


SCENARIOS = [  # (name, ranks, kind, optimizer: None (gradients only), "post", "defer" or "sync")
    ("1f1b-p2", 2, "1f1b", None),
    ("zb-h1-p4", 4, "zb-h1", None),
    ("zb-v-p2", 2, "zb-v", None),
    ("interleaved-p2", 2, "interleaved-1f1b", None),
    ("zb-h2-p2-post", 2, "zb-h2", "post"),
    ("zb-v-p2-post-defer", 2, "zb-v", "defer"),
    ("1f1b-p4-sync", 4, "1f1b", "sync"),
    ("zb-h1-p4-post", 4, "zb-h1", "post"),
]


def _worker(rank, world, send, scenarios, out):
    from zbsearch.runtime import PipelineRuntime, PostValidatedOptimizer, SyncClippedOptimizer

    for name, p, kind, opt_kind in scenarios:
        schedule = build_classic(kind, uniform_profile(p), M)
        n = schedule.num_stages
        whole = model(n)
        stages = {s: whole[s] for s, r in enumerate(schedule.stage_to_rank) if r == rank}
        runtime = PipelineRuntime(schedule, stages, loss_fn if n - 1 in stages else None, tied=tie(n), timeout=60)
        params = list({id(q): q for s in sorted(stages) for q in stages[s].parameters()}.values())
        opt = None
        if opt_kind:
            inner = torch.optim.AdamW(params, lr=0.05)
            if opt_kind == "sync":
                opt = SyncClippedOptimizer(inner, MAX_NORM, stages=stages, tied=tie(n), timeout=60)
            else:
                opt = PostValidatedOptimizer(inner, MAX_NORM, stages=stages, tied=tie(n), timeout=60, defer=opt_kind == "defer")
                opt.attach(runtime)
        steps = []
        for k in range(STEPS if opt_kind else 1):
            x, y = batch(k)
            if opt_kind != "defer" and opt_kind != "sync" and opt is not None:
                opt.validate()
            grads = {}

            def keep(stage, grads=grads, stages=stages):
                grads[stage] = {q: t.grad.clone() for q, t in stages[stage].named_parameters(remove_duplicate=False)}

            runtime._hooks.insert(0, keep)
            runtime.step(x if 0 in stages else None, y if n - 1 in stages else None)
            while opt_kind == "defer" and opt.replay:
                runtime.step(x if 0 in stages else None, y if n - 1 in stages else None)
            runtime._hooks.remove(keep)
            total = None
            if opt_kind == "sync":
                total = opt.step().total_norm
                opt.zero_grad()
            elif opt is not None:
                if opt_kind == "post":
                    total = opt.validate().total_norm
            steps.append((grads, total))
        if opt_kind in ("post", "defer"):
            last = opt.validate()
            if opt_kind == "defer":
                steps[-1] = (steps[-1][0], last.total_norm)
        final = {s: {q: t.detach().clone() for q, t in st.named_parameters(remove_duplicate=False)} for s, st in stages.items()}
        torch.save(dict(steps=steps, final=final), os.path.join(out, f"{name}-{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tied"))
    for world in (2, 4):
        run_local(_worker, world, [s for s in SCENARIOS if s[1] == world], out)
    return {s[0]: [torch.load(os.path.join(out, f"{s[0]}-{r}.pt")) for r in range(s[1])] for s in SCENARIOS}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_tied_weights_equal_one_process(runs, scenario):
    name, p, kind, opt_kind = scenario
    n = 2 * p if kind in ("zb-v", "interleaved-1f1b") else p
    ref = reference(n, STEPS if opt_kind else 1, opt_kind)
    wte, head = ref[0][0][0]["wte.weight"], ref[0][0][n - 1]["lm_head.weight"]
    assert torch.equal(wte, head)  # one shared Parameter in one process
    ranks = runs[name]
    for k, (grads, total, _params) in enumerate(ref if opt_kind != "defer" else ref[:1]):
        for r in ranks:
            got_grads, got_total = r["steps"][k]
            for s, named in got_grads.items():
                for q, g in named.items():
                    d = ((g - grads[s][q]).abs() / (grads[s][q].abs() + 1e-7)).max().item()
                    print("DIFF", name, k, s, q, d, torch.equal(g, grads[s][q]))
            if opt_kind in ("post", "sync"):
                assert got_total == pytest.approx(total, rel=1e-6)
    for r in ranks:
        for s, named in r["final"].items():
            for q, t in named.items():
                torch.testing.assert_close(t, ref[-1][2][s][q], rtol=1e-5, atol=1e-6, msg=f"{name} final stage {s} {q}")
    if opt_kind == "defer":  # every step clipped, so every iteration ran again; the last norm is the last step's
        assert all(r["steps"][-1][1] == pytest.approx(ref[-1][1], rel=1e-6) for r in ranks)


def test_untied_partial_gradient_differs():
    """The check above means something: the head's own part is far from the summed gradient."""
    stages = model(2)
    x, y = batch(0)
    h = stages[0](x).detach()
    loss_fn(stages[1](h), y).backward()
    head_only = stages[1].lm_head.weight.grad.clone()
    stages = model(2)
    loss_fn(stages[1](stages[0](x)), y).backward()
    assert (stages[0].wte.weight.grad - head_only).abs().max() > 1e-3


# -- post-validation next to other groups ------------------------------------------------------
def _subgroup_first(rank, world, send, what):
    from zbsearch.runtime import PostValidatedOptimizer

    dist.new_group([0, 1], use_local_synchronization=True)  # only ranks 0 and 1 call this
    if what == "missing" and rank == world - 1:
        return None
    lin = nn.Linear(3, 3)
    opt = PostValidatedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), max_norm=1.0, timeout=3 if what == "missing" else 60)
    lin.weight.grad = torch.full_like(lin.weight, float(rank + 1))
    lin.bias.grad = torch.zeros_like(lin.bias)
    opt.step()
    return opt.validate().total_norm


@pytest.mark.slow
def test_post_validation_after_a_local_subgroup():
    norms = run_local(_subgroup_first, 4, "ok", timeout=120)
    want = float(torch.tensor([float(r + 1) * 3 for r in range(4)]).norm())  # each weight's norm is 3(r+1)
    assert norms == [pytest.approx(want)] * 4


@pytest.mark.slow
def test_post_validation_missing_rank_is_a_clear_error():
    with pytest.raises(ZbError, match=r"ranks \[3\] did not set up the post-validation group within 3s"):
        run_local(_subgroup_first, 4, "missing", timeout=120)


def test_two_copies_on_one_rank_are_summed_locally(one_rank):
    """V placement on one rank with the head holding its own copy of the embedding weight."""
    from zbsearch.runtime import PipelineRuntime

    schedule = build_classic("zb-v", uniform_profile(1), M)
    assert schedule.stage_to_rank == [0, 0]
    stages = model(2)
    stages[1].lm_head.weight = nn.Parameter(stages[0].wte.weight.detach().clone())  # untied copy
    runtime = PipelineRuntime(schedule, dict(enumerate(stages)), loss_fn, tied=tie(2))
    x, y = batch(0)
    runtime.step(x, y)
    (ref_grads, _, _), = reference(2, 1, None)
    torch.testing.assert_close(stages[0].wte.weight.grad, ref_grads[0]["wte.weight"])
    torch.testing.assert_close(stages[1].lm_head.weight.grad, ref_grads[0]["wte.weight"])
    with pytest.raises(ZbError, match="has no parameter 'nope'"):
        PipelineRuntime(schedule, dict(enumerate(stages)), loss_fn, tied=[("0.wte.weight", "1.nope")])
    with pytest.raises(ZbError, match="not a stage-qualified parameter name"):
        PipelineRuntime(schedule, dict(enumerate(stages)), loss_fn, tied=[("wte.weight", "1.lm_head.weight")])
