"""zbsearch command line: parse arguments, call the library, print.

Every user error surfaces as a ZbError and is printed as one line with exit status 1; usage
errors (an unknown option, a missing or malformed value) are one line with exit status 2, in
place of typer's multi-line box (``main``); Ctrl-C prints "interrupted" and exits 130. Anything
else is a bug and keeps its traceback. Only typer's public API is used, so the same code runs
on typer releases that use click and on those that carry their own copy of it.

One rule for inputs, in ``_load_schedule``: a schedule that does not validate is refused unless
``--force``; a profile given with ``--profile`` must fit the schedule's stages
(``formats.schedule.profile_misfit``) and its memory limit is recomputed in that profile's
units (``limits.limit_for_profile``). Outputs are checked before the work (``_output``), so a
bad ``-o`` never throws a finished result away, and the path printed is the one written.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

import zbsearch as zb
from zbsearch.distributed.timeouts import PEER_TIMEOUT_S
from zbsearch.errors import ZbError
from zbsearch.formats.fileio import check_writable, parse_model, write_model, write_text
from zbsearch.formats.profile import MAX_TIME_MS, profile_misfit
from zbsearch.formats.trace import load_trace
from zbsearch.idle_time import RankIdleTime, measure_idle_time
from zbsearch.limits import limit_for_profile
from zbsearch.pass_times import PassTimes, compare_pass_times
from zbsearch.reduction_times import (
    GatherTimes,
    LaneEnd,
    ReductionTimes,
    compare_gathers,
    compare_lane_ends,
    compare_reductions,
)
from zbsearch.tolerances import EPS_MS

if TYPE_CHECKING:
    from zbsearch.formats.layers import LayerProfile
    from zbsearch.solver import Objective, Recomputation

app = typer.Typer(
    help="Zero Bubble pipeline-parallel schedules: build, simulate, validate, compare, solve, replay.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)
# a figure this close to zero is rounding noise of a difference (a span less its busy time)
EPS_PRINT = EPS_MS
# cells up to this wide (numbers, kind names) keep their width; longer text may wrap
_SHORT_CELL = 16

ProfileOpt = typer.Option(..., "--profile", "-p", help="profile JSON path, or a bundled profile name (e.g. 1.5b-m24)")
MicrobatchOpt = typer.Option(..., "-m", "--microbatches", help="microbatches per iteration")
OtherProfileOpt = typer.Option(None, "--profile", "-p", help="use this profile instead of the embedded one (same stages)")
ForceOpt = typer.Option(False, "--force", help="go on with a schedule that does not validate")
LimitOpt = typer.Option(None, "--mem-limit", help="memory limit instead of the schedule's (1p, 2p, 40GiB, capacity, none)")
ChunksOpt = typer.Option(
    None, "--chunks", min=1,
    help="interleaved-1f1b's chunks per rank (default: the profile's pieces per rank, else 2)",
)
PlacementOpt = typer.Option("one", "--placement", help="one stage per rank, or v: two per rank in a V (the ZB-V family)")
# the spellings of an earlier release: -v for --chunks; --chunks 1|2 for --placement one|v in solve and frontier
OldChunksOpt = typer.Option(None, "-v", hidden=True)
OldPlacementOpt = typer.Option(None, "--chunks", "-v", hidden=True)
DpOpt = typer.Option(
    None, "--dp", min=1,
    help="data-parallel replicas of the pipeline: the iteration ends once each stage's gradients are reduced across "
         "them (with --dp-bandwidth and --grad-bytes)",
)
DpBandwidthOpt = typer.Option(None, "--dp-bandwidth", help="GB/s per rank on the data-parallel links (ring all-reduce)")
ActionOpt = typer.Option(
    None, "--action-ms",
    help="the runtime's own host time per action (ms), added to every pass: a number, or a stage profile measured "
         "under torchrun on this machine whose t_action to take (default: the per-layer profile's, absent 0)")
ShardOpt = typer.Option(
    False, "--shard",
    help="the --dp ranks shard the stages (fully_shard): each stage reduce-scatters its gradients and gathers its "
         "parameters (as many bytes) at the step's start, before its first pass",
)
DpShareOpt = typer.Option(
    None, "--dp-share",
    help="with --dp-bandwidth, how the reductions (and gathers) of pipeline ranks on one link slow each other: k at once "
         "each move at 1 / (1 + S (k - 1)) of their speed alone (0: not at all, the default; 1: they split the link "
         "evenly)",
)
RanksPerLinkOpt = typer.Option(
    None, "--ranks-per-link", min=1,
    help="with --dp-share, the consecutive pipeline ranks that share one link, a node's (default: every rank)",
)
GradBytesOpt = typer.Option(
    None, "--grad-bytes",
    help="gradient bytes to reduce: the model's total (3GB, split evenly over the stages) or one per stage, "
         "comma-separated",
)
RecomputeOpt = typer.Option(
    "none", "--recompute",
    help="none; auto: the solver checkpoints and recomputes microbatches where that pays under the limit, fully (R) "
         "or selectively (RS) as the profile offers; full: every one, by full recomputation (R)",
)


def _load_schedule(path: Path, profile: str | None, mem_limit: str | None = None, force: bool = False) -> zb.Schedule:
    """The schedule, with another profile and limit if given; refused unless valid or ``force``."""
    sched = zb.load_schedule(path)
    update: dict = {}
    if profile is not None:
        prof = zb.resolve_profile(profile)
        misfit = profile_misfit(prof.num_stages, sched.num_stages, sched.num_ranks)
        if misfit:
            raise ZbError(f"--profile {profile}: {misfit}")
        update["profile"] = prof
        if mem_limit is None:
            update["memory_limit"] = limit_for_profile(
                sched.memory_limit, sched.memory_limit_spec, sched.profile, prof, sched.stage_to_rank)
    if mem_limit is not None:
        prof = update.get("profile", sched.profile)
        update["memory_limit"] = zb.parse_memory_limit(mem_limit, prof, zb.CostModel.from_profile(prof, sched.stage_to_rank))
        update["memory_limit_spec"] = mem_limit.strip()
    if update:  # through validation again: model_copy would not check the new fields
        data = sched.model_dump()
        data.update({k: v.model_dump() if k == "profile" else v for k, v in update.items()})
        sched = parse_model(zb.Schedule, data, str(path))
    if not force:
        problem = zb.find_problem(sched)
        if problem:
            raise ZbError(f"{path}: invalid schedule: {problem} (--force to use it anyway)")
    return sched


def _renamed_chunks(chunks: int | None, old: int | None) -> int | None:
    """``--chunks``, or the earlier ``-v`` with a note on stderr."""
    if old is None:
        return chunks
    if chunks is not None:
        raise ZbError("give --chunks once (-v is its earlier spelling)")
    err.print(f"note: -v is now --chunks (--chunks {old})", highlight=False, soft_wrap=True)
    return old


def _solver_chunks(placement: str, old: int | None) -> int:
    """Chunks per rank for the solver from ``--placement`` (one or v), or from the earlier
    ``--chunks 1|2`` (or ``-v``) with a note on stderr."""
    if placement not in ("one", "v"):
        raise ZbError(f"--placement {placement!r}: use one (one stage per rank) or v (two per rank in a V)")
    if old is None:
        return 2 if placement == "v" else 1
    if old not in (1, 2):
        raise ZbError(f"--chunks {old}: the solver places one stage per rank or two in a V (--placement one|v)")
    err.print(f"note: --chunks/-v {old} is now --placement {'v' if old == 2 else 'one'}", highlight=False, soft_wrap=True)
    return old


def _output(text: str | None, suffixes: tuple[str, ...] = (), what: str = "output") -> Path | None:
    """An output path, checked before the work: '-' (stdout) as it is, else it must be writable
    (and, given ``suffixes``, name one of those formats). Taken as text: typer would read '' as '.'."""
    if text is None:
        return None
    if text == "":
        raise ZbError("-o: the output path is empty ('-' writes to stdout)")
    path = Path(text)
    if text == "-":
        return path
    if suffixes and path.suffix.lower() not in suffixes:
        raise ZbError(
            f"{path}: cannot tell the {what} format from {path.suffix or 'no suffix'!r}; use one of {', '.join(suffixes)}"
        )
    check_writable(path)
    return path


def _write(model, path: Path) -> None:
    if str(path) == "-":
        sys.stdout.write(model.model_dump_json(indent=1) + "\n")
    else:
        err.print(f"wrote {write_model(model, path)}", highlight=False, soft_wrap=True)


def _fmt(x: float) -> str:
    """A time or memory figure: 6 significant digits; rounding noise around zero shows as 0."""
    return "0" if abs(x) < EPS_PRINT else f"{x:.6g}"


def _show(table: Table) -> None:
    """Print a table whose short cells (numbers, names) are never cut: such a column gets a fixed
    width, its widest cell or its header (its header's longest word where whole headers do not
    fit the terminal, the header then wraps). Where even that is wider than the terminal, lines
    run over rather than lose digits."""
    cells = [[Text.from_markup(c).cell_len if isinstance(c, str) else _SHORT_CELL + 1 for c in col._cells]
             for col in table.columns]
    short = [all(w <= _SHORT_CELL for w in ws) for ws in cells]
    headers = [str(col.header) for col in table.columns]
    for whole in (True, False):
        widths = [max([*ws, len(h) if whole else max(map(len, h.split() or [""]))]) for ws, h in zip(cells, headers)]
        if sum(widths) + 3 * len(widths) + 1 <= out.width:
            break
    for col, ok, width in zip(table.columns, short, widths):
        if ok:
            col.width = width
    fixed = [col.width for col in table.columns if col.width is not None]
    need = sum(fixed) + 3 * len(table.columns) + 1  # cell padding and borders
    title = str(table.title or "")
    if len(title) > min(out.measure(table).maximum, out.width):  # on a line of its own rather than wrapped
        table.title = None
        out.print(title, highlight=False, soft_wrap=True)
    if len(fixed) < len(table.columns) or need <= out.width:
        out.print(table)
    else:  # a console as wide as the table: rich would otherwise cut cells to the terminal's width
        Console(file=out.file, width=need, force_terminal=out.is_terminal, no_color=out.no_color).print(table)


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
    text = (
        f"bubble rate {pred.bubble_rate:.4f}   span {_fmt(max(pred.span))} ms   makespan {_fmt(pred.makespan)} ms   "
        f"bound (any memory) {_fmt(pred.lower_bound)} ms (gap {gap:.2%})   peak memory {_fmt(max(pred.peak_memory))}"
    )
    if pred.iteration is not None:
        text += f"\niteration {_fmt(max(pred.iteration))} ms: {_iteration_words(sched.profile)}"
    return text


def _iteration_words(prof: zb.Profile) -> str:
    """What the iteration counts beyond the span, in words."""
    dp = prof.data_parallel
    across = f" across {dp.replicas} replicas" if dp is not None else ""
    gathers = "from each rank's step start: the parameter gathers its first passes wait for, " if any(
        st.t_gather for st in prof.stages) else ""
    return f"{gathers}the span, then the gradient reductions{across} and optimizer steps the passes do not hide"


def _replicas(dp: int | None, bandwidth: float | None) -> tuple[int, float] | None:
    """``--dp`` with ``--dp-bandwidth``, for commands that take the gradient bytes from the model."""
    if (dp is None) != (bandwidth is None):
        raise ZbError("--dp and --dp-bandwidth go together: the replicas and GB/s per rank")
    return None if dp is None or bandwidth is None else (dp, bandwidth)


def _action_ms(text: str | None) -> float | None:
    """``--action-ms``: a time in ms, or the ``t_action`` of the stage profile at that path (None: not given)."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None:
        if not 0 <= value <= MAX_TIME_MS:  # nan, inf and negatives too
            raise ZbError(f"--action-ms {text}: give a time in ms (0 or more) or a stage profile that records t_action")
        return value
    if not Path(text).exists():
        raise ZbError(f"--action-ms {text}: neither a time in ms nor a stage profile file")
    found = zb.load_profile(text).t_action
    if found is None:
        raise ZbError(f"--action-ms {text}: the profile records no t_action (zbsearch profile measures it under "
                      "torchrun, in its in-step steps)")
    return found


