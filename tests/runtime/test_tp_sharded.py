"""Tensor parallelism and sharding together (PP x DP_shard x TP, torchtitan's 3-D layout): stages
of the built-in GPT parallelized with ``parallelize_stage`` on ``mesh["tp"]``, then sharded with
``shard_stage`` on ``mesh["dp_shard"]``, run by the runtime under the split backward.

The oracle is one process running the unparallelized model on the global batch, microbatch
after microbatch. After every AdamW step each rank's losses and gradients, and its stages'
``state_dict`` gathered into full tensors, equal it (rel. 1e-5): the state dict, not the
parameters, since a fused projection's parameters are stored with their rows grouped rank by
rank (``fully_shard_layout``), which the gradients are compared in too. The optimizer state
is each rank's shard. A state dict loaded back (a whole one, through torch's
``set_model_state_dict``) puts the parameters back exactly.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import zbsearch as zb
from tests.runtime.test_tensor_parallel import _close, _full, _model, _share, schedules
from zbsearch.distributed import run_local

M = 4
STEPS = 2


def _blocked(g: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """A fused projection's full tensor with its rows grouped by tensor-parallel rank (each
    rank's share of each part, rank after rank), written independently of the library's."""
    pieces = [part.chunk(tp) for part in g.chunk(parts)]
    return torch.cat([pieces[k][r] for r in range(tp) for k in range(parts)])


def _case(text: str, sp: bool, mesh) -> list[str]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from zbsearch.models.sharding import shard_stage
    from zbsearch.models.tensor_parallel import parallelize_stage
    from zbsearch.runtime import PipelineRuntime

    sched = zb.Schedule.model_validate_json(text)
    pp, tp = mesh["pp"].get_local_rank(), mesh["tp"].size()
    dp, replica = mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()
    S, last = sched.num_stages, sched.num_stages - 1
    ref, inputs, targets, loss_fn = _model("gpt", S, dp)
    ours = _model("gpt", S)[0]
    mine = {s: shard_stage(parallelize_stage(ours[s], mesh["tp"], sequence_parallel=sp), mesh["dp_shard"])
            for s in range(S) if sched.stage_to_rank[s] == pp}
    adamw = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)  # eps: see test_tensor_parallel._run_case
    ref_opt = torch.optim.AdamW([q for st in ref for q in st.parameters()], **adamw)
    trained = [q for st in mine.values() for q in st.parameters()]
    our_opt = torch.optim.AdamW(trained, **adamw)
    problems = []
    name = f"{sched.kind}{' sequence-parallel' if sp else ''}"
    with PipelineRuntime(sched, mine, loss_fn, mesh=mesh, timeout=120) as rt:
        for step in range(STEPS):
            want = []
            for j in range(M * dp):
                x = inputs.chunk(M * dp)[j]
                for st in ref:
                    x = st(x)
                loss = loss_fn(x, targets.chunk(M * dp)[j])
                loss.backward(torch.full((), 1.0 / (M * dp)))
                want.append(loss.detach())
            got = rt.step(_share(inputs, dp, replica) if 0 in mine else None,
                          _share(targets, dp, replica) if last in mine else None)
            if got is not None and not _close(got, torch.stack(want[replica * M:(replica + 1) * M])):
                problems.append(f"{name} step {step}: losses differ")
            for s, st in mine.items():
                for (n, q), r in zip(st.named_parameters(), ref[s].parameters()):
                    wanted = _blocked(r.grad, 3, tp) if n.endswith(("qkv.weight", "qkv.bias")) else r.grad
                    if not _close(_full(q.grad), wanted):
                        problems.append(f"{name} step {step} stage {s} {n}: gradient differs")
            ref_opt.step()
            our_opt.step()
            for s, st in mine.items():
                theirs = ref[s].state_dict()
                for k, v in st.state_dict().items():
                    if not _close(_full(v), theirs[k]):
                        problems.append(f"{name} step {step} stage {s} state_dict[{k!r}] differs after AdamW")
            ref_opt.zero_grad()
            our_opt.zero_grad()
    for q in trained:  # each rank keeps its share of every parameter: over dp_shard (the first), and tp where split
        split = [q.device_mesh.size(i) for i, pl in enumerate(q.placements) if not pl.is_replicate()]
        if q.placements[0].is_replicate() or q.to_local().numel() * math.prod(split) != q.numel():
            problems.append(f"{name}: a parameter of {tuple(q.shape)} laid out as {q.placements} keeps {q.to_local().numel()}")
    kept = sum(q.to_local().numel() for q in trained)
    state = sum(v.to_local().numel() for st in our_opt.state.values() for k, v in st.items() if k != "step")
    if state != 2 * kept:
        problems.append(f"{name}: AdamW holds {state} elements for {kept} kept")
    for s, st in mine.items():  # a whole state dict loaded back, then saved again
        with torch.no_grad():
            for q in st.parameters():
                q.zero_()
        set_model_state_dict(st, ref[s].state_dict(), options=StateDictOptions(full_state_dict=True))
        theirs = ref[s].state_dict()
        for k, v in st.state_dict().items():
            if not torch.equal(_full(v), theirs[k]):
                problems.append(f"{name} stage {s} state_dict[{k!r}] differs after loading the reference's")
    return problems


def _check(rank: int, world: int, send, shape: tuple[int, int, int], cases: list[tuple[str, bool]]) -> list[str]:
    from zbsearch.distributed.mesh import build_mesh

    warnings.filterwarnings("ignore", message=".*(view tensor|sequential all_gather).*")
    pp, dp, tp = shape
    mesh = build_mesh(pp=pp, dp_shard=dp, tp=tp)
    return [line for text, sp in cases for line in _case(text, sp, mesh)]


def _kinds(p: int, kinds: tuple[str, ...], sp: bool = False) -> list[tuple[str, bool]]:
    from tests.runtime.test_tensor_parallel import _profile

    if p == 2:
        by_kind = {s.kind: s for s in schedules()}
        return [(by_kind[k].model_dump_json(), sp) for k in kinds]
    return [(zb.build_classic(k, _profile(p), M).model_dump_json(), sp) for k in kinds]


def test_pp1_dp_shard2_tp2_split_stages_equal_one_process():
    """Four ranks: one pipeline rank holding a V's two stages (the second runs the split
    backward), sharded over two replicas and split over two tensor ranks."""
    problems = run_local(_check, 4, (1, 2, 2), _kinds(1, ("zb-v",)), timeout=900)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


@pytest.mark.slow
def test_pp2_dp_shard2_tp2_equals_one_process():
    """Eight ranks; the V with sequence parallelism (its norms' gradients are partial sums)."""
    cases = _kinds(2, ("zb-h1", "1f1b")) + _kinds(2, ("zb-v",), sp=True)
    problems = run_local(_check, 8, (2, 2, 2), cases, timeout=1800)
    assert all(not x for x in problems), "\n".join(line for x in problems for line in x[:20])


# -- the layout itself (one process) ---------------------------------------------------------------
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_the_grouped_order_puts_each_ranks_share_of_each_part_together(parts):
    from zbsearch.models.tensor_parallel import _order

    for tp in (1, 2, 3, 4, 8):
        for per in (tp, 2 * tp, 3 * tp):
            rows = torch.arange(parts * per)
            assert torch.equal(rows[_order(parts * per, parts, tp)], _blocked(rows, parts, tp)), (parts, tp, per)


def _one_rank_stage():
    from torch.distributed.device_mesh import init_device_mesh

    from zbsearch.models import GPTConfig, gpt_stages
    from zbsearch.models.tensor_parallel import parallelize_stage

    cfg = GPTConfig(layers=2, stages=2, hidden=16, heads=2, seq=8, vocab=16, microbatch_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    return gpt_stages(cfg, seed=0)[1], parallelize_stage(gpt_stages(cfg, seed=0)[1], mesh["tp"]), mesh


def test_a_sharded_tensor_parallel_stage_saves_and_loads_the_unparallelized_tensors(one_rank):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from zbsearch.models.sharding import shard_stage
    from zbsearch.models.tensor_parallel import full_tensor

    ref, stage, mesh = _one_rank_stage()
    shard_stage(stage, mesh["dp_shard"])
    theirs = ref.state_dict()
    ours = stage.state_dict()
    assert list(ours) == list(theirs)
    for k, v in ours.items():
        assert torch.equal(_full(v), theirs[k]), k
    for n, _ in stage.named_parameters():
        assert torch.equal(full_tensor(stage, n), ref.get_parameter(n)), n
    with torch.no_grad():
        for q in stage.parameters():
            q.zero_()
    set_model_state_dict(stage, theirs, options=StateDictOptions(full_state_dict=True))
    for n, _ in stage.named_parameters():
        assert torch.equal(full_tensor(stage, n), ref.get_parameter(n)), n


def test_a_fused_projection_already_sharded_is_refused_in_one_line(one_rank):
    from torch.distributed.fsdp import fully_shard

    from zbsearch.errors import ZbError
    from zbsearch.models.tensor_parallel import fully_shard_layout

    _, stage, mesh = _one_rank_stage()
    for child in stage.children():
        fully_shard(child, mesh=mesh["dp_shard"])
    with pytest.raises(ZbError, match=r"fully_shard_layout: Linear\.weight is laid out as .*; call it before fully_shard") as err:
        fully_shard_layout(stage)
    assert "\n" not in str(err.value)
