"""Mixture-of-experts under pipeline and expert parallelism: PP2 x EP2 on 4 gloo processes (the
expert groups are the data-parallel peers of each stage) equals one process holding every
expert on the global batch, for every schedule kind and for DualPipeV with its overlapped pairs
run at once, over several AdamW steps with the routing balanced after each (the tokens counted
and the biases moved equal to one process's); and with expert groups of one rank (every rank
holding every expert), the expert copies' gradients summed across the replicas."""

from __future__ import annotations

import pytest
import torch

import zbsearch as zb
from tests.helpers.toy import uniform_profile
from zbsearch.actions import Op
from zbsearch.costs import CostModel
from zbsearch.distributed import run_local
from zbsearch.distributed.mesh import build_mesh, expert_data_group, expert_groups
from zbsearch.formats.layers import load_layers
from zbsearch.formats.trace import Trace
from zbsearch.idle_time import measure_idle_time
from zbsearch.layout import placement
from zbsearch.models.gpt import gpt_batch, gpt_loss
from zbsearch.models.moe import MoE, MoEConfig, all_to_all_time, balance_experts, moe_stages
from zbsearch.pass_times import compare_pass_times
from zbsearch.runtime import PipelineError, PipelineRuntime
from zbsearch.runtime.data_parallel import is_expert
from zbsearch.solver.paired_v import paired_v

PP, EP, M = 2, 2, 4
RATE = 0.05  # large enough that the biases change the routing within the test's steps


def _config(stages: int) -> MoEConfig:
    return MoEConfig(layers=stages, hidden=16, heads=2, seq=6, vocab=24, microbatch_size=2, stages=stages, experts=4,
                     top_k=2)


def _schedules() -> list[zb.Schedule]:
    prof = uniform_profile(PP)
    out = [zb.build_classic(k, prof, M) for k in ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")]
    recompute = zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.6, m_w=-0.4, t_r=1.0, m_fc=0.1)
    out.append(zb.build_classic("1f1b-recompute", zb.Profile(name="unit-r", memory_unit="activations",
                                                             stages=[recompute] * PP), M))  # R repeats the dispatch
    out.append(zb.build_classic("dualpipe-v", prof, M, overlap=True))  # DualPipeV's own pairs
    v = placement(PP, 2, "v")
    actions, pairs = paired_v(CostModel.from_profile(prof, v), M)  # the solver's paired start: every pair it can
    out.append(zb.Schedule.build("paired-v", prof, M, v, actions, overlapped=pairs))
    assert all(len(r) >= 2 for s in out[-2:] for r in s.overlapped or [[]])  # pairs on every rank
    return out


def _reference(stages, ids, targets, microbatches: int) -> None:
    """One process, every expert, microbatch by microbatch over the global batch (mean loss)."""
    for x, y in zip(ids.split(2), targets.split(2)):
        for st in stages:
            x = st(x)
        (gpt_loss(x, y) / microbatches).backward()


def _expert_slice(name: str, rank: int, full: torch.Tensor, held: int) -> torch.Tensor:
    return full[rank * held:(rank + 1) * held] if name.rsplit(".", 1)[-1] in ("w_in", "b_in", "w_out") else full


