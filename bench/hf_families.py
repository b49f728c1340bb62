"""Every causal-LM model type of the installed transformers, cut into stages and checked exact.

For each type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny random config
(``tiny_config``: hidden 32, 4 layers, 4 heads, vocabulary 128, dropout off), the model, and
``hf_stages``. A type is

* ``no tiny config``: transformers cannot build a small model of it from its defaults (or it
  is multimodal / larger than 2M parameters at those sizes): not a verdict on the cut;
* ``refused``: ``hf_stages`` refuses it, in the one line shown;
* ``exact``: the cut's logits equal the model's bit for bit (``hf_stages`` checks that), one
  process's gradients through 4 stages equal ``loss.backward()`` on the unsplit model, and
  (``--runtime``) one step of every schedule kind on 2 gloo ranks (1F1B, ZB-H1, ZB-H2, ZB-V,
  interleaved 1F1B, a solver schedule with the 2p limit) gives every rank's parameters the
  unsplit model's gradient and every microbatch its loss (the largest differences are saved).

Prints the table and saves ``bench/results/hf_families.json``. Run:
``python bench/hf_families.py --runtime`` (``--only TYPE ...`` for some types).
"""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from zbsearch.errors import ZbError
from zbsearch.models.hf import hf_batch, hf_loss, hf_stages, tiny_config

LAYERS, M, MB, SEQ = 4, 4, 2, 12
MAX_PARAMS = 2_000_000
KINDS = ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "solver"]


def _quiet():
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    return transformers


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_model(model_type: str, layers: int = LAYERS, seed: int = 0):
    """(config, model) of a tiny random ``model_type``, or a ZbError saying why there is none."""
    tf = _quiet()
    cfg = tiny_config(model_type, layers=layers)
    for sub in ("vision_config", "audio_config", "encoder_config", "vq_config", "speech_config"):
        if getattr(cfg, sub, None) is not None:
            raise ZbError(f"multimodal ({sub})")
    try:
        with torch.device("meta"):
            shape = tf.AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in shape.parameters())
        if n > MAX_PARAMS:
            raise ZbError(f"{n / 1e6:.0f}M parameters at the tiny sizes")
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except ZbError:
        raise
    except Exception as err:
        text = str(err).strip().splitlines()
        raise ZbError(f"{type(err).__name__}: {text[0][:160] if text else ''}") from None
    return cfg, model


def features(cfg, model, tied: bool) -> list[str]:
    """What the family does that a cut must get right, read off its config and modules."""
    out = []
    get = lambda k: getattr(cfg, k, None)  # noqa: E731
    if any(isinstance(get(k), int) and get(k) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                                              "moe_num_experts")):
        out.append("MoE")
    names = [n for n, _ in model.named_modules()]
    if any(n.endswith("rotary_emb") for n in names):
        rope = get("rope_parameters") or {}
        partial = get("partial_rotary_factor") or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
        out.append("partial rotary" if (partial and partial < 1) or get("rotary_dim") else "rotary")
    base = getattr(model, model.base_model_prefix, model)
    try:
        if "alibi" in inspect.getsource(type(base).forward) and getattr(cfg, "alibi", True) is not False:
            out.append("ALiBi")
    except (OSError, TypeError):
        pass
    if any(n.rpartition(".")[2] in ("wpe", "position_embeddings", "embed_positions") for n in names):
        out.append("learned positions")
    types = set(get("layer_types") or [])
    if len(types) > 1:
        out.append("hybrid layers")
    elif get("sliding_window"):
        out.append("sliding window")
    if get("final_logit_softcapping") or get("attn_logit_softcapping"):
        out.append("soft-capping")
    if any(get(k) not in (None, 1, 1.0) for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling",
                                                   "logit_scale", "scale_emb", "scale_depth")):
        out.append("multipliers")
    out.append("tied" if tied else "untied")
    return out


