"""Tune's choice run for real: a small GPT on local processes against torchtitan's default.

For each rank count asked (``--ranks 4``; ``--ranks 4,2`` adds 2 processes, one per core on 2
cores):

1. profile the built-in GPT per layer at microbatch sizes 1, 2 and 4 (``zbsearch profile
   --per-layer``, one thread, as each rank runs), and time AdamW's step over the whole model at
   one thread: the bytes the tuner streams for it over that time are the ``--memory-gbs`` that
   prices each rank's optimizer step;
2. ``zbsearch tune`` for the ranks on one node, its links the profile's estimate between local
   processes (pipeline messages and gradient reductions alike), ``-o`` a folder: the winner's
   ``launch.json`` and, under ``baselines/``, the best torchtitan configurations';
3. run the command lines those files hold (``torchrun ... examples/train_gpt.py ...``, gloo),
   with ``--steps`` added, in rounds: every configuration once per round, real passes and
   emulated ones (``--emulate``: the same command, stages sleeping their profiled times, the
   messages and reductions real), the order turned each round, so that load from elsewhere
   falls on all alike; the median step after the warm-up steps per run, then the median over
   the rounds; the 1-minute load average after every run;
4. compare: measured speed-up over the torchtitan-style default (1F1B, its cut, 2 pp
   microbatches) against tune's predicted one, for real and emulated passes. The emulated runs
   test the model (schedule, messages, reductions, optimizer step) without compute contention;
   the real runs add the compute, and where the processes outnumber the free cores they wait for
   one: the CPU work of every process together over the cores (``work_bound``) is then a floor
   that the prediction, one core per rank, does not see.

Run (about 10 minutes per rank count on 2 cores): PYTHONPATH=. python bench/tune_run.py
Quick check that it works: PYTHONPATH=. python bench/tune_run.py --rounds 1 --steps 3 --warmup 1 --repeat 3 -o /tmp/t.json
Saves bench/results/tune_run.json (or -o).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, save

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
       "OMP_NUM_THREADS": "1"}
SIZES = (1, 2, 4)
TARGET = 0.05  # |measured / predicted speed-up - 1| at most this
DEFAULT = "torchtitan 1F1B"  # the torchtitan-style default; the others are reported beside it


def _zb(*args: str, cwd: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "zbsearch", *args], capture_output=True, text=True, cwd=cwd, env=ENV)
    if r.returncode:
        raise SystemExit(f"zbsearch {args[0]} failed: {r.stderr[-2000:]}")
    return r.stdout


def profile(args, tmp: Path) -> tuple[list[Path], list[dict]]:
    """Per-layer profiles of the model at each microbatch size, and per size what it took, the
    load after it, and the compute per sequence it measured (F + B + W of every unit over b): a
    load that changed between sizes shows as a per-sequence cost that jumps with the size."""
    paths, took = [], []
    for b in SIZES:
        path = tmp / f"gpt-b{b}.json"
        t0 = time.monotonic()
        _zb("profile", "--builtin", "gpt", "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
            str(args.heads), "--seq", str(args.seq), "-b", str(b), "--per-layer",
            "--threads", "1", "--repeat", str(args.repeat), "--rounds", "2", "-o", str(path), cwd=tmp)
        paths.append(path)
        units = json.loads(path.read_text())["units"]
        took.append({"b": b, "s": time.monotonic() - t0, "load": os.getloadavg()[0],
                     "per_sequence_ms": sum(u["t_f"] + u["t_b"] + u["t_w"] for u in units) / b})
    return paths, took


def optimizer_gbs(model: dict) -> dict:
    """AdamW's step over the whole model at one thread, and the memory bandwidth it makes of the
    bytes the tuner counts for it (``zbsearch.tuner.optimizer``: 7x the parameter bytes)."""
    import torch

    from zbsearch.models import GPTConfig, gpt_stages

    torch.set_num_threads(1)
    cfg = GPTConfig(**{k: model[k] for k in ("layers", "hidden", "heads", "seq", "vocab")})
    params = [p for st in gpt_stages(cfg) for p in st.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    times = []
    for i in range(25):
        t0 = time.perf_counter()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return {"param_bytes": nbytes, "step_ms": step * 1e3, "memory_gbs": 7 * nbytes / step / 1e9}


def tune(args, ranks: int, paths: list[Path], link: dict, gbs: float, out: Path) -> dict:
    """``zbsearch tune`` for ``ranks`` local processes; its result (``--json``)."""
    bw = str(link["bandwidth_gb_s"])
    text = _zb("tune", *[x for p in paths for x in ("-l", str(p))], "-r", str(ranks), "--ranks-per-node", str(ranks),
               "-g", str(args.global_batch), "--optimizer", "adamw", "--intra-gbs", bw, "--inter-gbs", bw,
               "--memory-gbs", f"{gbs:.6g}", "-t", str(args.tune_time), "--json", "-o", str(out), cwd=out.parent)
    return json.loads(text)


def _steps(text: str) -> list[float]:
    """The step times (ms) train_gpt.py printed."""
    return [float(line.split()[-2]) for line in text.splitlines() if line.startswith("step ")]


def _work(launch_dir: Path, dp: int) -> float:
    """The CPU work of one step over every process (ms): each rank's passes and optimizer steps
    in the schedule, times the replicas."""
    from zbsearch.formats.schedule import load_schedule
    from zbsearch.prediction import timeline

    sched = load_schedule(launch_dir / "schedule.json")
    steps = sum(c.t_opt or 0.0 for c in sched.profile.stages)
    return dp * (sum(timeline(sched).busy) + steps)


def run_rank_count(args, ranks: int, tmp: Path, paths: list[Path], link: dict, opt: dict) -> dict:
    folder = tmp / f"tuned-{ranks}"
    res = tune(args, ranks, paths, link, opt["memory_gbs"], folder)
    rows = res["rows"]
    win = rows[res["best"]]
    runs = {"tuned": (folder, win)}
    for name in (DEFAULT, "torchtitan interleaved"):
        costed = [r for r in rows if r["source"] == name and r["iteration_ms"]]
        if costed:
            runs[name] = (folder / "baselines" / "-".join(name.lower().split()), min(costed, key=lambda r: r["iteration_ms"]))
    if DEFAULT not in runs:
        raise SystemExit(f"tune costed no {DEFAULT} configuration for {ranks} ranks")
    commands = {}
    for name, (where, row) in runs.items():
        launch = json.loads((where / "launch.json").read_text())
        assert (launch["pp"], launch["dp"], launch["microbatch_size"]) == (row["pp"], row["dp"], row["microbatch_size"])
        commands[name] = launch["commands"][0]
    measured: dict[str, dict[str, list[float]]] = {name: {"real": [], "emulated": []} for name in runs}
    steps: dict[str, dict[str, list[list[float]]]] = {name: {"real": [], "emulated": []} for name in runs}
    loads = []
    order = [(name, mode) for name in runs for mode in ("real", "emulated")]
    for rnd in range(args.rounds):
        turn = order[rnd % len(order):] + order[:rnd % len(order)]
        for name, mode in turn:
            cmd = shlex.split(commands[name]) + ["--steps", str(args.warmup + args.steps)] + (
                ["--emulate"] if mode == "emulated" else [])
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
            if r.returncode:
                raise SystemExit(f"{name} ({mode}) failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
            got = _steps(r.stdout)
            assert len(got) == args.warmup + args.steps, r.stdout[-2000:]
            steps[name][mode].append(got)
            measured[name][mode].append(statistics.median(got[args.warmup:]))
            loads.append(os.getloadavg()[0])
            print(f"{ranks} ranks, round {rnd} {name} {mode}: median step {measured[name][mode][-1]:.1f} ms "
                  f"(load {loads[-1]:.1f})", flush=True)
    cores = os.cpu_count() or 1
    out: dict = {"ranks": ranks, "tune": {k: res[k] for k in ("time_s", "lower_bound_ms", "gap", "optimizer_step")},
                 "commands": commands, "loads": loads, "runs": {}}
    for name, (where, row) in runs.items():
        work = _work(where, row["dp"])
        out["runs"][name] = {
            "pp": row["pp"], "dp": row["dp"], "b": row["microbatch_size"], "m": row["microbatches"],
            "placement": row["placement"], "schedule": row["schedule"], "layers_per_stage": row["layers_per_stage"],
            "predicted_ms": row["iteration_ms"], "work_ms": work, "work_bound_ms": max(row["iteration_ms"], work / cores),
            **{f"{mode}_ms": statistics.median(v) for mode, v in measured[name].items()},
            "rounds": measured[name], "steps": steps[name],
        }
    t = out["runs"]["tuned"]
    for name, r in out["runs"].items():
        if name == "tuned":
            continue
        r["speedup"] = {"predicted": r["predicted_ms"] / t["predicted_ms"], "real": r["real_ms"] / t["real_ms"],
                        "emulated": r["emulated_ms"] / t["emulated_ms"], "work_bound": r["work_bound_ms"] / t["work_bound_ms"],
                        "per_round": {mode: [a / b for a, b in zip(r["rounds"][mode], t["rounds"][mode])]
                                      for mode in ("real", "emulated")}}
        s = r["speedup"]
        print(f"{ranks} ranks, tuned over {name}: predicted {s['predicted']:.3f}x; emulated {s['emulated']:.3f}x "
              f"({s['emulated'] / s['predicted'] - 1:+.1%}); real {s['real']:.3f}x ({s['real'] / s['predicted'] - 1:+.1%}); "
              f"CPU work over {cores} cores predicts {s['work_bound']:.3f}x", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4", help="local processes, comma-separated: one tune and set of runs each")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per iteration")
    ap.add_argument("--tune-time", type=float, default=60.0, help="tune's time limit (s)")
    ap.add_argument("--repeat", type=int, default=10, help="profiler repetitions per pass")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    ap.add_argument("--rounds", type=int, default=4, help="runs of every configuration, real and emulated")
    ap.add_argument("-o", "--output", type=Path, default=RESULTS / "tune_run.json")
    args = ap.parse_args()
    t0 = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        paths, sizes = profile(args, tmp)
        profiled_s = time.monotonic() - t0
        first = json.loads(paths[0].read_text())
        link, model = first["link"], {k: v for k, v in first["model"].items() if k != "identity"}
        opt = optimizer_gbs(model)
        print(f"profiled in {profiled_s:.0f} s; link {link['bandwidth_gb_s']:.3g} GB/s, {link['latency_ms']:.3g} ms; "
              f"AdamW step {opt['step_ms']:.2f} ms for {opt['param_bytes'] / 1e6:.2f} MB: {opt['memory_gbs']:.3g} GB/s",
              flush=True)
        units = [{k: u[k] for k in ("name", "t_f", "t_b", "t_w")} for u in json.loads(paths[-1].read_text())["units"]]
        results = [run_rank_count(args, int(r), tmp, paths, link, opt) for r in args.ranks.split(",")]
    doc = {"model": model,
           "sizes": list(SIZES), "global_batch": args.global_batch, "tune_time_s": args.tune_time,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "repeat": args.repeat,
           "target": TARGET, "default": DEFAULT, "link": link, "optimizer": opt, "units_b4": units, "profiles": sizes,
           "profile_s": profiled_s, "load_before": load_before, "total_s": time.monotonic() - t0, "results": results}
    save(doc, path=args.output)


if __name__ == "__main__":
    main()