def _run(rank: int, world: int, send, schedules: list[tuple[str, int]], steps: int) -> list:
    """Each (schedule, ep): experts over expert groups of ep ranks of the data dimension (of 2);
    with ep 1 every rank holds every expert and their copies' gradients are summed."""
    mesh = build_mesh(pp=PP, dp_replicate=EP)
    made = {ep: (expert_groups(mesh, ep), expert_data_group(mesh, ep)) for ep in sorted({ep for _, ep in schedules})}
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    done, traces = [], []
    for text, ep in schedules:
        groups, copies = made[ep]
        assert groups.size == ep and groups.rank == replica % ep and (copies is None) == (ep == EP)
        sched = zb.Schedule.model_validate_json(text)
        cfg = _config(sched.num_stages)
        ref = moe_stages(cfg, seed=3)
        ours = moe_stages(cfg, seed=3, groups=groups)
        mine = {s: ours[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == pp_rank}
        held = cfg.experts // ep
        expert_rank = replica % ep
        ref_opt = torch.optim.AdamW([p for st in ref for p in st.parameters()], lr=0.01)
        our_opt = torch.optim.AdamW([p for st in mine.values() for p in st.parameters()], lr=0.01)
        last = sched.num_stages - 1
        runtime = PipelineRuntime(sched, mine, gpt_loss if last in mine else None, mesh=mesh, timeout=60,
                                  expert_data_group=copies)
        with all_to_all_time() as clock:
            for step in range(steps):
                ids, targets = gpt_batch(cfg, EP * M, seed=step + 10)
                part = slice(replica * M * 2, (replica + 1) * M * 2)
                ref_opt.zero_grad()
                our_opt.zero_grad()
                _reference(ref, ids, targets, EP * M)
                runtime.step(ids[part] if 0 in mine else None, targets[part] if last in mine else None)
                for s, st in mine.items():
                    for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                        where = f"{sched.kind} step {step} stage {s} {name}"
                        assert q.grad is not None and p.grad is not None, where
                        torch.testing.assert_close(q.grad, _expert_slice(name, expert_rank, p.grad, held), rtol=1e-5,
                                                   atol=1e-6, msg=lambda e, w=where: f"{w}: {e}")
                ref_opt.step()
                our_opt.step()
                theirs = {s: balance_experts(st, RATE) for s, st in enumerate(ref)}
                for s, st in mine.items():
                    ours = balance_experts(st, RATE, mesh["dp_replicate"].get_group())
                    assert ours == theirs[s] and ours and sum(ours[0].tokens) == EP * M * 2 * cfg.seq * cfg.top_k, \
                        f"{sched.kind} step {step} stage {s}: {ours} != {theirs[s]}"
        for s, st in mine.items():  # parameters after the AdamW steps
            for (name, q), p in zip(st.named_parameters(), ref[s].parameters()):
                q, p = q.detach().clone(), _expert_slice(name, expert_rank, p.detach(), held).clone()
                if name.endswith("attn.qkv.bias"):
                    # the key bias's gradient is zero but for rounding, which Adam turns into steps of
                    # either sign: it only stays within Adam's step bound
                    key = slice(p.numel() // 3, 2 * p.numel() // 3)
                    assert (q[key] - p[key]).abs().max() <= 0.01 * steps * 1.01, name
                    q[key] = p[key]
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda e, n=f"{sched.kind} {name}": f"{n}: {e}")
        experts = [p for st in mine.values() for p in st.parameters() if is_expert(p)]
        assert experts and all(p.shape[0] == held for p in experts)
        # pairs ran in the pair thread, both passes timed from one start
        rows = runtime._timer.rows
        paired = [(a, b) for (a, b0, _, _), (b, c0, _, _) in zip(rows, rows[1:]) if b0 == c0]
        assert len(paired) == len(sched.overlapped[pp_rank] if sched.overlapped else []), sched.kind
        done.append((sched.kind, ep, clock.forward > 0, clock.backward > 0, runtime._worker is not None))
        if sched.overlapped is not None:  # the last step's trace, pairs and all (on each pipeline's rank 0)
            trace = runtime.trace()
            traces.append(None if trace is None else trace.model_dump_json())
        runtime.close()
    return done, traces


def test_pp2_ep2_every_kind_and_overlapped_pairs_equal_one_process():
    schedules = [(s, EP) for s in _schedules()] + [(zb.build_classic("zb-h1", uniform_profile(PP), M), 1)]
    got = run_local(_run, PP * EP, [(s.model_dump_json(), ep) for s, ep in schedules], 3)
    assert got[0][0] == [(s.kind, ep, ep > 1, ep > 1, s.overlapped is not None) for s, ep in schedules]
    assert all(g[0] == got[0][0] for g in got)
    # the real traces of the paired runs: each pair compared as one block, the waits split around it
    paired = [s for s, _ in schedules if s.overlapped is not None]
    assert len(got[0][1]) == len(paired)
    for sched, text in zip(paired, got[0][1]):
        trace = Trace.model_validate_json(text)
        rows = compare_pass_times(sched, [trace])
        for r in range(PP):
            mine = {x.kind: x for x in rows if x.rank == r}
            pairs = [(sched.rank_actions[r][i], sched.rank_actions[r][i + 1]) for i in sched.pairs(r)]
            kinds = {f"F+{b.op.value}" for _, b in pairs}
            assert sum(mine[k].count for k in kinds) == len(pairs) > 0, sched.kind
            alone = sum(a.op is Op.F for a in sched.rank_actions[r]) - len(pairs)
            assert mine["F"].count == alone and all(mine[k].measured_ms > 0 for k in kinds)
            events = {(e.pid, e.action): e for e in trace.traceEvents}
            blocks = [(events[(r, b)].ts + events[(r, b)].dur - events[(r, f)].ts) / 1e3 for f, b in pairs]
            assert sum(mine[k].count * mine[k].measured_ms for k in kinds) == pytest.approx(sum(blocks))
        for w in measure_idle_time(sched, [trace]):
            assert min(w.idle_ms, w.dependency_ms, w.link_ms, w.local_ms) >= 0
            assert w.idle_ms == pytest.approx(w.dependency_ms + w.link_ms + w.local_ms)


def test_moe_layer_routes_each_token_to_its_top_k_experts():
    """One process: the layer's output is, per token, the renormalised top-k weighted sum of
    its experts' outputs, computed token by token (an independent oracle)."""
    torch.manual_seed(0)
    layer = MoE(hidden=6, inner=10, experts=5, top_k=2)
    x = torch.randn(3, 4, 6)
    got = layer(x)
    for t in x.reshape(-1, 6):
        probs = layer.router(t).softmax(-1)
        w, e = probs.topk(2)
        want = sum(wi / w.sum() * (torch.nn.functional.gelu(t @ layer.w_in[ei] + layer.b_in[ei]) @ layer.w_out[ei])
                   for wi, ei in zip(w, e))
        row = (x.reshape(-1, 6) == t).all(-1).nonzero()[0, 0]
        torch.testing.assert_close(got.reshape(-1, 6)[row], want, rtol=1e-5, atol=1e-6)


def test_a_biased_layer_picks_by_probability_plus_bias_and_weights_by_probability():
    """Token by token: the experts are the top k of probability + bias, weighted by their
    renormalised probabilities; training forwards count the tokens, evaluation does not."""
    torch.manual_seed(1)
    layer = MoE(hidden=6, inner=10, experts=5, top_k=2)
    layer.balance_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.5, -0.1]))
    x = torch.randn(7, 6)
    got = layer(x)
    counts = torch.zeros(5)
    for t, row in zip(x, got):
        probs = layer.router(t).softmax(-1)
        e = (probs + layer.balance_bias).topk(2).indices
        counts[e] += 1
        w = probs[e] / probs[e].sum()
        want = sum(wi * (torch.nn.functional.gelu(t @ layer.w_in[ei] + layer.b_in[ei]) @ layer.w_out[ei])
                   for wi, ei in zip(w, e))
        torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer.balance_load, counts)
    layer.eval()
    layer(x)
    assert torch.equal(layer.balance_load, counts)


