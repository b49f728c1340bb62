"""Hugging Face models through the pipeline: exactness per schedule, and per-piece V costs.

1. Exactness: GPT-2 (tied embedding) and Llama tiny configs, random init, padded batches, cut
   with ``zbsearch.models.hf``, one step of every schedule on p = 2 and 4 gloo ranks of this
   machine; the largest gradient and loss difference against the unsplit model
   (``model(input_ids, attention_mask, labels)`` per microbatch, in one process), fp32.
2. V costs: one model profiled as P stages and as 2P pieces of a V (``--placement v``);
   ZB-V's predicted span with halved stages vs with the measured pieces (embedding and head
   pieces both sit on rank 0).

Prints and saves bench/results/hf.json (times noisy on a shared machine: ``uptime`` is saved).
Run: python bench/hf.py
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import zbsearch as zb
from zbsearch.distributed import run_local
from zbsearch.models.hf import hf_batch, hf_config, hf_loss, hf_model, hf_stages

M, MB, SEQ = 4, 2, 16
KINDS = ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "zb-2p (solver)"]
PRESETS = ["gpt2-tiny", "llama-tiny"]


def _unit(p: int) -> zb.Profile:
    return zb.Profile(name="unit", memory_unit="activations",
                      stages=[zb.StageCost(t_f=1, t_b=1, t_w=1, m_f=1, m_b=-0.5, m_w=-0.5)] * p)


def _schedule(kind: str, p: int) -> zb.Schedule:
    if kind.startswith("zb-2p"):
        from zbsearch.solver.solve import solve

        return solve(_unit(p), M, "2p", time_limit=2, milp=False).schedule
    return zb.build_classic(kind, _unit(p), M)


def _batch():
    return hf_batch(hf_config("gpt2-tiny"), M * MB, SEQ, seed=7)


def _worker(rank, world, send, folder):
    from zbsearch.runtime import PipelineRuntime

    (ids, mask), labels = _batch()
    out = {}
    for preset in PRESETS:
        for kind in KINDS:
            sched = _schedule(kind, world)
            n = sched.num_stages
            cut = hf_stages(hf_model(hf_config(preset), seed=0), n)
            stages = {s: cut.stages[s] for s, r in enumerate(sched.stage_to_rank) if r == rank}
            rt = PipelineRuntime(sched, stages, hf_loss if n - 1 in stages else None, tied=cut.tied, timeout=120)
            losses = rt.step((ids, mask) if 0 in stages else None, labels if n - 1 in stages else None)
            grads = {
                f"{s}.{q}": t.grad.clone() for s, st in stages.items() for q, t in st.named_parameters(remove_duplicate=False)
            }
            out[(preset, kind)] = (losses, grads)
    torch.save(out, os.path.join(folder, f"{world}-{rank}.pt"))  # tensors do not survive the result queue


def exactness(tmp: Path) -> list[dict]:
    rows = []
    (ids, mask), labels = _batch()
    for p in (2, 4):
        run_local(_worker, p, str(tmp), timeout=900)
        runs = [torch.load(tmp / f"{p}-{r}.pt") for r in range(p)]
        for preset in PRESETS:
            for kind in KINDS:
                n = _schedule(kind, p).num_stages
                model = hf_model(hf_config(preset), seed=0)
                ref_losses = []
                for i, am, y in zip(ids.chunk(M), mask.chunk(M), labels.chunk(M)):
                    loss = model(input_ids=i, attention_mask=am, labels=y).loss
                    (loss / M).backward()
                    ref_losses.append(loss.detach())
                cut = hf_stages(model, n)
                ref = {
                    f"{s}.{q}": t.grad for s, st in enumerate(cut.stages) for q, t in st.named_parameters(remove_duplicate=False)
                }
                grad_err, loss_err, scale = 0.0, 0.0, max(g.abs().max().item() for g in ref.values())
                for losses, grads in (r[(preset, kind)] for r in runs):
                    if losses is not None:
                        loss_err = max(loss_err, (losses - torch.stack(ref_losses)).abs().max().item())
                    for k, g in grads.items():
                        grad_err = max(grad_err, (g - ref[k]).abs().max().item())
                rows.append(dict(model=preset, p=p, schedule=kind, stages=n, tied=bool(cut.tied),
                                 max_grad_abs_err=grad_err, max_grad=scale, max_loss_abs_err=loss_err))
                print(
                    f"{preset:11s} p={p} {kind:16s} stages={n}  max|dgrad|={grad_err:.2e} (max|grad| {scale:.2e})"
                    f"  max|dloss|={loss_err:.2e}"
                )
    return rows


def v_costs(tmp: Path) -> list[dict]:
    """ZB-V predictions from halved P-stage profiles vs measured 2P-piece profiles."""
    rows = []
    cfg = tmp / "gpt2-small-vocab.json"
    cfg.write_text(json.dumps(dict(model_type="gpt2", n_layer=4, n_embd=128, n_head=4, n_positions=128, vocab_size=8192,
                                   bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))
    for p in (2,):
        files = {}
        for what, args in (("stages", ["--stages", str(p)]), ("pieces", ["--stages", str(2 * p), "--placement", "v"])):
            out = tmp / f"{what}-{p}.json"
            cmd = ["python", "-m", "zbsearch", "profile", "--hf", str(cfg), *args, "--seq", "128", "-b", "2",
                   "--warmup", "3", "--repeat", "10", "--threads", "1", "-o", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            files[what] = zb.load_profile(out)
        pieces = files["pieces"]
        halved = zb.build_classic("zb-v", files["stages"], 8)
        measured = zb.build_classic("zb-v", pieces, 8)
        rows.append(dict(p=p, piece_t_f_ms=[round(s.t_f, 2) for s in pieces.stages],
                         stage_t_f_ms=[round(s.t_f, 2) for s in files["stages"].stages],
                         zbv_span_halved_ms=max(halved.predicted.span), zbv_span_pieces_ms=max(measured.predicted.span)))
        print(
            f"V p={p}: piece F times {rows[-1]['piece_t_f_ms']} ms vs stage F times {rows[-1]['stage_t_f_ms']} ms; "
            f"ZB-V span predicted {rows[-1]['zbv_span_halved_ms']:.1f} ms (halved)"
            f" vs {rows[-1]['zbv_span_pieces_ms']:.1f} ms (pieces)"
        )
    return rows


def main() -> None:
    import transformers

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        rows, v = exactness(Path(tmp)), v_costs(Path(tmp))
    result = dict(torch=torch.__version__, transformers=transformers.__version__, cpu=os.cpu_count(),
                  uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                  seconds=round(time.time() - t0, 1), exactness=rows, v_costs=v)
    path = Path(__file__).parent / "results" / "hf.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
