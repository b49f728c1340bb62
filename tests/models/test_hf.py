"""Hugging Face models cut into stages: the same logits, loss and gradients as the unsplit model.

One process: every supported family (GPT-2, Llama, Qwen2 with tied embeddings, Mistral with a
sliding window), eager and SDPA attention, right padding: the stages' logits and loss equal
``model(input_ids, attention_mask, labels=...)``. Through ``PipelineRuntime`` on 2 and 4
gloo ranks: every schedule kind (1F1B, ZB-H1, ZB-H2, ZB-V, interleaved, a solver schedule)
gives the unsplit model's loss and gradients (GPT-2 with its tied embedding summed across
ranks; Llama untied).
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.toy import uniform_profile  # noqa: E402
from zbsearch import build_classic  # noqa: E402
from zbsearch.distributed import run_local  # noqa: E402
from zbsearch.errors import ZbError  # noqa: E402
from zbsearch.models.hf import (  # noqa: E402
    PRESETS,
    build,
    hf_batch,
    hf_config,
    hf_loss,
    hf_loss_sum,
    hf_model,
    hf_stages,
    hf_token_count,
)

M, MB, SEQ = 4, 2, 8
KINDS = ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "solver"]
FAMILIES = ["gpt2-tiny", "llama-tiny"]


def _run_stages(stages, inputs):
    x = inputs
    for st in stages:
        x = st(*x)
        x = x if isinstance(x, tuple) else (x,)
    return x[0]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_stages_equal_unsplit_model(preset, attn, side):
    cfg = hf_config(preset)
    model = hf_model(cfg, 0, attn)
    (ids, mask), labels = hf_batch(cfg, 6, 12, padding=side)
    assert (mask == 0).any() and (mask == 1).any()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    cut = hf_stages(model, 3)
    logits = _run_stages(cut.stages, (ids, mask))
    valid = mask.bool()
    assert torch.equal(logits[valid], ref.logits[valid])
    torch.testing.assert_close(hf_loss(logits, labels), ref.loss)
    if side == "left":  # the padding mask matters: without it the logits differ (so it is not ignored)
        unmasked = _run_stages(cut.stages, (ids, torch.ones_like(mask)))
        assert not torch.allclose(unmasked[valid], ref.logits[valid])
    # causal: changing the last token changes no earlier logit
    later = ids.clone()
    later[:, -1] = (later[:, -1] + 1) % cfg.vocab_size
    changed = _run_stages(cut.stages, (later, mask))
    assert torch.equal(changed[:, :-1][valid[:, :-1]], logits[:, :-1][valid[:, :-1]])
    assert not torch.equal(changed[:, -1], logits[:, -1])
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert bool(cut.tied) == tied
    for name in (n for pair in cut.tied for n in pair):
        s, _, path = name.partition(".")
        assert cut.stages[int(s)].get_parameter(path) is model.lm_head.weight


def test_errors_are_one_line():
    cfg = hf_config("gpt2-tiny")
    with pytest.raises(ZbError, match="8 layers cannot fill 9 stages"):
        hf_stages(hf_model(cfg), 9)
    with pytest.raises(ZbError, match="neither a config JSON file, tiny:MODEL_TYPE nor a preset"):
        hf_config("no-such-model")
    with pytest.raises(ZbError, match="cannot build a 'no-such-type' config"):
        hf_config("gpt2-tiny", model_type="no-such-type")


def test_layers_per_stage_and_empty_stages():
    cfg = hf_config("llama-tiny")
    model = hf_model(cfg)
    (ids, mask), labels = hf_batch(cfg, 2, 6)
    cut = hf_stages(model, 4, layers_per_stage=[0, 4, 4, 0])  # embedding alone, head alone
    assert cut.layers == [0, 4, 4, 0]
    assert torch.equal(_run_stages(cut.stages, (ids, mask)), model(input_ids=ids, attention_mask=mask).logits)


def test_build_contract_for_the_profiler():
    from zbsearch.profiler import as_model

    spec = as_model(build("llama-tiny", stages=2, microbatch_size=3, seq=10), "build()")
    assert len(spec.stages) == 2 and spec.microbatch[0].shape == (3, 10)


# -- the runtime, every schedule, against the unsplit model -------------------------------------
def _schedule(kind: str, p: int):
    if kind == "solver":
        from zbsearch.solver.solve import solve

        return solve(uniform_profile(p), M, "2p", time_limit=2, milp=False).schedule
    return build_classic(kind, uniform_profile(p), M)


def _model(preset: str, layers: int):
    key = "n_layer" if preset.startswith("gpt2") else "num_hidden_layers"
    return hf_model(hf_config(preset, **{key: layers}), seed=3)


def _worker(rank, world, send, out):
    from zbsearch.runtime import PipelineRuntime

    (ids, mask), labels = hf_batch(hf_config("gpt2-tiny"), M * MB, SEQ, seed=5)
    for preset in FAMILIES:
        for kind in KINDS:
            schedule = _schedule(kind, world)
            n = schedule.num_stages
            cut = hf_stages(_model(preset, 2 * world), n)
            stages = {s: cut.stages[s] for s, r in enumerate(schedule.stage_to_rank) if r == rank}
            runtime = PipelineRuntime(schedule, stages, hf_loss if n - 1 in stages else None, tied=cut.tied, timeout=60)
            losses = runtime.step((ids, mask) if 0 in stages else None, labels if n - 1 in stages else None)
            grads = {f"{s}.{q}": t.grad for s, st in stages.items() for q, t in st.named_parameters(remove_duplicate=False)}
            torch.save(dict(losses=losses, grads=grads, tied=cut.tied), os.path.join(out, f"{preset}-{kind}-{world}-{rank}.pt"))
    # the token mean over the whole batch (HF's loss on the batch), not the mean of microbatch means
    schedule = _schedule("zb-h1", world)
    cut = hf_stages(_model("gpt2-tiny", 2 * world), world)
    stages = {rank: cut.stages[rank]}
    runtime = PipelineRuntime(schedule, stages, hf_loss_sum if rank == world - 1 else None, tied=cut.tied, timeout=60,
                              loss_normalization="tokens", count_tokens=hf_token_count)
    runtime.step((ids, mask) if rank == 0 else None, labels if rank == world - 1 else None)
    grads = {f"{rank}.{q}": t.grad for q, t in stages[rank].named_parameters(remove_duplicate=False)}
    torch.save(dict(grads=grads), os.path.join(out, f"tokens-{world}-{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    for world in (2, 4):
        run_local(_worker, world, out, timeout=300)
    return out


def _reference(preset: str, p: int, n: int):
    model = _model(preset, 2 * p)
    (ids, mask), labels = hf_batch(hf_config("gpt2-tiny"), M * MB, SEQ, seed=5)
    losses = []
    for i, am, y in zip(ids.chunk(M), mask.chunk(M), labels.chunk(M)):
        loss = model(input_ids=i, attention_mask=am, labels=y).loss
        (loss / M).backward()
        losses.append(loss.detach())
    cut = hf_stages(model, n)
    grads = {f"{s}.{q}": t.grad for s, st in enumerate(cut.stages) for q, t in st.named_parameters(remove_duplicate=False)}
    return torch.stack(losses), grads


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset", FAMILIES)
def test_runtime_equals_unsplit_model(runs, preset, kind, p):
    n = 2 * p if kind in ("zb-v", "interleaved-1f1b") else p
    ref_losses, ref_grads = _reference(preset, p, n)
    seen = set()
    for r in range(p):
        got = torch.load(os.path.join(runs, f"{preset}-{kind}-{p}-{r}.pt"))
        if got["losses"] is not None:
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        assert bool(got["tied"]) == preset.startswith("gpt2")
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{preset} {kind} p={p} {name}")
            seen.add(name)
    assert seen == set(ref_grads)


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 4])
def test_token_normalisation_equals_the_loss_on_the_whole_batch(runs, p):
    model = _model("gpt2-tiny", 2 * p)
    (ids, mask), labels = hf_batch(hf_config("gpt2-tiny"), M * MB, SEQ, seed=5)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # HF: token mean over the batch
    cut = hf_stages(model, p)
    ref = {f"{s}.{q}": t.grad for s, st in enumerate(cut.stages) for q, t in st.named_parameters(remove_duplicate=False)}
    _, mean_of_means = _reference("gpt2-tiny", p, p)
    assert max((ref[k] - mean_of_means[k]).abs().max().item() for k in ref) > 1e-4  # padding makes them differ
    for r in range(p):
        for name, g in torch.load(os.path.join(runs, f"tokens-{p}-{r}.pt"))["grads"].items():
            torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=f"p={p} {name}")


@pytest.mark.slow
def test_cli_profile_hf(tmp_path):
    from tests.helpers import run_cli
    from zbsearch import load_profile

    out = tmp_path / "p.json"
    r = run_cli("profile", "--hf", "llama-tiny", "--stages", "4", "--placement", "v", "--seq", "8", "-b", "1",
                "--warmup", "1", "--repeat", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    prof = load_profile(out)
    assert prof.num_stages == 4 and prof.model["model"] == "hf llama-tiny"
    assert prof.placement == [0, 1, 1, 0] and prof.num_ranks == 2  # 4 pieces of a V on 2 ranks
    sched = run_cli("schedule", "zb-v", "-p", out, "-m", "4", "-o", tmp_path / "v.json")
    assert sched.returncode == 0, sched.stderr


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_first_stage_w_either_way_equals_a_plain_backward(preset, deferred):
    """A first stage (embeddings, masks, the first layers) whose W runs its whole backward, plain
    or deferred as a profile may pick: microbatch after microbatch, the gradients of
    ``loss.backward()`` on the same stage."""
    from zbsearch.runtime import backward_input, backward_weight, forward_pass

    cfg = hf_config(preset)
    ref = hf_stages(hf_model(cfg, 0, "eager"), 3).stages[0]
    ours = hf_stages(hf_model(cfg, 0, "eager"), 3).stages[0]
    for mb in range(3):
        (ids, mask), _ = hf_batch(cfg, 2, SEQ, seed=mb)
        out = ref(ids, mask)
        grads = [torch.randn_like(o) if o.requires_grad else None for o in out]
        torch.autograd.backward([o for o, g in zip(out, grads) if g is not None], [g for g in grads if g is not None])
        fp = forward_pass(ours, [ids, mask], deferred_first=deferred)
        assert fp.whole_in_w and fp.fast is (deferred and mb > 0)  # the first microbatch checks the stage
        got, w = backward_input(fp, grads)
        assert got == [None, None]
        backward_weight(w)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"{preset} microbatch {mb} {name}")
