"""``zbsearch demo``: the whole loop on one machine, profile -> solve -> replay -> compare.

p local processes (gloo on CPU, NCCL with one GPU each) form the pipeline. Together they
profile the built-in GPT, one stage per rank (``profiler.profile_distributed``); rank 0 builds
1F1B and solves ZB-2p on that profile; every rank then replays both schedules with the runtime
and rank 0 gathers the traces. This process shows progress, writes the files and prints
predicted against measured iteration time (the longest per-rank span) for both.

On a machine with fewer cores than ranks the real passes wait for a core, and the measured
times hold that contention. ``emulate`` replays with stages that sleep the profiled times
(``runtime.emulation``) instead, so what is measured is the schedules themselves.

With ``dp`` replicas, the p ranks profile and solve as above; then p x dp processes form a mesh
(``distributed.mesh``) and replay each schedule twice, round robin (``mesh_replay``): with the
runtime reducing each stage's gradients across the replicas as the stage finishes, and with the
same reductions after the step. Emulated stages hold the real stages' gradient bytes, so the
reductions are real.
"""

from __future__ import annotations

import functools
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .. import render
from ..classic import build_classic
from ..distributed import run_local
from ..errors import ZbError
from ..formats.profile import Profile, save_profile
from ..formats.schedule import Schedule, save_schedule
from ..formats.trace import Trace, save_trace
from ..models.gpt import GPTConfig, gpt_batch
from ..profiler import Settings, builtin_gpt, profile_distributed
from ..profiler.settings import cpu_cores
from ..runtime import PipelineRuntime, emulated_loss, emulated_stages
from ..solver import solve

__all__ = ["DemoConfig", "DemoRun", "run_demo", "should_emulate", "contention_note", "mesh_replay"]


@dataclass(frozen=True)
class DemoConfig:
    """What ``zbsearch demo`` runs: the model (one stage per rank), microbatches, steps, device,
    the solver's time limit, the profiler's repetitions and where the files go."""

    gpt: GPTConfig = field(default_factory=GPTConfig)
    microbatches: int = 8
    emulate: bool = False
    steps: int = 3  # measured steps per schedule, after one warm-up step
    time_limit: float = 10.0  # seconds for the solver
    device: str = "cpu"
    warmup: int = 2  # profiler repetitions
    repeat: int = 5
    out: Path = Path("zbsearch-demo")
    dp: int = 1  # data-parallel replicas of the pipeline

    @property
    def processes(self) -> int:
        """Local processes of the replay: the pipeline's ranks times the replicas."""
        return self.gpt.stages * self.dp

    def check(self) -> None:
        """Raise a one-line ZbError for a configuration the demo cannot run here."""
        self.gpt.check()
        if self.gpt.stages < 2:
            raise ZbError(f"the demo compares pipeline schedules: --stages {self.gpt.stages} has no pipeline (every "
                          "schedule runs the same passes one after the other); use --stages 2 or more")
        if self.microbatches < 1 or self.steps < 1:
            raise ZbError("the demo needs at least 1 microbatch and 1 step")
        if self.dp < 1:
            raise ZbError(f"--dp must be at least 1, not {self.dp}")
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ZbError(f"CUDA was requested but is not available (torch {torch.__version__} sees no GPU)")
            if torch.cuda.device_count() < self.processes:
                raise ZbError(f"the demo runs one rank per GPU: {self.processes} ranks need {self.processes} GPUs, "
                              f"{torch.cuda.device_count()} visible")
        elif self.device != "cpu":
            raise ZbError(f"device {self.device!r} is not supported; use cpu or cuda")


@dataclass
class DemoRun:
    """What the demo produced: the profile, the schedules with their traces and measured
    iteration times (in the same order), and the files written."""

    profile: Profile
    schedules: list[Schedule]
    traces: list[Trace]
    measured: list[float]  # ms, median over steps of the longest per-rank span (dp > 1: barrier to barrier, reductions in)
    files: list[Path]
    measured_after: list[float] | None = None  # dp > 1: ms, the same with the reductions after the step
    reduction_ms: list[float] | None = None  # dp > 1: the most any rank's reductions take alone

    @property
    def predicted(self) -> list[float]:
        """Per schedule, the predicted iteration time (ms): its longest per-rank span."""
        spans = []
        for s in self.schedules:
            assert s.predicted is not None  # built or solved schedules carry their prediction
            spans.append(max(s.predicted.span))
        return spans

    @property
    def names(self) -> list[str]:
        """Per schedule, its name in the files and tables: its kind, and ``KIND-solved`` for a
        solved schedule of the first one's kind (where a zero-bubble split does not pay)."""
        first = self.schedules[0].kind
        return [s.kind if k == 0 or s.kind != first else f"{s.kind}-solved" for k, s in enumerate(self.schedules)]

    @property
    def measured_peak_memory(self) -> list[float]:
        """Bytes: the most activations any rank held in the last measured step."""
        return [max(e.args.activations or 0.0 for e in t.traceEvents) for t in self.traces]


