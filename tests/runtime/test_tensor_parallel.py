"""Pipelines of tensor-parallel stages: PP2 x TP2 on four gloo ranks (ranks {0, 1} share pipeline
rank 0's stages, {2, 3} pipeline rank 1's; pipelines {0, 2} and {1, 3}), and PP2 x DP2 x TP2 on
eight, in ``build_mesh``'s mesh, stages parallelized with ``parallelize_stage`` (torch's
``parallelize_module``: DTensor parameters).

Every schedule kind, split and fused backwards, V and interleaved placements, a solver schedule
and schedules with R passes, on the built-in GPT (with and without sequence parallelism), the
built-in Llama and a Hugging Face Llama. The oracle is one process running the unparallelized
model on the same batch, ``loss.backward()`` microbatch after microbatch: after every one of
several AdamW steps each rank's gradients (DTensors gathered into full tensors) and parameters,
and the losses, equal it (rel. 1e-5). The activation bytes each rank's meter reads after every
pass equal the simulator's prediction on a profile that the profiler measured on the
parallelized stages (their local shards). One spawned run checks every case.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

import zbsearch as zb
from zbsearch.costs import CostModel
from zbsearch.distributed import run_local
from zbsearch.simulator import simulate

HAVE_HF = importlib.util.find_spec("transformers") is not None
M = 4  # microbatches per step
STEPS = 3
_GPT = dict(hidden=32, heads=4, seq=8, vocab=32, microbatch_size=2)


def _model(family: str, num_stages: int, dp: int = 1):
    """(stages, inputs, targets, loss) of a family's tiny model, the batch of ``dp`` replicas:
    the same weights and data on every rank."""
    if family == "hf":
        from zbsearch.models.hf import hf_batch, hf_loss, hf_model, hf_stages, tiny_config

        cfg = tiny_config("llama", layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=32, tie_word_embeddings=False)
        stages = hf_stages(hf_model(cfg, seed=0), num_stages).stages
        (ids, mask), labels = hf_batch(cfg, 2 * M * dp, 8, seed=3)
        return stages, (ids, mask), labels, hf_loss
    from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages, llama_stages

    cut = (1, 1) if num_stages == 2 else (0, 1, 1, 0)
    size = {**_GPT, "hidden": 48} if family == "llama" else _GPT  # SwiGLU's 8/3 x hidden: a multiple of 2
    cfg = GPTConfig(layers=2, stages=num_stages, cut=cut, **size)
    build = llama_stages if family == "llama" else gpt_stages
    return build(cfg, seed=0), *gpt_batch(cfg, M * dp, seed=3), gpt_loss


def _profile(p: int) -> zb.Profile:
    return zb.Profile(name="unit", memory_unit="activations", stages=[
        zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.6, m_w=-0.4, t_r=1.0, m_fc=0.2)] * p)


def schedules() -> list[zb.Schedule]:
    from zbsearch.solver import solve

    prof = _profile(2)
    kinds = ("1f1b", "1f1b-split", "gpipe", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "1f1b-recompute",
             "zb-h1-recompute")
    out = [zb.build_classic(k, prof, M) for k in kinds]
    out.append(solve(prof, M, "2p", chunks=1, time_limit=2, milp=False).schedule)
    out.append(solve(prof, M, "1.5p", chunks=2, time_limit=2, milp=False).schedule)
    return out


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor gathered into its full tensor; any other tensor as it is."""
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def _shard(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _close(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    if got is None or want is None:
        return got is None and want is None
    scale = want.abs().max().item()
    return got.shape == want.shape and (got - want).abs().max().item() <= 1e-5 * max(scale, 1e-6)


def _share(batch, dp: int, replica: int):
    """A replica's share of the global batch (a tensor or a tuple of tensors)."""
    return tuple(t.chunk(dp)[replica] for t in batch) if isinstance(batch, tuple) else batch.chunk(dp)[replica]


def _run_case(text: str, family: str, sp: bool, mesh, measured: dict) -> list[str]:
    """One schedule on one family: STEPS AdamW steps against the one-process model on the global
    batch (each data-parallel replica, if any, runs its share)."""
    import torch.distributed as dist

    from zbsearch.models.tensor_parallel import parallelize_stage
    from zbsearch.runtime import PipelineRuntime

    sched = zb.Schedule.model_validate_json(text)
    name = f"{family}{'-sp' if sp else ''} {sched.kind}"
    pp = mesh["pp"].get_local_rank()
    dp, replica = mesh["dp_replicate"].size(), mesh["dp_replicate"].get_local_rank()
    S, last = sched.num_stages, sched.num_stages - 1
    ref, inputs, targets, loss_fn = _model(family, S, dp)
    ours = _model(family, S)[0]
    mine = {s: parallelize_stage(ours[s], mesh["tp"], sequence_parallel=sp)
            for s in range(S) if sched.stage_to_rank[s] == pp}
    profile = measured.get((family, sp, S))
    if profile is None:
        profile = measured[(family, sp, S)] = _measure(mine, family, sp, S, mesh)
    sched = zb.Schedule.build(sched.kind, profile, M, list(sched.stage_to_rank), sched.rank_actions)
    # The key projection's bias has no gradient (attention ignores a shift shared by every key), only
    # rounding noise, which AdamW divides by eps: eps well above that noise keeps it out of the step.
    adamw = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)
    ref_opt = torch.optim.AdamW([q for st in ref for q in st.parameters()], **adamw)
    our_opt = torch.optim.AdamW([q for st in mine.values() for q in st.parameters()], **adamw)
    problems = []
    with PipelineRuntime(sched, mine, loss_fn, mesh=mesh, timeout=120) as rt:
        for step in range(STEPS):
            want = []
            for j in range(M * dp):  # one process, microbatch after microbatch
                x = tuple(t.chunk(M * dp)[j] for t in inputs) if isinstance(inputs, tuple) else inputs.chunk(M * dp)[j]
                for st in ref:
                    x = st(*x) if isinstance(x, tuple) else st(x)
                loss = loss_fn(x, targets.chunk(M * dp)[j])
                loss.backward(torch.full((), 1.0 / (M * dp)))
                want.append(loss.detach())
            mine_in, mine_t = _share(inputs, dp, replica), _share(targets, dp, replica)
            got = rt.step(mine_in if 0 in mine else None, mine_t if last in mine else None)
            want_here = torch.stack(want[replica * M:(replica + 1) * M])
            if got is not None and not _close(got, want_here):
                problems.append(f"{name} step {step}: losses {got.tolist()} != {want_here.tolist()}")
            trace = rt.trace()
            if trace is not None and step == STEPS - 1:
                problems += _memory(name, sched, trace)
            for s, st in mine.items():
                for (n, q), r in zip(st.named_parameters(), ref[s].parameters()):
                    if not _close(_full(q.grad), r.grad):
                        problems.append(f"{name} step {step} stage {s} {n}: gradient differs")
            ref_opt.step()
            our_opt.step()
            for s, st in mine.items():
                for (n, q), r in zip(st.named_parameters(), ref[s].parameters()):
                    if not _close(_full(q.detach()), r.detach()):
                        d = (_full(q.detach()) - r.detach()).abs().max().item()
                        problems.append(f"{name} step {step} stage {s} {n}: parameter differs after AdamW by {d:.3g} "
                                        f"(grad {r.grad.abs().max().item() if r.grad is not None else -1:.3g})")
            ref_opt.zero_grad()
            our_opt.zero_grad()
        left = rt.meter.bytes
    if left:
        problems.append(f"{name} rank {dist.get_rank()}: {left} bytes of activations left after the step")
    return problems[:5]


def _measure(mine: dict, family: str, sp: bool, num_stages: int, mesh) -> zb.Profile:
    """The profiler's measurement of this rank's parallelized stages (the bytes the meter counts:
    local shards), shared by all ranks: each stage as its first tensor-parallel rank measured it
    (a stage's ranks measure together: its passes run collectives)."""
    import torch.distributed as dist

    from zbsearch.profiler.measure import measure_stage

    ref, inputs, targets, loss_fn = _model(family, num_stages)
    # a microbatch of its own, as the runtime splits a batch (a saved view would be charged its whole batch)
    x = tuple(t.chunk(M)[0].clone() for t in inputs) if isinstance(inputs, tuple) else (inputs.chunk(M)[0].clone(),)
    boundary = []
    for st in ref:  # what each stage receives
        boundary.append(x)
        with torch.no_grad():
            out = st(*x)
        x = out if isinstance(out, tuple) else (out,)
    tp, tp_rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
    measured = {}
    for s, st in mine.items():
        args = boundary[s]
        if s:  # a later stage's input: its slice of the sequence under sequence parallelism
            first = args[0].chunk(tp, dim=1)[tp_rank].contiguous() if sp else args[0]
            args = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in (first, *args[1:]))
        target = targets.chunk(M)[0].clone()
        post = functools.partial(lambda t, out: loss_fn(out, t), target) if s == num_stages - 1 else None
        measured[s] = measure_stage(st, args, post, torch.device("cpu"), 1, 2, recompute_too=True).cost().model_dump_json()
        st.zero_grad(set_to_none=True)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (tp_rank, measured))
    costs = {s: zb.StageCost.model_validate_json(c) for rank_tp, part in every if rank_tp == 0 for s, c in part.items()}
    return zb.Profile(name="tp-measured", memory_unit="bytes", stages=[costs[s] for s in range(num_stages)],
                      microbatch_size=2)


