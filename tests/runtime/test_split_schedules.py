"""Every schedule kind, split or fused, on gloo ranks with a model written as user code is: Linear
outputs on 3-D inputs changed in place (``mul_``, ``F.relu(inplace=True)``, ``+=``,
``nn.ReLU(inplace=True)``), a Linear applied twice, a frozen Linear, a buffer, a
``torch.utils.checkpoint`` region, an embedding with ``padding_idx``, and gradient hooks on the
parameters. Each step's gradients (and the hooks fired) equal one process running
``loss.backward()`` microbatch after microbatch, bit for bit."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import zbsearch as zb
from zbsearch.distributed import run_local

VOCAB, WIDTH, SEQ = 13, 8, 5


class Stage(nn.Module):
    def __init__(self, first: bool, last: bool, checkpointed: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, padding_idx=0) if first else None
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.twice = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)
        self.act = nn.ReLU(inplace=True)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 2 * WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB) if last else None
        self.checkpointed = checkpointed

    def block(self, h):
        u = self.up(h)
        u.mul_(self.gain)
        F.relu(u, inplace=True)
        y = self.down(u)
        y += h
        return self.act(self.twice(torch.tanh(self.twice(self.norm(y))))) + self.frozen(y)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        return self.head(h) if self.head is not None else h


def build(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Stage(s == 0, s == num_stages - 1, s % 2 == 1) for s in range(num_stages)]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(m: int, step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (2 * m, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (2 * m, SEQ), generator=g)


class Hooks:
    """A doubling tensor hook on every other trainable parameter, and a post-accumulate hook on
    each that counts."""

    def __init__(self, stages) -> None:
        self.fired: collections.Counter[str] = collections.Counter()
        for s, st in stages.items():
            for k, (name, p) in enumerate(st.named_parameters()):
                if not p.requires_grad:
                    continue
                if k % 2 == 0:
                    p.register_hook(lambda g: 2 * g)
                p.register_post_accumulate_grad_hook(lambda _, key=f"{s}.{name}": self.fired.update([key]))


def schedules(p: int) -> list[zb.Schedule]:
    from zbsearch.solver import solve

    m = 2 * p
    prof = zb.Profile(name="unit", memory_unit="activations",
                      stages=[zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.6, m_w=-0.4)] * p)
    out = [zb.build_classic(k, prof, m) for k in ("zb-h1", "zb-h2", "zb-v", "1f1b", "gpipe", "interleaved-1f1b")]
    for limit, chunks in (("1p", 1), ("2p", 1), ("2p", 2)):
        out.append(solve(prof, m, limit, chunks=chunks, time_limit=2, milp=False).schedule)
    return out


def _check(rank: int, world: int, send, texts: list[str]) -> list[str]:
    from zbsearch.runtime import PipelineRuntime

    problems = []
    for text in texts:
        sched = zb.Schedule.model_validate_json(text)
        m, last = sched.num_microbatches, sched.num_stages - 1
        ref, ours = build(sched.num_stages), build(sched.num_stages)
        mine = {s: ours[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank}
        ref_hooks, our_hooks = Hooks(dict(enumerate(ref))), Hooks(mine)
        runtime = PipelineRuntime(sched, mine, loss_fn, timeout=60)
        ref_opt = torch.optim.SGD([q for st in ref for q in st.parameters() if q.requires_grad], lr=0.1)
        our_opt = torch.optim.SGD([q for st in mine.values() for q in st.parameters() if q.requires_grad], lr=0.1)
        for step in range(2):
            ids, targets = batch(m, step)
            for x, t in zip(ids.chunk(m), targets.chunk(m)):  # loss.backward(), microbatch after microbatch
                for st in ref:
                    x = st(x)
                loss_fn(x, t).backward(torch.full((), 1.0 / m))  # the runtime's 1/m of each microbatch loss
            runtime.step(ids if 0 in mine else None, targets if last in mine else None)
            for s, st in mine.items():
                for (name, q), r in zip(st.named_parameters(), ref[s].parameters()):
                    same = (q.grad is None and r.grad is None) or (
                        q.grad is not None and r.grad is not None and torch.equal(q.grad, r.grad))
                    if not same:
                        problems.append(f"{sched.kind} p={world} step {step} stage {s} {name}: gradient differs")
                want = {k: v for k, v in ref_hooks.fired.items() if k.split(".")[0] == str(s)}
                got = {k: v for k, v in our_hooks.fired.items() if k.split(".")[0] == str(s)}
                if got != want:
                    problems.append(f"{sched.kind} p={world} step {step} stage {s}: hooks fired {got}, not {want}")
            ref_opt.step()
            our_opt.step()
            ref_opt.zero_grad()
            our_opt.zero_grad()
        runtime.close()
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3])
def test_every_schedule_kind_is_exact_on_user_code(p):
    texts = [s.model_dump_json() for s in schedules(p)]
    problems = run_local(_check, p, texts, timeout=600)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])
