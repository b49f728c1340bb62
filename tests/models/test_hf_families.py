"""Every causal-LM type of the installed transformers: cut exactly or refused in one line.

The survey builds a tiny random model of each type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
(2 layers) and cuts it into 2 stages: the cut must give the unsplit model's logits bit for bit
(``hf_stages`` refuses it otherwise) and, in one process, the gradients of ``loss.backward()``
on the unsplit model; any other outcome must be a one-line refusal. A few families whose
forwards differ most are checked on every test run with left padding and SDPA too, and (slow)
through the runtime: one step of every schedule kind on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench.hf_families import (  # noqa: E402
    causal_lm_types,
    exact_runtime,
    runtime_matrix,
    survey_one,
)
from zbsearch.models.hf import hf_batch, hf_stages, tiny_config  # noqa: E402

# families the cut must support: each stands for a way of wrapping the layers
MUST = {
    "gpt2": "learned positions, tied head, transformer.h",
    "llama": "rotary",
    "mistral": "sliding window",
    "qwen2": "rotary, biases",
    "qwen3": "qk norms",
    "gemma": "embedding scale",
    "gemma2": "soft-capping, hybrid sliding/full layers",
    "gemma3_text": "per-layer-type rotary tables",
    "cohere2": "hybrid layers, logit scale",
    "phi": "partial rotary",
    "persimmon": "partial rotary",
    "mpt": "ALiBi, transformer.blocks",
    "bloom": "ALiBi, embedding norm",
    "gpt_neo": "learned positions, local attention",
    "gptj": "rotary on part of each head",
    "gpt_neox": "gpt_neox.layers",
    "opt": "decoder.layers, learned positions",
    "granite": "embedding, residual and logit multipliers",
    "qwen2_moe": "mixture of experts",
    "olmoe": "mixture of experts",
    "granitemoe": "mixture of experts, multipliers",
    "mixtral": "mixture of experts",
    "falcon": "parallel attention",
    "stablelm": "partial rotary",
    "starcoder2": "sliding window",
}


@pytest.fixture(scope="module")
def survey():
    return {t: survey_one(t, layers=2, stages=2) for t in causal_lm_types()}


@pytest.mark.slow
def test_every_type_is_cut_exactly_or_refused_in_one_line(survey):
    rows = list(survey.values())
    for r in rows:
        print(f"{r['model_type']:26s} {r['status']:15s} {r.get('reason') or ', '.join(r.get('features', []))}")
    assert {r["status"] for r in rows} <= {"exact", "refused", "no tiny config"}
    for r in rows:
        if r["status"] == "refused":
            assert "\n" not in r["reason"] and r["reason"].startswith("hf_stages: "), r
        if r["status"] == "exact":
            assert r["one_process"]["max_abs_diff"] == 0, r
    exact = {r["model_type"] for r in rows if r["status"] == "exact"}
    assert len(exact) >= 40
    assert set(MUST) <= exact, sorted(set(MUST) - exact)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["gemma2", "mpt", "gpt_neox", "granitemoe", "phi", "opt"])
def test_quirky_families_with_left_padding(model_type, attn):
    cfg = tiny_config(model_type, layers=3)
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    except ValueError as err:
        assert attn == "sdpa" and "does not support an attention implementation" in str(err)
        pytest.skip(f"{model_type} has no SDPA attention")
    (ids, mask), _ = hf_batch(cfg, 4, 10, padding="left")
    cut = hf_stages(model, 3)
    x = (ids, mask)
    for st in cut.stages:
        x = st(*x)
        x = x if isinstance(x, tuple) else (x,)
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    valid = mask.bool()
    assert torch.equal(x[0][valid], ref[valid])


@pytest.mark.slow
def test_one_step_of_every_schedule_kind_equals_the_unsplit_model(tmp_path):
    """Runtime, 2 gloo ranks: 1F1B, ZB-H1, ZB-H2, ZB-V, interleaved, a solver schedule."""
    sample = ["gemma2", "mpt", "qwen2_moe", "gpt_neox"]
    result = runtime_matrix(sample, tmp_path)
    for model_type, per_kind in result.items():
        assert exact_runtime(per_kind), (model_type, per_kind)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("model_type", ["gpt2", "opt", "bert", "bloom", "gemma2"])
def test_a_later_stage_runs_nothing_it_does_not_hold(model_type, stage):
    """Learned positions, embedding norms, buffers on embedding modules: with everything this
    stage does not hold on the meta device (as on a rank whose other stages stayed on the CPU
    while its own went to a GPU), it still gives its output."""
    from tests.models.test_hf_anatomy import to_meta_except

    cfg = tiny_config(model_type, layers=3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    (ids, mask), _ = hf_batch(cfg, 2, 8)
    cut = hf_stages(model, 3)
    x = (ids, mask)
    for st in cut.stages[:stage]:
        x = st(*x)
    want = cut.stages[stage](*x)
    to_meta_except(model, cut.stages[stage])
    got = cut.stages[stage](*x)
    assert torch.equal(got, want) if stage == 2 else all(torch.equal(g, w) for g, w in zip(got, want))