def _with_action(layers: LayerProfile, text: str | None) -> LayerProfile:
    """The per-layer profile with ``--action-ms``'s host time per action, where given."""
    ms = _action_ms(text)
    return layers if ms is None else layers.model_copy(update={"t_action": ms})


def _print_action(layers: LayerProfile) -> None:
    """Say what the runtime's host time per action priced, where it priced any."""
    if layers.t_action:
        out.print(f"every pass priced with the runtime's host time per action, {layers.t_action:.3g} ms", soft_wrap=True,
                  highlight=False)


def _sharing(share: float | None, per_link: int | None, priced: bool):
    """``--dp-share`` and ``--ranks-per-link`` as the profile's ``LaneSharing`` (None where not
    given), for reductions priced from ``--dp-bandwidth`` (``priced``)."""
    if share is None:
        if per_link is not None:
            raise ZbError("--ranks-per-link says which ranks share a link: give --dp-share too")
        return None
    if not priced:
        raise ZbError("--dp-share says how the reductions priced from --dp-bandwidth share a link: give --dp N and "
                      "--dp-bandwidth too")
    from zbsearch.reductions import given_sharing

    return given_sharing(share, per_link, names=("--dp-share", "--ranks-per-link"))


def _with_dp(prof: zb.Profile, dp: int | None, bandwidth: float | None, grad_bytes: str | None,
             shard: bool = False, share: float | None = None, per_link: int | None = None) -> zb.Profile:
    """The profile with each stage's reduction across ``dp`` replicas, where the options ask for it
    (``shard``: the stages sharded over them, so each also gathers its parameters at the step's
    start; ``share``, ``per_link``: how the lanes of ranks on one link slow each other)."""
    if dp is None and bandwidth is None and grad_bytes is None:
        if shard:
            raise ZbError("--shard needs --dp, --dp-bandwidth and --grad-bytes: the ranks the stages are sharded over")
        _sharing(share, per_link, priced=False)
        return prof
    if dp is None or bandwidth is None or grad_bytes is None:
        raise ZbError("--dp, --dp-bandwidth and --grad-bytes go together: the replicas, GB/s per rank, and the "
                      "gradient bytes to reduce")
    from zbsearch.reductions import grad_bytes_per_stage, with_reductions

    sharing = _sharing(share, per_link, priced=True)
    return with_reductions(prof, dp, bandwidth, grad_bytes_per_stage(grad_bytes, prof.num_stages), sharded=shard,
                           sharing=sharing)


@app.command()
def schedule(
    kind: str = typer.Argument(..., help=f"one of: {', '.join(zb.CLASSIC_KINDS)}"),
    profile: str = ProfileOpt,
    m: int = MicrobatchOpt,
    chunks: int | None = ChunksOpt,
    output: str | None = typer.Option(None, "-o", "--output", help="write the schedule JSON here ('-' for stdout)"),
    dp: int | None = DpOpt,
    dp_bandwidth: float | None = DpBandwidthOpt,
    grad_bytes: str | None = GradBytesOpt,
    shard: bool = ShardOpt,
    dp_share: float | None = DpShareOpt,
    ranks_per_link: int | None = RanksPerLinkOpt,
    old_chunks: int | None = OldChunksOpt,
):
    """Build a classic schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V) for a profile."""
    chunks = _renamed_chunks(chunks, old_chunks)
    path = _output(output)
    prof = _with_dp(zb.resolve_profile(profile), dp, dp_bandwidth, grad_bytes, shard, dp_share, ranks_per_link)
    sched = zb.build_classic(kind, prof, m, chunks)
    zb.validate(sched)
    if path is not None:
        _write(sched, path)
    if path is None or str(path) != "-":
        assert sched.predicted is not None  # build_classic predicts
        out.print(_summary(sched, sched.predicted), soft_wrap=True)


@app.command()
def simulate(
    schedule_path: Path = typer.Argument(..., metavar="SCHEDULE", help="schedule JSON"),
    profile: str | None = OtherProfileOpt,
    mem_limit: str | None = LimitOpt,
    as_json: bool = typer.Option(False, "--json", help="print the prediction as JSON"),
    measured: list[Path] | None = typer.Option(
        None, "--measured",
        help="runtime trace JSON of this schedule (repeatable): per rank and pass type, measured vs predicted, "
             "where idle time went, and in a mesh the gathers, reductions and where each rank's step ends",
    ),
    force: bool = ForceOpt,
    dp: int | None = DpOpt,
    dp_bandwidth: float | None = DpBandwidthOpt,
    grad_bytes: str | None = GradBytesOpt,
    shard: bool = ShardOpt,
    dp_share: float | None = DpShareOpt,
    ranks_per_link: int | None = RanksPerLinkOpt,
):
    """Simulate a schedule: per-rank span, busy time, bubble and peak memory (and the iteration,
    where the profile or --dp ends it with gradient reductions)."""
    sched = _load_schedule(schedule_path, profile, mem_limit, force)
    if dp is not None or dp_bandwidth is not None or grad_bytes is not None or dp_share is not None \
            or ranks_per_link is not None:
        sched = sched.model_copy(update={"profile": _with_dp(sched.profile, dp, dp_bandwidth, grad_bytes, shard, dp_share,
                                                             ranks_per_link)})
    tl = zb.timeline(sched)
    pred = zb.predict(sched, tl)
    traces = [load_trace(t) for t in measured] if measured else []
    passes = compare_pass_times(sched, traces) if traces else None
    waits = measure_idle_time(sched, traces) if traces else None
    lane = _measured_lane(sched, traces) if traces else None
    if as_json:
        if passes is None or lane is None:
            out.print_json(pred.model_dump_json())
        else:
            rows = [{"rank": x.rank, "op": x.kind, "count": x.count, "measured_ms": x.measured_ms,
                     "predicted_ms": x.predicted_ms, "ratio": x.ratio} for x in passes]
            out.print_json(json.dumps({"predicted": pred.model_dump(), "passes": rows, "waits": [vars(w) for w in waits or []],
                                       **{k: [vars(x) for x in v] if isinstance(v, list) else v for k, v in lane.items()}}))
        return
    _show(_rank_table(sched, tl))
    out.print(_summary(sched, pred), soft_wrap=True)
    if passes is not None and waits is not None and lane is not None:
        _show(_pass_table(passes, len(traces)))
        _show(_wait_table(waits, len(traces)))
        sharded = bool(lane["gathers"]) or (sched.profile.data_parallel is not None and sched.profile.data_parallel.sharded)
        if lane["gathers"]:
            _show(_gather_table(lane["gathers"], len(traces)))
        if lane["reductions"]:
            _show(_reduction_table(lane["reductions"], len(traces), sharded))
        if lane["lane_ends"]:
            _show(_lane_end_table(lane["lane_ends"], len(traces)))
        if lane["note"]:
            out.print(lane["note"], soft_wrap=True)


def _measured_lane(sched: zb.Schedule, traces: list) -> dict:
    """The data-parallel lane of ``traces`` against the prediction: reductions, gathers, where
    each rank's step ends (where a trace or the profile has a lane), and a one-line note where
    the profile predicts gathers that no trace recorded (None otherwise)."""
    reductions = compare_reductions(sched, traces)
    gathers = compare_gathers(sched, traces)
    predicts = any(st.t_gather for st in sched.profile.stages)
    note = None
    if predicts and not gathers:
        note = (f"the measured trace{'s' if len(traces) > 1 else ''} record no parameter gathers (stages not sharded, or "
                "written by an older zbsearch): the predicted gathers are not compared")
    has_lane = reductions or gathers or sched.profile.has_reductions or predicts
    return {"reductions": reductions, "gathers": gathers,
            "lane_ends": compare_lane_ends(sched, traces) if has_lane else [], "note": note}


def _gather_table(rows: list[GatherTimes], steps: int) -> Table:
    return _table(f"parameter gathers of sharded stages, mean over {steps} measured step(s): from the step's start "
                  "until complete, and from then to the stage's first pass",
                  ("rank", "stage", "MiB", "measured (ms)", "predicted (ms)", "first pass after (ms)", "predicted after (ms)"),
                  [(str(x.rank), str(x.stage), f"{x.bytes / 2**20:.4g}", _fmt(x.measured_ms), _fmt_or_dash(x.predicted_ms),
                    _fmt(x.measured_slack_ms), _fmt_or_dash(x.predicted_slack_ms)) for x in rows])