def _rank(rank: int, world: int, send, cfg: DemoConfig, replay: bool = True) -> dict | None:
    """One pipeline rank: profile its stage, get the schedules from rank 0, replay them
    (``replay``; else rank 0 returns the profile and the schedules)."""

    def report(description: str, done: int, total: int) -> None:
        send((f"profiling: {description}", done, total))

    spec = builtin_gpt(cfg.gpt)
    settings = Settings(device=cfg.device, warmup=cfg.warmup, repeat=cfg.repeat)
    profile = profile_distributed(spec, settings, name=f"demo-{spec.name}", progress=report)
    box: list[list[str] | None] = [None]
    if rank == 0:
        assert profile is not None  # profile_distributed returns it on rank 0
        send(("solving ZB-2p", 0, None))
        zb_2p = solve(profile, cfg.microbatches, "2p", time_limit=cfg.time_limit).schedule
        box = [[s.model_dump_json() for s in (build_classic("1f1b", profile, cfg.microbatches), zb_2p)]]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None  # filled by rank 0's broadcast
    if not replay:
        return None if rank else {"profile": profile.model_dump_json(), "schedules": box[0]}  # type: ignore[union-attr]
    schedules = [Schedule.model_validate_json(text) for text in box[0]]
    last = rank == world - 1
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device.startswith("cuda") else torch.device("cpu")
    ids, targets = gpt_batch(cfg.gpt, cfg.microbatches, seed=2)
    spans, traces = [], []
    for sched in schedules:
        if cfg.emulate:
            stage = emulated_stages(sched.profile, sched.stage_to_rank, bytes_per_unit=1.0)[rank].to(device)
            rows = cfg.microbatches * cfg.gpt.microbatch_size  # the profiled microbatch size, which the runtime checks
            loss, x, y = emulated_loss, torch.zeros(rows, 16), torch.zeros(rows, 16)
        else:
            stage, loss, x, y = spec.stages[rank], spec.loss_fn, ids, targets
        runtime = PipelineRuntime(sched, {rank: stage}, loss if last else None, device=device)
        step_spans, trace = [], None
        for step in range(1 + cfg.steps):
            if rank == 0:
                send((f"replaying {sched.kind}" + (" (emulated)" if cfg.emulate else ""), step, 1 + cfg.steps))
            stage.zero_grad()
            runtime.step(x if rank == 0 else None, y if last else None)
            trace = runtime.trace()
            if rank == 0 and step > 0:
                step_spans.append(max(trace.span_ms()))
        if rank == 0:
            assert trace is not None  # the loop above ran at least once
            spans.append(statistics.median(step_spans))
            traces.append(trace.model_dump_json())
    if rank != 0:
        return None
    assert profile is not None  # rank 0 has the profile
    return {"profile": profile.model_dump_json(), "schedules": box[0], "traces": traces, "measured": spans}


def run_demo(cfg: DemoConfig, on_progress=None) -> DemoRun:
    """Run the demo; ``on_progress(description, done, total)`` follows it. Writes into ``cfg.out``."""
    cfg.check()
    out = cfg.out  # created only once there is something to write: an interrupted demo leaves nothing

    def message(rank: int, msg: object) -> None:
        assert isinstance(msg, tuple)  # _rank sends (description, done, total)
        if on_progress is not None:
            on_progress(*msg)

    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    result = run_local(_rank, cfg.gpt.stages, cfg, cfg.dp == 1, backend=backend, on_message=message)[0]
    if cfg.dp > 1:
        result.update(run_local(_mesh_rank, cfg.processes, cfg, result["schedules"], backend=backend, on_message=message)[0])
    if on_progress is not None:
        on_progress("writing files", 0, None)
    out.mkdir(parents=True, exist_ok=True)
    run = DemoRun(
        profile=Profile.model_validate_json(result["profile"]),
        schedules=[Schedule.model_validate_json(s) for s in result["schedules"]],
        traces=[Trace.model_validate_json(t) for t in result["traces"]],
        measured=result["measured"],
        files=[],
        measured_after=result.get("measured_after"),
        reduction_ms=result.get("reduction_ms"),
    )
    save_profile(run.profile, out / "profile.json")
    run.files.append(out / "profile.json")
    panels = []
    for name, sched, trace in zip(run.names, run.schedules, run.traces):
        save_schedule(sched, out / f"{name}.json")
        save_trace(trace, out / f"{name}-trace.json")
        run.files += [out / f"{name}.json", out / f"{name}-trace.json"]
        panels += render.with_measured(render.schedule_panel(sched), out / f"{name}-trace.json")[0]
    mesh = f" x dp={cfg.dp}" if cfg.dp > 1 else ""
    title = (f"predicted and measured, p={cfg.gpt.stages}{mesh} m={cfg.microbatches}{' (emulated)' if cfg.emulate else ''}: "
             f"{run.names[1]} is {run.measured[0] / run.measured[1]:.2f}x as fast as 1F1B")
    run.files.append(render.write_chart(panels, out / "gantt.png", title))
    return run