def test_balancing_evens_a_skewed_router_out():
    """A router that sends most tokens to two experts: updates alone (no training) bring the
    busiest expert's load towards the mean, and never move a bias by more than the rate."""
    torch.manual_seed(2)
    layer = MoE(hidden=8, inner=8, experts=8, top_k=2)
    with torch.no_grad():
        layer.router.weight[:2] += layer.router.weight[:2].sign()
    x = torch.randn(256, 8)
    loads, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # a hundred tiny forwards: threads only contend
    try:
        for _ in range(100):
            before = layer.balance_bias.clone()
            with torch.no_grad():
                layer(x)
            (load,) = balance_experts(layer, 0.002)
            assert (layer.balance_bias - before).abs().max() <= 0.002 + 1e-7
            assert sum(load.tokens) == 256 * 2 and torch.equal(layer.balance_load, torch.zeros(8))
            loads.append(load.imbalance)
    finally:
        torch.set_num_threads(threads)
    assert loads[0] > 1.5 and max(loads[-10:]) < 0.75 * loads[0], loads


def test_balance_refuses_a_negative_rate_in_one_line():
    with pytest.raises(zb.ZbError, match="rate must be >= 0"):
        balance_experts(MoE(hidden=4, inner=4, experts=2, top_k=1), -1.0)


