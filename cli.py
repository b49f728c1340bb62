"""zbsearch command line: parse arguments, call the library, print.

Every user error surfaces as a ZbError and is printed as one line with exit status 1 (2 for
usage errors, from typer); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

import zbsearch as zb
from zbsearch.errors import ZbError

app = typer.Typer(
    help="Zero Bubble pipeline-parallel schedules: build, simulate, validate, compare, solve, replay.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)

ProfileOpt = typer.Option(..., "--profile", "-p", help="profile JSON path, or a bundled profile name (e.g. 1.5b-m24)")
MicrobatchOpt = typer.Option(..., "-m", "--microbatches", help="microbatches per iteration")


def _load_schedule(path: Path, profile: Optional[str]) -> zb.Schedule:
    sched = zb.load_schedule(path)
    if profile is not None:
        prof = zb.resolve_profile(profile)
        sched = sched.model_copy(update={"profile": prof})
        sched = zb.Schedule.model_validate(sched.model_dump())  # re-check stage counts against the new profile
    return sched


def _write(model, path: Path) -> None:
    if str(path) == "-":
        sys.stdout.write(model.model_dump_json(indent=1) + "\n")
    else:
        zb.fileio.write_model(model, path)
        err.print(f"wrote {path}")


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _rank_table(sched: zb.Schedule, tl: zb.Timeline) -> Table:
    unit = "M_B" if sched.profile.memory_unit == "activations" else "bytes"
    t = Table(title=f"{sched.kind}: p={sched.num_ranks}, stages={sched.num_stages}, m={sched.num_microbatches}")
    for col in ("rank", "span (ms)", "busy (ms)", "bubble (ms)", f"peak memory ({unit})", "limit"):
        t.add_column(col, justify="right")
    for r in range(tl.num_ranks):
        lim = sched.memory_limit[r] if sched.memory_limit else None
        t.add_row(
            str(r), _fmt(tl.span[r]), _fmt(tl.busy[r]), _fmt(tl.span[r] - tl.busy[r]),
            _fmt(tl.peak_memory[r]), "-" if lim is None else _fmt(lim),
        )
    return t


def _summary(sched: zb.Schedule, pred: zb.Predicted) -> str:
    gap = max(pred.span) / pred.lower_bound - 1 if pred.lower_bound > 0 else 0.0
    return (
        f"bubble rate {pred.bubble_rate:.4f}   span {_fmt(max(pred.span))} ms   makespan {_fmt(pred.makespan)} ms   "
        f"lower bound {_fmt(pred.lower_bound)} ms (gap {gap:.2%})   peak memory {_fmt(max(pred.peak_memory))}"
    )


@app.command()
def schedule(
    kind: str = typer.Argument(..., help=f"one of: {', '.join(zb.CLASSIC_KINDS)}"),
    profile: str = ProfileOpt,
    m: int = MicrobatchOpt,
    chunks: Optional[int] = typer.Option(None, "--chunks", "-v", help="chunks per rank (interleaved-1f1b; zb-v is 2)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write the schedule JSON here ('-' for stdout)"),
):
    """Build a classic schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V) for a profile."""
    sched = zb.build_classic(kind, zb.resolve_profile(profile), m, chunks)
    zb.validate(sched)
    if output is not None:
        _write(sched, output)
    if output is None or str(output) != "-":
        out.print(_summary(sched, sched.predicted), soft_wrap=True)


@app.command()
def simulate(
    schedule_path: Path = typer.Argument(..., metavar="SCHEDULE", help="schedule JSON"),
    profile: Optional[str] = typer.Option(None, "--profile", "-p", help="simulate with this profile instead of the embedded one"),
    as_json: bool = typer.Option(False, "--json", help="print the prediction as JSON"),
):
    """Simulate a schedule: per-rank span, busy time, bubble and peak memory."""
    sched = _load_schedule(schedule_path, profile)
    tl = zb.timeline(sched)
    pred = zb.predict(sched, tl)
    if as_json:
        out.print_json(pred.model_dump_json())
        return
    out.print(_rank_table(sched, tl))
    out.print(_summary(sched, pred), soft_wrap=True)


@app.command()
def validate(
    schedule_path: Path = typer.Argument(..., metavar="SCHEDULE", help="schedule JSON"),
    profile: Optional[str] = typer.Option(None, "--profile", "-p", help="check memory with this profile"),
    mem_limit: Optional[str] = typer.Option(None, "--mem-limit", help="override the schedule's memory limit (1p, 2p, 40GiB, none)"),
):
    """Exit 0 if the schedule is valid, else print the first problem and exit 1."""
    sched = _load_schedule(schedule_path, profile)
    limit = sched.memory_limit
    if mem_limit is not None:
        limit = zb.parse_memory_limit(mem_limit, sched.profile, zb.CostModel.from_profile(sched.profile, sched.stage_to_rank))
    problem = zb.find_problem(sched, memory_limit=limit)
    if problem:
        _fail(f"invalid: {problem}")
    out.print(f"valid: {sched.kind}, {sched.num_ranks} ranks, {sched.num_stages} stages, {sched.num_microbatches} microbatches")


@app.command()
def compare(
    profile: str = ProfileOpt,
    m: int = MicrobatchOpt,
    mem_limit: Optional[str] = typer.Option(None, "--mem-limit", help="mark schedules over this limit (1p, 2p, 40GiB)"),
    chunks: int = typer.Option(2, "--chunks", "-v", help="chunks for interleaved-1f1b"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON"),
):
    """All schedule kinds side by side on one profile."""
    prof = zb.resolve_profile(profile)
    rows = []
    for kind in zb.CLASSIC_KINDS:
        try:
            sched = zb.build_classic(kind, prof, m, chunks if kind == "interleaved-1f1b" else None)
        except ZbError as e:
            rows.append({"kind": kind, "error": str(e)})
            continue
        pred = sched.predicted
        cost = zb.CostModel.from_profile(prof, sched.stage_to_rank)
        limit = zb.parse_memory_limit(mem_limit, prof, cost)
        fits = limit is None or all(pk <= lim * (1 + 1e-9) for pk, lim in zip(pred.peak_memory, limit))
        rows.append({
            "kind": kind, "bubble_rate": pred.bubble_rate, "span": max(pred.span), "makespan": pred.makespan,
            "peak_memory": max(pred.peak_memory), "lower_bound": pred.lower_bound, "fits": fits,
        })
    if as_json:
        out.print_json(json.dumps(rows))
        return
    t = Table(title=f"{prof.name}: p={prof.num_stages}, m={m}" + (f", memory limit {mem_limit}" if mem_limit else ""))
    for col in ("schedule", "bubble rate", "span (ms)", "makespan (ms)", "peak memory", "fits limit"):
        t.add_column(col, justify="right")
    for row in rows:
        if "error" in row:
            t.add_row(row["kind"], f"[dim]{row['error']}[/dim]", "", "", "", "")
        else:
            t.add_row(row["kind"], f"{row['bubble_rate']:.4f}", _fmt(row["span"]), _fmt(row["makespan"]),
                      _fmt(row["peak_memory"]), "yes" if row["fits"] else "[red]no[/red]")
    out.print(t)
    lb = next((r["lower_bound"] for r in rows if "lower_bound" in r), None)
    if lb is not None:
        out.print(f"lower bound on span for any 1-chunk schedule: {_fmt(lb)} ms")


def _fail(message: str, code: int = 1) -> None:
    """One unwrapped line on stderr (rich would wrap it), then exit."""
    sys.stderr.write(message.replace("\n", " ") + "\n")
    raise SystemExit(code)


@app.command()
def show(
    schedule_paths: list[Path] = typer.Argument(..., metavar="SCHEDULE...", help="schedule JSON; several are stacked on one time axis"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write a chart: .png, .svg or .html (self-contained; hover a box for its times)"),
    text: bool = typer.Option(False, "--text", help="print the text chart even when -o is given"),
    width: Optional[int] = typer.Option(None, "--width", min=20, help="text chart width in columns (default: the terminal's)"),
    measured: Optional[Path] = typer.Option(None, "--measured", help="runtime trace JSON to draw under the prediction (one SCHEDULE)"),
    profile: Optional[str] = typer.Option(None, "--profile", "-p", help="predict with this profile instead of the embedded one"),
):
    """Gantt chart of schedules (predicted, or against a measured trace): text, or PNG/SVG/HTML with -o."""
    import os
    import shutil

    from zbsearch import render

    panels = [render.schedule_panel(_load_schedule(p, profile)) for p in schedule_paths]
    title = None
    if measured is not None:
        if len(panels) != 1:
            raise ZbError("--measured compares one schedule with its trace; give exactly one SCHEDULE")
        panels, title = render.with_measured(panels[0], measured)
    if output is not None:
        render.write_chart(panels, output, title)
        err.print(f"wrote {output}")
    if output is None or text:
        cols = width or shutil.get_terminal_size((120, 24)).columns
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        sys.stdout.write(render.render_text(panels, cols, title, colour) + "\n")


def main() -> None:
    try:
        app()
    except ZbError as e:
        _fail(f"error: {e}")
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