def _lane_end_table(rows: list[LaneEnd], steps: int) -> Table:
    return _table(f"where each rank's step ends, mean over {steps} measured step(s): from the step's start (the first "
                  "gather on the first pass's rank, else that pass) to its last pass or reduction, optimizer steps left out",
                  ("rank", "measured (ms)", "predicted (ms)", "measured / predicted"),
                  [("step" if x.rank is None else str(x.rank), _fmt(x.measured_ms), _fmt(x.predicted_ms),
                    f"{x.measured_ms / x.predicted_ms:.3f}" if x.predicted_ms > 0 else "-") for x in rows])


def _reduction_table(rows: list[ReductionTimes], steps: int, sharded: bool = False) -> Table:
    what = "reduce-scatters of sharded stages" if sharded else "reductions"
    return _table(f"data-parallel {what}, mean over {steps} measured step(s)",
                  ("rank", "stage", "measured (ms)", "predicted (ms)", "started after last W (ms)", "predicted after (ms)"),
                  [(str(x.rank), str(x.stage), _fmt(x.measured_ms), _fmt_or_dash(x.predicted_ms), _fmt(x.measured_delay_ms),
                    _fmt_or_dash(x.predicted_delay_ms)) for x in rows])


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A table of right-aligned columns."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="right")
    for row in rows:
        t.add_row(*row)
    return t


def _fmt_or_dash(x: float | None) -> str:
    return "-" if x is None else _fmt(x)


def _pass_table(passes: list[PassTimes], steps: int) -> Table:
    t = Table(title=f"pass times, mean over {steps} measured step(s)")
    for col in ("rank", "pass", "count", "measured (ms)", "predicted (ms)", "measured / predicted"):
        t.add_column(col, justify="right")
    for x in passes:
        t.add_row(str(x.rank), x.kind, str(x.count), _fmt(x.measured_ms), _fmt(x.predicted_ms), f"{x.ratio:.3f}")
    return t


def _wait_table(waits: list[RankIdleTime], steps: int) -> Table:
    t = Table(title=f"idle time per step, mean over {steps} measured step(s): dependency = the model's own waits on the "
                    "measured passes; link = beyond the modelled link time; local = between passes with no message")
    for col in ("rank", "idle (ms)", "dependency (ms)", "link (ms)", "local (ms)", "late messages", "beyond link q1-q3 (ms)"):
        t.add_column(col, justify="right")
    for w in waits:
        q1, _, q3 = w.link_excess_ms
        t.add_row(str(w.rank), _fmt(w.idle_ms), _fmt(w.dependency_ms), _fmt(w.link_ms), _fmt(w.local_ms),
                  f"{w.late_messages:g}", f"{_fmt(q1)}-{_fmt(q3)}")
    return t


@app.command()
def validate(
    schedule_path: Path = typer.Argument(..., metavar="SCHEDULE", help="schedule JSON"),
    profile: str | None = OtherProfileOpt,
    mem_limit: str | None = LimitOpt,
):
    """Exit 0 if the schedule is valid, else print the first problem and exit 1."""
    sched = _load_schedule(schedule_path, profile, mem_limit, force=True)
    problem = zb.find_problem(sched)
    if problem:
        _fail(f"invalid: {problem}")
    out.print(f"valid: {sched.kind}, {sched.num_ranks} ranks, {sched.num_stages} stages, {sched.num_microbatches} microbatches")


@app.command()
def compare(
    profile: str = ProfileOpt,
    m: int = MicrobatchOpt,
    mem_limit: str | None = typer.Option(None, "--mem-limit", help="mark schedules over this limit (1p, 2p, 40GiB)"),
    chunks: int | None = ChunksOpt,
    time_limit: float = typer.Option(
        2.0, "--time-limit", "-t", min=0.1,
        help="seconds for the whole table: classic rows in the first half, the zb-1p and zb-2p rows (solver "
        "heuristics) in what is left; rows not built in time are listed as skipped",
    ),
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON"),
    dp: int | None = DpOpt,
    dp_bandwidth: float | None = DpBandwidthOpt,
    grad_bytes: str | None = GradBytesOpt,
    shard: bool = ShardOpt,
    dp_share: float | None = DpShareOpt,
    ranks_per_link: int | None = RanksPerLinkOpt,
    old_chunks: int | None = OldChunksOpt,
):
    """All schedule kinds side by side on one profile (with the iteration's reductions where the
    profile or --dp has them)."""
    from zbsearch.compare import compare as compare_kinds

    chunks = _renamed_chunks(chunks, old_chunks)
    prof = _with_dp(zb.resolve_profile(profile), dp, dp_bandwidth, grad_bytes, shard, dp_share, ranks_per_link)
    with _spinner() as bar:
        task = bar.add_task("building", total=None)
        rows = compare_kinds(prof, m, chunks=chunks, mem_limit=mem_limit, time_limit=time_limit,
                             progress=_progress(bar, task))
    if as_json:
        out.print_json(json.dumps(rows))
        return
    t = Table(title=f"{prof.name}: p={prof.num_stages}, m={m}" + (f", memory limit {mem_limit}" if mem_limit else ""))
    lane = any("iteration" in r for r in rows)
    cols = ["schedule", "bubble rate", "span (ms)", "makespan (ms)", *(["iteration (ms)", "gain kept"] if lane else []),
            "peak memory", "fits limit"]
    for col in cols:
        t.add_column(col, justify="right")
    errors: dict[str, list[str]] = {}  # reason -> kinds, printed under the table
    for row in rows:
        if "error" in row or "skipped" in row:
            if "error" in row:
                errors.setdefault(row["error"], []).append(row["kind"])
            t.add_row(row["kind"], "[dim]n/a[/dim]" if "error" in row else "[dim]skipped[/dim]", *[""] * (len(cols) - 2))
            continue
        it = [_fmt(row["iteration"]), "-" if row.get("gain_kept") is None else f"{row['gain_kept']:.0%}"] if lane else []
        t.add_row(row["kind"], f"{row['bubble_rate']:.4f}", _fmt(row["span"]), _fmt(row["makespan"]), *it,
                  _fmt(row["peak_memory"]), "yes" if row["fits"] else "[red]no[/red]")
    _show(t)
    if lane:
        out.print(f"iteration: {_iteration_words(prof)}; gain kept: how much of a row's span gain over 1f1b remains "
                  "in its iteration", soft_wrap=True)
    for reason, kinds in errors.items():
        out.print(f"n/a for {', '.join(kinds)}: {reason}", highlight=False, soft_wrap=True)
    skipped = [r["kind"] for r in rows if "skipped" in r]
    if skipped:
        out.print(f"skipped (not built: the time limit of {time_limit:g} s was spent): {', '.join(skipped)}; "
                  "a larger --time-limit builds them")
    lb = next((r["lower_bound"] for r in rows if "lower_bound" in r), None)
    if lb is not None:
        out.print(f"bound (any memory) on span for any 1-chunk schedule: {_fmt(lb)} ms")
    out.print(f"zb-1p, zb-2p: the solver's heuristics only (no MILP, {time_limit:g} s for the whole table); "
              "`zbsearch solve` may find better")


def _progress(bar, task):
    """A solver progress callback (phase, best, bound) that shows itself on the progress line."""
    from zbsearch.solver import progress_text

    def update(phase: str, value: float, bound: float) -> None:
        bar.update(task, description=progress_text(phase, value, bound))

    return update


class _NoProgress:
    """Stands in for the progress line where stderr is not a terminal: prints nothing at all
    (a disabled rich Progress still writes an empty line on some rich releases)."""

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        return None


def _spinner():
    """The progress line of the long-running commands (on a terminal only), on stderr."""
    if not err.is_terminal:
        return _NoProgress()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True)


def _fail(message: str, code: int = 1) -> None:
    """One unwrapped line on stderr (rich would wrap it), then exit."""
    sys.stderr.write(message.replace("\n", " ") + "\n")
    raise SystemExit(code)


@app.command()
def show(
    schedule_paths: list[Path] = typer.Argument(
        ..., metavar="SCHEDULE...", help="schedule JSON; several are stacked on one time axis"
    ),
    output: str | None = typer.Option(
        None, "-o", "--output", help="write a chart: .png, .svg or .html (self-contained; hover a box for its times)"
    ),
    text: bool = typer.Option(False, "--text", help="print the text chart even when -o is given"),
    width: int | None = typer.Option(None, "--width", min=20, help="text chart width in columns (default: the terminal's)"),
    measured: Path | None = typer.Option(
        None, "--measured", help="runtime trace JSON to draw under the prediction (one SCHEDULE)"
    ),
    profile: str | None = OtherProfileOpt,
    mem_limit: str | None = LimitOpt,
    force: bool = ForceOpt,
):
    """Gantt chart of schedules (predicted, or against a measured trace): text, or PNG/SVG/HTML with -o."""
    import os
    import shutil

    from zbsearch import render

    path = _output(output, render.CHART_SUFFIXES, "chart")
    panels = [render.schedule_panel(_load_schedule(p, profile, mem_limit, force)) for p in schedule_paths]
    title = None
    if measured is not None:
        if len(panels) != 1:
            raise ZbError("--measured compares one schedule with its trace; give exactly one SCHEDULE")
        panels, title = render.with_measured(panels[0], measured)
    if path is not None:
        err.print(f"wrote {render.write_chart(panels, path, title)}", highlight=False, soft_wrap=True)
    if path is None or text:
        cols = width or shutil.get_terminal_size((120, 24)).columns
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        sys.stdout.write(render.render_text(panels, cols, title, colour) + "\n")


