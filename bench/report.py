"""Render a benchmark's saved results (``bench/results/*.json``) as a dated markdown report.

A report records what its numbers were measured on: the machine, the load average, the commit
and the date, each taken from the results file where it has them. Where a file lacks one, the
report says so and gives what git knows instead: the commit that saved the file, and its date.
Text below the notes marker of an existing report is kept, so comments written by hand
survive a regeneration.

Run: python bench/report.py TOPIC [RESULTS.json ...] [--hardware TAG] [--date YYYY-MM-DD] [-o FILE]
     python bench/report.py --list
The report goes to bench/reports/TOPIC_HARDWARE_DATE.md (or -o; '-' for stdout); a later run of
the topic on a day that has its report already takes --date DATE-2 (DATE-3, ...). The docs site
lists the newest report of each name (``reports_by_name``) and marks the earlier ones superseded.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
REPORTS = BENCH / "reports"
NOTES = "<!-- notes: text below this line is kept when the report is regenerated -->"


# ---------------------------------------------------------------- report files

# NAME_HARDWARE_DATE.md; a later run of one name on one day that already has a report adds -N
# to the date (the N-th run that day; the plain date is the first). NAME is the topic, or what
# --name gave in its place; it holds no underscore, HARDWARE none either.
_REPORT_NAME = re.compile(r"(?P<name>[^_]+)_(?P<hardware>[^_]+)_(?P<date>\d{4}-\d{2}-\d{2}|undated)(?:-(?P<run>[2-9]|[1-9]\d+))?")


@dataclass(frozen=True)
class ReportFile:
    """One report in ``bench/reports``, as its file name describes it."""

    path: Path
    name: str  # its topic: the docs site's Results menu shows the newest report of each name
    hardware: str
    date: str  # YYYY-MM-DD, or undated
    run: int  # 1 for the first run of the name on that day

    @property
    def when(self) -> tuple[str, int]:
        """What orders the reports of one name, oldest first (an undated one is the oldest)."""
        return ("" if self.date == "undated" else self.date, self.run)

    @property
    def label(self) -> str:
        """The date, and the run where it is not the day's first."""
        return self.date if self.run == 1 else f"{self.date}, run {self.run}"

    @property
    def title(self) -> str:
        """The report's heading."""
        return self.path.read_text().splitlines()[0].lstrip("# ").strip()


def report_file(path: Path) -> ReportFile:
    """What a report's file name says (ValueError: a name outside the rule above)."""
    found = _REPORT_NAME.fullmatch(path.stem)
    if not found or path.suffix != ".md":
        raise ValueError(f"{path.name}: a report is named NAME_HARDWARE_DATE.md (DATE: YYYY-MM-DD, -N for a later run "
                         "that day)")
    return ReportFile(path, found["name"], found["hardware"], found["date"], int(found["run"] or 1))


def reports_by_name(folder: Path = REPORTS) -> dict[str, list[ReportFile]]:
    """Each name's reports in ``folder``, newest first, names in order (ValueError: a file named
    outside the rule, or two reports of one name with one date and run)."""
    out: dict[str, list[ReportFile]] = {}
    for path in sorted(folder.glob("*.md")):
        rep = report_file(path)
        out.setdefault(rep.name, []).append(rep)
    for reps in out.values():
        reps.sort(key=lambda r: r.when, reverse=True)
        for a, b in zip(reps, reps[1:]):
            if a.when == b.when:
                raise ValueError(f"{b.path.name} and {a.path.name}: two reports of {a.name} dated {a.label}, neither "
                                 "the later; give the later one's date the next run number (-N)")
    return dict(sorted(out.items()))


# ---------------------------------------------------------------- provenance


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def _saved_in(path: Path) -> tuple[str, str]:
    """(short commit, date) of the last commit that changed ``path``; empty where git does not know."""
    line = _git("log", "-1", "--format=%h %ad", "--date=short", "--", str(path.relative_to(ROOT)))
    commit, _, date = line.partition(" ")
    return commit, date


def _loads(values) -> str:
    if isinstance(values, str):
        found = re.search(r"load average:?\s*([\d.]+),?\s+([\d.]+),?\s+([\d.]+)", values) or re.match(
            r"([\d.]+) ([\d.]+) ([\d.]+)", values)
        return " / ".join(found.groups()) if found else values
    return " / ".join(f"{v:.2f}" for v in values)


@dataclass
class Machine:
    text: str  # what it was, in words
    tag: str  # the hardware part of the report's file name
    load: list[str]  # load averages, each with where it was read


def _machine(doc: dict) -> Machine:
    """What a results file says about its machine (older files say less, in other places)."""
    m = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    named = [v for v in (doc.get("device"), doc.get("cpu")) if isinstance(v, str)]
    cpu = m.get("cpu") or (named[0].removeprefix("cpu: ").split(",")[0] if named else None)
    cores = m.get("cores") or doc.get("cores") or doc.get("cpus")
    if cores is None and isinstance(doc.get("cpu"), int):
        cores = doc["cpu"]
    if cores is None and isinstance(doc.get("device"), str):
        found = re.search(r"(\d+) cores", doc["device"])
        cores = int(found.group(1)) if found else None
    cpu = cpu if isinstance(cpu, str) else None
    parts = [cpu or "CPU model not recorded", f"{cores} cores" if cores else "cores not recorded"]
    torch = m.get("torch") or doc.get("torch")
    python = m.get("python") or doc.get("python")
    parts.append(f"Python {python}" if python else "Python not recorded")
    parts.append(f"torch {torch}" if torch else "torch not recorded or not used")
    if isinstance(doc.get("machine"), str):
        parts.append(doc["machine"])
    words = [w for w in re.sub(r"[^a-z0-9 ]", "", re.sub(r"\(r\)|\(tm\)", "", (cpu or "").lower())).split()
             if w not in ("amd", "intel", "processor", "cpu")]
    tag = f"{words[0] if words else 'cpu'}{cores or ''}{'c' if cores else ''}"
    gpu = m.get("gpu") or doc.get("gpu")
    if isinstance(gpu, str):  # a run on a GPU is named for it: the CPU beside it sets none of its figures
        parts.insert(0, gpu)
        tag = re.sub(r"[^a-z0-9]", "", gpu.lower().removeprefix("nvidia").split()[0] if gpu.split() else "gpu") or "gpu"
    load = []
    for key, where in (("load_before", "before the run"), ("load_per_round", "per round, 1-minute"),
                       ("load_after", "after the run")):
        if doc.get(key):
            load.append(f"{_loads(doc[key])} ({where})")
    if not load and doc.get("load_average") is not None:
        load.append(f"{_loads(doc['load_average'])} (as the results file records it)")
    for key in ("uptime", "v_costs_uptime"):
        if doc.get(key):
            load.append(f"{_loads(doc[key])} (1 / 5 / 15 minutes, `{key}`)")
    if m.get("load_average"):
        load.append(f"{_loads(m['load_average'])} (1 / 5 / 15 minutes, when the file was saved)")
    return Machine(", ".join(parts), tag, load)


@dataclass
class Source:
    """One results file: its content and where it was saved (a commit of this repository)."""

    name: str  # bench/results/NAME
    where: str  # the path or COMMIT:path it was read from
    doc: dict
    commit: str  # the commit that saved it; empty if git does not know
    date: str  # that commit's date


def source(spec: str) -> Source:
    """A results file on disk, or ``COMMIT:bench/results/NAME.json`` as saved in an earlier commit."""
    found = re.match(r"^([0-9a-f]{7,40}):(.+)$", spec)
    if found:
        commit, path = found.groups()
        text = _git("show", f"{commit}:{path}")
        if not text:
            sys.exit(f"error: no {path} in commit {commit}")
        date = _git("log", "-1", "--format=%ad", "--date=short", commit)
        return Source(Path(path).name, spec, json.loads(text), commit, date)
    path = Path(spec).resolve()
    if not path.is_file():
        sys.exit(f"error: no results file {spec}")
    inside = path.is_relative_to(ROOT)
    changed = inside and _git("status", "--porcelain", "--", str(path.relative_to(ROOT)))  # not committed as it is
    commit, date = _saved_in(path) if inside and not changed else ("", "")
    return Source(path.name, spec, json.loads(path.read_text()), commit, date)


def moe_run(docs: list[dict]) -> list[str]:
    doc = docs[0]
    c = doc["compute_ms"]
    lb = doc.get("load_before")
    out = [f"PP{doc['pp']} x EP{doc['ep']} on local gloo processes, m={doc['m']}. Each stage's compute is emulated (F "
           f"{c['f']:g}, B {c['b']:g}, W {c['w']:g} ms per stage, half per piece of a V, slept holding the process's one "
           "device); its expert all-to-all is real (dispatch and combine in F, their mirrors in B, "
           f"{doc['payload_kib']} KiB per rank each way). Per schedule the stages are first profiled as `zbsearch profile "
           f"--ep` profiles them ({doc['rounds']} timed rounds per stage, every expert peer at once): F, B and W alone "
           "with the runtime's split passes, the forward and fused backward of a BW (`t_ff`, `t_bw`), the all-to-all "
           "inside F and B, and a pair (F on a thread while another "
           "microbatch's B runs) against the two alone, which gives the stage's `pair_exposed`; the profile is the "
           "first expert peer's medians. "
           + ("Then, as `zbsearch profile` does under torchrun, the stages run the profiler's calibration steps of the "
              "runtime (1F1B, or ZB-V's order on the V; split and fused, every expert peer's pipeline at once): each "
              "pass costs its median in those steps, and the runtime's host time between two actions there (its mean "
              "gap where the next action's inputs were in) is the profile's `t_action`, added to every pass. "
              if any("t_action_ms" in r for r in doc["rows"]) else "Nothing else is calibrated. ") + "Then "
           f"{doc['iters']} steps after {doc['warmup']} of warm-up, barrier to barrier; median (± half the interquartile "
           "range)." + (f" Load average {lb[0]:.1f} when the run started." if lb else ""), "",
           "- *predicted*: the simulator's makespan on that profile (what `zbsearch simulate` predicts); *fully "
           "hidden*: the same with `pair_exposed` left out (the cost rule before it was measured)"
           + ("; *passes alone*: the same from the passes timed alone, without the steps and `t_action` (measured vs)."
              if any("t_action_ms" in r for r in doc["rows"]) else "."),
           "- *passes measured / profiled*: from the runtime's trace of each timed step, each kind of pass's time "
           "against the profile's (`zbsearch simulate --measured`), over every rank and replica; a pair is one block. "
           "*busy*: per pipeline rank, the time its passes held it in a step, predicted and traced (a pair counted once): "
           "what the measured iteration has beyond it is waits and the runtime's own work between passes.",
           ""]
    body, errs = [], []
    steps = all("t_action_ms" in r for r in doc["rows"])
    for r in doc["rows"]:
        st = r["profile"]["stages"]
        shares = [x.get("pair_exposed") for x in st if x.get("pair_exposed") is not None]
        runs = sorted(r["iteration_ms"])
        q = statistics.quantiles(runs, n=4) if len(runs) > 1 else [runs[0]] * 3
        errs.append(abs(r["vs_predicted"]))
        body.append([_kind(r["kind"]), str(r["pairs"]),
                     f"{st[0]['t_f']:.1f} / {st[0]['a_f']:.1f} / {st[0]['t_b']:.1f} / {st[0]['a_b']:.1f}",
                     f"{min(shares):.2f}-{max(shares):.2f}" if shares else "-",
                     f"{r['predicted_fully_hidden_ms']:.1f}" if r["pairs"] else "-"]
                    + ([f"{r['predicted_passes_alone_ms']:.1f} ({r['vs_passes_alone']:+.1%})", f"{r['t_action_ms']:.2f}"]
                       if steps else [])
                    + [f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f} ±{(q[2] - q[0]) / 2 / r['measured_ms']:.0%}",
                     f"{r['vs_predicted']:+.1%}",
                     ", ".join(f"{k} {v:.2f}" for k, v in r["pass_ratio"].items())]
                    + ([" / ".join(f"{p:.0f}→{m:.0f}" for p, m in zip(r["busy_predicted_ms"], r["busy_measured_ms"]))]
                       if "busy_measured_ms" in r else []))
    out += _table(["schedule", "pairs", "stage 0 t_f / a_f / t_b / a_b (ms)", "pair_exposed (stages)",
                   "predicted, fully hidden (ms)"] + (["passes alone (measured vs)", "t_action (ms)"] if steps else [])
                  + ["predicted (ms)", "measured (ms)", "measured vs predicted",
                   "passes measured / profiled"] + (["busy per rank, predicted→traced (ms)"]
                                                    if all("busy_measured_ms" in r for r in doc["rows"]) else []), body)
    out += [f"- {sum(e <= 0.05 for e in errs)} of {len(errs)} schedules within 5% of the prediction; largest "
            f"|measured / predicted - 1| {max(errs):.1%} (target 5%: {'met' if max(errs) <= 0.05 else 'not met'})."]
    if steps:
        alone = [abs(r["vs_passes_alone"]) for r in doc["rows"]]
        out += [f"- From the passes timed alone (no steps, no `t_action`): {sum(e <= 0.05 for e in alone)} of {len(alone)} "
                f"within 5%; largest {max(alone):.1%}."]
    return out + [""]


def header(title: str, command: str, sources: list[Source], duration: str) -> list[str]:
    machine = _machine(sources[0].doc)
    lines = [f"# {title}", "", "| | |", "|---|---|", f"| bench | `{command}` ({duration}) |",
             f"| machine | {machine.text} |"]
    lines.append("| load average | " + ("; ".join(machine.load) if machine.load else "not recorded") + " |")
    for src in sources:
        rec = src.doc.get("machine") if isinstance(src.doc.get("machine"), dict) else {}
        saved = f"`{src.commit}`" if src.commit else "an uncommitted change"
        lines.append(f"| commit measured ({src.name}) | " + (f"`{rec['commit']}`" if rec.get("commit") else
                     f"not recorded in the file; it was saved in {saved}") + " |")
        lines.append(f"| date ({src.name}) | " + (rec.get("date") or (f"{src.date} (the day the file was committed; "
                     "the run's own date is not recorded)" if src.date else "not recorded")) + " |")
        if _current(src):
            lines.append(f"| data | [bench/results/{src.name}](../results/{src.name})"
                         + (f" as saved in commit `{src.commit}`" if src.commit else "") + " |")
        elif not src.commit:
            lines.append(f"| data | `{src.where}` (not committed) |")
        else:
            lines.append(f"| data | `git show {src.commit}:bench/results/{src.name}` (replaced since by a later run) |")
    return [*lines, ""]


def _current(src: Source) -> bool:
    """Whether the saved file in bench/results is the one this source was read from."""
    path = RESULTS / src.name
    return path.is_file() and json.loads(path.read_text()) == src.doc


# ---------------------------------------------------------------- formatting


def _round(x: float, digits: int) -> str:
    """``x`` to ``digits`` decimals, halves rounded up as written in decimal (0.00045 -> 0.0005)."""
    q = Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    return f"{q:f}".replace("-0.", "0.") if q == 0 else f"{q:f}"