def _memory(name: str, sched: zb.Schedule, trace) -> list[str]:
    cost = CostModel.from_profile(sched.profile, list(sched.stage_to_rank))
    predicted = simulate(sched.rank_actions, cost).memory
    out = []
    for r, events in enumerate(trace.rank_events()):
        measured = [e.args.activations for e in events]
        bad = [(str(e.action), x, y) for e, x, y in zip(events, measured, predicted[r]) if x != pytest.approx(y, abs=0.5)]
        if bad:
            out.append(f"{name} pipeline rank {r}: measured != predicted activation bytes after {bad[:3]}")
    return out


def _check(rank: int, world: int, send, cases: list[tuple[str, str, bool]]) -> list[str]:
    from zbsearch.distributed.mesh import build_mesh

    mesh = build_mesh(pp=2, dp_replicate=world // 4, tp=2)
    measured: dict = {}
    problems = []
    for text, family, sp in cases:
        problems += _run_case(text, family, sp, mesh, measured)
    return problems


# -- the split passes on tensor-parallel stages (two ranks, one stage) -------------------------------
class Mixed(torch.nn.Module):
    """A tensor-parallel MLP beside a parameter used in a plain matrix product: the generic split."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.mix = torch.nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))) + x @ self.mix


def _stage(family: str, where: int, sp: bool, mesh):
    """(stage, microbatch inputs, loss or None, output gradients) on this tensor-parallel rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from zbsearch.models.tensor_parallel import parallelize_stage

    tp, me = mesh.size(), mesh.get_local_rank()
    g = torch.Generator().manual_seed(where)
    if family == "mixed":
        torch.manual_seed(0)
        stage = parallelize_module(Mixed(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        xs = [(torch.randn(2, 5, 8, generator=g),) for _ in range(M)]
        return stage, xs, None, [[torch.randn(2, 5, 8, generator=g)] for _ in range(M)]
    if family == "hf":
        stages, inputs, targets, loss = _model("hf", 2)
    else:
        from zbsearch.models import GPTConfig, gpt_batch, gpt_loss, gpt_stages, llama_stages

        cfg = GPTConfig(layers=3, stages=3, **({**_GPT, "hidden": 48} if family == "llama" else _GPT))
        stages = (llama_stages if family == "llama" else gpt_stages)(cfg, seed=0)
        (inputs, targets), loss = gpt_batch(cfg, M, seed=3), gpt_loss
    stage = parallelize_stage(stages[where], mesh, sequence_parallel=sp)
    last = where == len(stages) - 1
    if where == 0:
        xs = [tuple(t.chunk(M)[j].clone() for t in inputs) if isinstance(inputs, tuple) else (inputs.chunk(M)[j].clone(),)
              for j in range(M)]
    else:
        with torch.no_grad():
            x = inputs.chunk(M)[0] if not isinstance(inputs, tuple) else tuple(t.chunk(M)[0] for t in inputs)
            for st in stages[:where]:
                x = st(*x) if isinstance(x, tuple) else st(x)
        x = x if isinstance(x, tuple) else (x,)
        xs = []
        for _ in range(M):
            h = torch.randn(x[0].shape, generator=g)
            xs.append(((h.chunk(tp, dim=1)[me].contiguous() if sp else h), *x[1:]))
    if last:
        return stage, xs, [functools.partial(lambda t, out: loss(out, t), targets.chunk(M)[j].clone()) for j in range(M)], None
    grads = []
    for x in xs:  # a gradient for each floating output (the same on every rank where it is whole)
        with torch.no_grad():
            out = stage(*x)
        out = out if isinstance(out, tuple) else (out,)
        full = [torch.randn(o.shape[:1] + (o.shape[1] * tp,) + o.shape[2:] if sp else o.shape, generator=g) for o in out]
        grads.append([(f.chunk(tp, dim=1)[me].contiguous() if sp else f) if o.is_floating_point() else None
                      for f, o in zip(full, out)])
    return stage, xs, None, grads


def _saved_local_bytes(stage, x, post) -> int:
    """What a plain forward saves for backward, counted independently of the meter: each local
    storage once (a DTensor's shard, a pending collective's result), parameters and buffers left out."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    params = {id(q) for q in (*stage.parameters(), *stage.buffers())}
    found: dict[int, int] = {}

    def pack(t):
        if id(t) not in params and not (t._base is not None and id(t._base) in params):
            inner = t._local_tensor if isinstance(t, DTensor) else t.elem if isinstance(t, AsyncCollectiveTensor) else t
            found[inner.untyped_storage().data_ptr()] = inner.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*x)
        if post is not None:
            post(out)
    return sum(found.values())


def _split_check(mesh, cases: list[tuple[str, int, bool, bool]]) -> list[str]:
    from zbsearch.runtime import backward_input, backward_weight, forward_pass
    from zbsearch.runtime.memory import ActivationMeter

    problems = []
    for family, where, sp, fast in cases:
        name = f"{family}{'-sp' if sp else ''} stage {where}"
        ours, xs, posts, grads = _stage(family, where, sp, mesh)
        plain = _stage(family, where, sp, mesh)[0]
        meter = ActivationMeter(replay=False)
        passes, weights, got = {}, {}, {}
        order = ["F0", "F1", "B0", "F2", "B1", "W0", "F3", "B2", "W1", "B3", "W2", "W3"]
        for step in order:
            op, j = step[0], int(step[1])
            before = meter.bytes
            if op == "F":
                x = tuple(t.detach().requires_grad_(t.is_floating_point() and where > 0) for t in xs[j])
                passes[j] = forward_pass(ours, x, post=posts[j] if posts else None, meter=meter, deferred_first=True)
                want = _saved_local_bytes(plain, x, posts[j] if posts else None)
                if meter.bytes - before != want:
                    problems.append(f"{name} {step}: the meter counted {meter.bytes - before} bytes, saved {want}")
                if j == 3 and passes[j].fast != fast:  # after the first microbatch's backward gave the verdict
                    problems.append(f"{name} {step}: fast path {passes[j].fast}, expected {fast}")
            elif op == "B":
                fp = passes.pop(j)
                out_grads = [torch.ones(())] if posts else grads[j]
                got[j], weights[j] = backward_input(fp, out_grads)
            else:
                backward_weight(weights.pop(j))
        if meter.bytes:
            problems.append(f"{name}: {meter.bytes} bytes left after every W")
        for j, x in enumerate(xs):  # one plain backward per microbatch, the same order
            xp = tuple(t.detach().requires_grad_(t.is_floating_point() and where > 0) for t in x)
            out = plain(*xp)
            if posts:
                posts[j](out).backward()
            else:
                pairs = [(o, q) for o, q in zip(out if isinstance(out, tuple) else (out,), grads[j]) if q is not None]
                torch.autograd.backward([o for o, _ in pairs], [q for _, q in pairs])
            if where and not torch.equal(got[j][0], xp[0].grad):
                problems.append(f"{name} microbatch {j}: input gradient differs")
        for (n, q), r in zip(ours.named_parameters(), plain.parameters()):
            same = type(q.grad) is type(r.grad) and getattr(q.grad, "placements", None) == getattr(r.grad, "placements", None)
            if not same or not torch.equal(_shard(q.grad), _shard(r.grad)):
                problems.append(f"{name} {n}: gradient differs from the unsplit stage's")
    return problems


def _sizes_refused(mesh) -> list[str]:
    """Sizes that do not split across the ranks: one line each, naming what."""
    from zbsearch.errors import ZbError
    from zbsearch.models import GPTConfig, gpt_stages
    from zbsearch.models.tensor_parallel import parallelize_stage

    problems = []
    for over, want in (({"heads": 3, "hidden": 24}, "attention heads (3) is not a multiple of 2"),
                       ({"vocab": 33}, "vocabulary rows (33) is not a multiple of 2")):
        stage = gpt_stages(GPTConfig(**{**_GPT, "layers": 2, "stages": 2, **over}))[0]
        try:
            parallelize_stage(stage, mesh)
            problems.append(f"{over}: not refused")
        except ZbError as err:
            if want not in str(err) or "\n" in str(err):
                problems.append(f"{over}: refused with {err}")
    return problems


def _dtensor_output_refused(timeout: float) -> list[str]:
    """PP2 with one-rank tensor parallelism, the first stage ending in a DTensor: its rank
    refuses it in one line naming the stage; the peer waiting for it gives up at the timeout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from zbsearch.runtime import PipelineError, PipelineRuntime

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "tp"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = torch.nn.Linear(8, 8)
    if rank == 0:
        stage = parallelize_module(stage, mesh["tp"], ColwiseParallel(use_local_output=False))
    sched = zb.build_classic("zb-h1", _profile(2), 2)
    loss = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    x = torch.randn(4, 8)
    with PipelineRuntime(sched, {rank: stage}, loss, group=mesh["pp"].get_group(), timeout=timeout) as rt:
        try:
            rt.step(x if rank == 0 else None, x if rank == 1 else None)
            return ["a DTensor crossed a stage boundary"]
        except PipelineError as err:
            text = str(err)
    if rank == 0 and not ("rank 0: 0F0: stage 0 output 0 is a DTensor with placements" in text
                          and "use_local_output=True" in text and "\n" not in text):
        return [f"refused with: {text}"]
    return []


HF_FAMILIES = ("mistral", "qwen2", "gpt_neox", "phi3", "olmo2")  # biases, fused q/k/v, gathered outputs, q/k norms


def _hf_families(mesh) -> list[str]:
    """Hugging Face families under their own plans, both stages on each of two ranks, split
    passes (the first stage deferred): gradients within rounding of the unparallelized model."""
    from zbsearch.models.hf import hf_batch, hf_loss, hf_model, hf_stages, tiny_config
    from zbsearch.models.tensor_parallel import parallelize_stage
    from zbsearch.runtime import backward_input, backward_weight, forward_pass

    problems = []
    for kind in HF_FAMILIES:
        cfg = tiny_config(kind, layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False)
        ref = hf_stages(hf_model(cfg), 2).stages
        ours = [parallelize_stage(st, mesh) for st in hf_stages(hf_model(cfg), 2).stages]
        for j in range(2):
            (ids, mask), labels = hf_batch(cfg, 2, 8, seed=j)
            hf_loss(ref[1](*ref[0](ids, mask)), labels).backward()
            first = forward_pass(ours[0], (ids, mask), deferred_first=True)
            h = tuple(o.detach().requires_grad_(o.is_floating_point()) for o in first.outputs)
            last = forward_pass(ours[1], h, post=functools.partial(hf_loss, labels=labels))
            got, w_last = backward_input(last, [torch.ones(())])
            _, w_first = backward_input(first, [got[0], *([None] * (len(h) - 1))])
            backward_weight(w_last)
            backward_weight(w_first)
        for a, b in zip(ours, ref):
            for (n, q), r in zip(a.named_parameters(), b.parameters()):
                if not _close(_full(q.grad), r.grad):
                    problems.append(f"{kind} {n}: gradient differs from the unparallelized model's")
    return problems


def _two_ranks(rank: int, world: int, send, cases: list) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {"split": _split_check(mesh, cases), "sizes": _sizes_refused(mesh), "hf": _hf_families(mesh) if HAVE_HF else []}
    out["output"] = _dtensor_output_refused(3.0)  # last: the failed step leaves its links closed
    return out


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[str]]:
    """One spawned run of two ranks for every check below."""
    cases = [("gpt", 0, False, True), ("gpt", 1, False, True), ("gpt", 2, False, True), ("gpt", 1, True, True),
             ("llama", 1, False, True), ("hf", 1, False, True), ("hf", 0, False, True), ("mixed", 1, False, False)]
    results = run_local(_two_ranks, 2, [c for c in cases if HAVE_HF or c[0] != "hf"], timeout=600)
    return {key: [line for r in results for line in r[key]] for key in results[0]}


@pytest.mark.slow
def test_split_passes_of_tensor_parallel_stages_are_bitwise_and_metered_locally(two_ranks):
    """The split's F, B and W on a stage parallelized across two ranks: gradients bit for bit those
    of the same parallelized stage's plain backward (DTensor gradients with the same placements),
    the fast path taken on the built-in and Hugging Face layers (DTensor Linears deferred; a first
    stage's whole backward in W run as the split's B and W, as ``deferred_first`` does) and the
    generic split beside a plain matrix product; the meter charges each forward the local bytes
    it saved, and nothing is left after W."""
    assert not two_ranks["split"], "\n".join(two_ranks["split"][:20])


@pytest.mark.slow
def test_sizes_that_do_not_split_across_the_ranks_are_refused(two_ranks):
    assert not two_ranks["sizes"], "\n".join(two_ranks["sizes"])


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_HF, reason="needs transformers (the [hf] extra)")
def test_hugging_face_families_split_across_two_ranks_within_rounding(two_ranks):
    assert not two_ranks["hf"], "\n".join(two_ranks["hf"][:20])


@pytest.mark.slow
def test_a_dtensor_crossing_stages_is_refused_in_one_line(two_ranks):
    assert not two_ranks["output"], "\n".join(two_ranks["output"])


def test_pp2_tp2_zero_bubble_schedules_equal_one_process():
    """The fast suite's shapes: a split schedule with sequence parallelism, and a V."""
    by_kind = {s.kind: s.model_dump_json() for s in schedules()}
    problems = run_local(_check, 4, [(by_kind["zb-h1"], "gpt", True), (by_kind["zb-v"], "gpt", False)], timeout=600)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


@pytest.mark.slow
def test_pp2_tp2_every_schedule_kind_equals_one_process():
    scheds = schedules()
    cases = [(s.model_dump_json(), "gpt", False) for s in scheds]
    by_kind = {s.kind: s.model_dump_json() for s in scheds}
    cases += [(by_kind[k], "gpt", True) for k in ("zb-h1", "zb-v", "1f1b")]
    cases += [(by_kind[k], "llama", False) for k in ("zb-h1", "interleaved-1f1b")]
    cases += [(by_kind[k], "hf", False) for k in ("zb-h1", "1f1b") if HAVE_HF]
    problems = run_local(_check, 4, cases, timeout=1500)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


@pytest.mark.slow
def test_pp2_dp2_tp2_equals_one_process_on_the_global_batch():
    """Eight ranks: two replicas of PP2 x TP2, each on its half of the global batch; the runtime
    sums each stage's gradients (DTensor shards) over the replicas. Equal to one process on the
    global batch, with and without sequence parallelism (whose norms' gradients are partial sums)."""
    by_kind = {s.kind: s.model_dump_json() for s in schedules()}
    cases = [(by_kind["zb-h1"], "gpt", False), (by_kind["zb-v"], "gpt", True)]
    problems = run_local(_check, 8, cases, timeout=1500)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


# -- plans (one process) ---------------------------------------------------------------------------
def test_plans_split_attention_and_mlp_the_megatron_way():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from zbsearch.models import GPTConfig, gpt_stages, llama_stages
    from zbsearch.models.tensor_parallel import FusedColwiseParallel, tp_plan

    cfg = GPTConfig(layers=2, stages=2, **_GPT)
    first, last = gpt_stages(cfg)
    plan = tp_plan(first)
    assert isinstance(plan["1.attn.qkv"], FusedColwiseParallel) and plan["1.attn.qkv"].parts == 3
    assert isinstance(plan["1.attn.proj"], RowwiseParallel) and isinstance(plan["1.mlp.0"], ColwiseParallel)
    assert isinstance(plan["1.mlp.2"], RowwiseParallel) and isinstance(plan["0.tok"], RowwiseParallel)
    assert isinstance(tp_plan(last)["1.out"], ColwiseParallel)
    sp = tp_plan(last, sequence_parallel=True)
    assert isinstance(sp["0.ln1"], SequenceParallel) and isinstance(sp["1.ln"], SequenceParallel)
    llama = tp_plan(llama_stages(cfg)[0])
    assert {k for k, v in llama.items() if isinstance(v, ColwiseParallel)} == {
        "1.q", "1.k", "1.v", "1.mlp.gate", "1.mlp.up"}
    assert {k for k, v in llama.items() if isinstance(v, RowwiseParallel)} == {"0", "1.o", "1.mlp.down"}


def test_stages_without_a_plan_are_refused_in_one_line():
    from zbsearch.errors import ZbError
    from zbsearch.models import GPTConfig, llama_stages
    from zbsearch.models.tensor_parallel import parallelize_stage, tp_plan

    with pytest.raises(ZbError, match="no plan for a stage of type Linear"):
        tp_plan(torch.nn.Linear(4, 4))
    with pytest.raises(ZbError, match="Llama takes no sequence parallelism"):
        tp_plan(llama_stages(GPTConfig(layers=2, stages=2, **_GPT))[1], sequence_parallel=True)
    with pytest.raises(ZbError, match="tp_mesh must be a 1-D DeviceMesh"):
        parallelize_stage(llama_stages(GPTConfig(layers=2, stages=2, **_GPT))[1], "tp")  # type: ignore[arg-type]


@pytest.mark.slow
def test_hugging_face_plans_come_from_the_model():
    pytest.importorskip("transformers")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from zbsearch.errors import ZbError
    from zbsearch.models.hf import hf_model, hf_stages, tiny_config
    from zbsearch.models.tensor_parallel import tp_plan

    def last(model_type: str, **over):
        cfg = tiny_config(model_type, layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **over)
        return hf_stages(hf_model(cfg), 2).stages[1]

    plan = tp_plan(last("llama", tie_word_embeddings=False))
    assert isinstance(plan["layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["lm_head"], ColwiseParallel) and len(plan) == 8
    assert "lm_head" not in tp_plan(last("llama", tie_word_embeddings=True))  # summed with the embedding: whole
    with pytest.raises(ZbError, match="'qwen3' plans 'layers.*.self_attn.q_norm' as 'replicated_with_grad_allreduce'"):
        tp_plan(last("qwen3"))


def test_post_validation_refuses_dtensor_parameters_in_one_line(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from zbsearch.runtime import PipelineError, PostValidatedOptimizer

    layer = parallelize_module(torch.nn.Linear(4, 4), init_device_mesh("cpu", (1,)), ColwiseParallel())
    with pytest.raises(PipelineError, match="post-validation takes plain parameters, not DTensors"):
        PostValidatedOptimizer(torch.optim.AdamW(layer.parameters()), max_norm=1.0)


def test_a_schedule_made_for_another_tensor_parallel_degree_is_refused_in_one_line(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    from zbsearch.distributed.mesh import MESH_DIMS
    from zbsearch.formats.mesh import ProfileMesh
    from zbsearch.models import GPTConfig, gpt_stages
    from zbsearch.runtime import PipelineError, PipelineRuntime

    base = zb.Profile(name="one", memory_unit="activations", stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5,
                                                                                     m_w=-0.5)])

    def made_for(tp: int | None) -> zb.Schedule:
        prof = base if tp is None else base.model_copy(update={"mesh": ProfileMesh(pp=1, tp=tp)})
        return zb.build_classic("1f1b", prof, 2)

    loss = lambda out, y: out.sum()  # noqa: E731
    for kwargs in ({}, {"mesh": init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_DIMS)}):
        with pytest.raises(PipelineError) as err:
            PipelineRuntime(made_for(2), {0: torch.nn.Linear(4, 4)}, loss, **kwargs)
        assert str(err.value) == (
            "rank 0: schedule '1f1b' was made for tensor-parallel degree 2 (profile 'one' measured the stages at tp 2), "
            "but this rank's stages run at tp 1: run it at tp 2, or profile the stages with --tp 1 and make the "
            "schedule from that profile")
        for tp in (None, 1):  # a profile at tp 1, or one that does not say (older files): runs
            PipelineRuntime(made_for(tp), {0: torch.nn.Linear(4, 4)}, loss, **kwargs).close()
    # a stage split on a tensor-parallel mesh (of one rank here): its degree is that mesh's
    from zbsearch.models.tensor_parallel import parallelize_stage
    from zbsearch.runtime.runtime import tensor_parallel_degree

    cfg = GPTConfig(layers=1, hidden=16, heads=2, seq=8, vocab=32, microbatch_size=2, stages=1)
    split = parallelize_stage(gpt_stages(cfg)[0], init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    assert tensor_parallel_degree({0: split}, None) == 1 and tensor_parallel_degree({0: torch.nn.Linear(2, 2)}, None) == 1
    unnamed = parallelize_stage(gpt_stages(cfg)[0], init_device_mesh("cpu", (1,)))
    assert tensor_parallel_degree({0: unnamed}, None) is None  # a mesh with no 'tp' dimension: not told