@app.command()
def export(
    schedule_path: Path = typer.Argument(..., metavar="SCHEDULE", help="schedule JSON"),
    to: str = typer.Option(..., "--to", help="target format: torch-csv (torch.distributed.pipelining's action notation)"),
    output: str = typer.Option(..., "-o", "--output", help="file to write ('-' for stdout)"),
    force: bool = ForceOpt,
):
    """Write a schedule for another tool: torch-csv is read by torch's _PipelineScheduleRuntime._load_csv;
    torchtitan (a plan from zbsearch plan): -o names a folder for the CSV and torchtitan's overrides."""
    from zbsearch.formats.torch_csv import to_torch_csv  # pure Python: no torch import

    if to not in ("torch-csv", "torchtitan"):
        raise ZbError(f"unknown export format {to!r}; supported: torch-csv, torchtitan")
    if to == "torchtitan":
        _export_torchtitan(schedule_path, output, force)
        return
    path = _output(output)
    assert path is not None  # -o is required
    text = to_torch_csv(_load_schedule(schedule_path, None, force=force))
    if str(path) == "-":
        sys.stdout.write(text)
    else:
        err.print(f"wrote {write_text(path, text)}", highlight=False, soft_wrap=True)


def _export_torchtitan(schedule_path: Path, output: str, force: bool) -> None:
    """The plan's CSV and torchtitan's overrides (``args.txt``, shell-quoted) in the folder ``output``."""
    import shlex

    from zbsearch.planner.torchtitan import torchtitan_export

    if output in ("", "-"):
        raise ZbError("-o: --to torchtitan writes a folder (schedule.csv and args.txt); name it")
    folder = Path(output)
    if folder.exists() and not folder.is_dir():
        raise ZbError(f"{folder}: exists and is not a folder; -o names the folder for torchtitan's files")
    csv_path, args_path = folder / "schedule.csv", folder / "args.txt"
    check_writable(csv_path)
    # the overrides name the CSV by its absolute path: torchtitan may start in any folder
    exported = torchtitan_export(_load_schedule(schedule_path, None, force=force), str(csv_path.resolve()))
    write_text(csv_path, exported.csv)
    write_text(args_path, shlex.join(exported.args) + "\n")
    out.print(shlex.join(exported.args), soft_wrap=True, highlight=False)
    err.print(f"wrote {csv_path}, {args_path}", highlight=False, soft_wrap=True)


DeterministicOpt = typer.Option(
    False, "--deterministic",
    help="the time limit counts work (simulated passes, search steps, MILP nodes), not seconds: the same inputs give "
         "the same result on any machine and load; a loaded machine takes longer")


def _left(time_limit: float, deterministic: bool, least: float) -> float:
    """The time limit less what the command's own start took (on the wall clock only: work
    counted does not include it)."""
    if deterministic or _STARTED is None:
        return time_limit
    return max(time_limit - (time.monotonic() - _STARTED), least)


@app.command()
def solve(
    profile: str = ProfileOpt,
    m: int = MicrobatchOpt,
    mem_limit: str = typer.Option(
        "2p", "--mem-limit", help="1p, 2p, <x>p (x*p*M_B per rank), a byte budget per rank (40GiB), or none"
    ),
    placement: str = PlacementOpt,
    time_limit: float = typer.Option(
        30.0, "--time-limit", "-t", min=0.1, help="seconds; the best schedule found by then is returned"
    ),
    objective: str | None = typer.Option(
        None, "--objective",
        help="span: longest per-rank span (iteration period without reductions); makespan: first start to last end; "
             "iteration: the span with the gradient reductions and optimizer steps after it (the default where the "
             "profile or --dp has reductions, else span)",
    ),
    uniform_costs: bool = typer.Option(
        False,
        "--uniform-costs",
        help="schedule with the median stage costs as the paper's scheduler does (results on the true costs)",
    ),
    no_milp: bool = typer.Option(False, "--no-milp", help="heuristics only (milliseconds to seconds)"),
    recompute: str = RecomputeOpt,
    output: str | None = typer.Option(None, "-o", "--output", help="write the schedule JSON here ('-' for stdout)"),
    dp: int | None = DpOpt,
    dp_bandwidth: float | None = DpBandwidthOpt,
    grad_bytes: str | None = GradBytesOpt,
    shard: bool = ShardOpt,
    dp_share: float | None = DpShareOpt,
    ranks_per_link: int | None = RanksPerLinkOpt,
    old_chunks: int | None = OldPlacementOpt,
    deterministic: bool = DeterministicOpt,
):
    """Find the schedule with the least bubble under a memory limit, and how far from optimal it can be."""
    from zbsearch import solver

    chunks = _solver_chunks(placement, old_chunks)
    path = _output(output)
    prof = _with_dp(zb.resolve_profile(profile), dp, dp_bandwidth, grad_bytes, shard, dp_share, ranks_per_link)
    cost = zb.CostModel.from_profile(prof, solver.solver_placement(prof.num_ranks, chunks))
    zb.parse_memory_limit(mem_limit, prof, cost)  # a bad limit fails now, not under the progress display
    with _spinner() as bar:
        task = bar.add_task("starting", total=None)
        res = solver.solve(
            prof, m, mem_limit, chunks=chunks, time_limit=time_limit,
            objective=cast("Objective | None", objective),  # solve() rejects any other text with a ZbError
            uniform_costs=uniform_costs, milp=not no_milp, progress=_progress(bar, task),
            recompute=cast("Recomputation", recompute),  # solve() rejects any other text with a ZbError
            deterministic=deterministic,
        )
    if path is not None:
        _write(res.schedule, path)
    if path is None or str(path) != "-":
        info = res.info
        _show(_rank_table(res.schedule, res.timeline))
        pred = res.schedule.predicted
        assert pred is not None  # solve predicts
        bubble = pred.bubble_rate_makespan if info.objective == "makespan" else pred.bubble_rate
        out.print(f"bubble rate {bubble:.4f}   {info.objective} {_fmt(info.value)} ms   "
                  f"{solver.bound_name(info)} {_fmt(info.lower_bound)} ms")
        out.print(f"{solver.status_text(info)}   ({info.method}: {info.construction}; {info.time_s:.1f} s)")
        for line in solver.explain(res.schedule, info):
            out.print(line)


@app.command()
def plan(
    layers: str = typer.Option(..., "--layers", "-l", help="per-layer profile JSON (zbsearch profile --per-layer)"),
    ranks: int = typer.Option(..., "--ranks", "-r", help="pipeline ranks P"),
    m: int = MicrobatchOpt,
    memory: str = typer.Option(
        "none", "--memory", help="bytes per rank for parameters, gradients, optimizer state and activations (80GiB, none)"),
    placement: str = typer.Option("auto", "--placement", help="one (P stages), v (2P pieces in a V) or auto (both)"),
    optimizer: str = typer.Option(
        "adamw", "--optimizer", help="what the static memory counts: sgd (momentum), adamw (as profiled), mixed (16 B/param)"),
    time_limit: float = typer.Option(60.0, "--time-limit", "-t", min=0.5, help="seconds; the best plan found by then"),
    objective: str | None = typer.Option(
        None, "--objective",
        help="span (iteration period without reductions), makespan, or iteration (the span with the gradient "
             "reductions after it; the default with --dp)"),
    dp: int | None = typer.Option(
        None, "--dp", min=1,
        help="data-parallel replicas: each cut's stages end the iteration with the all-reduce of their units' "
             "gradients (as many bytes as their parameters), with --dp-bandwidth"),
    dp_bandwidth: float | None = DpBandwidthOpt,
    shard: bool = typer.Option(
        False, "--shard",
        help="the --dp ranks shard the stages (fully_shard): the budget counts whole parameters and gradients during "
             "the step plus each rank's share of stored parameters and optimizer state"),
    dp_share: float | None = DpShareOpt,
    ranks_per_link: int | None = RanksPerLinkOpt,
    no_milp: bool = typer.Option(False, "--no-milp", help="heuristics only when polishing the best cuts"),
    recompute: str = typer.Option(
        "none", "--recompute",
        help="none; auto: every cut's schedule checkpoints and recomputes microbatches where that pays under the budget; "
             "full: every one (the units' recomputation costs, zbsearch profile --per-layer --recompute)"),
    action_ms: str | None = ActionOpt,
    as_json: bool = typer.Option(False, "--json", help="print the partition section as JSON"),
    output: str | None = typer.Option(None, "-o", "--output", help="write the planned schedule JSON here ('-' for stdout)"),
    deterministic: bool = DeterministicOpt,
):
    """Cut the model's units into stages, place them and schedule them together under a per-rank byte budget."""
    from zbsearch.formats.layers import load_layers
    from zbsearch.limits import parse_bytes
    from zbsearch.planner import plan as make_plan
    from zbsearch.solver import covered, unsearched

    path = _output(output)
    replicas = _replicas(dp, dp_bandwidth)
    if shard and replicas is None:
        raise ZbError("--shard needs --dp and --dp-bandwidth: the data-parallel ranks the stages are sharded over")
    sharing = _sharing(dp_share, ranks_per_link, priced=replicas is not None)
    found = _with_action(load_layers(layers), action_ms)
    budget = parse_bytes(memory)
    with _spinner() as bar:
        task = bar.add_task("starting", total=None)
        res = make_plan(found, ranks, m, budget, placement=placement, optimizer=optimizer,
                        time_limit=_left(time_limit, deterministic, 0.1), objective=objective, milp=not no_milp,
                        recompute=recompute, progress=_progress(bar, task),
                        data_parallel=replicas, shard=dp if shard else None, sharing=sharing,
                        deterministic=deterministic)
    if path is not None:
        _write(res.schedule, path)
    if path is not None and str(path) == "-":
        return
    if as_json:
        out.print_json(res.partition.model_dump_json())
        return
    for table in _plan_tables(res.schedule):
        _show(table)
    part = res.partition
    assert part is not None and res.schedule.predicted is not None
    how = ("every cut priced" if part.exhaustive else "cuts searched locally, the bound from a relaxation over all cuts")
    solver = res.schedule.solver
    if part.recompute != "none" and solver is not None:
        out.print(f"recompute {part.recompute}: {solver.recomputed} forwards checkpointed and recomputed", soft_wrap=True)
    out.print(f"plan: {part.objective} {_fmt(part.value)} ms, bubble {res.schedule.predicted.bubble_rate:.4f}; "
              f"bound over every cut ({'/'.join(part.placements_searched)}) and schedule {covered(part.recompute)} "
              f"{_fmt(part.lower_bound)} ms, gap {part.gap:.2%}; {part.cuts_solved} cuts solved, {part.cuts_bounded} "
              f"bounded ({how}); {part.time_s:.1f} s", soft_wrap=True)
    note = unsearched(zb.CostModel.from_profile(res.schedule.profile, res.schedule.stage_to_rank), part.recompute)
    if note is not None:
        out.print(note, soft_wrap=True)
    _print_action(found)


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.4g}"