def one_process(model, cfg, stages: int = 4, layers: int = LAYERS) -> dict:
    """Gradients of ``stages`` stages run in one process (each stage's input a fresh leaf, as
    the runtime hands it) against ``loss.backward()`` on the unsplit model."""
    (ids, mask), labels = hf_batch(cfg, 4, SEQ, seed=3)
    kw = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    hf_loss(model(input_ids=ids, attention_mask=mask, **kw).logits, labels).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    cut = hf_stages(model, stages, [layers // stages] * stages)
    x, outs, ins = (ids, mask), [], []
    for st in cut.stages:
        y = st(*x)
        y = y if isinstance(y, tuple) else (y,)
        x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in y)
        outs.append(y)
        ins.append(x)
    hf_loss(outs[-1][0], labels).backward()
    for i in range(len(outs) - 2, -1, -1):
        torch.autograd.backward(outs[i][0], ins[i][0].grad)
    worst, differ = 0.0, []
    for n, p in model.named_parameters():
        if (n in ref) != (p.grad is not None):
            differ.append(n)
        elif n in ref:
            d = (p.grad - ref[n]).abs().max().item()
            worst = max(worst, d)
            if d:
                differ.append(n)
    model.zero_grad(set_to_none=True)
    return {"max_abs_diff": worst, "params_differing": len(differ)}


def survey_one(model_type: str, layers: int = LAYERS, stages: int = 4) -> dict:
    """One type's row: its status (exact, refused, no tiny config), the reason, what it does."""
    row: dict = {"model_type": model_type}
    t0 = time.perf_counter()
    try:
        cfg, model = tiny_model(model_type, layers)
    except ZbError as err:
        row.update(status="no tiny config", reason=str(err).removeprefix(f"tiny_config({model_type!r}): "))
        return row
    row["class"] = type(model).__name__
    try:
        cut = hf_stages(model, 2)
    except ZbError as err:
        row.update(status="refused", reason=str(err))
        return row
    row.update(layer_list=cut.layer_list, tied=[list(t) for t in cut.tied], features=features(cfg, model, bool(cut.tied)),
               params=sum(p.numel() for p in model.parameters()))
    try:
        row["one_process"] = one_process(model, cfg, stages, layers)
    except ZbError as err:
        row.update(status="refused", reason=str(err))
        return row
    ok = row["one_process"]["params_differing"] == 0
    row.update(status="exact" if ok else "differs", seconds=round(time.perf_counter() - t0, 2))
    return row


# -- one step of every schedule kind on 2 ranks -------------------------------------------------
def schedule(kind: str, p: int):
    import zbsearch as zb

    unit = zb.Profile(name="unit", memory_unit="activations",
                      stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)] * p)
    if kind == "solver":
        from zbsearch.solver.solve import solve

        return solve(unit, M, "2p", time_limit=2, milp=False).schedule
    return zb.build_classic(kind, unit, M)


def _worker(rank, world, send, folder, model_types):
    from zbsearch.runtime import PipelineRuntime

    _quiet()
    for model_type in model_types:
        out = {}
        for kind in KINDS:
            sched = schedule(kind, world)
            n = sched.num_stages
            cfg, model = tiny_model(model_type)
            model.train()
            cut = hf_stages(model, n)
            names = {id(p): q for q, p in model.named_parameters()}
            stages = {s: cut.stages[s] for s, r in enumerate(sched.stage_to_rank) if r == rank}
            (ids, mask), labels = hf_batch(cfg, M * MB, SEQ, seed=5)
            try:
                with PipelineRuntime(sched, stages, hf_loss if n - 1 in stages else None, tied=cut.tied, timeout=120) as rt:
                    losses = rt.step((ids, mask) if 0 in stages else None, labels if n - 1 in stages else None)
            except ZbError as err:
                out[kind] = str(err)
                continue
            grads = {names[id(p)]: p.grad.clone() for st in stages.values() for p in st.parameters() if p.grad is not None}
            held = sorted({names[id(p)] for st in stages.values() for p in st.parameters() if p.requires_grad})
            out[kind] = (losses, grads, held)
        torch.save(out, os.path.join(folder, f"{model_type}-{rank}.pt"))


