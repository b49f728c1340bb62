"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE) under pipeline and expert
parallelism: PP2 x EP2 on 4 gloo processes, each rank holding half of every layer's experts
(``shard_hf_experts``), equals the unsplit model in one process on the global batch, for a
split zero-bubble schedule and for DualPipeV with its overlapped pairs run at once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import zbsearch as zb  # noqa: E402
from tests.helpers.toy import uniform_profile  # noqa: E402
from zbsearch.distributed import run_local  # noqa: E402
from zbsearch.distributed.mesh import build_mesh, expert_groups  # noqa: E402
from zbsearch.runtime.data_parallel import is_expert  # noqa: E402

PP, EP, M, MB, SEQ = 2, 2, 4, 2, 8
TYPES = ("mixtral", "qwen2_moe")


def _model(model_type: str):
    import transformers

    from zbsearch.models.hf import tiny_config

    cfg = tiny_config(model_type, layers=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.train()
    return cfg, model


def _run(rank: int, world: int, send, schedules: list[str]) -> list:
    import transformers

    from zbsearch.models.hf import hf_batch, hf_loss, hf_stages
    from zbsearch.models.moe import all_to_all_time, shard_hf_experts
    from zbsearch.runtime import PipelineRuntime

    transformers.logging.set_verbosity_error()
    mesh = build_mesh(pp=PP, dp_replicate=EP)
    groups = expert_groups(mesh)
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    done = []
    for model_type in TYPES:
        for text in schedules:
            sched = zb.Schedule.model_validate_json(text)
            cfg, ref = _model(model_type)
            _, model = _model(model_type)
            cut = hf_stages(model, sched.num_stages)
            assert shard_hf_experts(cut.stages, groups) == cfg.num_hidden_layers
            names = {id(p): q for q, p in model.named_parameters()}
            (ids, mask), labels = hf_batch(cfg, EP * M * MB, SEQ, seed=5, padding=None)
            for i, am, y in zip(ids.chunk(EP * M), mask.chunk(EP * M), labels.chunk(EP * M)):
                (hf_loss(ref(input_ids=i, attention_mask=am, use_cache=False).logits, y) / (EP * M)).backward()
            want = dict(ref.named_parameters())
            mine = {s: cut.stages[s] for s, r in enumerate(sched.stage_to_rank) if r == pp_rank}
            part = slice(replica * M * MB, (replica + 1) * M * MB)
            last = sched.num_stages - 1
            with all_to_all_time() as clock, PipelineRuntime(sched, mine, hf_loss if last in mine else None, mesh=mesh,
                                                             tied=cut.tied, timeout=120) as rt:
                rt.step((ids[part], mask[part]) if 0 in mine else None, labels[part] if last in mine else None)
            checked = 0
            for st in mine.values():
                for p in st.parameters():
                    name = names[id(p)]
                    g = want[name].grad
                    if is_expert(p):
                        n = p.shape[0]
                        g = g[replica * n:(replica + 1) * n]
                    assert p.grad is not None, (model_type, sched.kind, name)
                    torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6,
                                               msg=lambda e, w=f"{model_type} {sched.kind} {name}": f"{w}: {e}")
                    checked += is_expert(p)
            done.append((model_type, sched.kind, checked > 0, clock.forward > 0 and clock.backward > 0))
    return done


@pytest.mark.slow
def test_hf_moe_pp2_ep2_equals_one_process():
    prof = uniform_profile(PP)
    schedules = [zb.build_classic("zb-h1", prof, M), zb.build_classic("dualpipe-v", prof, M, overlap=True)]
    got = run_local(_run, PP * EP, [s.model_dump_json() for s in schedules])
    assert got[0] == [(t, s.kind, True, True) for t in TYPES for s in schedules]