def _plan_tables(sched: zb.Schedule) -> list[Table]:
    part = sched.partition
    assert part is not None
    kinds = dict(zip(part.units, part.kinds))
    paired = f", {sched.num_pairs} overlapped pairs" if sched.num_pairs else ""
    t = Table(title=f"plan: {len(part.stages)} stages on {sched.num_ranks} ranks ({part.placement}), "
                    f"m={sched.num_microbatches}{paired}")
    for col in ("stage", "rank", "units", "layers"):
        t.add_column(col, justify="right")
    for s, names in enumerate(part.stages):
        ends = [n for n in names if kinds[n] != "layer"]
        what = f"{names[0]} .. {names[-1]}" if len(names) > 1 else names[0]
        t.add_row(str(s), str(sched.stage_to_rank[s]), what, str(sum(kinds[n] == "layer" for n in names))
                  + (f" + {', '.join(ends)}" if ends else ""))
    pred = sched.predicted
    assert pred is not None
    r = Table(title=f"per rank, GiB (budget {_gib(part.budget_bytes) if part.budget_bytes else 'none'}; {part.optimizer})")
    for col in ("rank", "params+grads+optimizer", "activations", "peak", "span (ms)"):
        r.add_column(col, justify="right")
    for k, (st, act) in enumerate(zip(part.static_bytes, part.activation_bytes)):
        r.add_row(str(k), _gib(st), _gib(act), _gib(st + act), _fmt(pred.span[k]))
    how = "" if part.recompute == "none" else f", recompute {part.recompute}"
    b = Table(title=f"baselines, solved at the same budget{how}")
    cols = ["cut", "layers per stage", f"{part.objective} (ms)", "plan's speed-up", "peak (GiB)"]
    cols += ["recomputed"] if part.recompute != "none" else []
    pairs = sched.num_pairs > 0 or any(x.overlapped_pairs for x in part.baselines)
    cols += ["pairs"] if pairs else []
    for col in (*cols, "note"):
        b.add_column(col, justify="right")
    for x in part.baselines:
        speed = f"{x.value / part.value:.3f}x" if x.value else "-"
        b.add_row(x.name, ",".join(map(str, x.layers_per_stage)) or "-", _fmt(x.value) if x.value else "-", speed,
                  _gib(max(x.peak_bytes)) if x.peak_bytes else "-",
                  *([str(x.recomputed) if x.value else "-"] if part.recompute != "none" else []),
                  *([str(x.overlapped_pairs) if x.value else "-"] if pairs else []), x.note or "")
    return [t, r, b]


@app.command()
def tune(
    layers: list[str] = typer.Option(
        ..., "--layers", "-l", help="per-layer profile JSON, one per microbatch size measured (repeat -l)"),
    ranks: int = typer.Option(..., "--ranks", "-r", min=1, help="accelerators in all"),
    ranks_per_node: int = typer.Option(8, "--ranks-per-node", min=1, help="accelerators per node"),
    memory: str = typer.Option("none", "--memory", help="bytes per rank for everything it holds (80GiB, none)"),
    global_batch: int | None = typer.Option(None, "--global-batch", "-g", min=1,
                                            help="sequences per iteration, all replicas"),
    global_tokens: int | None = typer.Option(None, "--global-tokens", min=1,
                                             help="tokens per iteration, all replicas (instead of -g)"),
    seq: int | None = typer.Option(None, "--seq", min=1, help="tokens per sequence (default: the profile's)"),
    tp: int = typer.Option(1, "--tp", min=1, help="tensor-parallel degree, as the profiles were measured at"),
    ep: int | None = typer.Option(None, "--ep", min=1, help="expert-parallel degree of a MoE model, as the profiles' "
                                  "all-to-all was measured at (default: theirs); meshes whose dp it divides"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="sgd, adamw or mixed (16 B/param)"),
    sharded: bool = typer.Option(False, "--sharded", help="optimizer state sharded over the replicas (ZeRO-1)"),
    shard: bool = typer.Option(False, "--shard", help="stages sharded over the replicas (fully_shard): parameters, "
                               "gradients and optimizer state"),
    intra: float = typer.Option(150.0, "--intra-gbs", help="GB/s per rank inside a node"),
    inter: float = typer.Option(25.0, "--inter-gbs", help="GB/s per rank between nodes"),
    latency: float | None = typer.Option(None, "--latency-ms", help="pipeline message latency (default: the profile's)"),
    memory_gbs: float | None = typer.Option(
        None, "--memory-gbs", help="device memory GB/s the optimizer step streams its state at (default: not priced)"),
    dp_share: float = typer.Option(
        0.0, "--dp-share", help="how the reductions of the pipeline ranks on one node slow each other: k at once each "
        "move at 1 / (1 + S (k - 1)) of their speed alone (0: not at all; 1: they split the link evenly)"),
    sizes: str | None = typer.Option(None, "--microbatch-sizes", "-b", help="sizes to search, e.g. 1,2,4 (default: "
                                     "those measured; others interpolated)"),
    placement: str = typer.Option("auto", "--placement", help="one, v or auto (both)"),
    recompute: str | None = typer.Option(None, "--recompute", help="modes to search: none, auto, full, comma-"
                                         "separated (default: auto where the profile has recomputation costs, else none)"),
    time_limit: float = typer.Option(300.0, "--time-limit", "-t", min=1.0, help="seconds for the whole search"),
    plan_time: float | None = typer.Option(None, "--plan-time", min=0.1, help="most seconds one configuration's first "
                                           "plan takes (default: its share of the time left); those planned again get 3x"),
    no_milp: bool = typer.Option(False, "--no-milp", help="plan with the solver's heuristics only"),
    no_baselines: bool = typer.Option(False, "--no-baselines", help="leave out torchtitan's and Megatron's defaults"),
    top: int = typer.Option(12, "--top", min=1, help="configurations shown"),
    action_ms: str | None = ActionOpt,
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON (zbsearch.tune)"),
    output: str | None = typer.Option(None, "-o", "--output", help="folder for the winner's schedule, tune.json, "
                                      "launch.json, run.sh and torchtitan's overrides"),
    deterministic: bool = DeterministicOpt,
):
    """Choose pipeline and data-parallel degrees, microbatches, placement, recomputation and cut for a cluster."""
    from zbsearch.formats.layers import load_layers
    from zbsearch.limits import parse_bytes
    from zbsearch.tuner import Cluster
    from zbsearch.tuner import tune as search
    from zbsearch.tuner.launch import check_folder, write_launch

    if output == "" or output == "-":
        raise ZbError("-o names the folder for tune's files")
    folder = None if output is None else Path(output)
    if folder is not None:
        check_folder(folder)
    cluster = Cluster.checked(ranks=ranks, ranks_per_node=min(ranks_per_node, ranks), memory_bytes=parse_bytes(memory),
                              intra_node_gbs=intra, inter_node_gbs=inter, link_latency_ms=latency, memory_gbs=memory_gbs,
                              dp_share=dp_share)
    profiles = [_with_action(load_layers(p), action_ms) for p in layers]
    if (global_batch is None) == (global_tokens is None):
        raise ZbError("give the global batch once: -g SEQUENCES or --global-tokens TOKENS")
    if global_tokens is not None:
        found = seq or (profiles[0].model or {}).get("seq")
        if not isinstance(found, int) or found < 1:
            raise ZbError("--global-tokens needs the sequence length: --seq, or a profile that records it")
        if global_tokens % found:
            raise ZbError(f"--global-tokens {global_tokens} is not whole sequences of {found} tokens")
        global_batch = global_tokens // found
    assert global_batch is not None
    with _bar() as bar:
        task = bar.add_task("starting", total=None)
        tuned = search(profiles, cluster, global_batch, tp=tp, ep=ep, optimizer=optimizer, sharded=sharded, shard=shard,
                       sizes=_ints(sizes, "--microbatch-sizes"), seq=seq,
                       placements=("one", "v") if placement == "auto" else (placement,),
                       recompute=None if recompute is None else [x.strip() for x in recompute.split(",")],
                       time_limit=_left(time_limit, deterministic, 0.5), plan_time=plan_time, milp=not no_milp,
                       baselines=not no_baselines, deterministic=deterministic,
                       progress=lambda done, total, text: bar.update(task, completed=done, total=total, description=text))
    res = tuned.result
    if folder is not None:
        for path in write_launch(folder, res, tuned.schedule, tuned.layers, tuned.baselines):
            err.print(f"wrote {path}", highlight=False, soft_wrap=True)
    if as_json:
        out.print_json(res.model_dump_json())
        return
    for table in _tune_tables(res, top):
        _show(table)
    best, base = res.winner, res.best_baseline()
    if best is None:
        out.print("no configuration was costed: " + next((r.note or r.status for r in res.rows), "none to search"),
                  soft_wrap=True)
        return
    assert best.iteration_ms is not None and res.lower_bound_ms is not None and res.gap is not None
    rate = "tokens/s" if res.seq else "sequences/s"
    pairs = f", {best.overlapped_pairs} overlapped pairs" if best.overlapped_pairs else ""
    out.print(f"best: pp {best.pp} x dp {best.dp} x tp {best.tp}{f' (ep {res.ep})' if res.ep > 1 else ''}, "
              f"{best.microbatches} microbatches of {best.microbatch_size}, {best.placement}, recompute {best.recompute}"
              f"{pairs}: {_fmt(best.iteration_ms)} ms, "
              f"{best.tokens_per_s:.6g} {rate}; bound over every configuration {_fmt(res.lower_bound_ms)} ms, gap "
              f"{res.gap:.2%}" + (f" (before planning {_fmt(res.bound_before_planning_ms)} ms, gap "
                                  f"{res.gap_before_planning:.2%})" if res.bound_before_planning_ms is not None
                                  and res.gap_before_planning is not None else ""),
              soft_wrap=True, highlight=False)
    if base is not None and base.iteration_ms:
        out.print(f"speed-up over the best baseline ({base.source}, pp {base.pp} x dp {base.dp}, b {base.microbatch_size}"
                  f"): {base.iteration_ms / best.iteration_ms:.3f}x", soft_wrap=True, highlight=False)
    counts = {s: sum(r.status == s for r in res.rows) for s in dict.fromkeys(r.status for r in res.rows)}
    out.print(", ".join(f"{n} {s}" for s, n in counts.items()) + f"; {res.time_s:.1f} s; optimizer step "
              f"{res.optimizer_step}", soft_wrap=True, highlight=False)
    if tuned.layers is not None:  # the winner's
        _print_action(tuned.layers)