def _mesh_rank(rank: int, world: int, send, cfg: DemoConfig, texts: list[str]) -> dict | None:
    """One rank of the p x dp mesh: each schedule replayed with the reductions overlapped and
    after the step (``mesh_replay``); rank 0 returns what was measured, with one trace each."""
    from ..distributed.mesh import build_mesh

    mesh = build_mesh(pp=cfg.gpt.stages, dp_replicate=cfg.dp)
    me, replica = mesh["pp"].get_local_rank(), mesh["dp_replicate"].get_local_rank()
    spec = builtin_gpt(cfg.gpt)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device.startswith("cuda") else torch.device("cpu")
    ids, targets = gpt_batch(cfg.gpt, cfg.microbatches * cfg.dp, seed=2)
    rows = cfg.microbatches * cfg.gpt.microbatch_size  # one replica's share of the global batch
    share = slice(replica * rows, (replica + 1) * rows)
    schedules = [Schedule.model_validate_json(t) for t in texts]

    def stages_for(sched: Schedule) -> dict[int, torch.nn.Module]:
        if not cfg.emulate:
            return {me: spec.stages[me].to(device)}
        grad_bytes = sum(p.numel() * p.element_size() for p in spec.stages[me].parameters() if p.requires_grad)
        return {me: emulated_stages(sched.profile, sched.stage_to_rank, bytes_per_unit=1.0, grad_bytes=grad_bytes)[me].to(device)}

    def batch(sched: Schedule):
        if cfg.emulate:
            rows = cfg.microbatches * cfg.gpt.microbatch_size
            return torch.zeros(rows, 16), torch.zeros(rows, 16), emulated_loss
        return ids[share], targets[share], spec.loss_fn

    def progress(kind: str, done: int, total: int) -> None:
        if rank == 0:
            send((f"replaying {kind} in the mesh" + (" (emulated)" if cfg.emulate else ""), done, total))

    got = mesh_replay(mesh, schedules, stages_for, batch, cfg.steps, device=device, progress=progress)
    if rank != 0:
        return None
    return {"measured": [got[s.kind]["overlapped_ms"] for s in schedules],
            "measured_after": [got[s.kind]["after_ms"] for s in schedules],
            "reduction_ms": [got[s.kind]["reduction_ms"] for s in schedules],
            "traces": [got[s.kind]["trace"] for s in schedules]}