def _rate(x: float) -> str:
    """A bubble rate as the tables print it: .1585."""
    return _round(x, 4).removeprefix("0")


def _paper(x: float, digits: int = 3) -> str:
    """A figure of the paper's tables, to the decimals it prints (3 for Table 5, 4 for ZB-2p and ZB-V)."""
    return _round(x, digits).removeprefix("0")


def _secs(t: float) -> str:
    return f"{_round(t, 1)} s" if t < 9.95 else f"{_round(t, 0)} s"


def _pct(x: float, digits: int = 2) -> str:
    return f"{_round(100 * x, digits)}%"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows), ""]


_MODELS = ["1.5b", "6.2b", "14.6b", "28.3b"]
_KINDS = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2", "zb-v": "ZB-V", "zb-2p": "ZB-2p (solver)"}


def _kind(name: str) -> str:
    """'ours zb-h1' -> 'ours ZB-H1'; torch's class names stay as they are."""
    return " ".join(_KINDS.get(word, word) for word in name.split())


def _model(name: str) -> str:
    return name.upper() if name.endswith("b") else name


# ---------------------------------------------------------------- topics


def classic(docs: list[dict]) -> list[str]:
    rows = docs[0]["rows"]
    out = ["## Table 5: bubble rates, ours / paper", ""]
    t5 = [r for r in rows if r["table"] == 5]
    keys = sorted({(r["model"], r["p"], r["m"]) for r in t5}, key=lambda k: (_MODELS.index(k[0]), k[2]))
    body = []
    for model, p, m in keys:
        cells = {r["kind"].split()[0]: r for r in t5 if (r["model"], r["p"], r["m"]) == (model, p, m)}
        inter = cells["interleaved-1f1b"]
        v = inter["kind"].split()[1]
        pair = {k: f"{_rate(r['ours'])} / {_paper(r['paper'])}" for k, r in cells.items()}
        body.append([_model(model), str(p), str(m), pair["1f1b"], f"{pair['interleaved-1f1b']} ({v})", pair["zb-h1"],
                     pair["zb-h2"]])
    out += _table(["model", "p", "m", "1F1B", "1F1B-I", "ZB-H1", "ZB-H2"], body)
    close = [abs(r["diff"]) for r in t5 if r["kind"] in ("1f1b", "zb-h1", "zb-h2")]
    inter = [r["diff"] for r in t5 if r["kind"].startswith("interleaved")]
    out += [f"1F1B, ZB-H1 and ZB-H2: largest difference from the paper {max(close):.4f} over {len(close)} cells.",
            f"Interleaved 1F1B: {min(inter):+.4f} to {max(inter):+.4f}.", ""]
    t8 = [r for r in rows if r["table"] == 8]
    if t8:
        out += ["## Table 8: ZB-V at p · M_B, ours / paper", ""]
        body = [[_model(r["model"]), str(r["p"]), str(r["m"]), f"{_rate(r['ours'])} / {_paper(r['paper'], 4)}",
                 f"{r['diff']:+.4f}", r.get("profile", "")] for r in t8]
        out += _table(["model", "p", "m", "ZB-V", "difference", "profile"], body)
    return out


def _cell(r: dict) -> str:
    state = "optimal" if r["status"] == "optimal" else f"gap {_pct(r['gap'])}"
    digits = 3 if r["limit"] == "1p" else 4
    return f"{_rate(r['bubble'])} / {_paper(r['paper'], digits)}, {state}, {_secs(r['time_s'])}"