def _ints(text: str | None, option: str) -> list[int] | None:
    """A comma-separated list of whole numbers (None: not given)."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ZbError(f"{option} {text!r}: give whole numbers, comma-separated (1,2,4)") from None


def _bar():
    """A progress bar on stderr (on a terminal only)."""
    if not err.is_terminal:
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
                    console=err, transient=True)


def _tune_tables(res, top: int) -> list[Table]:
    rate = "tokens/s" if res.seq else "seq/s"
    t = Table(title=f"{res.cluster.ranks} ranks, global batch {res.global_batch}, {res.optimizer}"
                    f"{' sharded' if res.sharded else ''}{', stages sharded' if res.shard else ''}: fastest first")
    for col in ("#", "pp.dp.tp", "b x m", "place", "recompute", rate, "ms", "bubble", "GiB", "gap", "by"):
        t.add_column(col, justify="right")
    costed = [r for r in res.rows if r.status == "costed"]
    for i, r in enumerate(costed[:top]):
        gap = f"{r.iteration_ms / r.bound_ms - 1:.1%}" if r.bound_ms and r.iteration_ms else "-"
        t.add_row(str(i + 1), f"{r.pp}.{r.dp}.{r.tp}", f"{r.microbatch_size} x {r.microbatches}", r.placement,
                  r.recompute, f"{r.tokens_per_s:.4g}" if r.tokens_per_s else "-", f"{r.iteration_ms:.5g}",
                  f"{r.bubble:.1%}" if r.bubble is not None else "-", _gib(r.peak_bytes), gap,
                  "tune" if r.source == "tune" else "baseline")
    families = {r.source: r for r in reversed(costed) if r.source != "tune"}  # the best of each baseline
    b = Table(title="the best of each baseline, costed the same way")
    for col in ("baseline", "#", "pp.dp.tp", "b x m", "recompute", "ms", "tune's speed-up"):
        b.add_column(col, justify="right")
    for name, r in sorted(families.items()):
        b.add_row(name, str(costed.index(r) + 1), f"{r.pp}.{r.dp}.{r.tp}", f"{r.microbatch_size} x {r.microbatches}",
                  r.recompute, f"{r.iteration_ms:.5g}", f"{r.iteration_ms / costed[0].iteration_ms:.3f}x")
    return [t, b] if families else [t]


@app.command()
def frontier(
    profile: str = ProfileOpt,
    m: int = MicrobatchOpt,
    placement: str = PlacementOpt,
    objective: str = typer.Option("span", "--objective", help="span or makespan"),
    time_limit: float = typer.Option(
        20.0, "--time-limit", "-t", min=0.1, help="seconds for the whole sweep (shared by its points)"
    ),
    milp: bool = typer.Option(False, "--milp", help="also improve each point with MILP windows (slower)"),
    uniform_costs: bool = typer.Option(False, "--uniform-costs", help="schedule with the median stage costs (paper behaviour)"),
    recompute: str = RecomputeOpt,
    output: str | None = typer.Option(
        None, "-o", "--output", help="frontier.json ('-': JSON on stdout), or a plot: .png, .svg, .pdf"
    ),
    old_chunks: int | None = OldPlacementOpt,
):
    """Bubble rate against memory limit, from the smallest feasible limit to where the bubble stops falling."""
    chunks = _solver_chunks(placement, old_chunks)

    from zbsearch.formats.frontier import save_frontier
    from zbsearch.render.frontier import save_frontier_plot
    from zbsearch.solver import covered, gap_text, solver_placement, unsearched
    from zbsearch.solver import frontier as sweep

    path = _output(output, (".json", ".png", ".svg", ".pdf"))
    prof = zb.resolve_profile(profile)
    with _spinner() as bar:
        task = bar.add_task("solving without a limit", total=None)
        fr = sweep(
            prof, m, chunks=chunks, time_limit=time_limit, milp=milp, uniform_costs=uniform_costs,
            objective=cast("Objective", objective), progress=_progress(bar, task),  # other text: ZbError in solve()
            recompute=cast("Recomputation", recompute),
        )
    where = "V placement" if chunks == 2 else "one stage per rank"
    how = "" if recompute == "none" else f", recompute {recompute}"
    t = Table(title=f"{prof.name}: m={m}, {where}, {objective}{how}; no limit: bubble {fr.unlimited_bubble_rate:.4f}")
    cols = ["limit (x p M_B)", "bubble rate", "bound allows", "gap", "status", "peak memory"]
    for col in cols + (["recomputed"] if recompute != "none" else []):
        t.add_column(col, justify="right")
    for pt in fr.points:
        t.add_row(
            f"{pt.limit:.4g}p",
            f"{pt.bubble_rate:.4f}",
            f"{pt.bound_bubble_rate:.4f}",
            gap_text(pt.gap),
            pt.status,
            _fmt(max(pt.peak_memory)),
            *([str(pt.recomputed)] if recompute != "none" else []),
        )
    if path is not None and str(path) == "-":
        sys.stdout.write(fr.model_dump_json(indent=1) + "\n")
        return
    _show(t)
    note = unsearched(zb.CostModel.from_profile(prof, solver_placement(prof.num_ranks, chunks)), recompute)
    out.print(f"bounds and statuses cover schedules {covered(recompute)}" + (f"; {note}" if note else ""), soft_wrap=True)
    if path is not None:
        if path.suffix.lower() == ".json":
            save_frontier(fr, path)
        else:
            save_frontier_plot(fr, path)
        err.print(f"wrote {path}", highlight=False, soft_wrap=True)


@app.command()
def profile(
    model: str | None = typer.Option(
        None, "--model", help="package.module:function returning (stages, microbatch[, loss_fn, target])"
    ),
    model_arg: list[str] = typer.Option(
        [], "--model-arg", help="key=value passed to the --model function (repeatable; ints, floats, true/false converted)"
    ),
    builtin: str | None = typer.Option(None, "--builtin", help="a built-in model instead of --model: gpt, or moe (gpt "
                                       "with --experts experts per layer, --top-k per token)"),
    experts: int = typer.Option(4, "--experts", help="moe: experts per layer"),
    top_k: int = typer.Option(2, "--top-k", help="moe: experts per token"),
    ep: int | None = typer.Option(
        None, "--ep", help="moe: measure on an expert-parallel group of N local processes (gloo; on CUDA one GPU each, "
                           "NCCL), each holding 1/N of "
                           "the experts; records each stage's all-to-all time inside F and B (a_f, a_b) and the share of it an "
                           "overlapped pair leaves exposed (pair_exposed)"),
    hf: str | None = typer.Option(
        None,
        "--hf",
        help="a Hugging Face causal LM, random init: config JSON, preset (gpt2-tiny, llama-tiny, ...) or tiny:MODEL_TYPE; "
        "uses --stages, --seq, -b, --layers-per-stage",
    ),
    layers: int = typer.Option(8, "--layers", help="gpt: transformer layers"),
    hidden: int = typer.Option(128, "--hidden", help="gpt: hidden size"),
    heads: int = typer.Option(4, "--heads", help="gpt: attention heads"),
    seq: int | None = typer.Option(None, "--seq", help="sequence length (gpt: 128; --hf: 32, or the model's positions if fewer)"),
    microbatch_size: int | None = typer.Option(
        None, "--microbatch-size", "-b", help="sequences per microbatch (gpt: 4; --hf: 2, as examples/train_hf.py)"),
    stages: int = typer.Option(4, "--stages", help="pipeline stages (gpt, --hf)"),
    layers_per_stage: str | None = typer.Option(
        None, "--layers-per-stage", help="--hf: decoder layers of each stage, comma-separated (e.g. 3,3,2; default: even)"),
    placement: str | None = typer.Option(
        None,
        "--placement",
        help="the stages are 2 pieces per rank for this placement: v (ZB-V) or interleaved; "
        "recorded, so schedules use each piece's costs; under torchrun start one process per rank (stages / 2), "
        "each measures its own pieces",
    ),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:<i> (under torchrun: cuda:LOCAL_RANK)"),
    dtype: str | None = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: the model's own)"),
    warmup: int = typer.Option(3, "--warmup", help="untimed repetitions per stage"),
    repeat: int = typer.Option(10, "--repeat", help="timed repetitions per stage and round (median and quartiles recorded)"),
    rounds: int = typer.Option(
        3, "--rounds", help="rounds over all stages and links, pooled: a machine's speed drifts, one round catches one moment"),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: torch's; torchrun sets 1)"),
    keep_heap: bool = typer.Option(
        True, "--keep-heap/--release-memory",
        help="keep freed host memory in the process, as the runtime does by default (else passes pay page faults)"),
    timeout: float = typer.Option(
        PEER_TIMEOUT_S, "--timeout", help="seconds a rank waits for another rank's message while links are timed"),
    in_step: bool = typer.Option(
        True, "--in-step/--no-in-step",
        help="under torchrun, take each pass's time from a few steps of the runtime (1F1B, split and fused) rather "
             "than from repeating one microbatch: what a schedule's steps run"),
    recompute: bool = typer.Option(
        False, "--recompute",
        help="also time each stage's forward checkpointed and its recompute pass, and what it keeps (for solve --recompute; "
             "with --per-layer each unit's, for plan --recompute); selectively too, where the model declares modules "
             "for the --selective mode"),
    selective: str | None = typer.Option(
        None, "--selective",
        help="with --recompute, which modules selective recomputation re-runs: attention (each layer's attention core, "
             "Megatron's selective recomputation; the default), mlp (each layer's MLP) or none. The built-in GPT "
             "declares both, --hf declares the mode's modules on every decoder layer, a --model builder its own "
             "(selective_recompute = 'attention' or 'mlp'); recorded as the profile's selective"),
    name: str | None = typer.Option(None, "--name", help="profile name (default: from the model and device)"),
    per_layer: bool = typer.Option(
        False, "--per-layer",
        help="measure each unit (the embedding, every layer, the head; for --model each module it returns) on one "
             "device and write a per-layer profile (zbsearch.layers) for zbsearch plan"),
    output: str | None = typer.Option(None, "-o", "--output", help="profile JSON to write (default: profiles/NAME.json)"),
    dp: int | None = typer.Option(
        None, "--dp", min=1,
        help="data-parallel replicas the stages will train in: each stage's gradient all-reduce and its AdamW step "
             "(timed here) end the iteration. The all-reduce is timed on a real group: N local processes (gloo, on CPU), "
             "or under torchrun the replicas started with the pipeline (pipeline ranks x N processes); with "
             "--dp-bandwidth it is priced as a ring all-reduce of the stage's trainable parameters' bytes instead"),
    dp_bandwidth: float | None = DpBandwidthOpt,
    dp_share: float | None = typer.Option(
        None, "--dp-share",
        help="with --dp-bandwidth, how the priced reductions of pipeline ranks on one link slow each other: k at once "
             "each move at 1 / (1 + S (k - 1)) of their speed alone (--dp N alone measures it)"),
    ranks_per_link: int | None = RanksPerLinkOpt,
    shard: bool = typer.Option(
        False, "--shard",
        help="with --dp N, the stages are sharded over the N replicas (fully_shard): each stage's parameter gather at the "
             "step's start and its gradient reduce-scatter are timed as the runtime runs them (with --dp-bandwidth, "
             "priced as a ring all-gather and reduce-scatter of the parameters' bytes)"),
    tp: int = typer.Option(
        1, "--tp", min=1,
        help="tensor-parallel ranks each stage is split over (the runtime's plans: built-in GPT, --hf decoders): its "
             "passes are measured split, collectives included, per rank. N local processes (gloo, on CPU), or under torchrun "
             "the ranks started with the pipeline (pipeline ranks x --dp x N processes); recorded in the profile's mesh"),
    sequence_parallel: bool = typer.Option(
        False, "--sequence-parallel", help="with --tp, the built-in GPT's plan also splits the sequence"),
    link_bandwidth: float | None = typer.Option(
        None, "--link-bandwidth",
        help="on one device: GB/s of the link between pipeline ranks (NVLink, the network), instead of estimating it "
             "between two local processes (through the host where there is one GPU); each boundary costs "
             "--link-latency + its bytes at this bandwidth. Under torchrun the links are measured"),
    link_latency: float | None = typer.Option(
        None, "--link-latency", help="with --link-bandwidth, ms per message on that link (default 0)"),
):
    """Measure per-stage F, B, W times, activation memory and link times; write a profile (bytes).

    One device: stage after stage, links estimated. Under torchrun (one rank per stage): each
    rank measures its stage and its link to the next, rank 0 writes the file. With --per-layer:
    every unit on one device, for zbsearch plan."""
    import os

    from zbsearch import profiler
    from zbsearch.models import GPTConfig

    if sum(x is not None for x in (model, builtin, hf)) != 1:
        raise ZbError("give one of --model package.module:function, --builtin gpt or --hf CONFIG")
    if builtin is not None and builtin not in ("gpt", "moe"):
        raise ZbError(f"unknown built-in model {builtin!r}; available: gpt, moe")
    if ep is not None and builtin != "moe":
        raise ZbError("--ep measures a model with experts: give --builtin moe")
    if ep is not None and (placement is not None or dp is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ZbError("--ep profiles the stages on local processes: --placement, --dp and torchrun do not apply")
    target = _output(output)  # None: profiles/NAME.json, once the name is known
    if target is None:
        check_writable(Path("profiles") / "profile.json")  # that folder must be writable too
    if layers_per_stage is not None and hf is None:
        raise ZbError("--layers-per-stage applies to --hf (with --model, pass --model-arg layers_per_stage=3,3,2)")
    if selective is not None and not recompute:
        raise ZbError("--selective applies with --recompute")
    mode = _selective_mode(selective)
    if per_layer and (placement is not None or layers_per_stage is not None):
        raise ZbError("--per-layer measures every unit apart: --placement and --layers-per-stage do not apply "
                      "(zbsearch plan chooses the cut)")
    if dp_bandwidth is not None and dp is None:
        raise ZbError("--dp-bandwidth prices the reductions of --dp replicas: give --dp N too")
    if shard and dp is None:
        raise ZbError("--shard needs --dp N: the replicas the stages are sharded over")
    if shard and tp > 1 and dp_bandwidth is None:
        raise ZbError("--shard with --tp: the sharded tensor-parallel stages' gathers are not timed; price them with "
                      "--dp-bandwidth")
    if dp is not None and per_layer:
        raise ZbError("--dp applies to stage profiles: zbsearch plan --dp prices each cut's reductions")
    if dp_bandwidth is not None and not dp_bandwidth > 0:
        raise ZbError("--dp-bandwidth must be a positive number of GB/s")
    if dp_share is not None and dp is not None and dp_bandwidth is None:
        raise ZbError("--dp-share gives the share of reductions priced from --dp-bandwidth: profile --dp N alone "
                      "measures it")
    sharing = _sharing(dp_share, ranks_per_link, priced=dp is not None and dp_bandwidth is not None)
    if tp > 1 and per_layer:
        raise ZbError("--tp applies to stage profiles: --per-layer measures whole units on one device")
    if tp > 1 and dp_bandwidth is not None:
        raise ZbError("--dp-bandwidth prices whole stages' gradients: with --tp time the reductions of each rank's shards "
                      "on a real group (--dp N alone)")
    if sequence_parallel and tp == 1:
        raise ZbError("--sequence-parallel splits the sequence over the tensor-parallel ranks: give --tp N too")
    if per_layer and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ZbError("--per-layer measures on one device: run it without torchrun")
    if link_latency is not None and link_bandwidth is None:
        raise ZbError("--link-latency gives the latency of the link --link-bandwidth gives: give --link-bandwidth GB/s too")
    link = None if link_bandwidth is None else profiler.LinkModel.given(link_bandwidth, link_latency or 0.0)
    if link is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ZbError("under torchrun the links between ranks are measured: --link-bandwidth and --link-latency apply "
                      "on one device")
    kinds = None
    if hf is not None:
        from zbsearch.models import hf as hf_models

        seq, microbatch_size = hf_models.profile_shape(hf, seq, microbatch_size)
        built = hf_models.build(hf, stages=stages, microbatch_size=microbatch_size, seq=seq, layers_per_stage=layers_per_stage,
                                units=per_layer, selective=mode if recompute else None)
        spec = profiler.as_model(built, f"--hf {hf!r}")
        shape = "units" if per_layer else f"p{stages}"
        spec.name = f"hf-{Path(hf).stem.replace(':', '-')}-s{seq}-b{microbatch_size}-{shape}"
        spec.settings = {"model": f"hf {hf}", "stages": len(spec.stages), "seq": seq, "microbatch_size": microbatch_size,
                         **({"layers_per_stage": layers_per_stage} if layers_per_stage else {})}
        if per_layer:
            kinds = profiler.unit_kinds([0, *([1] * (len(spec.stages) - 2)), 0])
    else:
        if model_arg and not model:
            raise ZbError("--model-arg applies to --model")
        if model:
            args = profiler.parse_model_args(model_arg)
            spec = profiler.load_model(model, args)
            if per_layer and "layers_per_stage" in args:  # the build function's cut into units names their kinds
                text = str(args["layers_per_stage"])
                counts = [int(x) for x in text.split(",")] if all(x.strip().isdigit() for x in text.split(",")) else []
                if len(counts) == len(spec.stages):
                    kinds = profiler.unit_kinds(counts)
        elif builtin == "moe":
            from zbsearch.models.moe import MoEConfig

            moe = MoEConfig(layers=layers, hidden=hidden, heads=heads, seq=128 if seq is None else seq,
                            microbatch_size=4 if microbatch_size is None else microbatch_size, stages=stages,
                            experts=experts, top_k=top_k)
            if per_layer:
                moe = moe.units()
                kinds = profiler.unit_kinds(list(moe.cut or ()))
            moe.check()
            if ep is not None and (ep < 2 or moe.experts % ep):
                raise ZbError(f"--ep {ep}: the {moe.experts} experts must split over at least 2 processes")
            spec = profiler.builtin_moe(moe)
        else:
            cfg = GPTConfig(layers=layers, hidden=hidden, heads=heads, seq=128 if seq is None else seq,
                            microbatch_size=4 if microbatch_size is None else microbatch_size, stages=stages)
            if per_layer:
                cfg = cfg.units()
                kinds = profiler.unit_kinds(list(cfg.cut or ()))
            spec = profiler.builtin_gpt(cfg)
            if per_layer:
                spec.name = f"gpt-l{cfg.layers}-h{cfg.hidden}-s{cfg.seq}-b{cfg.microbatch_size}-units"
    settings = profiler.Settings(device=device, dtype=dtype, warmup=warmup, repeat=repeat, rounds=rounds, threads=threads,
                                 keep_heap=keep_heap, timeout=timeout, recompute=recompute, in_step=in_step,
                                 selective=mode)
    if ep is not None:  # refused here, before the line announcing the group, where the device cannot hold it
        from zbsearch.profiler.experts import expert_group

        expert_group(settings, ep)
    if per_layer:
        if ep is not None:
            import functools

            from zbsearch.profiler.experts import layers_expert_parallel

            err.print(f"profiling the units on an expert-parallel group of {ep} local processes", highlight=False)
            found = layers_expert_parallel(functools.partial(profiler.builtin_moe, moe), ep, settings, kinds=kinds,
                                           name=name, link=link)
        else:
            with profiler.progress_bar(err) as bar:
                found = profiler.profile_layers(spec, settings, kinds=kinds, name=name, progress=bar, link=link)
        if target is None or str(target) != "-":
            out.print(profiler.layers_table(found))
        _write(found, target or Path("profiles") / f"{found.name}.json")
        return
    pieces = _pieces(placement, len(spec.stages)) if placement is not None else None
    if name is None and placement is not None:
        name = f"{spec.name}-{device.split(':')[0]}-{placement}"
    if name is None and tp > 1:
        name = f"{spec.name}-{device.split(':')[0]}-tp{tp}{'-sp' if sequence_parallel else ''}"
    measure = dp if dp is not None and dp_bandwidth is None else None  # timed on a real group
    if ep is None:
        with profiler.progress_bar(err) as bar:
            prof = profiler.profile_model(spec, settings, placement=pieces, name=name, progress=bar, replicas=measure,
                                          tp=tp, sequence_parallel=sequence_parallel,
                                          shard=shard and measure is not None, link=link)
    else:
        import functools

        from zbsearch.profiler.experts import profile_expert_parallel

        err.print(f"profiling on an expert-parallel group of {ep} local processes", highlight=False)
        prof = profile_expert_parallel(functools.partial(profiler.builtin_moe, moe), ep, settings, name=name, link=link)
    if prof is None:  # a torchrun rank other than 0
        return
    if dp is not None and dp_bandwidth is not None:
        from zbsearch.profiler.gradients import with_data_parallel
        from zbsearch.profiler.settings import resolve_device, resolve_dtype

        prof = with_data_parallel(prof, spec.stages, dp, dp_bandwidth, resolve_device(device), resolve_dtype(dtype),
                                  sharded=shard, sharing=sharing)
    if dp is not None and name is not None:  # the name given, not the one the reductions add -dpN to
        prof = prof.model_copy(update={"name": name})
    if target is None or str(target) != "-":
        out.print(profiler.summary_table(prof))
    elif prof.measured is not None:  # the profile goes to stdout: the warnings to stderr
        for w in prof.measured.warnings:
            err.print(f"warning: {w}", style="yellow", highlight=False, soft_wrap=True)
    _write(prof, target or Path("profiles") / f"{prof.name}.json")


def _selective_mode(text: str | None) -> str | None:
    """``--selective``'s mode: attention unless given, None for none."""
    from zbsearch.formats.profile import SELECTIVE_MODES

    if text is None:
        return "attention"
    if text == "none":
        return None
    if text not in SELECTIVE_MODES:
        raise ZbError(f"--selective {text!r}: choose {', '.join(SELECTIVE_MODES)} or none")
    return text