def mesh_replay(mesh, schedules: list[Schedule], stages_for, batch, steps: int, *, warmup: int = 1,
                device: torch.device | None = None, progress=None) -> dict[str, dict]:
    """Collective over ``mesh`` (dimensions ``pp`` and ``dp_replicate``): each schedule replayed
    ``warmup + steps`` times three ways, round robin, barrier to barrier: the runtime reducing the
    gradients across the replicas as stages finish (``overlapped``), the same reductions started
    after ``step()`` (``after``), and no reduction at all (``none``: the passes alone); then each
    stage's reduction alone, every rank at once.

    ``stages_for(schedule)``: this rank's stages; ``batch(schedule)``: this replica's inputs,
    targets and loss function. Returns per schedule kind the medians in ms, the largest time
    any rank's reductions take alone, and (on the mesh's rank 0) the overlapped runtime's last
    trace as JSON; ``reduction_stage_ms``: this rank's stages' reductions alone;
    ``overlapped_reductions_ms``: per measured overlapped round, this rank's reductions (stage,
    start, end) in ms from its leaving the round's barrier (the replicas' compared, a
    collective's wait for the later replica shows).
    """
    import time

    from ..runtime.data_parallel import GradientReducer

    me = mesh["pp"].get_local_rank()
    dp_group = mesh["dp_replicate"].get_group()
    runners, runtimes = {}, {}
    for sched in schedules:
        mine = stages_for(sched)
        x, y, loss = batch(sched)
        last = sched.num_stages - 1
        over = PipelineRuntime(sched, mine, loss if last in mine else None, mesh=mesh, device=device)
        plain = PipelineRuntime(sched, mine, loss if last in mine else None, group=mesh["pp"].get_group(), device=device)
        order = list(dict.fromkeys(a.stage for a in reversed(sched.rank_actions[me]) if a.op.name in ("W", "BW")))[::-1]
        reducer = GradientReducer(mine, order, dp_group, over.timeout)

        def run(rt, after, mine=mine, x=x, y=y, last=last, reducer=reducer, order=order):
            for st in mine.values():
                st.zero_grad(set_to_none=True)
            rt.step(x if 0 in mine else None, y if last in mine else None)
            if after:
                for s in order:
                    reducer.start(s)
                reducer.finish()

        modes = {"overlapped": functools.partial(run, over, False), "after": functools.partial(run, plain, True),
                 "none": functools.partial(run, plain, False)}
        runners[sched.kind] = (modes, reducer, order)
        runtimes[sched.kind] = over
    walls: dict[str, dict[str, list[float]]] = {k: {mode: [] for mode in runners[k][0]} for k in runners}
    lanes: dict[str, list[list[tuple[int, float, float]]]] = {k: [] for k in runners}
    for i in range(warmup + steps):
        for k, (modes, _, _) in runners.items():
            if progress is not None:
                progress(k, i, warmup + steps)
            for mode, fn in modes.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                if i >= warmup:
                    walls[k][mode].append((time.perf_counter() - t0) * 1e3)
                    if mode == "overlapped":
                        lanes[k].append([(s, (b - t0) * 1e3, (e - t0) * 1e3) for s, b, e in runtimes[k].reductions])
    out = {}
    for k, (_, reducer, order) in runners.items():
        took: dict[int, list[float]] = {st: [] for st in order}
        for _ in range(max(steps, 3)):  # each stage's reduction, every rank at once, nothing else running
            for st in order:
                dist.barrier()
                t0 = time.perf_counter()
                reducer.start(st)
                reducer.finish()
                took[st].append((time.perf_counter() - t0) * 1e3)
        per_stage = {st: statistics.median(v) for st, v in took.items()}
        worst = torch.tensor([sum(per_stage.values())], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        trace = runtimes[k].trace()
        out[k] = {"overlapped_ms": statistics.median(walls[k]["overlapped"]), "after_ms": statistics.median(walls[k]["after"]),
                  "none_ms": statistics.median(walls[k]["none"]),
                  "overlapped_runs_ms": walls[k]["overlapped"], "after_runs_ms": walls[k]["after"],
                  "none_runs_ms": walls[k]["none"],
                  "reduction_ms": float(worst.item()), "reduction_stage_ms": per_stage, "overlapped_reductions_ms": lanes[k],
                  "trace": trace.model_dump_json() if trace is not None else None}
    return out


def should_emulate(stages: int, device: str) -> bool:
    """Default for ``--emulate``: on a CPU with fewer cores than ranks, real passes would mostly
    measure waiting for a core, not the schedule."""
    return device == "cpu" and cpu_cores() < stages


def contention_note(cfg: DemoConfig) -> str:
    """One line: whether the replay ran real or emulated passes, and why; and when measured times
    will include waiting for a core."""
    cores, p = cpu_cores(), cfg.processes
    crowded = cfg.device == "cpu" and cores < p
    if cfg.emulate:
        why = (f"{p} ranks share {cores} CPU cores (--real runs the real passes, which then also wait for a core)"
               if crowded else "as asked (--emulate)")
        return f"replay: emulated passes (each stage sleeps its profiled F, B, W and BW times): {why}"
    if crowded:
        return (f"replay: real passes, as asked (--real); {p} ranks share {cores} CPU cores, so measured times "
                f"include waiting for a core; --emulate replays the profiled times without that contention")
    where = f"{cores} CPU cores for {p} ranks" if cfg.device == "cpu" else f"device {cfg.device}"
    load = os.getloadavg()[0] if cfg.device == "cpu" else 0.0
    busy = (
        f"; the machine is busy (load average {load:.1f}), so measured times include waiting for a core" if load > cores else ""
    )
    return f"replay: real passes ({where}){busy}"