def solver(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = doc["rows"]
    out = []
    rerun = doc.get("rerun")
    if rerun:
        out += [f"The file merges runs of its sections; the last re-ran `--only {','.join(rerun.get('only') or [])}`"
                + (f" `--match {','.join(rerun['match'])}`" if rerun.get("match") else "") + ".", ""]
    t5 = [r for r in rows if r["setting"] == "table5"]
    if t5:
        out += ["## Table 5 settings: ZB-1p and ZB-2p", "",
                "Bubble rate (ours / paper), status or gap to our lower bound, solve time.", ""]
        keys = sorted({(r["model"], r["m"]) for r in t5}, key=lambda k: (_MODELS.index(k[0]), k[1]))
        body = []
        for model, m in keys:
            cell = {r["limit"]: r for r in t5 if (r["model"], r["m"]) == (model, m)}
            body.append([f"{_model(model)} m{m}", *(_cell(cell[k]) if k in cell else "-" for k in ("1p", "2p"))])
        out += _table(["setting", "ZB-1p", "ZB-2p"], body)
        gaps = [r["gap"] for r in t5 if r["limit"] == "2p" and r["status"] != "optimal"]
        worse = [r for r in t5 if r["limit"] == "2p" and float(_round(r["bubble"], 4)) > r["paper"]]
        out += [f"At 2p: {sum(r['status'] == 'optimal' for r in t5 if r['limit'] == '2p')} of "
                f"{sum(r['limit'] == '2p' for r in t5)} proven optimal" +
                (f", the other gaps {_pct(min(gaps))}-{_pct(max(gaps))}" if gaps else "") +
                f"; above the paper's ZB-2p: {len(worse)} of {sum(r['limit'] == '2p' for r in t5)}.", ""]
    t8 = [r for r in rows if r["setting"] == "table8"]
    if t8:
        out += ["## Table 8 settings: V placement (`--placement v`) at 1p", ""]
        body = [[_model(r["model"]), str(r["p"]), str(r["m"]), f"{_rate(r['bubble'])} / {_paper(r['paper'], 4)}",
                 r["status"], _pct(r["gap"]), _secs(r["time_s"]), r["construction"]] for r in t8]
        out += _table(["model", "p", "m", "bubble, ours / paper", "status", "gap", "time", "construction"], body)
    het = [r for r in rows if r["setting"] == "hetero"]
    if het:
        out += ["## Heterogeneous stages: per-stage costs against `--uniform-costs`", ""]
        body = [[r["variant"], r["limit"], f"{r['span']:.1f}", f"{r['uniform_costs_span']:.1f}",
                 _pct(r["span_reduction"], 1), r["status"], _pct(r["gap"])] for r in het]
        out += _table(["1.5B, m=24", "limit", "span (ms)", "span, uniform costs (ms)", "span cut", "status", "gap"], body)
    for r in (r for r in rows if r["setting"] in ("held-out", "issue10")):
        out += ["## Held-out case: p=8, m=16, 2p, unit pass times, comm 0.1", "",
                *_table(["span", "lower bound", "optimum (CP-SAT)", "paper's scheduler", "first reached target", "status"],
                        [[f"{r['span']}", f"{r['lower_bound']}", f"{r['optimum_span']}", f"{r['paper_span']}",
                          _secs(r["time_to_target_s"]), f"{r['status']} after {_secs(r['time_s'])}"]])]
    speed = [r for r in rows if r["setting"] == "speed"]
    if speed:
        out += ["## Speed at 2p", ""]
        body = [[f"{_model(r['model'])} p={r['p']} m={r['m']}", _secs(r["time_to_first_s"]), _secs(r["time_to_1pct_s"]),
                 _secs(r["time_s"]), _pct(r["gap"]), f"{r['target_s']} s"] for r in speed]
        out += _table(["setting", "first valid schedule", "within 1% of the bound", "solve time", "final gap",
                       "time limit"], body)
    lim = [r for r in rows if r["setting"] == "limits"]
    if lim:
        out += ["## Time limits: wall time against `--time-limit` (target: 10% + 1 s)", ""]
        body = []
        for r in lim:
            result = r["status"] if r["what"] != "solve" else f"{r['status']}, {r['construction']}, gap {_pct(r['gap'], 3)}"
            body.append([f"{r['what']} {r['model']} p={r['p']} m={r['m']}", f"{r['time_limit_s']:g}",
                         f"{r['elapsed_s']:.2f} s", result, f"{r['load_average']:.2f}",
                         "yes" if r["target_met"] else "no"])
        out += _table(["run", "-t", "wall", "result", "load", "within target"], body)
    return out


def solver_gap(docs: list[dict]) -> list[str]:
    doc = docs[0]
    s = doc["settings"]
    out = [f"{s['count']} instances (seed {s['seed']}), each solved for span and makespan at `-t {s['time_limit']:g}`; "
           f"the oracle had {s['oracle_time']:g} s of CP-SAT deterministic time per solve.", ""]
    body = []
    for key, v in doc["summary"].items():
        objective, chunks, family = key.split()
        place = "1 chunk" if chunks == "chunks=1" else "V"
        body.append([objective, place, family, str(v["n"]), _pct(v["within_1pct"], 0), _pct(v["within_3pct"], 0),
                     _pct(v["max_gap"]), f"{v['solve_time_mean_s']:.2f} / {v['solve_time_max_s']:.2f} s",
                     str(v["unsound_bound"]), str(v["false_optimal"]), str(v["invalid"]), str(v["oracle_unproven"])])
    out += _table(["objective", "placement", "family", "instances", "within 1%", "within 3%", "max gap",
                   "mean / max solve time", "bound above optimum", "false `optimal`", "invalid", "oracle unproven"], body)
    out += ["Gaps are to the oracle's optimum; where the oracle did not prove one (last column), to its best schedule.", ""]
    return out


def solver_family(docs: list[dict]) -> list[str]:
    out = []
    for doc in docs:
        s = doc["settings"]
        after = s.get("after") or "the checkout it ran in"
        mode = "heuristics only (`--no-milp`)" if s.get("no_milp") else "full solve"
        su = doc["summary"]
        out += [f"## {s['before']} against {after}: {mode}", "",
                f"{su['n']} instances (seed {s['seed']}), `-t {s['time_limit']:g}`; load average when saved: "
                f"{_loads(doc['machine']['load_average'])}.", ""]
        out += _table(["", "before", "after"], [
            ["better / worse / same", "", f"{su['better']} / {su['worse']} / {su['same']}"],
            ["mean gap to the bound", _pct(su["mean_gap_to_bound_before"]), _pct(su["mean_gap_to_bound_after"])],
            ["at the bound", str(su["at_bound_before"]), str(su["at_bound_after"])],
            ["mean time to the final span", f"{su['mean_time_to_final_before_s']:.2f} s",
             f"{su['mean_time_to_final_after_s']:.2f} s"]])
        changed = [r for r in doc["rows"] if abs(r["before"]["span"] - r["after"]["span"]) > 1e-9]
        if changed:
            body = [[str(r["p"]), str(r["m"]), r["limit"], f"{r['comm']:g}", "yes" if r["hetero"] else "no",
                     f"{r['before']['span']:g}", f"{r['after']['span']:g}", f"{r['after']['bound']:g}"] for r in changed]
            out += ["Instances whose span changed:", "",
                    *_table(["p", "m", "limit", "comm", "hetero", "span before", "span after", "bound"], body)]
    return out


def runtime(docs: list[dict]) -> list[str]:
    doc = docs[0]
    ms = sorted(doc["emulated"], key=int)
    out = [f"p={doc['p']}, emulated stages with the {_model(doc['model'])} paper costs, {doc['iters']} timed iterations "
           f"after {doc['warmup']} of warm-up.", "",
           "## Emulated passes: iteration time (ms), (measured / predicted makespan - 1)", ""]
    names = list(doc["emulated"][ms[0]])
    body = []
    for name in names:
        cells = []
        for m in ms:
            r = doc["emulated"][m][name]
            extra = (f" ({r['measured_makespan_ms'] / r['predicted_makespan_ms'] - 1:+.1%})"
                     if "predicted_makespan_ms" in r else "")
            cells.append(f"{r['iteration_ms']:.1f}{extra}")
        body.append([_kind(name), *cells])
    out += _table(["schedule", *(f"m={m}" for m in ms)], body)
    for m in ms:
        t = doc["targets"][m]
        e = doc["emulated"][m]
        predicted = e["ours 1f1b"]["predicted_makespan_ms"] / e["ours zb-2p"]["predicted_makespan_ms"]
        vs = ", ".join(f"{k} {v:.3f}" for k, v in t["ours vs torch, same kind (>= 1 is faster)"].items())
        out.append(f"- m={m}: ZB-2p {t['zb-2p vs 1f1b']:.3f}x our 1F1B (predicted {predicted:.3f}x); "
                   "largest |measured / predicted makespan - 1| "
                   f"{t['max |measured/predicted makespan - 1|']:.1%}; ours against torch's of the same kind: {vs}.")
    out.append("")
    if doc.get("overhead"):
        out += ["## Zero-time passes: the runtime's own time", ""]
        body = [[_kind(name), f"{r['iteration_ms']:.1f}", str(r.get("actions_per_rank", "-"))]
                for name, r in doc["overhead"].items()]
        out += _table(["schedule", "iteration (ms)", "actions per rank"], body)
    if doc.get("real"):
        out += ["## Real compute: p=2, small GPT, one thread per rank", ""]
        body = [[_kind(name), f"{r['iteration_ms']:.1f}", f"{r['measured_makespan_ms']:.1f}", f"{r['predicted_makespan_ms']:.1f}"]
                for name, r in doc["real"].items()]
        out += _table(["schedule", "iteration (ms)", "measured makespan (ms)", "predicted makespan (ms)"], body)
    return out


def real(docs: list[dict]) -> list[str]:
    doc = docs[0]
    c = doc["config"]
    out = [f"GPT, hidden {c['hidden']}, {c['layers']} layers, seq {c['seq']}, microbatch {c['batch']}, m={c['m']}; "
           f"{c['steps']} timed steps per schedule in {c['rounds']} rounds; busy: {'yes' if doc['busy'] else 'no'}.",
           f"Profiling took {doc['profile_seconds']:.0f} s of the {doc['total_seconds']:.0f} s.", "",
           "## Step time against the prediction", ""]
    body = []
    for name, r in doc["rows"].items():
        w = r["wall_ms"]
        mk = f"{r['makespan_ms']['median']:.1f}" if "makespan_ms" in r else "-"
        ratio = (f"{r['measured_over_predicted']:.3f}" if "measured_over_predicted" in r
                 else f"{r['wall_over_predicted']:.3f} (wall)")
        reps = []
        if "predicted_repetitions_ms" in r:
            over = r.get("measured_over_repetitions")
            reps = [f"{r['predicted_repetitions_ms']:.1f}" + (f" ({over:.3f})" if over is not None else "")]
        body.append([_kind(name), f"{w['median']:.1f} ({w['q1']:.1f}-{w['q3']:.1f})", mk, f"{r['predicted_makespan_ms']:.1f}",
                     f"{r['predicted_first_round_ms']:.1f}", *reps, ratio])
    with_reps = ["repetitions only (measured / it)"] if "predicted_repetitions_ms" in next(iter(doc["rows"].values())) else []
    out += _table(["schedule", "wall ms median (q1-q3)", "makespan ms", "predicted ms", "1st round", *with_reps,
                   "measured / predicted"], body)
    out += ["\"1st round\" is what the first profiler round alone predicts; the prediction pools every round."
            + (" \"Repetitions only\" is what the profiler's repetitions predict without its steps' pass times."
               if with_reps else ""), "",
            "## Speed-up over our 1F1B", ""]
    body = [[_kind(name), f"{v['predicted']:.3f}x", f"{v['measured_wall']:.3f}x"] for name, v in doc["speedups_vs_1f1b"].items()]
    out += _table(["schedule", "predicted", "measured (wall)"], body)
    out += ["## Targets", "", *_table(["target", "schedule", "met", "detail"],
                                        [[v["target"], v["schedule"], "yes" if v["met"] else "no", v["detail"]]
                                         for v in doc["verdicts"]]), doc["summary"], ""]
    out += ["## Per-pass time, runtime against the pooled profile (measured / predicted)", ""]
    body = []
    for name, r in doc["rows"].items():
        for p in r.get("passes", []):
            body.append([_kind(name), str(p["rank"]), p["op"], f"{p['measured_ms']:.2f}", f"{p['predicted_ms']:.2f}",
                         f"{p['ratio']:.3f}"])
    out += _table(["schedule", "rank", "pass", "measured ms", "predicted ms", "ratio"], body)
    out += ["## Where each rank's idle time went (ms per step)", ""]
    body = []
    for name, r in doc["rows"].items():
        for w in r.get("waits", []):
            body.append([_kind(name), str(w["rank"]), f"{w['idle_ms']:.1f}", f"{w['dependency_ms']:.1f}", f"{w['link_ms']:.1f}",
                         f"{w['local_ms']:.1f}", f"{w['late_messages']:.1f}"])
    out += _table(["schedule", "rank", "idle", "dependency", "link", "local", "late messages"], body)
    return out


_SPLIT_MODELS = {"gpt": "GPT", "llama": "Llama", "moe": "MoE", "vit": "ViT"}


def _split_built(doc: dict) -> list[str]:
    """What the MoE and ViT stages were (files that name their models record it)."""
    out = []
    for model, sizes in doc.get("built", {}).items():
        b = next(iter(sizes.values()))
        if model == "moe":
            out.append(f"MoE: Hugging Face `{b['hf_model_type']}` with random weights, {b['num_experts']} routed experts "
                       f"of width hidden, top-{b['num_experts_per_tok']} routing, a shared expert of width 2 x hidden, "
                       f"{b['tokens']} tokens.")
        elif model == "vit":
            out.append(f"ViT: {b['image']} x {b['image']} images in {b['patch']} x {b['patch']} patches, "
                       f"{b['tokens']} tokens with the class token, {b['classes']} classes.")
    return out


def split(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = doc["rows"]
    models = doc.get("models", ["gpt", "llama"])
    names = " / ".join(_SPLIT_MODELS[m] for m in models)
    out = [f"One layer per stage, seq {doc['seq']}, microbatch {doc['batch']}, {doc['microbatches']} microbatches per step, "
           f"{doc['threads']} thread, {doc['steps']} steps. Ratios are a variant's backward time over a plain "
           "`loss.backward()` of the same stage in the same step (thread CPU time), median over steps; "
           + ("middle/last and fused are medians over the GPT and Llama-style models." if "models" not in doc else
              f"middle/last and fused are medians over the models ({names}), each model's own figures below."), ""]
    out += [*_split_built(doc), ""] if "built" in doc else []
    body = []
    for h in sorted({r["hidden"] for r in rows}):
        R = [r for r in rows if r["hidden"] == h]
        rest = [r for r in R if r["stage"] != "first"]
        first = {r["model"]: r for r in R if r["stage"] == "first"}
        body.append([
            str(h), f"{statistics.median(r['cpu']['ratio']['zb'] for r in rest):.2f}",
            f"{statistics.median(r['cpu']['ratio']['torch'] for r in rest):.2f}",
            " / ".join(f"{first[m]['cpu']['ratio']['zb']:.3f}" for m in models),
            " / ".join("deferred" if first[m]["first_stage_w"]["deferred"] else "plain" for m in models),
            " / ".join(f"{first[m]['cpu']['ratio']['torch']:.3f}" for m in models),
            " / ".join(f"{first[m]['cpu']['zb_over_torch']:.3f}" for m in models),
            f"{statistics.median(r['cpu']['ratio']['fused'] for r in R):.2f}"])
    out += _table(["hidden", "zb B+W, middle/last", "torch split, middle/last",
                   f"zb, first ({names if 'models' in doc else 'GPT / Llama'})",
                   "first stage's W, as picked", "torch, first (plain backward)", "zb / torch, first", "zb fused BW"], body)
    if "models" in doc:
        m = doc["microbatches"]
        body = [[_SPLIT_MODELS[r["model"]], str(r["hidden"]), r["stage"], f"{r['cpu']['step_ms']['plain'] / m:.2f}",
                 f"{r['cpu']['ratio']['zb']:.3f}", f"{r['cpu']['ratio']['torch']:.3f}", f"{r['cpu']['ratio']['fused']:.3f}",
                 f"{r['cpu']['zb_over_torch']:.3f} ({'-'.join(f'{x:.3f}' for x in r['cpu']['zb_over_torch_95'])})",
                 f"{r['load_1min']:.2f}"] for name in models for r in rows if r["model"] == name]
        out += ["Per model and stage (thread CPU time; plain: ms per microbatch; zb / torch with the 95% bootstrap "
                "interval of its median):", "",
                *_table(["model", "hidden", "stage", "plain ms", "zb", "torch", "fused", "zb / torch", "load"], body)]
    out += ["Targets, judged on CPU time and on wall time:", ""]
    for clock, targets in doc["targets"].items():
        out.append(f"- {clock}: " + "; ".join(f"{k}: {'met' if v is True else 'missed' if v is False else v}"
                                             for k, v in targets.items()))
    out.append("")
    above = [r for r in rows if r["cpu"]["zb_over_torch"] > 1]
    if above:
        body = [[r["model"], str(r["hidden"]), r["stage"], f"{r['cpu']['zb_over_torch']:.3f}",
                 "-".join(f"{x:.3f}" for x in r["cpu"]["zb_over_torch_95"])] for r in above]
        out += ["Cells where zb took longer than torch (95% bootstrap interval of the median):", "",
                *_table(["model", "hidden", "stage", "zb / torch", "95% interval"], body)]
    return out


def profiler(docs: list[dict]) -> list[str]:
    doc = docs[0]
    m = doc["model"]
    out = [f"Built-in GPT: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, seq {m['seq']}, microbatch "
           f"{m['microbatch_size']}, {m['stages']} stages, m={m['microbatches']}; {m['steps']} steps, {m['rounds']} rounds.",
           "", "## Runtime pass time against the profile (ms)", ""]
    body = []
    for p in doc["passes"]:
        body.append([str(p["stage"]), p["op"], f"{p['profiled_ms']:.2f}", f"{p['one_process_ms']:.2f}",
                     _pct(p["one_process_ms"] / p["profiled_ms"] - 1, 1), f"{p['processes_ms']:.2f}",
                     _pct(p["processes_ms"] / p["profiled_ms"] - 1, 1)])
    out += _table(["stage", "pass", "profile", "one process", "error", f"{m['stages']} processes", "error"], body)
    out += [f"- {k}: mean error {_pct(v['mean_abs_error'], 1)}, worst {_pct(v['max_abs_error'], 1)}"
            for k, v in doc["summary"].items()]
    return [*out, ""]


def hf(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = doc["exactness"]
    out = [f"transformers {doc.get('transformers')}, torch {doc.get('torch')}; took {doc.get('seconds', 0):.0f} s.", "",
           "## Largest gradient difference from the unsplit model, after one step", ""]
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    body = []
    for model, p in dict.fromkeys((r["model"], r["p"]) for r in rows):
        cell = {r["schedule"]: r for r in rows if (r["model"], r["p"]) == (model, p)}
        tied = " (tied)" if next(iter(cell.values()))["tied"] else ""
        body.append([f"{model}{tied}", str(p), *(_sci(cell[s]["max_grad_abs_err"]) if s in cell else "-" for s in schedules)])
    out += _table(["model", "p", *schedules], body)
    out += [f"Largest gradient entry {max(r['max_grad'] for r in rows):.2f}; largest loss difference "
            f"{_sci(max(r['max_loss_abs_err'] for r in rows))}.", ""]
    for v in doc.get("v_costs", []):
        out += ["## Per-piece costs in a V", "",
                *_table(["", "T_F per piece or stage (ms)", "predicted ZB-V span (ms)"],
                        [[f"{len(v['piece_t_f_ms'])} pieces for {v['p']} ranks",
                          " / ".join(f"{x:g}" for x in v["piece_t_f_ms"]), f"{v['zbv_span_pieces_ms']:.0f}"],
                         [f"{len(v['stage_t_f_ms'])} stages, halved", " / ".join(f"{x:g}" for x in v["stage_t_f_ms"]),
                          f"{v['zbv_span_halved_ms']:.0f}"]])]
    return out


def hf_families(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = doc["families"]
    counts = doc["counts"]
    through = [r for r in rows if r.get("runtime_exact")]
    out = [f"transformers {doc.get('transformers')}; tiny random configs (hidden 32, {doc['layers']} layers, vocabulary "
           f"128, dropout off); {doc['microbatches']} microbatches of {doc['microbatch_size']} x {doc['seq']} tokens; "
           f"took {doc.get('seconds', 0):.0f} s.", "",
           f"{len(rows)} causal-LM model types: {counts.get('exact', 0)} exact, {counts.get('refused', 0)} refused, "
           f"{counts.get('no tiny config', 0)} without a tiny config; {len(through)} exact through the runtime.", "",
           "## Exact", "",
           "Logits bit for bit at 2 stages, one process's gradients bit for bit through 4 stages, and the largest "
           "gradient difference from the unsplit model after one step of every schedule kind on 2 gloo ranks "
           "(the largest over 1F1B, ZB-H1, ZB-H2, ZB-V, interleaved 1F1B and a solver schedule).", ""]
    body = []
    for r in rows:
        if r["status"] != "exact":
            continue
        rt = r.get("runtime") or {}
        worst = max((v.get("max_grad_abs_diff", float("inf")) for v in rt.values()), default=None)
        body.append([r["model_type"], r.get("class", ""), f"`{r.get('layer_list', '')}`", ", ".join(r.get("features", [])),
                     "-" if worst is None else _sci(worst), "yes" if r.get("runtime_exact") else "no"])
    out += _table(["type", "class", "layers", "what it does", "max grad diff", "all kinds exact"], body)
    out += ["## Refused", ""]
    out += _table(["type", "reason"], [[r["model_type"], r["reason"].split("): ", 1)[-1]] for r in rows
                                        if r["status"] == "refused"])
    out += ["## No tiny config", ""]
    out += _table(["type", "why"], [[r["model_type"], r["reason"]] for r in rows if r["status"] == "no tiny config"])
    return out


def _sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}".replace("e-0", "e-")


def post_validation(docs: list[dict]) -> list[str]:
    doc = docs[0]
    out = [f"p={doc['p']}, m={doc['m']}; optimizer step {doc['t_step_ms']} ms, snapshot {doc['t_snapshot_ms']} ms "
           "(emulated).", "", "## Predicted cost of a synchronous step (simulator)", ""]
    body = [[k, f"{v['span_ms']:.1f}", f"{v['makespan_ms']:.1f}", _pct(v["sync_cost"], 1)] for k, v in doc["predicted"].items()]
    out += _table(["schedule", "longest span (ms)", "makespan (ms)", "makespan / span - 1"], body)
    out += ["## Measured iteration period", ""]
    body = [[r["schedule"], r["mode"], "yes" if r["barrier"] else "no", f"{r['period_ms']:.1f}", f"{r['vs_sync']:+.1%}"]
            for r in doc["rows"]]
    out += _table(["schedule", "mode", "barrier before each step", "period (ms)", "against sync"], body)
    return out


def faults(docs: list[dict]) -> list[str]:
    doc = docs[0]
    out = [f"Runtime timeout {doc['timeout_s']:g} s; every case as expected: {'yes' if doc['all_ok'] else 'no'}.", ""]
    body = []
    for c in doc["cases"]:
        case = c["case"]
        ranks = [r for r in c["ranks"] if r]
        times = [r["elapsed_s"] for r in ranks if r.get("elapsed_s") is not None]
        outcomes = ", ".join(sorted({r["outcome"] for r in ranks}))
        body.append([str(case["world"]), case["fault"], f"rank {case['rank']} at {c['action']}", outcomes,
                     f"{min(times):.2f}-{max(times):.2f} s" if times else "-", f"{c['wall_s']:.1f} s",
                     "yes" if c["ok"] else "no"])
    out += _table(["p", "fault", "where", "outcome on the ranks", "fault to error", "case wall time", "as expected"], body)
    return out


def fused(docs: list[dict]) -> list[str]:
    doc = docs[0]
    s = doc["settings"]
    out = []
    if "oracle" in doc:
        o = doc["oracle"]
        out += ["## Against the exact optimum over mixed schedules", "",
                f"{s['count']} generated instances (seed {s['seed']}; a quarter also for makespan), t_bw / (t_b + t_w) "
                "from 0.4 to 1.0 per stage, t_ff up to 10% below t_f; `solve` at "
                f"`-t {s['time_limit']:g}`; the oracle had {s['oracle_time']:g} s of CP-SAT deterministic time per "
                "solve, over split, fused and mixed schedules and over split ones only.", ""]
        body = [[k, str(v["n"]), str(v["proven"]), _pct(v["within_1pct_proven"], 0), _pct(v["max_gap_proven"]),
                 str(v["unsound_bound"]), str(v["false_optimal"]), str(v["worse_than_classic"]),
                 str(v["mixed_below_split"]), str(v["optimal_claims"]), f"{v['solve_time_mean_s']:.2f} s"]
                for k, v in o["summary"].items()]
        out += _table(["group", "instances", "oracle proven", "within 1% (proven)", "max gap", "bound above optimum",
                       "false `optimal`", "longer than a classic kind", "mixed optimum below split",
                       "`optimal` claims", "mean solve time"], body)
    if "large" in doc:
        lg = doc["large"]
        su = lg["summary"]
        out += ["## Larger profiles against the classic schedules", "",
                f"m = 4p, limits 1p and 2p, one stage per rank (v=1) and the V (v=2), `-t {s['large_time_limit']:g}`: "
                f"{su['n']} solves, longer than the best classic kind {su['worse_than_classic']}, shorter "
                f"{su['beats_classic']}, as long {su['is_classic']}; a bound above a classic schedule that fits "
                f"{su['bound_above_a_classic']}; `optimal` claims {su['optimal_claims']}.", ""]
        body = []
        for r in lg["cases"]:
            lo, hi = r["ratio"]
            ratio = f"{lo:.2f}" if abs(hi - lo) < 5e-3 else f"{lo:.2f}-{hi:.2f}"
            vs = "" if r["vs_classic"] is None else f"{100 * r['vs_classic']:+.2f}%"
            body.append([r["profile"], ratio, str(r["chunks"]), str(r["m"]), r["limit"], f"{r['value']:.5g}",
                         f"{r['lower_bound']:.5g}", r["status"], r["best_classic_kind"] or "-", vs,
                         f"{r['fused_backwards']}/{r['fused_backwards'] + r['split_backwards']}", _secs(r["time_s"])])
        out += _table(["profile", "t_bw / (t_b + t_w)", "v", "m", "limit", "span", "bound", "status", "best classic",
                       "against it", "fused / backwards", "time"], body)
    if "paper" in doc:
        pp = doc["paper"]
        su = pp["summary"]
        out += ["## The paper's profiles (no t_bw): before and after", "",
                f"`-t {s['paper_time_limit']:g}`, the code before the change (`--base`) and after it in turn: "
                f"{su['n']} solves, same span {su['same_value']}, shorter {su['better']}, longer {su['worse']}, same "
                f"bound {su['same_bound']}; fused backwards in any result {su['fused_backwards']}.", ""]
        body = []
        for r in pp["cases"]:
            b, a = r.get("before"), r["after"]
            before = [f"{b['value']:.7g}", f"{b['lower_bound']:.7g}", b["status"]] if b else ["-", "-", "-"]
            body.append([r["profile"], str(r["chunks"]), r["limit"], *before, f"{a['value']:.7g}",
                         f"{a['lower_bound']:.7g}", a["status"]])
        out += _table(["profile", "v", "limit", "before: span", "bound", "status", "after: span", "bound", "status"],
                      body)
    return out


def plan(docs: list[dict]) -> list[str]:
    d = docs[0]
    out: list[str] = []

    def x(v, digits=3):
        return "-" if v is None else f"{v:.{digits}f}"

    def at(section: dict) -> list[str]:  # sections are rerun apart: the commit each measured, where saved
        return [f"Measured at commit `{section['commit']}`.", ""] if section.get("commit") else []

    if "units" in d:
        u = d["units"]
        out += ["## Per-layer sums against the stage profiler", "",
                f"Built-in GPT {u['model']}; each stage's costs composed from its units over what the stage profiler "
                f"measured for the same cut (one device, one thread), both in {u.get('rounds', 1)} interleaved rounds "
                "and pooled (medians). 1.000 is exact.", ""]
        out += _table(["cut", "stage", "F", "B", "W", "BW", "F+BW", "M_B"],
                      [[str(r["cut"]), str(r["stage"]), x(r["t_f"]), x(r["t_b"]), x(r["t_w"]), x(r["t_bw"]), x(r["fb_w"]),
                        x(r["m_f"])] for r in u["rows"]])
        out += ["", f"Load average while measuring: {x(u['load_average'][0], 1)}.", ""]
    if "exact" in d:
        e = d["exact"]
        out += ["## Exactness against every cut", "", *at(e),
                f"A generated Llama-like model of 12 units, 4 ranks, m=8, mixed precision; every cut solved by the solver "
                f"({e['cut_time_s']:g} s each), against the plan ({e['plan_time_s']:g} s).", ""]
        out += _table(["placement", "budget GiB", "cuts", "feasible", "proven optimal", "best over cuts", "best cut",
                       "plan", "plan's cut", "plan / best", "plan's bound", "bound <= best", "plan s"],
                      [[r["placement"], f"{r['budget_gib']:g}", str(r["cuts"]), str(r["feasible"]), str(r["optimal"]),
                        f"{r['best']:.6g}", str(r["best_cut"]), f"{r['plan']:.6g}", str(r["plan_cut"]),
                        f"{r['plan'] / r['best']:.4f}", f"{r['plan_bound']:.6g}", "yes" if r["bound_ok"] else "NO",
                        f"{r['plan_s']:.1f}"] for r in e["rows"]])
        out.append("")
    if "baselines" in d:
        b = d["baselines"]
        out += ["## Against the baselines", "", *at(b),
                f"Generated Llama-like models, 32 layers, hidden 4096, {b['budget_gib']} GiB per rank, {b['optimizer']}; "
                f"plan time limit {b['time_limit_s']:g} s. Speed-up = baseline's span / plan's span (predicted).", ""]
        rows = []
        for r in b["rows"]:
            base = r["baselines"]
            rows.append([f"{r['vocab'] // 1000}k", str(r["p"]), str(r["m"]), r["placement"], f"{r['plan']:.6g}",
                         x(r["vs_even"]), x(r["vs_best_baseline"]),
                         ", ".join(f"{k}: {v:.6g}" if v else f"{k}: -" for k, v in base.items()), _pct(r["gap"]),
                         "yes" if r["exhaustive"] else "no", f"{r['time_s']:.0f}"])
        out += _table(["vocab", "p", "m", "placement", "plan (ms)", "vs even", "vs best baseline", "baselines (ms)",
                       "gap to bound", "every cut priced", "s"], rows)
        out.append("")
    if "emulated" in d:
        em = d["emulated"]
        out += ["## Emulated runs (p=4)", "",
                f"Median of {em['iters']} steps per schedule, round-robin, each timed barrier to barrier, against the "
                "predicted makespan (first start to last end) of the same schedule: on the generated profile the plan "
                "was solved on (\"own\"), and on that profile's emulated stages as the stage profiler measured them "
                "(\"profiled\": what each sleeping pass costs with the runtime's own work around it, and the link "
                "between two local processes). The plan's objective, its span (period without a barrier), is shown "
                "for reference.", ""]
        rows = []
        for r in em["rows"]:
            for k in ("plan", "even"):
                e = r[k]
                rows.append([f"{r['vocab'] // 1000}k", str(r["m"]), k, str(r[f"{k}_cut"]), f"{e['measured_ms']:.1f}",
                             f"{e['predicted_span_ms']:.1f}", f"{e['predicted_ms']:.1f}", f"{e['profiled_ms']:.1f}",
                             x(e["span_ratio"]), x(e["ratio"]), x(e["profiled_ratio"])])
        out += _table(["vocab", "m", "schedule", "cut", "measured ms", "span ms", "makespan ms (own)",
                       "makespan ms (profiled)", "measured / span", "measured / own", "measured / profiled"], rows)
        out += ["", "Speed-up of the plan over the even split:", ""]
        out += _table(["vocab", "m", "predicted (own)", "predicted (profiled)", "measured"],
                      [[f"{r['vocab'] // 1000}k", str(r["m"]), x(r["speedup_predicted"]), x(r["speedup_profiled"]),
                        x(r["speedup_measured"])] for r in em["rows"]])
        excess = [(r["vocab"], k, r[k]["pass_excess_ms"]) for r in em["rows"] for k in ("plan", "even")]
        out += ["", "What an emulated pass measured beyond the time it sleeps (ms, mean over stages): "
                + "; ".join(f"{v // 1000}k {k}: " + ", ".join(f"{p[2:].upper()} {e[p]:+.2f}" for p in ("t_f", "t_b", "t_w"))
                            for v, k, e in excess) + ".",
                "", f"Load average at the end: {x(em['load_average'][0], 1)}.", ""]
    if "real" in d:
        r = d["real"]
        out += ["## Real passes (CPU, p=2)", "",
                f"Built-in GPT {r['model']}, m={r['m']}. Both ranks measure the per-layer profile at once, in the "
                f"processes that then run the steps, in {r['profile_rounds']} rounds interleaved with the steps; the plan "
                "and the even split are solved on the first round, and predicted (makespan, first start to last end, "
                "as a step timed barrier to barrier runs) on every round pooled.", ""]
        out += _table(["schedule", "cut", "predicted ms (pooled)", "predicted ms (first round)", "measured ms (median)",
                       "q1-q3", "measured / predicted"],
                      [[k, str(r[k]["cut"]), f"{r[k]['predicted_ms']:.1f}", f"{r[k]['predicted_first_round_ms']:.1f}",
                        f"{r[k]['measured_ms']:.1f}", "-".join(f"{q:.1f}" for q in r[k]["q1_q3"]), x(r[k]["ratio"])]
                       for k in ("plan", "even")])
        out += ["", f"Speed-up over the even split: predicted {x(r['speedup_predicted'])} (first round "
                f"{x(r['speedup_predicted_first_round'])}), measured {x(r['speedup_measured'])} "
                f"({r['speedup_error']:+.1%}). Load average per round: "
                f"{', '.join(x(v, 1) for v in r['loads'])}; at the end {x(r['load_average'][0], 1)}.", ""]
        out += ["Per pass, the runtime's trace against the pooled profile:", ""]
        out += _table(["schedule", "rank", "pass", "measured ms", "predicted ms", "ratio"],
                      [[k, str(p["rank"]), p["op"], f"{p['measured_ms']:.2f}", f"{p['predicted_ms']:.2f}", x(p["ratio"])]
                       for k in ("plan", "even") for p in r[k]["passes"]])
        out.append("")
    if "recompute" in d:
        e = d["recompute"]
        out += ["## Exactness with recomputation", "", *at(e),
                f"Generated per-layer profiles (random unit costs and memory) at a budget where recomputation pays; "
                f"every cut solved with `recompute=\"auto\"` ({e['cut_time_s']:g} s each), against `plan --recompute "
                f"auto` ({e['plan_time_s']:g} s). \"feasible\": cuts that fit the budget with recomputation (without "
                "it); \"recomputed\": forwards run checkpointed.", ""]
        out += _table(["seed", "units", "ranks", "placement", "m", "cuts", "feasible", "best over cuts", "best cut",
                       "recomputed", "plan", "plan's cut", "recomputed ", "plan / best", "plan's bound", "gap",
                       "bound <= best", "plan s"],
                      [[str(r["seed"]), str(r["units"]), str(r["ranks"]), r["placement"], str(r["m"]), str(r["cuts"]),
                        f"{r['feasible']} ({r['feasible_without']})", f"{r['best']:.6g}", str(r["best_cut"]),
                        str(r["best_recomputed"]), f"{r['plan']:.6g}", str(r["plan_cut"]), str(r["plan_recomputed"]),
                        f"{r['ratio']:.4f}", f"{r['plan_bound']:.6g}", _pct(r["plan_gap"]),
                        "yes" if r["bound_ok"] else "NO", f"{r['plan_s']:.1f}"] for r in e["rows"]])
        out.append("")
        if all("best_known" in r for r in e["rows"]):
            work = " of work (`deterministic=True`: the same at any load)" if e.get("long_clock") == "work" else ""
            out += [f"Where the gap is: every cut whose bound is under the best value found, solved again for "
                    f"{e['long_time_s']:g} s{work}. *best known*: the least value of every solve and the plan; *bound known*: "
                    "the least over the feasible cuts of the best bound any solve proved for each. *plan side*: plan / "
                    "best known; *bound side*: best known / plan's bound (the gap is the two together).", ""]
            out += _table(["seed", "cuts solved again", "plan", "best known", "plan side", "plan's bound", "bound known",
                           "bound side", "best known / bound known"],
                          [[str(r["seed"]), str(r["long_solved"]), f"{r['plan']:.6g}", f"{r['best_known']:.6g}",
                            _pct(r["plan"] / r["best_known"] - 1), f"{r['plan_bound']:.6g}", f"{r['bound_known']:.6g}",
                            _pct(r["best_known"] / r["plan_bound"] - 1), _pct(r["best_known"] / r["bound_known"] - 1)]
                           for r in e["rows"]])
            out.append("")
    if "small" in d:
        e = d["small"]
        out += ["## Where the gap with recomputation is: exact optima", "", *at(e),
                "Smaller members of the recompute family (5 or 6 units, 2 ranks, m=3, costs on a grid, fused backwards "
                f"no cheaper than split ones): every feasible cut's exact optimum over every order and choice of "
                f"recomputation (CP-SAT, the tests' oracle, up to {e['oracle_time_s']:g} s per cut), against its key and "
                f"`plan --recompute auto` ({e['plan_time_s']:g} s). *plan side*: plan / optimum; *bound side*: optimum / "
                "plan's bound; *worst key*: the largest optimum / key over the cuts.", ""]
        out += _table(["seed", "units", "cuts", "proven", "optimum", "plan", "plan side", "plan's bound", "bound side",
                       "worst key", "plan s"],
                      [[str(r["seed"]), str(r["units"]), str(r["cuts"]), "yes" if r["proven"] else "no",
                        f"{r['optimum']:.6g}", f"{r['plan']:.6g}", _pct(r["plan_side"]), f"{r['plan_bound']:.6g}",
                        _pct(r["bound_side"]), _pct(r["worst_key"]), f"{r['plan_s']:.1f}"] for r in e["rows"]])
        out.append("")
    if "time" in d:
        t = d["time"]
        out += ["## Solve time", "", *at(t)]
        if "measured" in t:
            out += [f"Wall time: {t['measured']}.", ""]
        out += _table(["layers", "p", "m", "recompute", "time limit s", "wall s", "plan ms", "bound ms", "gap",
                       "placement", "cuts solved", "cuts bounded", "recomputed", "vs best baseline"],
                      [[str(r["layers"]), str(r["p"]), str(r["m"]), r.get("recompute", "none"), f"{r['time_limit_s']:g}",
                        f"{r['wall_s']:.1f}", f"{r['value']:.6g}", f"{r['bound']:.6g}", _pct(r["gap"]), r["placement"],
                        str(r["solved"]), str(r["bounded"]), str(r.get("recomputed", "-")), x(r["vs_best_baseline"])]
                       for r in t["rows"]])
        if "load_average" in t:
            out += ["", f"Load average at the end: {x(t['load_average'][0], 1)}."]
        out.append("")
    if "torchtitan" in d:
        t = d["torchtitan"]
        out += ["## torchtitan", ""]
        if "error" in t:
            out += [f"Not checked: {t['error']}", ""]
        else:
            out += [f"torchtitan baseline against torchtitan's `_generate_llm_fqn_per_model_part`: {t['rule_equal']} of "
                    f"{t['rule_cases']} (layers, stages) cases equal.", ""]
            split = all("split_equal" in e for e in t["exports"])  # older results did not check the split
            yes = ("yes", "NO")
            out += _table(["schedule name", *(["layer names"] if split else []), "module FQNs as parsed = exported",
                           "stage mapping = plan's", *(["torchtitan's module split = plan's cut"] if split else [])],
                          [[e["schedule"], *([e["names"]] if split else []), yes[not e["fqns_equal"]],
                            yes[not e["placement_equal"]], *([yes[not e["split_equal"]]] if split else [])]
                           for e in t["exports"]])
            out.append("")
    return out


def recompute(docs: list[dict]) -> list[str]:
    """The recompute bench's parts, from however many runs saved them (one part per file)."""
    parts: dict[str, dict] = {}
    settings: dict[str, dict] = {}
    for d in docs:
        for k, v in d.items():
            if k not in ("settings", "machine"):
                parts[k], settings[k] = v, d["settings"]
    out: list[str] = []
    targets: list[list[str]] = []
    if "controllable" in parts:
        c, st = parts["controllable"], settings["controllable"]
        out += ["## V-Half and V-Min against zbsearch at their own memory", "",
                "V-Half and V-Min built from the building blocks of arXiv 2405.15362 and timed by the simulator "
                "(unit costs: F = B = W = 1 per chunk pass, no communication, B frees nothing, W frees all; the "
                "paper's profiles: their own costs). `solve` on the V at the schedule's own peak memory, "
                f"`-t {st['time_limit']:g}`. \"published\": the bubble rate printed for the authors' generator; memory in "
                "p M_B per rank, M_B one microbatch's activations on a rank.", ""]
        body = []
        for r in c["cases"]:
            pub = "-" if r["published_bubble"] is None else _rate(r["published_bubble"])
            ref = r["built_span"]
            body.append([r["kind"], r["profile"], str(r["p"]), str(r["m"]), f"{r['memory_p']:.4g}p", pub,
                         _rate(r["built_bubble"]), f"{r['built_span']:.6g}", f"{r['solve_span']:.6g}",
                         f"{r['solve_span'] / ref:.3f}", f"{r['bound']:.6g}", _pct(r["gap"]), r["status"],
                         "yes" if r["met"] else "no"])
        out += _table(["schedule", "profile", "p", "m", "memory", "published bubble", "built bubble", "built span",
                       "zbsearch span", "zbsearch / built", "bound", "gap", "status", "span <= built"], body)
        targets.append(["zbsearch's span at most V-Half's / V-Min's at their memory", f"{c['met']} of {c['n']}",
                        "yes" if c["met"] == c["n"] else "no"])
    if "recompute" in parts:
        rc, st = parts["recompute"], settings["recompute"]
        kinds = ("1f1b-recompute", "1f1b-split-recompute", "zb-h1-recompute")
        out += ["## Recomputation at 0.5p and 1p (p = 8, m = 24, one stage per rank)", "",
                "The paper's 1.5B and 6.2B profiles with recomputation costs derived from the paper's formulas "
                f"(`zbsearch/profiles/paper/generate.py`); `solve --recompute MODE`, `-t {st['time_limit']:g}`. "
                "\"selective\": the selective recomputation the profile offers besides full recomputation: the "
                "attention cores (`attention`, the bundled profiles: Megatron's selective recomputation, which keeps "
                "34sbh of a layer's sb(34h+5as)), the MLPs (`mlp`: keeps sb(18h+5as)), or none. Classic spans at no "
                "limit of their own, every microbatch recomputed: 1F1B with fused backwards (`1f1b-recompute`, "
                "Megatron's, the reference of the targets), 1F1B with its backwards split into B and W "
                "(`1f1b-split-recompute`) and ZB-H1 (`zb-h1-recompute`).", ""]
        body = []
        for r in rc["cases"]:
            # results from before the modes: the bundled profiles' (attention), "selective" counting the RS passes
            old = not isinstance(r.get("selective"), str)
            selective, rs = ("attention", r.get("selective", 0)) if old else (r["selective"], r["rs"])
            vs = [r.get(f"vs_{k}", r.get(f"speedup_vs_{k.replace('-', '_')}")) for k in kinds]
            body.append([r["profile"], selective, r["mode"], r["limit"], f"{r['span']:.6g}", f"{r['bound']:.6g}",
                         _pct(r["gap"]), r["status"], f"{r['recomputed']} / {rs}",
                         *("-" if v is None else f"{v:.3f}x" for v in vs), _secs(r["time_s"])])
            if r["mode"] == "auto" and r["limit"] == "0.5p":
                what = f"{r['profile']} auto 0.5p, selective {selective}"
                x = vs[0]
                targets.append([f"{what}: >= 1.2x 1F1B with full recomputation", f"{x:.3f}x", "yes" if x >= 1.2 else "no"])
                targets.append([f"{what}: gap <= 3%", _pct(r["gap"]), "yes" if r["gap"] <= 0.03 else "no"])
                targets.append([f"{what}: solved within {st['time_limit']:g} s", _secs(r["wall_s"]),
                                "yes" if r["wall_s"] <= st["time_limit"] * 1.05 else "no"])
        spans = {(r["profile"], k): r["classic"][k] for r in rc["cases"] for k in kinds if k in r["classic"]}
        out += _table(["profile", "selective", "recompute", "limit", "span", "bound", "gap", "status",
                       "recomputed passes / of them RS", *(f"vs {k}" for k in kinds), "time"], body)
        out += ["Classic spans (every microbatch recomputed, at no limit of their own):", ""]
        out += _table(["profile", *kinds], [[name, *(f"{spans[(name, k)]:.6g}" if (name, k) in spans else "-" for k in kinds)]
                                            for name in dict.fromkeys(r["profile"] for r in rc["cases"])])
    if "scale" in parts:
        out += ["## Scale: p = 32, m = 256 (28.3B profile), `--recompute auto`, `-t 5`", ""]
        body = [[r["limit"], f"{r['span']:.6g}", f"{r['bound']:.6g}", _pct(r["gap"]), str(r["recomputed"]),
                 _secs(r["time_s"]), _secs(r["wall_s"]), "yes" if r["valid"] else "no"] for r in parts["scale"]["cases"]]
        out += _table(["limit", "span", "bound", "gap", "recomputed", "solve time", "call time", "valid"], body)
        for r in parts["scale"]["cases"]:
            targets.append([f"p=32 m=256 {r['limit']}: a valid schedule in 5 s", _secs(r["wall_s"]),
                            "yes" if r["valid"] and r["wall_s"] <= 5.0 else "no"])
    if "oracle" in parts:
        o, st = parts["oracle"]["summary"], settings["oracle"]
        out += ["## Bounds and claims against the exact optimum with recomputation", "",
                f"{st['count']} generated instances (seed {st['seed']}), span and makespan, full recomputation offered "
                "and selective on every other one, limits from the least memory any schedule needs with "
                f"recomputation up to 1.5 times the least without; CP-SAT with {st['oracle_time']:g} s deterministic "
                f"time per solve; `solve --recompute auto -t {st['oracle_solve_time']:g}`.", ""]
        out += _table(["solves", "oracle proven", "optimum recomputes", "bound above optimum", "solve bound above optimum",
                       "solve below optimum", "false `optimal`", "`optimal` claims", "at the optimum",
                       "max gap to optimum", "mean bound / optimum"],
                      [[str(o["n"]), str(o["proven"]), str(o["optimum_recomputes"]), str(o["unsound_bound"]),
                        str(o["unsound_solve_bound"]), str(o["below_optimum"]), str(o["false_optimal"]),
                        str(o["optimal_claims"]), str(o["at_optimum"]), _pct(o["max_gap_to_optimum"]),
                        f"{o['mean_bound_share']:.3f}"]])
    if "frontier" in parts:
        st = settings["frontier"]
        out += ["## Frontier on the 1.5B profile (m = 24)", "",
                f"`zbsearch frontier`, `-t {st['frontier_time']:g}` per sweep: bubble rate at each limit (multiples "
                "of p M_B per rank).", ""]
        body = []
        for run in parts["frontier"]["runs"]:
            pts = ", ".join(f"{p['limit']:.3g}p {_rate(p['bubble'])}" for p in run["points"])
            body.append([str(run["chunks"]), run["mode"], pts])
        out += _table(["chunks", "recompute", "limit: bubble"], body)
    if "real" in parts:
        rl = parts["real"]
        c = rl["config"]
        heads = f", {c['heads']} heads" if "heads" in c else ""
        out += ["## Real passes, p = 2 (built-in GPT, CPU)", "",
                f"GPT hidden {c['hidden']}{heads}, {c['layers']} layers, seq {c['seq']}, microbatch {c['microbatch']}, "
                f"m = {c['m']}, {c['steps']} timed steps per schedule; profiled with recomputation before and after "
                f"each round (pooled); load average after each round {', '.join(f'{x:.1f}' for x in rl['loads'])}. "
                "Peak activation bytes: the most a rank holds after any pass (the trace), and inside the passes (the "
                "runtime's meter, `peak_activation_bytes`), against the prediction.", ""]
        body = []
        for name, r in rl["rows"].items():
            inside = r.get("meter_peak_bytes")
            rs = r["rs"] if "rs" in r else r.get("selective", "-")  # older results: "selective" counted RS passes
            body.append([name, str(r["recomputed"]), str(rs), f"{r['makespan_ms']:.1f}",
                         f"{r['predicted_ms']:.1f}", f"{r['measured_over_predicted']:.3f}",
                         " / ".join(f"{b:.0f}" for b in r["peak_bytes"]),
                         "-" if inside is None else " / ".join(f"{b:.0f}" for b in inside),
                         " / ".join(f"{b:.0f}" for b in r["predicted_peak_bytes"]),
                         "yes" if r["gradients_exact"] else "no"])
            targets.append([f"real {name}: iteration within 5% of prediction", f"{r['measured_over_predicted']:.3f}",
                            "yes" if abs(r["measured_over_predicted"] - 1) <= 0.05 else "no"])
            for what, got in (("after any pass", r["peak_bytes"]), ("inside the passes", inside)):
                if got is None:
                    continue
                same = all(abs(a - b) < 0.5 for a, b in zip(got, r["predicted_peak_bytes"]))
                targets.append([f"real {name}: peak activation bytes {what} as predicted",
                                " / ".join(f"{a - b:+.0f}" for a, b in zip(got, r["predicted_peak_bytes"])),
                                "yes" if same else "no"])
            targets.append([f"real {name}: gradients exact", "", "yes" if r["gradients_exact"] else "no"])
        out += _table(["schedule", "recomputed passes", "of them RS", "makespan ms (median)", "predicted ms",
                       "measured / predicted", "peak bytes after a pass, per rank", "peak bytes inside", "predicted",
                       "gradients = without R, RS"], body)
        body = [[name, str(x["rank"]), x["op"], str(x["count"]), f"{x['measured_ms']:.2f}", f"{x['predicted_ms']:.2f}",
                 f"{x['measured_ms'] / x['predicted_ms']:.3f}"] for name, r in rl["rows"].items() for x in r.get("passes", [])]
        if body:
            out += ["Per pass type and rank, the runtime's trace against the pooled profile (mean ms per pass):", ""]
            out += _table(["schedule", "rank", "pass", "count", "measured ms", "predicted ms", "ratio"], body)
        body = [[name, str(w["rank"]), f"{w['idle_ms']:.1f}", f"{w['dependency_ms']:.1f}", f"{w['link_ms']:.1f}",
                 f"{w['local_ms']:.1f}", f"{w['late_messages']:.1f}"] for name, r in rl["rows"].items()
                for w in r.get("waits", [])]
        if body:
            out += ["Where each rank's idle time went (ms per step):", ""]
            out += _table(["schedule", "rank", "idle", "dependency", "link", "local", "late messages"], body)
    if targets:
        out = ["## Targets", "", *_table(["target", "measured", "met"], targets), *out]
    return out


def startup(docs: list[dict]) -> list[str]:
    doc = docs[0]
    out = [f"Each command run {doc['repeat']} times as a new process, commands alternating; wall time from start to exit. "
           "`torch` marks a command that imports torch.", ""]
    body = [[f"`{r['command']}`", f"{r['median_ms']:.0f}", f"{r['q1_ms']:.0f}-{r['q3_ms']:.0f}",
             "yes" if r["imports_torch"] else "no"] for r in doc["rows"]]
    return out + _table(["command", "median ms", "quartiles ms", "torch"], body)


def _in_step_vs_simulated(rows: list[dict]) -> float:
    """Mean over a schedule's reductions in a traced step of measured / simulated - 1, each from
    its stage's last W or BW to its end (``reduction_times.compare_reductions``' records)."""
    return statistics.fmean((x["measured_delay_ms"] + x["measured_ms"]) / (x["predicted_delay_ms"] + x["predicted_ms"])
                            for x in rows) - 1


def _half_iqr(runs: list[float]) -> float:
    """Half the interquartile range of ``runs`` over their median."""
    q1, med, q3 = statistics.quantiles(runs, n=4, method="inclusive")
    return (q3 - q1) / 2 / med


def _shared(doc: dict) -> bool:
    """Whether a data_parallel run measured how the ranks' reductions share the host."""
    return all("share" in r for run in doc["runs"] for r in run["schedules"].values())


def data_parallel(docs: list[dict]) -> list[str]:
    doc = docs[0]
    t = doc["times_ms"]
    pps = ", ".join(str(r["pp"]) for r in doc["runs"])
    out = [f"PP x DP{doc['dp']} on local gloo processes, PP = {pps}, m={doc['m']}; emulated passes (F {t[0]:g}, "
           f"B {t[1]:g}, W {t[2]:g} ms per stage, half that per piece of a V), real gloo reductions of "
           f"{doc['grad_mb']:g} MiB of gradients per rank (split between a rank's stages). Per launch the reductions "
           f"are profiled first on the data-parallel groups ({doc['profile_reps']} timed per stage, "
           + ("each rank's alone and every rank's at once: the profile's share), " if _shared(doc) else "every rank at once), ") +
           f"the schedules solved on that profile ({doc['solve_s']:g} s per solve), then {doc['iters']} timed rounds "
           f"after {doc['warmup']} of warm-up, each round every schedule three ways, barrier to barrier; medians."
           + (f" The emulated passes run {doc['slowdown']:g} times slower while a reduction of their process is in flight; "
              "each stage's factor is measured as `zbsearch profile --dp` does (its pass beside its reduction against "
              "alone) and is in the profile the schedules are solved and predicted on." if "slowdown" in doc else ""), "",
           "- *zb-2p*: the span-optimal solve at 2p; *iteration-2p*: the iteration-aware solve (`--objective iteration`), "
           "started from zb-2p; *zb-2p-v*, *iteration-2p-v*: the same two on the V.",
           "- *passes*: the runtime with no reduction; *overlapped*: the runtime with the mesh, each stage's reduction "
           "started at its last W or BW (± half the interquartile range of its rounds); *after*: no mesh, the same "
           "reductions (same buckets) after `step()`.",
           "- *simulated*: the simulator's iteration from the profile, reduction lane included (what `zbsearch simulate` "
           "predicts); *on passes*: the measured passes plus what the reductions add to the simulated timeline."
           + (" The profile's passes are measured as `zbsearch profile` measures a stage (repetitions, then the "
              "runtime's calibration steps: each pass its repetitions' mean scaled by its median in the steps), and "
              "its `t_action` is the runtime's host time between two actions in those steps, added to every pass; "
              "*given*: the simulator's iteration from the given pass times without `t_action` (measured vs)."
              if "pass_reps" in doc else ""),
           "- *reductions in step vs simulated*: in the last overlapped step (the runtime's trace of replica 0), how much "
           "longer each reduction took than the simulator predicts, from its stage's last W or BW to its end (the runtime "
           "issues it at once and the group runs it after the rank's earlier ones, where the simulator's lane starts it: "
           "that wait counts on both sides), mean over the ranks' stages. "
           + ("The runtime notes a reduction's end as gloo completes it." if doc.get("reduction_end") == "completed" else
              "The runtime notes a reduction's end between actions: one that ends during a pass reads as ending with it."),
           ""]
    slowed = "slowdown" in doc
    shared = _shared(doc)
    if slowed:
        out[-1:] = ["- *slowdown*: the profile's factors (median over the stages), measured; *at full speed*: the "
                    "prediction on measured passes with every factor 1 (measured vs).", ""]
    if shared:
        out[-1:] = ["- *share*: how the ranks' reductions at once slow each other on this host, measured (each of k runs "
                    "at once moves at 1 / (1 + share (k - 1))); *no sharing*: the prediction on measured passes with "
                    "share 0, every lane at full speed (measured vs); *at full speed* is then both: every factor 1 and "
                    "share 0.", ""]
    worst_sim, worst_pass, worst_after = 0.0, 0.0, 0.0
    for run in doc["runs"]:
        sc = run["schedules"]
        lb, la = run["load_average_before"], run["load_average_after"]
        out += [f"## PP{run['pp']} x DP{doc['dp']} ({run['world']} processes; load average {lb[0]:.1f} before, "
                f"{la[0]:.1f} after)", ""]
        base = sc.get("1f1b")
        body = []
        for kind, r in sc.items():
            gain = ""
            if base is not None and kind != "1f1b":
                gain = (f"{r['measured_overlapped_ms'] - base['measured_overlapped_ms']:+.1f} / "
                        f"{r['simulated_overlapped_ms'] - base['simulated_overlapped_ms']:+.1f}")
            measured_passes = "given_overlapped_ms" in r
            body.append([_kind(kind), f"{r['reduction_per_rank_ms']:.1f}"]
                        + ([f"{r['given_overlapped_ms']:.1f} ({r['overlapped_vs_given']:+.1%})", f"{r['t_action_ms']:.2f}"]
                           if measured_passes else []) + [
                         f"{r['simulated_passes_ms']:.1f} / {r['measured_passes_ms']:.1f}",
                         f"{r['measured_overlapped_ms']:.1f} ±{_half_iqr(r['overlapped_runs_ms']):.0%}",
                         f"{r['simulated_overlapped_ms']:.1f} ({r['overlapped_vs_simulated']:+.1%})",
                         f"{r['on_passes_overlapped_ms']:.1f} ({r['overlapped_vs_on_passes']:+.1%})",
                         f"{r['measured_after_ms']:.1f} ({r['after_vs_on_passes']:+.1%})",
                         f"{_in_step_vs_simulated(r['in_step']):+.0%}", gain]
                        + ([f"{statistics.median(r['slowdown']):.2f}",
                            f"{r['on_passes_overlapped_full_speed_ms']:.1f} ({r['overlapped_vs_on_passes_full_speed']:+.1%})"]
                           if slowed else [])
                        + ([f"{r['share']:.2f}",
                            f"{r['on_passes_overlapped_no_sharing_ms']:.1f} ({r['overlapped_vs_on_passes_no_sharing']:+.1%})"]
                           if shared else []))
            worst_sim = max(worst_sim, abs(r["overlapped_vs_simulated"]))
            worst_pass = max(worst_pass, abs(r["overlapped_vs_on_passes"]))
            worst_after = max(worst_after, abs(r["after_vs_on_passes"]))
        out += _table(["schedule", "reductions per rank"]
                      + (["given (measured vs)", "t_action (ms)"] if "pass_reps" in doc else [])
                      + ["passes simulated / measured", "overlapped measured",
                       "simulated (measured vs)", "on passes (measured vs)", "after measured (vs on passes)",
                       "reductions in step vs simulated", "vs 1F1B measured / simulated"]
                      + (["slowdown", "at full speed (measured vs)"] if slowed else [])
                      + (["share", "no sharing (measured vs)"] if shared else []), body)
    share = [(r["measured_after_ms"] - r["measured_passes_ms"]) / r["measured_after_ms"]
             for run in doc["runs"] for r in run["schedules"].values()]
    runtime = [r["passes_vs_simulated"] for run in doc["runs"] for r in run["schedules"].values()]
    errs = [abs(r["overlapped_vs_on_passes"]) for run in doc["runs"] for r in run["schedules"].values()]
    sims = [abs(r["overlapped_vs_simulated"]) for run in doc["runs"] for r in run["schedules"].values()]
    given = [abs(r["overlapped_vs_given"]) for run in doc["runs"] for r in run["schedules"].values()
             if "overlapped_vs_given" in r]
    full = [abs(r["overlapped_vs_on_passes_full_speed"]) for run in doc["runs"] for r in run["schedules"].values()
            if "overlapped_vs_on_passes_full_speed" in r]
    alone = [abs(r["overlapped_vs_on_passes_no_sharing"]) for run in doc["runs"] for r in run["schedules"].values()
             if "overlapped_vs_on_passes_no_sharing" in r]
    out += [f"- Reductions add {min(share):.0%}-{max(share):.0%} of the iteration reduced after the step.",
            f"- Overlapped iteration against the prediction on measured passes: {sum(e <= 0.05 for e in errs)} of "
            f"{len(errs)} within 5%; largest |measured / predicted - 1| {worst_pass:.1%} (target 5%: "
            f"{'met' if worst_pass <= 0.05 else 'not met'}); reduced after the step {worst_after:.1%}.",
            *([f"- At full speed (every factor 1): {sum(e <= 0.05 for e in full)} of {len(errs)} within 5%; largest "
               f"{max(full):.1%}."] if slowed else []),
            *([f"- With no sharing (share 0): {sum(e <= 0.05 for e in alone)} of {len(errs)} within 5%; largest "
               f"{max(alone):.1%}."] if shared else []),
            *([f"- Against the simulator alone (the profile's prediction): {sum(e <= 0.05 for e in sims)} of {len(sims)} "
               f"within 5%; largest {worst_sim:.1%}; the passes alone ran {min(runtime):+.1%} to {max(runtime):+.1%} "
               f"against their simulation. From the given times: {sum(e <= 0.05 for e in given)} of {len(given)} within "
               f"5%; largest {max(given):.1%}."] if given else
              [f"- Against the simulator alone: {worst_sim:.1%}; the passes alone ran {min(runtime):+.0%} to "
               f"{max(runtime):+.0%} against their simulation (the runtime's own time per pass, which the emulated "
               "profile does not hold)."]),
            *_replica_drift(doc), ""]
    return out


def _replica_drift(doc: dict) -> list[str]:
    """The summary's line on how far apart the replicas reach each reduction (results that
    hold it): the simulator has them in step."""
    rows = [(run["pp"], kind, r) for run in doc["runs"] for kind, r in run["schedules"].items() if "replica_skew_ms" in r]
    if not rows:
        return []
    worst = max(rows, key=lambda x: x[2]["later_replica_wait_share"])
    return [f"- Replicas out of step (every rank's reductions, every overlapped round): the replicas reach a reduction a "
            f"median {min(r['replica_skew_ms'] for _, _, r in rows):.1f} to {max(r['replica_skew_ms'] for _, _, r in rows):.1f} "
            f"ms apart (largest {max(r['replica_skew_max_ms'] for _, _, r in rows):.0f} ms); waiting for the later replica is "
            f"{min(r['later_replica_wait_share'] for _, _, r in rows):.0%} to {worst[2]['later_replica_wait_share']:.0%} of "
            f"the reductions' time (most: {_kind(worst[1])} at PP{worst[0]})."]


def compiled(docs: list[dict]) -> list[str]:
    doc = docs[0]
    out = [f"One GPT stage ({doc['layers']} transformer layers, hidden {doc['hidden']}, sequence {doc['seq']}, "
           f"microbatch {doc['mb']}) in one process on {doc['threads']} threads, one microbatch at a time through the "
           f"runtime's pass functions; torch.compile with backend `{doc['backend']}`. {doc['reps']} rounds after "
           f"{doc['warmup']} of warm-up, each round every variant; medians (ms).", "",
           "- *split*: F, B, W as a zero-bubble rank runs them; a compiled stage runs its whole backward in B "
           "(its compiled region yields the weight gradients with the input gradients) and W does nothing.",
           "- *fused*: F, then one backward (BW).", ""]
    body = []
    for name, r in doc["variants"].items():
        p = r["passes_ms"]
        body.append([name, f"{p['F']:.2f}", f"{p['B']:.2f}" if "B" in p else "", f"{p['W']:.2f}" if "W" in p else "",
                     f"{p['BW']:.2f}" if "BW" in p else "", f"{r['total_ms']:.2f}"])
    out += _table(["variant", "F", "B", "W", "BW", "F + backward"], body)
    ratio = doc["speedup_compiled_split"]
    out += [f"- Compiled split against eager split: {ratio:.2f}x "
            f"({'at least as fast: target met' if ratio >= 1 else 'slower: target not met'}).", ""]
    return out


def iteration(docs: list[dict]) -> list[str]:
    doc = docs[0]
    out = [f"The paper's profiles at p=8, m={doc['m']}, limit {doc['limit']}; each stage reduces its share of the model's "
           "bf16 gradients (2 bytes per parameter, split evenly over the stages) as a ring "
           f"{'reduce-scatter' if doc.get('sharded') else 'all-reduce'}; "
           f"{doc['time_limit_s']:g} s per solve. *span*: the span-optimal solve, then its reductions; *iteration*: "
           "the iteration-aware solve (`--objective iteration`) started from the span solve's schedule. *kept*: how much "
           "of a schedule's span gain over 1F1B its iteration keeps.", ""]
    sharded = bool(doc.get("sharded"))
    if sharded:
        out += ["Stages sharded over the replicas (`fully_shard`): each reduction is a ring reduce-scatter (half the "
                "all-reduce's bytes), and each stage first gathers its parameters at the step's start (an all-gather of as "
                "many bytes, *gather per stage*), which the simulator, the bounds and the exact MILP price.", ""]
    out += ["## Iteration (ms)", ""]
    body = []
    worst_gap, slower = 0.0, []
    for r in doc["rows"]:
        sc = r["schedules"]
        place = "V" if r["chunks"] == 2 else "one"
        classic = " / ".join(f"{k} {v['iteration_ms']:.1f}" for k, v in sc.items() if k not in ("span", "iteration"))
        kept = sc["iteration"]["gain_kept"]
        body.append([r["model"], str(r["replicas"]), f"{r['bandwidth_gbs']:g}", place,
                     *([f"{r.get('t_gather_ms', 0.0):.1f}"] if sharded else []), f"{r['t_reduce_ms']:.1f}", classic,
                     f"{sc['span']['iteration_ms']:.2f}", f"{sc['iteration']['iteration_ms']:.2f}", f"{r['gain_ms']:.2f}",
                     f"{r['iteration_gap']:.2%}", "-" if kept is None else f"{kept:.0%}"])
        worst_gap = max(worst_gap, r["iteration_gap"])
        if r["gain_ms"] < -1e-9:
            slower.append(f"{r['model']} dp{r['replicas']} {r['bandwidth_gbs']:g} GB/s {place}")
    out += _table(["model", "replicas", "GB/s", "placement", *(["gather per stage"] if sharded else []), "reduce per stage",
                   "classic", "span, then reductions",
                   "iteration-aware", "gain", "gap to bound", "kept"], body)
    gains = [r["gain_ms"] for r in doc["rows"]]
    out += [f"- Iteration-aware never slower than the span-optimal schedule with its reductions: "
            f"{'yes' if not slower else 'no: ' + ', '.join(slower)}; gains {min(gains):.2f}-{max(gains):.2f} ms.",
            f"- Largest gap to the iteration bound: {worst_gap:.2%} (target at most 2%: "
            f"{'met' if worst_gap <= 0.02 else 'not met'}).", ""]
    speed = doc.get("speed") or []
    if speed:
        out += ["## Solve time", "",
                "One iteration-aware solve from scratch (no start), reductions across 64 replicas at 25 GB/s; wall time as "
                "the caller sees it; the schedule validated again. Target: within 1% of the bound at p=8 in 10 s; at p=32 a "
                "valid schedule within the limit (10% + 1 s).", ""]
        body = [[r["model"], str(r["ranks"]), str(r["m"]), "V" if r["chunks"] == 2 else "one", f"{r['time_limit_s']:g}",
                 f"{r['wall_s']:.1f}", f"{r['value_ms']:.2f}", f"{r['bound_ms']:.2f}", f"{r['gap']:.2%}", r["status"],
                 "met" if r["met"] else "not met"] for r in speed]
        out += _table(["model", "ranks", "m", "placement", "limit (s)", "wall (s)", "iteration", "bound", "gap", "status",
                       "target"], body)
    return out


def iteration_milp(docs: list[dict]) -> list[str]:
    doc = docs[0]
    st = doc["settings"]
    out = [f"{st['count']} generated instances (seed {st['seed']}; p=2-4, m=2-6, one stage per rank or the V, at 2p) whose "
           "stages reduce their gradients in 10-40% of the iteration's compute (*reduce*), "
           f"{st['time_limit']:g} s per solve; then the paper's profiles at p=8, m=24 with reductions across 64 replicas "
           f"at 25 GB/s, {st['paper_time_limit']:g} s per solve. Each solved for the iteration with the default engines "
           "(*MILP*: the exact MILP where the problem is small, MILP windows otherwise, both pricing the reduction lane) "
           "and with the heuristics alone (`milp=False`). *bound*: the larger of the two solves' lower bounds.", "",
           "## Iteration (ms)", ""]
    body = []
    closed = {"milp": 0, "heuristic": 0}
    better = 0
    for r in doc["rows"]:
        reduce = "-" if r["share"] is None else f"{r['share']:.0%}"
        cells = [r["name"], str(r["ranks"]), str(r["m"]), "V" if r["chunks"] == 2 else "one", reduce]
        for key in ("milp", "heuristic"):
            x = r[key]
            cells += [f"{x['value_ms']:.4f}", x["status"]]
            closed[key] += x["value_ms"] <= r["bound_ms"] * 1.01
        better += r["milp"]["value_ms"] < r["heuristic"]["value_ms"] * (1 - 1e-9)
        cells += [f"{r['bound_ms']:.4f}", f"{r['milp']['gap']:.2%}"]
        body.append(cells)
    out += _table(["instance", "ranks", "m", "placement", "reduce", "MILP", "status", "heuristics", "status", "bound",
                   "MILP gap"], body)
    n = len(doc["rows"])
    worse = sum(r["milp"]["value_ms"] > r["heuristic"]["value_ms"] * (1 + 1e-9) for r in doc["rows"])
    out += [f"- Within 1% of the bound: MILP {closed['milp']} of {n}, heuristics alone {closed['heuristic']} of {n}.",
            f"- MILP shorter than the heuristics alone on {better} of {n}, longer on {worse}.",
            f"- Proven optimal: MILP {sum(r['milp']['status'] == 'optimal' for r in doc['rows'])} of {n}, heuristics "
            f"alone {sum(r['heuristic']['status'] == 'optimal' for r in doc['rows'])} of {n}.", ""]
    return out


def tune(docs: list[dict]) -> list[str]:
    doc = docs[0]
    out: list[str] = []
    ex = doc.get("exact")
    if ex:
        out += ["## Exactness against every configuration", "",
                f"Generated Llama-like models (sequences of {ex['seq']}), microbatch sizes {ex['sizes']}: every "
                f"configuration planned the same way ({ex['plan_time_s']:g} s each"
                + (", of work: both sides on the work clock, `deterministic=True`" if ex.get("clock") == "work" else "")
                + "), against `tune` with the same time per plan and no baselines. *ratio*: tune's choice over the best "
                "configuration.", ""]
        again = "replan_factor" in ex
        if again:
            out[-2] = (out[-2][:-len("*ratio*: tune's choice over the best configuration.")]
                       + f"Both sides then plan again, with {ex['replan_factor']:g} times the time, the configurations "
                       "that may win by tune's rule (`replan_order`), each keeping its best plan. *ratio*: tune's "
                       "choice over the best configuration; *choice*: the enumeration's own value of tune's choice over "
                       "its best (the choice alone, free of tune's plans' luck); *pooled*: the same with each "
                       "configuration's best plan by either side; *spread*: the most two plans of one configuration "
                       "differ in the enumeration.")
        rows = [[r["model"], str(r["layers"]), str(r["ranks"]), str(r["memory_gib"]), str(r["global_batch"]),
                 r["optimizer"], str(r["configurations"]), str(r["costed_by_enumeration"]), f"{r['best']:.6g}",
                 r["best_config"], f"{r['tune']:.6g}", r["tune_config"], f"{r['ratio']:.4f}", f"{r['bound']:.6g}",
                 "yes" if r["bound_ok"] else "NO", _pct(r["gap"], 1),
                 "-" if r.get("bound_before") is None else f"{r['bound_before']:.6g}",
                 "-" if r.get("gap_before") is None else _pct(r["gap_before"], 1), str(r["planned_by_tune"]),
                 f"{_secs(r['enumeration_s'])} / {_secs(r['tune_s'])}"]
                + ([f"{r['choice_ratio']:.4f}" if r["choice_ratio"] is not None else "not costed",
                    f"{r['pooled_ratio']:.4f}", _pct(r["plans_spread"], 1),
                    f"{r['enumeration_replanned']} / {r['tune_replanned']}"] if again else []) for r in ex["rows"]]
        out += _table(["model", "layers", "ranks", "GiB", "batch", "optimizer", "configurations", "costed",
                       "best (ms)", "best configuration", "tune (ms)", "tune's", "ratio", "bound (ms)", "bound <= best",
                       "gap", "bound before planning (ms)", "gap before planning", "planned by tune",
                       "enumeration / tune"]
                      + (["choice", "pooled", "spread", "planned again (enumeration / tune)"] if again else []), rows)
        worst = max(r["ratio"] for r in ex["rows"])
        before = [r["bound_before_ok"] for r in ex["rows"] if "bound_before_ok" in r]
        out += [f"- Largest ratio {worst:.4f} (target at most 1.01: {'met' if worst <= 1.01 else 'not met'}); bound "
                f"never above the best: {'yes' if all(r['bound_ok'] for r in ex['rows']) else 'no'}"
                + (f"; the bound before planning never above it: {'yes' if all(before) else 'no'}" if before else "")
                + ".", ""]
        if again:
            choice = [r["choice_ratio"] for r in ex["rows"] if r["choice_ratio"] is not None]
            out[-2:-1] = [out[-2], f"- Largest choice ratio {max(choice):.4f}, largest pooled ratio "
                          f"{max(r['pooled_ratio'] for r in ex['rows']):.4f}; the plans' largest spread "
                          f"{_pct(max(r['plans_spread'] for r in ex['rows']), 1)}."]
        walls = [r for r in ex["rows"] if r.get("vs_wall_best") is not None]
        if walls:
            out[-1:-1] = [f"- Against the same grids planned on the wall clock ({walls[0]['vs_wall_plan_time_s']:g} s per "
                          "plan, the results file's previous run), each grid's best over the wall clock's best: "
                          + ", ".join(f"{r['model']} L{r['layers']} {r['vs_wall_best']:.4f}" for r in walls)
                          + "; the first plans' median ratio per grid: "
                          + ", ".join("-" if r["vs_wall_first_median"] is None else f"{r['vs_wall_first_median']:.4f}"
                                      for r in walls) + " (below 1: the work limit's plans are better)."]
    bs = doc.get("baselines")
    if bs:
        out += ["## Against torchtitan's and Megatron-LM's defaults", "",
                "Generated Llama-like models, sequences of 4096, microbatch sizes 1, 2, 4, 8 ranks to a node, 80 GiB "
                f"per rank, mixed precision; `tune` with {bs['case_time_s']:g} s. Speed-up: the best baseline's "
                "iteration over tune's (predicted, costed the same way at the same memory).", ""]
        rows = []
        for r in bs["rows"]:
            c = r["config"] or {}
            fam = ", ".join(f"{k}: {v['iteration_ms']:.6g} (pp{v['pp']} b{v['b']})" for k, v in sorted(r["families"].items()))
            rows.append([r["model"], str(r["ranks"]), str(r["global_batch"]), "yes" if r["sharded"] else "no",
                         f"pp{c.get('pp')} dp{c.get('dp')} b{c.get('b')} m{c.get('m')} {c.get('placement')}",
                         f"{r['tune']:.6g}" if r["tune"] else "-", fam or "none fits",
                         f"{r['speedup']:.3f}x" if r["speedup"] else "-", _pct(r["gap"], 1) if r["gap"] is not None else "-",
                         _secs(r["time_s"])])
        out += _table(["model", "ranks", "batch", "sharded", "tune's configuration", "tune (ms)",
                       "baselines, the best of each (ms)", "speed-up", "gap to bound", "time"], rows)
        sp = bs.get("speedup")
        if sp:
            slower = [r for r in bs["rows"] if r["speedup"] is not None and r["speedup"] < 1 - 1e-9]
            out += [f"- Speed-up over the best baseline: mean {sp['mean']:.3f}x, geometric mean {sp['geomean']:.3f}x, "
                    f"median {sp['median']:.3f}x, from {sp['min']:.3f}x to {sp['max']:.3f}x (Mist's published average "
                    f"over Megatron-LM: 1.28x).",
                    f"- Never slower than the best baseline: {'yes' if not slower else 'no'}.", ""]
    tt = doc.get("time")
    if tt:
        out += ["## Time", "", f"`zbsearch tune` on the {tt['model']} shape ({tt['ranks']} ranks, global batch "
                f"{tt['global_batch']}, 3 microbatch sizes), timed from the outside.", ""]
        rows = [[f"{r['time_limit_s']:g} s", _secs(r["wall_s"]),
                 ("pp{pp} dp{dp} b{microbatch_size} m{microbatches} {placement} {recompute}".format(**r["config"])
                  if r["config"] else "-"), f"{r['iteration_ms']:.6g}" if r["iteration_ms"] else "-",
                 f"{r['best_baseline']:.6g}" if r["best_baseline"] else "-",
                 _pct(r["gap"], 1) if r["gap"] is not None else "-",
                 ", ".join(f"{v} {k}" for k, v in sorted(r["statuses"].items()))] for r in tt["rows"]]
        out += _table(["time limit", "wall", "configuration", "iteration (ms)", "best baseline (ms)", "gap",
                       "configurations"], rows)
    real = doc.get("real")
    if real:
        t, d = real["tuned"], real["torchtitan"]
        out += ["## Real runs on CPU", "", f"The built-in GPT {real['model']} on 4 local processes, global batch "
                f"{real['global_batch']}, {real['rounds']} rounds of {real['steps']} steps each (the first "
                f"{real['warmup']} dropped), run in turns; medians.", ""]
        rows = [["tuned", f"pp{t['pp']} dp{t['dp']} b{t['b']} m{t['m']} {t['placement']}", str(t["layers_per_stage"]),
                 f"{t['predicted_ms']:.4g}", ", ".join(f"{x:.4g}" for x in t["measured_ms"])],
                ["torchtitan 1F1B", f"pp{d['pp']} dp{d['dp']} b{d['b']} m{d['m']}", str(d["layers_per_stage"]),
                 f"{d['predicted_ms']:.4g}", ", ".join(f"{x:.4g}" for x in d["measured_ms"])]]
        out += _table(["run", "configuration", "layers per stage", "predicted (ms)", "measured per round (ms)"], rows)
        out += [f"- Speed-up predicted {real['predicted_speedup']:.3f}x, measured {real['measured_speedup']:.3f}x "
                f"({_pct(real['error'], 1)}; target within 5%: {'met' if abs(real['error']) <= 0.05 else 'not met'})."]
        if "busy_ms" in real:
            b = real["busy_ms"]
            out += [f"- The 4 processes share {real['cores']} cores: the compute of all ranks together, tuned "
                    f"{b['tuned']:.4g} ms and torchtitan {b['torchtitan']:.4g} ms per step, predicts the speed-up where the "
                    f"ranks wait for cores rather than for each other: {real['work_speedup']:.3f}x."]
        out.append("")
    return out


def tune_run(docs: list[dict]) -> list[str]:
    doc = docs[0]
    md, opt, link = doc["model"], doc["optimizer"], doc["link"]
    cores = doc["machine"]["cores"]
    out = [f"The built-in GPT ({md['layers']} layers, hidden {md['hidden']}, {md['heads']} heads, sequences of "
           f"{md['seq']}, vocabulary {md['vocab']}), profiled per layer at microbatch sizes "
           f"{', '.join(map(str, doc['sizes']))} ({doc['profile_s']:.0f} s), global batch {doc['global_batch']}, AdamW. "
           f"Links: the profile's estimate between local processes, {link['bandwidth_gb_s']:.3g} GB/s and "
           f"{link['latency_ms']:.3g} ms, for pipeline messages and reductions alike. AdamW's step over the whole model "
           f"({opt['param_bytes'] / 1e6:.2f} MB of parameters) took {opt['step_ms']:.2f} ms at one thread: "
           f"{opt['memory_gbs']:.3g} GB/s for the bytes the tuner streams, given to `tune` as `--memory-gbs`.", "",
           f"Each configuration runs the command line `tune -o` wrote for it (the winner's `launch.json`, the baselines' "
           f"`baselines/NAME/launch.json`) with `--steps {doc['warmup'] + doc['steps']}`, real and with `--emulate`, "
           f"{doc['rounds']} rounds, the order turned each round; a run's figure is the median of its last "
           f"{doc['steps']} steps, the table's the median over the rounds. *work bound*: the CPU work of every process in "
           f"one step (passes and optimizer steps, as profiled) over the {cores} cores, or the prediction where larger: "
           "what the step takes where the processes wait for cores rather than for each other.", ""]
    if "profiles" in doc:
        out += ["Profiles, per microbatch size: " + "; ".join(
            f"b={p['b']}: {p['per_sequence_ms']:.1f} ms of F + B + W per sequence, {p['s']:.0f} s, load {p['load']:.1f} "
            "after" for p in doc["profiles"]) + ".", ""]
    for res in doc["results"]:
        loads = res["loads"]
        out += [f"## {res['ranks']} processes", "",
                f"`tune` took {res['tune']['time_s']:.1f} s; bound over every configuration "
                f"{res['tune']['lower_bound_ms']:.4g} ms (gap {_pct(res['tune']['gap'], 2)}). Load average during the runs "
                f"{min(loads):.1f} to {max(loads):.1f} on {cores} cores.", ""]
        rows = []
        shape = {n: (r["pp"], r["dp"], r["b"], r["m"], r["placement"], r["schedule"]) for n, r in res["runs"].items()}
        same = [n for n in shape if n != "tuned" and shape[n] == shape["tuned"]]
        for name, r in res["runs"].items():
            label = f"tuned (= {same[0]})" if name == "tuned" and same else name
            rows.append([label, f"pp{r['pp']} dp{r['dp']} b{r['b']} m{r['m']} {r['placement']}", r["schedule"] or "-",
                         ",".join(map(str, r["layers_per_stage"] or [])), f"{r['predicted_ms']:.1f}",
                         f"{r['emulated_ms']:.1f}", f"{r['real_ms']:.1f}", f"{r['work_bound_ms']:.1f}"])
        out += _table(["run", "configuration", "schedule", "layers per stage", "predicted (ms)", "emulated (ms)",
                       "real (ms)", "work bound (ms)"], rows)
        rows = []
        for name, r in res["runs"].items():
            if name == "tuned":
                continue
            sp = r["speedup"]
            rows.append([f"tuned over {name}", f"{sp['predicted']:.3f}x",
                         f"{sp['emulated']:.3f}x ({_pct(sp['emulated'] / sp['predicted'] - 1, 1)})",
                         f"{sp['real']:.3f}x ({_pct(sp['real'] / sp['predicted'] - 1, 1)})", f"{sp['work_bound']:.3f}x",
                         ", ".join(f"{x:.3f}" for x in sp["per_round"]["emulated"]),
                         ", ".join(f"{x:.3f}" for x in sp["per_round"]["real"])])
        out += _table(["speed-up", "predicted", "emulated", "real", "work bound", "emulated per round", "real per round"],
                      rows)
        sp = res["runs"][doc["default"]]["speedup"]
        err = {k: sp[k] / sp["predicted"] - 1 for k in ("emulated", "real")}
        out += [f"- Over the torchtitan-style default ({doc['default']}), target within {doc['target']:.0%} of the "
                f"predicted speed-up: emulated passes {_pct(err['emulated'], 1)} "
                f"({'met' if abs(err['emulated']) <= doc['target'] else 'not met'}), real passes {_pct(err['real'], 1)} "
                f"({'met' if abs(err['real']) <= doc['target'] else 'not met'}).",
                f"- {res['ranks']} processes on {cores} cores, load average up to {max(loads):.1f}: "
                + ("the real passes wait for cores; the work bound predicts their speed-up as "
                   f"{sp['work_bound']:.3f}x." if max(loads) > cores or res["ranks"] > cores else "a core per process."), ""]
    return out


def moe(docs: list[dict]) -> list[str]:
    doc = docs[0]
    st = doc["stage"]
    out = ["## Solved schedules against DualPipeV on DeepSeek-like MoE profiles", "",
           f"Every stage F {st['t_f']:g}, B {st['t_b']:g}, W {st['t_w']:g} ms, the all-to-all a share of F and B, V "
           f"placement; solved at DualPipeV's peak memory in {doc['time_limit_s']:g} s each. Spans in ms, predicted.", ""]
    body = [[str(r["p"]), str(r["m"]), f"{r['a2a_share']:.0%}", f"{r['solved']:.2f}", f"{r['bound']:.2f}", str(r["pairs"]),
             f"{r['dualpipe_v']:.2f}", f"{r['dualpipe_v_no_overlap']:.2f}", f"{r['zb_v']:.2f}",
             f"{r['vs_dualpipe_v']:.3f}x", f"{r['vs_zb_v']:.3f}x"] for r in doc["rows"]]
    out += _table(["p", "m", "all-to-all", "solved", "bound", "pairs", "dualpipe-v", "dualpipe-v no overlap", "zb-v",
                   "vs dualpipe-v", "vs zb-v"], body)
    fast = sum(r["vs_dualpipe_v"] >= 1 - 1e-9 for r in doc["rows"])
    big = [r for r in doc["rows"] if r["a2a_share"] >= 0.3 - 1e-9]
    reached = sum(r["vs_zb_v"] >= 1.2 for r in big)
    beyond = sum(r["zb_v"] / r["bound"] < 1.2 for r in big)
    out += [f"- Solved at least as fast as DualPipeV: {fast} of {len(doc['rows'])} (target: all).",
            f"- At least 1.2x ZB-V without overlap where the all-to-all is 30% or more: "
            f"{reached} of {len(big)} (best {max(r['vs_zb_v'] for r in big):.3f}x); "
            f"out of reach by the lower bound (ZB-V / bound below 1.2x): {beyond} of {len(big)}.",
            f"- Of the {len(big)} cases with 30% or more: {reached} reach 1.2x, {beyond} are proven out of reach (no "
            f"schedule can: the bound says so), {len(big) - reached - beyond} are open (neither reached nor ruled out).", ""]
    return out


@dataclass
class Topic:
    title: str
    files: tuple[str, ...]
    command: str | Callable[[dict], str]  # the command that made the results, or how to read it from them
    duration: str | Callable[[dict], str]  # how long it takes, or how to say it from the results
    render: Callable[[list[dict]], list[str]]


def _kinds(rounds: list[dict], name: str) -> str:
    """The schedule's kinds over the rounds (the solver may pick another kind from another profile)."""
    return " / ".join(dict.fromkeys(r["schedules"][name]["kind"] for r in rounds))


def gpu(docs: list[dict]) -> list[str]:
    doc = docs[0]
    a = doc["model"]
    rounds = doc["rounds"]
    out = [f"Built-in GPT on {doc.get('gpu') or 'the CPU'} ({a['dtype']}, torch {doc['torch']}, CUDA {doc.get('cuda')}): "
           f"{a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads, seq {a['seq']}, microbatch "
           f"{a['microbatch_size']}, in two stages that one rank holds as a V; m={a['microbatches']}, {a['steps']} steps "
           f"per schedule, {len(rounds)} rounds (a profile, then each schedule replayed); medians over the rounds.",
           "", "## The step against its prediction from the profile", ""]
    body = []
    for name in rounds[0]["schedules"]:
        rows = [r["schedules"][name] for r in rounds]
        pred = statistics.median(r["predicted_ms"] for r in rows)
        meas = statistics.median(r["measured_ms"] for r in rows)
        mem = [statistics.median(r[k] for r in rows) if rows[0][k] is not None else None
               for k in ("predicted_peak_mib", "allocator_peak_mib", "runtime_peak_mib")]
        body.append([_kinds(rounds, name), f"{pred:.1f}", f"{meas:.1f}", _pct(meas / pred - 1, 1),
                     *("-" if x is None else f"{x:.0f}" for x in mem)])
    out += _table(["schedule", "predicted ms", "measured ms", "error", "peak activations predicted MiB",
                   "allocator's peak above the step's start MiB", "runtime's count MiB"], body)
    out += ["", "## Each pass in the steps against the profile (ms)", ""]
    body = []
    for name in rounds[0]["schedules"]:
        per_round = [{(p["stage"], p["op"]): p for p in r["schedules"][name]["passes"]} for r in rounds]
        for key in sorted(set.intersection(*(set(x) for x in per_round))):  # the passes every round's schedule ran
            prof = statistics.median(x[key]["profiled_ms"] for x in per_round)
            meas = statistics.median(x[key]["measured_ms"] for x in per_round)
            body.append([_kinds(rounds, name), str(key[0]), key[1], f"{prof:.3f}", f"{meas:.3f}", _pct(meas / prof - 1, 1)])
    out += _table(["schedule", "stage", "pass", "profiled", "in the steps", "error"], body)
    out += ["", "## The profile's pass times per round (ms)", ""]
    body = []
    for k, r in enumerate(rounds):
        for s, st in enumerate(r["profile"]["stages"]):
            body.append([str(k + 1), str(s), f"{st['t_f']:.3f}", f"{st['t_b']:.3f}", f"{st['t_w']:.3f}",
                         f"{st['t_b'] / st['t_f']:.2f}", f"{st['t_w'] / st['t_f']:.2f}"])
    out += _table(["round", "stage", "F", "B", "W", "B / F", "W / F"], body)
    return [*out, ""]


TOPICS = {
    "classic": Topic("Classic schedules against the paper's Tables 5 and 8", ("classic.json",), "python bench/classic.py",
                     "about 15 s", classic),
    "solver": Topic("Solver on the paper's settings", ("solver.json",), "python bench/solver.py", "about 14 minutes",
                    solver),
    "solver-gap": Topic("Solver against the exact oracle", ("solver_gap.json",),
                        lambda d: "PYTHONPATH=. python bench/solver_gap.py --count {count} --seed {seed} --time-limit "
                        "{time_limit:g} --oracle-time {oracle_time:g}".format(**d["settings"]),
                        "minutes; oracle optima are cached with --oracle-cache", solver_gap),
    "solver-family": Topic("Solver before and after a change, on a generated family",
                           ("solver_family.json", "solver_family_no_milp.json", "solver_family_d409d7c.json"),
                           lambda d: "PYTHONPATH=. python bench/solver_family.py --before {before} --count {count} --seed "
                           "{seed} --time-limit {time_limit:g} [--no-milp] [--after {before}]".format(**d["settings"]),
                           "about 10 minutes per run", solver_family),
    "runtime": Topic("Runtime with emulated passes", ("runtime.json",), "python bench/runtime.py", "a few minutes", runtime),
    "real": Topic("Runtime with real passes, p=2", ("real.json",), "python bench/real.py",
                  "about 2 minutes on 2 quiet cores", real),
    "split": Topic("Cost of the split backward", ("split.json",),
                   lambda d: "python bench/split.py --steps 30" if "models" not in d else
                   "python bench/split.py --models {} --hidden {} --steps {}".format(
                       " ".join(d["models"]), " ".join(str(h) for h in dict.fromkeys(r["hidden"] for r in d["rows"])),
                       d["steps"]),
                   lambda d: "about 10 minutes" if "models" not in d else "about 10 minutes at the defaults; "
                   "MoE and ViT at three sizes, 10 steps: about 5 minutes at load 4", split),
    "profiler": Topic("Profiler accuracy", ("profiler.json",), "python bench/profiler.py", "about a minute", profiler),
    "hf": Topic("Hugging Face models through the pipeline", ("hf.json",), "python bench/hf.py", "about 2 minutes", hf),
    "hf-families": Topic("Every causal-LM type of transformers, cut and checked", ("hf_families.json",),
                         "python bench/hf_families.py --runtime", "15-40 minutes on 2 shared cores", hf_families),
    "post-validation": Topic("Optimizer post-validation", ("post_validation.json",), "python bench/post_validation.py",
                             "about 4 minutes", post_validation),
    "faults": Topic("The runtime under faults", ("faults.json",), "python bench/faults.py", "about 5 minutes", faults),
    "plan": Topic("Planning the cut, placement and schedule together", ("plan.json",),
                  "PYTHONPATH=. python bench/plan.py --cut-time 0.5 --torchtitan-path DIR", "about 15 minutes", plan),
    "fused": Topic("Fused and split backwards: certificates and schedules", ("fused.json",),
                   lambda d: "PYTHONPATH=. python bench/fused.py --count {count} --seed {seed} --time-limit {time_limit:g} "
                   "--oracle-time {oracle_time:g} --large-time-limit {large_time_limit:g} --paper-time-limit "
                   "{paper_time_limit:g} --base BEFORE".format(**d["settings"]),
                   "about 30 minutes; oracle optima are cached with --oracle-cache", fused),
    "recompute": Topic("Memory below 1F1B: V-Half, V-Min and recomputation",
                       ("recompute_real.json", "recompute_recompute.json", "recompute_scale.json",
                        "recompute_controllable.json", "recompute_checks.json"),
                       "PYTHONPATH=. python bench/recompute.py --parts PARTS -o recompute_NAME (one run per part, see the "
                       "notes)", "about 20 minutes in all", recompute),
    "data-parallel": Topic("Data-parallel reductions: the iteration measured against its prediction", ("data_parallel.json",),
                           lambda d: f"PYTHONPATH=. python bench/data_parallel.py --pp {' '.join(map(str, d['pp']))} "
                                     f"--dp {d['dp']} --iters {d['iters']} --warmup {d['warmup']}"
                                     + (f" --slowdown {d['slowdown']:g}" if "slowdown" in d else ""),
                           lambda d: f"{d.get('wall_s', 0) / 60:.0f} minutes", data_parallel),
    "compiled": Topic("torch.compile under the split backward", ("compiled.json",),
                      lambda d: f"PYTHONPATH=. python bench/compiled.py --hidden {d['hidden']} --seq {d['seq']} "
                                f"--mb {d['mb']} --layers {d['layers']} --backend {d['backend']} --reps {d['reps']}",
                      lambda d: f"{d.get('wall_s', 0):.0f} s", compiled),
    "iteration": Topic("The iteration with data-parallel reductions", ("iteration.json",),
                       lambda d: f"PYTHONPATH=. python bench/iteration.py --time-limit {d['time_limit_s']:g}"
                                 + ("" if d.get("speed") else " --no-speed")
                                 + "".join(f" --{k} {' '.join(f'{x:g}' if isinstance(x, float) else str(x) for x in d[k])}"
                                           for k in ("replicas", "bandwidth") if k in d)
                                 + (" --shard" if d.get("sharded") else ""),
                       lambda d: f"{d.get('wall_s', 0) / 60:.0f} minutes", iteration),
    "iteration-milp": Topic("The iteration-aware MILP against the heuristics", ("iteration_milp.json",),
                            lambda d: "PYTHONPATH=. python bench/iteration_milp.py --count {count} --seed {seed} "
                                      "--time-limit {time_limit:g} --paper-time-limit {paper_time_limit:g}"
                                      .format(**d["settings"]),
                            lambda d: f"{d.get('wall_s', 0) / 60:.0f} minutes", iteration_milp),
    "tune": Topic("Tuning the whole configuration for a cluster", ("tune.json",),
                  "PYTHONPATH=. python bench/tune.py --plan-time 1 --case-time 120",
                  lambda d: f"{sum(d[k].get('section_s', 0) for k in ('exact', 'baselines', 'time', 'real') if k in d) / 60:.0f}"
                            " minutes", tune),
    "tune-run": Topic("Tune's choice run on local processes against torchtitan's default", ("tune_run.json",),
                      lambda d: f"PYTHONPATH=. python bench/tune_run.py --ranks {','.join(str(r['ranks']) for r in d['results'])}"
                                f" --rounds {d['rounds']} --steps {d['steps']} --warmup {d['warmup']}",
                      lambda d: f"{d.get('total_s', 0) / 60:.0f} minutes", tune_run),
    "moe": Topic("Overlapped pairs on MoE profiles: solved against DualPipeV", ("moe.json",),
                 lambda d: f"PYTHONPATH=. python bench/moe.py --time-limit {d['time_limit_s']:g}",
                 lambda d: f"{d.get('wall_s', 0) / 60:.0f} minutes", moe),
    "moe-run": Topic("MoE overlapped pairs run: emulated passes, real gloo all-to-all", ("moe_run.json",),
                     lambda d: f"PYTHONPATH=. python bench/moe_run.py -m {d['m']} --iters {d['iters']} --warmup "
                               f"{d['warmup']} --payload-kib {d['payload_kib']} --rounds {d['rounds']}",
                     lambda d: f"{d.get('seconds', 0):.0f} s", moe_run),
    "gpu": Topic("One CUDA GPU: the profile against the runtime's passes, the step against its prediction", ("gpu.json",),
                 lambda d: f"python bench/gpu.py --dtype {d['model']['dtype']} --layers {d['model']['layers']} --hidden "
                           f"{d['model']['hidden']} --seq {d['model']['seq']} -b {d['model']['microbatch_size']} -m "
                           f"{d['model']['microbatches']} --steps {d['model']['steps']} --rounds {d['model']['rounds']}",
                 "about 2 minutes on an H200", gpu),
    "startup": Topic("How long the command line takes to start", ("startup.json",),
                     lambda d: f"python bench/startup.py --repeat {d['repeat']}", "under a minute", startup),
}


def render(name: str, sources: list[Source]) -> tuple[str, Machine, str]:
    """The report's generated part, its machine and the date its name takes."""
    topic = TOPICS[name]
    docs = [src.doc for src in sources]
    command = topic.command if isinstance(topic.command, str) else topic.command(docs[0])
    duration = topic.duration if isinstance(topic.duration, str) else topic.duration(docs[0])
    lines = header(topic.title, command, sources, duration) + topic.render(docs)
    rec = docs[0].get("machine") if isinstance(docs[0].get("machine"), dict) else {}
    date = (rec or {}).get("date") or sources[0].date or "undated"
    return "\n".join(lines).rstrip() + "\n", _machine(docs[0]), date[:10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("topic", nargs="?", choices=sorted(TOPICS))
    ap.add_argument("results", nargs="*", help="results JSON, or COMMIT:bench/results/NAME.json as saved in a commit "
                    "(default: the topic's files in bench/results)")
    ap.add_argument("--name", help="report name in place of the topic: a report of its own in the docs site's Results "
                    "menu, not one that supersedes the topic's")
    ap.add_argument("--hardware", help="hardware part of the file name (default: from the CPU model and cores)")
    ap.add_argument("--date", help="date part of the file name, DATE-N for the N-th run of a day (default: the run's "
                    "date, else the file's commit date; needed where that day has several runs)")
    ap.add_argument("-o", "--output", help="report file ('-': stdout; default: bench/reports/NAME_HARDWARE_DATE.md)")
    ap.add_argument("--list", action="store_true", help="list the topics and their results files")
    args = ap.parse_args()
    if args.list or not args.topic:
        for name, t in TOPICS.items():
            print(f"{name:16} {', '.join(t.files)}")
        return
    sources = [source(s) for s in args.results or [str(RESULTS / f) for f in TOPICS[args.topic].files]]
    text, machine, date = render(args.topic, sources)
    if args.output == "-":
        print(text, end="")
        return
    name, hardware = args.name or args.topic, args.hardware or machine.tag
    if args.output:
        out = Path(args.output)
    else:
        same_day = [r for r in reports_by_name().get(name, []) if (r.hardware, r.date) == (hardware, date)]
        if len(same_day) > 1 and not args.date:
            sys.exit(f"error: {name} has {len(same_day)} runs dated {date} on {hardware}; say which with --date "
                     f"({', '.join(r.path.stem.rsplit('_', 1)[1] for r in reversed(same_day))}, or the next for a new one)")
        out = REPORTS / f"{name}_{hardware}_{args.date or date}.md"
        try:
            report_file(out)
        except ValueError as e:
            sys.exit(f"error: {e}")
    notes = ""
    if out.is_file() and NOTES in out.read_text():
        notes = out.read_text().split(NOTES, 1)[1].lstrip("\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n" + NOTES + "\n\n" + notes)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