def _pieces(placement: str, pieces: int) -> list[int]:
    """piece -> rank for 2 pieces per rank in a V or looped (interleaved) placement."""
    from zbsearch.layout import placement as layout

    if placement not in ("v", "interleaved"):
        raise ZbError(f"--placement {placement!r}: use v or interleaved")
    if pieces % 2:
        raise ZbError(f"--placement {placement}: {pieces} stages cannot be 2 pieces per rank")
    return layout(pieces // 2, 2, "v" if placement == "v" else "looped")


@app.command()
def demo(
    stages: int | None = typer.Option(None, "--stages", help="pipeline ranks, one stage each (default: 4, or 4 / --dp)"),
    m: int = typer.Option(8, "-m", "--microbatches", help="microbatches per iteration"),
    dp: int = typer.Option(1, "--dp", help="data-parallel replicas of the pipeline: a mesh of stages x dp local processes, "
                           "gradients reduced across replicas, overlapped with the passes"),
    layers: int = typer.Option(8, "--layers", help="gpt: transformer layers"),
    hidden: int = typer.Option(128, "--hidden", help="gpt: hidden size"),
    heads: int = typer.Option(4, "--heads", help="gpt: attention heads"),
    seq: int = typer.Option(128, "--seq", help="gpt: sequence length"),
    microbatch_size: int = typer.Option(4, "--microbatch-size", "-b", help="gpt: sequences per microbatch"),
    emulate: bool | None = typer.Option(
        None,
        "--emulate/--real",
        help="replay with stages that sleep the profiled times, or with the real passes; "
        "default: emulate when the CPU has fewer cores than ranks",
    ),
    steps: int = typer.Option(3, "--steps", help="measured iterations per schedule"),
    time_limit: float = typer.Option(10.0, "--time-limit", "-t", min=0.1, help="seconds for the ZB-2p solver"),
    device: str = typer.Option("cpu", "--device", help="cpu (gloo), or cuda (NCCL, one GPU per rank)"),
    output: str = typer.Option("zbsearch-demo", "-o", "--output", help="folder for the profile, schedules, traces and gantt.png"),
):
    """Profile a small GPT on p local ranks, solve ZB-2p, replay it and 1F1B, compare with the prediction."""
    from zbsearch.app.demo import DemoConfig, contention_note, run_demo, should_emulate
    from zbsearch.models import GPTConfig
    from zbsearch.profiler import progress_bar, summary_table

    if output == "":
        raise ZbError("-o: the output folder is empty")
    folder = Path(output)
    if folder.exists() and not folder.is_dir():
        raise ZbError(f"{folder}: exists and is not a folder; -o names the folder for the demo's files")
    check_writable(folder / "profile.json")
    if dp < 1:
        raise ZbError(f"--dp must be at least 1, not {dp}")
    if stages is None:
        stages = max(2, 4 // dp)
    if emulate is None:
        emulate = should_emulate(stages * dp, device)
    cfg = DemoConfig(
        gpt=GPTConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, microbatch_size=microbatch_size, stages=stages),
        microbatches=m, emulate=emulate, steps=steps, time_limit=time_limit, device=device, out=folder, dp=dp,
    )
    cfg.check()
    with progress_bar(err) as bar:
        run = run_demo(cfg, bar)
    out.print(summary_table(run.profile))
    if run.measured_after is not None:
        _demo_mesh_table(run, cfg)
    else:
        _demo_table(run, stages, m, emulate)
    note = contention_note(cfg)
    if note:
        out.print(note, soft_wrap=True)
    err.print(f"wrote {', '.join(str(f) for f in run.files)}", highlight=False, soft_wrap=True)


def _demo_table(run, stages: int, m: int, emulate: bool) -> None:
    """One pipeline: predicted against measured iteration, bubble and memory per schedule."""
    t = Table(title=f"p={stages}, m={m}, {'emulated' if emulate else 'real'} passes; iteration = longest per-rank span")
    for col in ("schedule", "predicted\nms", "measured\nms", "measured\n/ predicted", "predicted\nbubble",
                "peak activations MiB\npredicted / measured"):
        t.add_column(col, justify="right")
    for name, sched, pred, meas, peak in zip(run.names, run.schedules, run.predicted, run.measured,
                                             run.measured_peak_memory):
        assert sched.predicted is not None  # the demo's schedules are built or solved, so predicted
        t.add_row(name, f"{pred:.1f}", f"{meas:.1f}", f"{meas / pred:.2f}", f"{sched.predicted.bubble_rate:.3f}",
                  f"{max(sched.predicted.peak_memory) / 2**20:.1f} / {peak / 2**20:.1f}")
    _show(t)
    (p0, p1), (m0, m1) = run.predicted, run.measured
    out.print(f"speed-up of {run.names[1]} over 1F1B: predicted {p0 / p1:.2f}x, measured {m0 / m1:.2f}x")


def _demo_mesh_table(run, cfg) -> None:
    """A mesh: each schedule with the reductions after the step and overlapped, barrier to barrier."""
    t = Table(title=f"p={cfg.gpt.stages} x dp={cfg.dp}, m={cfg.microbatches}, {'emulated' if cfg.emulate else 'real'} passes; "
                    "iteration = barrier to barrier, gradient reductions included")
    for col in ("schedule", "predicted\npasses ms", "reductions\nalone ms", "measured, reduced\nafter the step ms",
                "measured,\noverlapped ms", "saved\nms"):
        t.add_column(col, justify="right")
    for name, pred, red, after, over in zip(run.names, run.predicted, run.reduction_ms, run.measured_after, run.measured):
        t.add_row(name, f"{pred:.1f}", f"{red:.1f}", f"{after:.1f}", f"{over:.1f}", f"{after - over:+.1f}")
    _show(t)
    (a0, a1), (m0, m1) = run.measured_after, run.measured
    out.print(f"speed-up of {run.names[1]} over 1F1B with the reductions: {a0 / a1:.2f}x reduced after the step, "
              f"{m0 / m1:.2f}x overlapped", soft_wrap=True)


def _usage_error_classes() -> tuple[type[Exception], type[Exception]]:
    """typer's usage-error class and the base of its command-line errors. Both are bases of the
    public ``typer.BadParameter``: click's classes where typer uses click, its own copy where
    typer carries one, so they are found from it rather than imported from either."""
    bases = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
    return bases["UsageError"], bases["ClickException"]


def _version(value: bool) -> None:
    if value:
        out.print(f"zbsearch {zb.__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
) -> None:
    """Zero Bubble pipeline-parallel schedules: build, simulate, validate, compare, solve, replay."""


_STARTED: float | None = None  # when the command began (time.monotonic()): a time limit counts from there


def _process_age() -> float:
    """Seconds since this process started (Linux's /proc; 0 where unknown): the interpreter's
    start and the imports before ``main`` run count towards a command's time limit too."""
    import os

    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start, in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def main(argv: list[str] | None = None) -> None:
    """Run the command line on ``argv`` (default: the process's arguments) and exit."""
    global _STARTED
    # the process's own command line: from the process's start; called with arguments (from
    # Python, a test), from now
    _STARTED = time.monotonic() - (_process_age() if argv is None else 0.0)
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:  # bare ``zbsearch``: the help, exit 0
        args = ["--help"]
    usage_error, cli_error = _usage_error_classes()
    try:
        code = app(args=args, prog_name="zbsearch", standalone_mode=False)
    except usage_error as e:
        ctx = getattr(e, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _fail(f"error: {e.format_message()}{hint}", 2)  # type: ignore[attr-defined]
    except cli_error as e:  # e.g. an unreadable file argument
        _fail(f"error: {e.format_message()}")  # type: ignore[attr-defined]
    except ZbError as e:
        _fail(f"error: {e}")
    except (KeyboardInterrupt, typer.Abort):
        _fail("interrupted", 130)
    if code == 130:  # typer turns Ctrl-C inside a command into Exit(130), returned here
        _fail("interrupted", 130)
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