def test_pairs_that_cannot_run_are_refused_in_one_line():
    sched = zb.build_classic("1f1b", uniform_profile(PP), M)
    acts = sched.rank_actions[1]
    same = next(i for i in range(len(acts) - 1) if acts[i].op is Op.F and acts[i + 1].op is Op.BW)
    bad = [("backward of a microbatch needs its forward", [[], [same]]),
           ("is not a forward followed by a backward", [[0], []]),
           ("names position 99, but a pair needs positions 99 and 100", [[99], []]),
           ("overlaps the pair before it", [[], [same, same + 1]])]
    from zbsearch.runtime.runtime import _pairs

    for words, pairs in bad:
        with pytest.raises(PipelineError, match=words) as e:
            _pairs(sched.model_copy(update={"overlapped": pairs}), 0 if pairs[0] else 1)
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_profile_on_an_expert_group_records_the_all_to_all_inside_f_and_b(capsys, tmp_path):
    """``zbsearch profile --builtin moe --ep 2``: each stage's a_f and a_b, within its F and B, and
    the share of it a pair leaves exposed."""
    from tests.helpers import run_main

    out = tmp_path / "moe.json"
    code, _, err = run_main(capsys, "profile", "--builtin", "moe", "--layers", 2, "--hidden", 16, "--heads", 2, "--seq", 6,
                            "--microbatch-size", 2, "--stages", 2, "--experts", 4, "--ep", 2, "--warmup", 1, "--repeat", 3,
                            "--rounds", 1, "-o", out)
    assert code == 0, err
    prof = zb.load_profile(out)
    assert prof.ep == 2
    for st in prof.stages:
        assert 0 < st.a_f <= st.t_f and 0 < st.a_b <= st.t_b, st
        assert st.pair_exposed is not None and 0 <= st.pair_exposed <= 1, st  # a pair timed against its passes
    from zbsearch.profiler.report import mesh_summary

    assert any("of what it hides exposed (pair_exposed, 2 of 2 stages measured)" in line for line in mesh_summary(prof))


@pytest.mark.slow
def test_units_profiled_on_an_expert_group_plan_with_pairs(capsys, tmp_path):
    """``zbsearch profile --builtin moe --per-layer --ep 2``: each layer's a_f and a_b within its
    passes, none in the embedding and the head; ``zbsearch plan`` on it schedules with its
    all-to-all, DualPipeV among the baselines, never faster than the plan."""
    from tests.helpers import run_main

    out = tmp_path / "units.json"
    code, _, err = run_main(capsys, "profile", "--builtin", "moe", "--layers", 2, "--hidden", 16, "--heads", 2, "--seq", 6,
                            "--microbatch-size", 2, "--experts", 4, "--ep", 2, "--per-layer", "--warmup", 1,
                            "--repeat", 3, "--rounds", 1, "-o", out)
    assert code == 0, err
    layers = load_layers(out)
    assert layers.ep == 2 and [u.kind for u in layers.units] == ["embedding", "layer", "layer", "head"]
    for u in layers.units:
        held, hidden = 4 // 2, 16  # each rank holds 2 of the 4 experts: w_in, b_in, w_out of width 4 x hidden
        if u.kind == "layer":
            assert 0 < u.a_f <= u.t_f and 0 < u.a_b <= u.t_b, u
            assert u.expert_params == held * (2 * hidden * 4 * hidden + 4 * hidden) < u.params, u
            assert u.expert_param_bytes == 4.0 * u.expert_params
        else:
            assert u.a_f == u.a_b == 0 and u.expert_params == 0, u
    sched_path = tmp_path / "plan.json"
    code, _, err = run_main(capsys, "plan", "-l", out, "-r", 2, "-m", 8, "--placement", "v", "-t", 4, "--json",
                            "-o", sched_path)
    assert code == 0, err
    sched = zb.load_schedule(sched_path)
    assert zb.find_problem(sched) is None and sched.profile.ep == 2 and sched.profile.has_all_to_all
    dpv = [b for b in sched.partition.baselines if b.name.startswith("dualpipe-v")]
    assert dpv and all(b.value is None or sched.partition.value <= b.value * (1 + 1e-9) for b in dpv)


def test_profile_ep_refuses_what_it_cannot_measure_in_one_line(capsys):
    from tests.helpers import run_main

    for args, words in ((["--builtin", "gpt", "--ep", 2], "--builtin moe"),
                        (["--builtin", "moe", "--experts", 4, "--ep", 3], "must split"),
                        (["--builtin", "moe", "--ep", 2, "--dp", 2], "do not apply"),
                        (["--builtin", "moe", "--ep", 2, "--placement", "v"], "do not apply")):
        code, _, err = run_main(capsys, "profile", *args, "-o", "-")
        assert code != 0 and words in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