def reference(model_type: str):
    """Per-microbatch losses and the gradients of the unsplit model (loss / M per microbatch)."""
    cfg, model = tiny_model(model_type)
    model.train()
    (ids, mask), labels = hf_batch(cfg, M * MB, SEQ, seed=5)
    kw = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: more threads sum weight gradients in another order
    try:
        for i, am, y in zip(ids.chunk(M), mask.chunk(M), labels.chunk(M)):
            loss = hf_loss(model(input_ids=i, attention_mask=am, **kw).logits, y)
            (loss / M).backward()
            losses.append(loss.detach())
    finally:
        torch.set_num_threads(threads)
    grads = {q: p.grad for q, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses), grads


def runtime_matrix(model_types: list[str], folder: Path) -> dict[str, dict]:
    from zbsearch.distributed import run_local

    run_local(_worker, 2, str(folder), model_types, timeout=60 + 60 * len(model_types))
    result = {}
    for model_type in model_types:
        ref_losses, ref_grads = reference(model_type)
        runs = [torch.load(folder / f"{model_type}-{r}.pt") for r in range(2)]
        per_kind = {}
        for kind in KINDS:
            if any(isinstance(run[kind], str) for run in runs):
                per_kind[kind] = {"error": next(run[kind] for run in runs if isinstance(run[kind], str))}
                continue
            grad_err, loss_err, seen, missing = 0.0, 0.0, set(), []
            for losses, grads, held in (run[kind] for run in runs):
                if losses is not None:
                    loss_err = max(loss_err, (losses - ref_losses).abs().max().item())
                for q in held:
                    if q in ref_grads and q not in grads:
                        missing.append(q)
                for q, g in grads.items():
                    grad_err = max(grad_err, (g - ref_grads[q]).abs().max().item())
                    seen.add(q)
            missing += sorted(set(ref_grads) - seen)
            scale = max(g.abs().max().item() for g in ref_grads.values())
            per_kind[kind] = {"max_grad_abs_diff": grad_err, "max_grad": scale, "max_loss_abs_diff": loss_err,
                              "missing": missing}
        result[model_type] = per_kind
    return result


def exact_runtime(per_kind: dict, rtol: float = 1e-6) -> bool:
    """Every kind ran and matched: gradients within ``rtol`` of the largest gradient entry
    (the sum of a tied weight's parts across ranks is added in another order than one
    process adds them), losses equal, no gradient missing."""
    return all("error" not in r and not r["missing"] and r["max_loss_abs_diff"] == 0
               and r["max_grad_abs_diff"] <= rtol * r["max_grad"] for r in per_kind.values())


def main() -> None:
    from bench.common import save

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="model types (default: all of the causal-LM mapping)")
    ap.add_argument("--runtime", action="store_true", help="also one step of every schedule kind on 2 ranks")
    args = ap.parse_args()
    tf = _quiet()
    t0 = time.time()
    rows = []
    for model_type in args.only or causal_lm_types():
        row = survey_one(model_type)
        rows.append(row)
        print(f"{model_type:26s} {row['status']:15s} {row.get('reason') or ', '.join(row.get('features', []))}", flush=True)
    if args.runtime:
        exact = [r["model_type"] for r in rows if r["status"] == "exact"]
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(0, len(exact), 16):
                chunk = exact[k:k + 16]
                matrix = runtime_matrix(chunk, Path(tmp))
                for r in rows:
                    if r["model_type"] in matrix:
                        r["runtime"] = matrix[r["model_type"]]
                        r["runtime_exact"] = exact_runtime(r["runtime"])
                        worst = max(v.get("max_grad_abs_diff", float("inf")) for v in r["runtime"].values())
                        print(f"{r['model_type']:26s} runtime {'exact' if r['runtime_exact'] else 'NOT EXACT'}"
                              f"  max |dgrad| {worst:.2g}", flush=True)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(counts, "runtime exact:", sum(bool(r.get("runtime_exact")) for r in rows))
    path = save({"transformers": tf.__version__, "seconds": round(time.time() - t0, 1), "layers": LAYERS,
                 "microbatches": M, "microbatch_size": MB, "seq": SEQ, "counts": counts, "families": rows,
                 }, "hf_families" if not args.only else "hf_families_some")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
