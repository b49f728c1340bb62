"""Stages compiled with torch.compile under the pipeline: the whole stage or its layers, through
every schedule kind, with gradients equal to the compiled modules' own backward and one graph
per stage, not one per microbatch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import zbsearch as zb
from tests.helpers.toy import uniform_profile
from zbsearch.distributed import run_local
from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages
from zbsearch.models.gpt import Block
from zbsearch.runtime import PipelineRuntime, backward_input, backward_weight, forward_pass
from zbsearch.runtime.split import compiled

CFG = GPTConfig(layers=4, hidden=32, heads=4, seq=16, vocab=64, microbatch_size=2, stages=2)


def _recompute_profile(p: int) -> zb.Profile:
    st = zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.6, m_w=-0.4, t_r=1.0, m_fc=0.1)
    return zb.Profile(name="unit-r", memory_unit="activations", stages=[st] * p)


def _compile(stage: torch.nn.Module, how: str, backend: str) -> torch.nn.Module:
    if how == "stage":
        return torch.compile(stage, backend=backend)
    for i, child in enumerate(stage):  # each transformer layer compiled in place
        if isinstance(child, Block):
            stage[i] = torch.compile(child, backend=backend)
    return stage


def _reference(stages, ids, targets, m: int) -> None:
    for x, y in zip(ids.chunk(m), targets.chunk(m)):
        for st in stages:
            x = st(x)
        (gpt_loss(x, y) / m).backward()


def _worker(rank: int, world: int, send, cases: list[tuple[str, str, str]], steps: int) -> list[str]:
    import torch._dynamo as dynamo

    done = []
    for kind, how, backend in cases:
        dynamo.reset()
        prof = _recompute_profile(world) if "recompute" in kind else uniform_profile(world)
        sched = zb.build_classic(kind, prof, 4)
        cfg = GPTConfig(**{**CFG.__dict__, "stages": sched.num_stages, "layers": 2 * sched.num_stages})
        whole = gpt_stages(cfg)
        ref = [_compile(copy.deepcopy(st), how, backend) for st in whole]
        mine = {s: _compile(copy.deepcopy(st), how, backend) for s, st in enumerate(whole) if sched.stage_to_rank[s] == rank}
        assert all(compiled(st) for st in mine.values())
        runtime = PipelineRuntime(sched, mine, gpt_loss, timeout=120)
        for step in range(steps):
            ids, targets = gpt_batch(cfg, 4, seed=step)
            for st in [*ref, *mine.values()]:
                st.zero_grad()
            _reference(ref, ids, targets, 4)
            runtime.step(ids if 0 in mine else None, targets if sched.num_stages - 1 in mine else None)
            for s, st in mine.items():
                for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                    where = f"{kind} {how} {backend} stage {s} {name}"
                    if backend == "eager":  # the same kernels in the same order: bit for bit
                        assert torch.equal(q.grad, p.grad), where
                    torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=lambda e, w=where: f"{w}: {e}")
            if step == 0:
                first = dynamo.utils.counters["stats"]["unique_graphs"]
        # graphs are made in the first step (per compiled module, one per way it runs: split,
        # fused, checkpointed, recomputed); later steps, and later microbatches, make none
        assert dynamo.utils.counters["stats"]["unique_graphs"] == first, (kind, how, backend)
        held = [*ref, *mine.values()]  # the reference's modules are compiled in this process too
        wrapped = dynamo.eval_frame.OptimizedModule
        modules = len(held) if how == "stage" else sum(isinstance(m, wrapped) for st in held for m in st)
        assert first <= 4 * modules, (kind, how, backend, first)
        runtime.close()
        done.append(f"{kind}/{how}/{backend}")
    return done


def test_compiled_stages_follow_the_compiled_modules_own_backward():
    cases = [("zb-h1", "stage", "eager"), ("zb-v", "layers", "aot_eager"), ("1f1b", "stage", "aot_eager")]
    assert run_local(_worker, 2, cases, 2)[0] == [f"{k}/{h}/{b}" for k, h, b in cases]


@pytest.mark.slow
def test_compiled_stages_through_every_schedule_kind():
    kinds = ["gpipe", "1f1b-split", "zb-h2", "interleaved-1f1b", "1f1b-recompute", "zb-h1-recompute"]
    cases = [(k, "stage" if i % 2 else "layers", "aot_eager") for i, k in enumerate(kinds)] + [("zb-h1", "stage", "inductor")]
    assert len(run_local(_worker, 2, cases, 2)[0]) == len(cases)


def test_a_compiled_stages_b_runs_its_whole_backward_and_w_nothing():
    torch.manual_seed(0)
    stage = gpt_stages(CFG)[1]
    ref = copy.deepcopy(stage)
    c = torch.compile(stage, backend="eager")
    x = torch.randn(2, 16, 32, requires_grad=True)
    fp = forward_pass(c, (x,))
    grads, w = backward_input(fp, [torch.ones_like(fp.outputs[0])])
    assert all(p.grad is not None for p in stage.parameters())  # B ran the whole backward
    before = [p.grad.clone() for p in stage.parameters()]
    backward_weight(w)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, stage.parameters()))  # W had nothing left
    y = ref(x.detach().requires_grad_())
    y.backward(torch.ones_like(y))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(stage.parameters(), ref.parameters()))


class _Gate(torch.nn.Module):
    """A parameter-free region, compiled on its own."""

    def forward(self, x):
        return torch.nn.functional.gelu(x) * torch.sigmoid(x)


def test_a_compiled_region_without_parameters_leaves_the_weight_gradients_to_w():
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 16), _Gate(), torch.nn.Linear(16, 8))
    ref = copy.deepcopy(stage)
    stage[1] = torch.compile(stage[1], backend="aot_eager")
    assert not compiled(stage)
    x = torch.randn(4, 8, requires_grad=True)
    fp = forward_pass(stage, (x,))
    (gx,), w = backward_input(fp, [torch.ones(4, 8)])
    assert all(p.grad is None for p in stage.parameters())  # B: the input gradient only
    backward_weight(w)
    xr = x.detach().requires_grad_()
    ref(xr).sum().backward()
    torch.testing.assert_close(gx, xr.grad, rtol=1e-6, atol=1e-7)
    for p, q in zip(stage.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_the_runtime_says_in_one_line_that_a_compiled_stage_leaves_w_empty(one_rank):
    sched = zb.build_classic("zb-h1", uniform_profile(1), 2)
    stage = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    with pytest.warns(UserWarning, match=r"stages \[0\] are compiled .* fused backwards") as got:
        PipelineRuntime(sched, {0: stage}, lambda y, t: (y - t).square().mean(), check_model=False).close()
    assert len([w for w in got if "compiled" in str(w.message)]) == 1
    assert "\n" not in str(got[0].message)
    # a schedule with fused backwards has no W to leave empty
    fused = zb.build_classic("1f1b", uniform_profile(1), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PipelineRuntime(fused, {0: stage}, lambda y, t: (y - t).square().mean(), check_model=False).close()
