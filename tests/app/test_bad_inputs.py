"""Every command against bad input: exit 1 (2 for a usage error, 130 for Ctrl-C), exactly one line
on stderr, no traceback, and nothing written: the working folder is hashed before and after each case.

Runs ``main(argv)`` in this process (the real entry point, without a process start per case);
a few cases at the end run the installed command to check what only a process shows (usage
errors, Ctrl-C).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import zbsearch as zb
from tests.helpers import cli_command
from tests.helpers import run_main as _run


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: its type, mode and (for files) content hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), digest,
                                        os.readlink(p) if p.is_symlink() else None)
    return out


def _schedule_doc(**edits) -> dict:
    doc = json.loads(zb.build_classic("zb-h1", zb.resolve_profile("unit-p4"), 8).model_dump_json())
    doc.update(edits)
    return doc


def _edit(rank: int, fn) -> dict:
    doc = _schedule_doc()
    doc["actions"][rank] = fn(list(doc["actions"][rank]))
    return doc


def _profile_doc(**stage) -> dict:
    st = {"t_f": 1.0, "t_b": 1.0, "t_w": 1.0, "m_f": 1.0, "m_b": -0.5, "m_w": -0.5, **stage}
    return {"format": "zbsearch.profile", "version": 1, "name": "x", "memory_unit": "activations", "stages": [st] * 4}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder of inputs (valid and broken), and the cwd, so default outputs land there too."""
    files = {
        "good.json": _schedule_doc(),
        "w-before-b.json": _edit(0, lambda a: a[:4] + ["0W0", "0B0"] + a[6:]),
        "duplicate-w.json": _edit(0, lambda a: a + ["0W0"]),
        "missing-w.json": _edit(0, lambda a: [x for x in a if x != "0W7"]),
        "lost-microbatch.json": _edit(3, lambda a: [x for x in a if not x.endswith("7")]),
        "deadlock.json": _edit(0, lambda a: [a[0], "0B0"] + [x for x in a[1:] if x != "0B0"]),  # 0B0 waits for 0F1 via rank 1
        "over-limit.json": _schedule_doc(memory_limit=[1.0] * 4),
        "no-spec-limit.json": _schedule_doc(memory_limit=[4.0] * 4),
        "wrong-placement.json": _schedule_doc(stage_to_rank=[0, 1, 2, 2]),
        "two-stages.json": {**_profile_doc(), "stages": _profile_doc()["stages"][:2]},
        "huge-time.json": _profile_doc(t_f=1e308),
        "huge-memory.json": _profile_doc(m_f=1e308, m_b=-5e307, m_w=-5e307),
        "huge-comm.json": {**_profile_doc(), "t_comm": 1e308},
        "capacity-short.json": {**_profile_doc(), "memory_capacity": [1.0, 2.0]},
        "stage-extra-bad.json": _profile_doc(t_f="fast"),
    }
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    (tmp_path / "existing.txt").write_text("keep me\n")
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


P = ("-p", "unit-p4", "-m", "8")
CASES = [
    # invalid schedules: refused by every command that reads one (validate reports them)
    *[
        (cmd, f, "invalid schedule")
        for f in ("w-before-b", "duplicate-w", "missing-w", "lost-microbatch", "deadlock", "over-limit")
        for cmd in (["simulate"], ["show"], ["export", "--to", "torch-csv", "-o", "out.csv"])
    ],
    *[
        (["validate"], f, "invalid:")
        for f in ("w-before-b", "duplicate-w", "missing-w", "lost-microbatch", "deadlock", "over-limit")
    ],
    (["simulate"], "wrong-placement", "rank 3 holds no stage"),
    # profiles that do not fit the schedule, limits in another unit
    (["simulate", "good.json", "-p", "two-stages.json"], None, "profile has 2 stages but this schedule of 4 stages"),
    (["validate", "good.json", "-p", "1.5b-m24"], None, "profile has 8 stages"),
    (["show", "good.json", "-p", "1.5b-m24"], None, "profile has 8 stages"),
    (["validate", "no-spec-limit.json", "-p", "cpu-gpt-tiny"], None, "give the limit for profile"),
    # extreme numbers
    (["schedule", "zb-v", "-p", "huge-time.json", "-m", "8"], None, "out of range"),
    (["schedule", "1f1b", "-p", "huge-time.json", "-m", "8"], None, "out of range"),
    (["compare", "-p", "huge-time.json", "-m", "8"], None, "out of range"),
    (["solve", "-p", "huge-time.json", "-m", "8", "--no-milp"], None, "out of range"),
    (["schedule", "1f1b", "-p", "huge-memory.json", "-m", "8"], None, "out of range"),
    (["compare", "-p", "huge-comm.json", "-m", "8"], None, "out of range"),
    (["schedule", "1f1b", "-p", "capacity-short.json", "-m", "8"], None, "memory_capacity has 2 values for 4 stages"),
    (["schedule", "1f1b", "-p", "stage-extra-bad.json", "-m", "8"], None, "stages.0.t_f"),
    # memory limits
    (["validate", "good.json", "--mem-limit", ""], None, "is empty"),
    (["compare", *P, "--mem-limit", "lots"], None, "cannot read memory limit"),
    (["compare", *P, "--mem-limit", "40GiB"], None, "byte budget"),
    (["compare", *P, "--mem-limit", "0p"], None, "positive finite"),
    (["solve", *P, "--mem-limit", "1e400p"], None, "positive finite"),
    (["solve", *P, "--mem-limit", "capacity"], None, "has no memory_capacity"),
    (["validate", "good.json", "--mem-limit", "nanp"], None, "cannot read memory limit"),
    # outputs: checked before any work, one line, nothing created
    *[
        (cmd + ["-o", ""], None, "output path is empty")
        for cmd in (
            ["schedule", "1f1b", *P],
            ["solve", *P, "--no-milp"],
            ["export", "good.json", "--to", "torch-csv"],
            ["frontier", *P],
            ["show", "good.json"],
            ["profile", "--builtin", "gpt"],
        )
    ],
    (["demo", "-o", ""], None, "output folder is empty"),
    (["demo", "-o", "existing.txt"], None, "exists and is not a folder"),
    (["schedule", "1f1b", *P, "-o", "adir"], None, "is a directory"),
    (["solve", *P, "-t", "15", "-o", "existing.txt/x.json"], None, "cannot write"),
    (["export", "good.json", "--to", "torch-csv", "-o", "existing.txt/deeper/x.csv"], None, "Not a directory"),
    (["frontier", *P, "-o", "adir2"], None, "cannot tell the output format"),
    (["show", "good.json", "-o", "chart.gif"], None, "cannot tell the chart format"),
    (["export", "good.json", "--to", "bogus", "-o", "x.csv"], None, "unknown export format"),
    # a microbatch count no run could hold in memory is refused before any work
    (["schedule", "1f1b", "-p", "unit-p4", "-m", "1000000000"], None, "at most 2,000,000 per iteration"),
    (["schedule", "zb-v", "-p", "unit-p4", "-m", "0"], None, "at least 1"),
    (["solve", "-p", "unit-p4", "-m", "200000", "--no-milp"], None, "2,400,000 passes"),
    (["compare", "-p", "unit-p4", "-m", "10000000"], None, "at most 2,000,000"),
    (["frontier", "-p", "unit-p4", "-m", "10000000"], None, "at most 2,000,000"),
    (["schedule", "zb-h9", *P], None, "unknown schedule kind"),
    (["profile"], None, "give one of --model"),
    (["profile", "--builtin", "llama"], None, "unknown built-in model"),
    (["profile", "--builtin", "gpt", "--timeout", "0"], None, "--timeout must be a positive number"),
    (["demo", "--device", "tpu", "-o", "demo-out"], None, "not supported"),
    (["demo", "--dp", "0", "-o", "demo-out"], None, "--dp must be at least 1, not 0"),
    (["demo", "--stages", "1", "-o", "demo-out"], None, "--stages 1 has no pipeline"),
    # data-parallel reductions from bytes and a bandwidth
    (["compare", *P, "--dp", "8"], None, "--dp, --dp-bandwidth and --grad-bytes go together"),
    (["schedule", "1f1b", *P, "--grad-bytes", "1GB"], None, "go together"),
    (["compare", *P, "--dp", "8", "--dp-bandwidth", "50", "--grad-bytes", "lots"], None, "cannot read the byte budget"),
    (["compare", *P, "--dp", "8", "--dp-bandwidth", "50", "--grad-bytes", "1GB,1GB,1GB"], None,
     "3 gradient sizes for 4 stages"),
    (["schedule", "1f1b", *P, "--dp", "8", "--dp-bandwidth", "0", "--grad-bytes", "1GB"], None, "a positive bandwidth"),
    (["simulate", "--dp", "8", "--dp-bandwidth", "-5", "--grad-bytes", "1GB"], "good", "a positive bandwidth"),
    (["plan", "-l", "layers.json", "-r", "2", "-m", "2", "--dp", "8"], None, "--dp and --dp-bandwidth go together"),
    (["profile", "--builtin", "gpt", "--dp-bandwidth", "10"], None, "give --dp N too"),
    (["profile", "--builtin", "gpt", "--dp", "8", "--dp-bandwidth", "0"], None, "--dp-bandwidth must be a positive"),
    # how the priced reductions share a link
    (["compare", *P, "--dp-share", "1"], None, "give --dp N and --dp-bandwidth too"),
    (["simulate", "--dp-share", "1"], "good", "give --dp N and --dp-bandwidth too"),
    (["compare", *P, "--ranks-per-link", "2"], None, "--ranks-per-link says which ranks share a link: give --dp-share"),
    (["solve", *P, "--dp", "8", "--dp-bandwidth", "50", "--grad-bytes", "1GB", "--dp-share", "-0.5"], None,
     "--dp-share must be a number from 0 to 100"),
    (["schedule", "1f1b", *P, "--dp", "8", "--dp-bandwidth", "50", "--grad-bytes", "1GB", "--dp-share", "inf"], None,
     "--dp-share must be a number from 0 to 100"),
    (["plan", "-l", "layers.json", "-r", "2", "-m", "2", "--dp-share", "1"], None, "give --dp N and --dp-bandwidth too"),
    (["profile", "--builtin", "gpt", "--dp", "8", "--dp-share", "0.5"], None, "profile --dp N alone measures it"),
    (["profile", "--builtin", "gpt", "--dp-share", "0.5"], None, "give --dp N and --dp-bandwidth too"),
    # the link between ranks, given on one device
    (["profile", "--builtin", "gpt", "--link-bandwidth", "0"], None, "--link-bandwidth must be a positive number of GB/s"),
    (["profile", "--builtin", "gpt", "--link-bandwidth", "-5"], None, "--link-bandwidth must be a positive number"),
    (["profile", "--builtin", "gpt", "--link-bandwidth", "nan"], None, "--link-bandwidth must be a positive number"),
    (["profile", "--builtin", "gpt", "--link-bandwidth", "inf"], None, "--link-bandwidth must be a positive number"),
    (["profile", "--builtin", "gpt", "--link-bandwidth", "100", "--link-latency", "-1"], None,
     "--link-latency must be a number of ms, 0 or more"),
    (["profile", "--builtin", "gpt", "--link-latency", "0.01"], None, "give --link-bandwidth GB/s too"),
]


# usage errors (what typer itself refuses): one line, exit 2. The words are those every typer
# release in the declared range prints.
USAGE_CASES: list[tuple[list[str], str | None, str]] = [
    (["schedule"], None, "Missing argument"),
    (["schedule", "1f1b", "-m", "8"], None, "Missing option '--profile'"),
    (["schedule", "1f1b", "-p", "unit-p4", "-m", "x"], None, "valid integer"),
    (["solve", *P, "-t", "0"], None, "--time-limit"),
    (["solve"], None, "Missing option"),
    (["solve", *P, "--bogus"], None, "No such option"),
    (["demo", "-p", "4"], None, "No such option"),
    (["compare", *P, "--dp", "8", "--dp-bandwidth", "50", "--grad-bytes", "1GB", "--dp-share", "1", "--ranks-per-link", "0"],
     None, "--ranks-per-link"),
    (["nosuchcommand"], None, "No such command"),
]


@pytest.mark.parametrize("args, schedule, words", CASES + USAGE_CASES, ids=[
    " ".join(a + ([s] if s else [])) for a, s, _ in CASES + USAGE_CASES])
def test_bad_input_is_one_line_and_writes_nothing(work, capsys, args, schedule, words):
    expected_code = 2 if (args, schedule, words) in USAGE_CASES else 1
    if schedule is not None:
        args = [args[0], f"{schedule}.json", *args[1:]]
    before = _snapshot(work)
    code, out, err = _run(capsys, *args)
    assert code == expected_code, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err + out
    assert _snapshot(work) == before


def test_unwritable_folder_fails_before_the_work(work, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere; the path-under-a-file cases cover this")
    ro = work / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        before = _snapshot(work)
        code, _, err = _run(capsys, "solve", *P, "-o", ro / "s.json")
        assert code == 1 and "cannot write" in err and len(err.splitlines()) == 1
        assert _snapshot(work) == before
    finally:
        ro.chmod(0o700)


# -- what is written, and where ---------------------------------------------------------------------
def test_symlink_fifo_and_modes(work, capsys):
    good = work / "good.json"
    # a symlink stays a link; its target is replaced atomically and keeps its mode
    target = work / "target.csv"
    target.write_text("old\n")
    target.chmod(0o640)
    (work / "link.csv").symlink_to("target.csv")
    code, _, err = _run(capsys, "export", good, "--to", "torch-csv", "-o", "link.csv")
    assert code in (0, None) and err.strip() == f"wrote {target.resolve()}"
    assert (work / "link.csv").is_symlink() and target.read_text() != "old\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    # a new file gets 0666 less the umask
    old = os.umask(0o027)
    try:
        code, _, _ = _run(capsys, "export", good, "--to", "torch-csv", "-o", "new.csv")
    finally:
        os.umask(old)
    assert stat.S_IMODE((work / "new.csv").stat().st_mode) == 0o640
    assert (work / "new.csv").read_text() == target.read_text()  # the link's target got the same CSV
    # a FIFO is written in place, not replaced by a file
    fifo = work / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    code, _, err = _run(capsys, "export", good, "--to", "torch-csv", "-o", fifo)
    reader.join(timeout=30)
    assert code in (0, None) and stat.S_ISFIFO(fifo.lstat().st_mode)
    assert got and got[0] == (work / "new.csv").read_text()
    assert not [p for p in work.iterdir() if p.name.endswith(".tmp")]


def test_frontier_writes_and_prints_the_path_it_names(work, capsys):
    code, out, err = _run(capsys, "frontier", *P, "-t", "0.2", "-o", "adir/f.png")
    assert code in (0, None) and err.strip() == "wrote adir/f.png" and (work / "adir" / "f.png").stat().st_size > 0
    code, out, err = _run(capsys, "frontier", *P, "-t", "0.2", "-o", "-")
    assert code in (0, None) and json.loads(out)["format"] == "zbsearch.frontier" and not (work / "-.png").exists()


def test_zero_memory_rank_frontier_and_limits(work, capsys):
    doc = _profile_doc()
    doc["memory_unit"] = "bytes"
    doc["stages"] = [{**doc["stages"][0], "m_f": 0.0, "m_b": 0.0, "m_w": 0.0}] + [
        {**doc["stages"][0], "m_f": 100.0, "m_b": -60.0, "m_w": -40.0}] * 3
    (work / "frozen-first.json").write_text(json.dumps(doc))
    code, out, err = _run(capsys, "frontier", "-p", "frozen-first.json", "-m", "8", "-t", "0.2", "-o", "f.json")
    assert code in (0, None), err
    points = json.loads((work / "f.json").read_text())["points"]
    assert points and all(pt["peak_memory"][0] == 0 for pt in points)
    code, out, err = _run(capsys, "solve", "-p", "frozen-first.json", "-m", "8", "--mem-limit", "1p", "--no-milp", "-o", "s.json")
    assert code in (0, None), err
    assert json.loads((work / "s.json").read_text())["memory_limit"][0] == 0


def test_limit_spec_is_recomputed_for_another_profile(work, capsys):
    code, _, err = _run(capsys, "solve", *P, "--mem-limit", "2p", "--no-milp", "-o", "s.json")
    assert code in (0, None), err
    doc = json.loads((work / "s.json").read_text())
    assert doc["memory_limit_spec"] == "2p" and doc["memory_limit"] == [8.0] * 4
    code, out, err = _run(capsys, "validate", "s.json", "-p", "cpu-gpt-tiny")
    assert code in (0, None) and out.startswith("valid"), err
    tight = {**doc, "memory_limit": [4.0] * 4, "memory_limit_spec": "1p"}  # 1p: too little for this order
    (work / "tight.json").write_text(json.dumps(tight))
    code, _, err = _run(capsys, "validate", "tight.json", "-p", "cpu-gpt-tiny")
    assert code == 1 and "over its limit" in err, err
    limit = float(err.split("over its limit")[-1].split()[0])
    assert limit > 1e6, err  # 1p in the other profile's bytes, not 4 M_B


def test_memory_capacity_is_a_limit(work, capsys):
    doc = {**_profile_doc(), "memory_capacity": [3.0] * 4}
    (work / "cap.json").write_text(json.dumps(doc))
    code, out, err = _run(capsys, "compare", "-p", "cap.json", "-m", "8", "--mem-limit", "capacity", "--json")
    assert code in (0, None), err
    fits = {r["kind"]: r.get("fits") for r in json.loads(out)}
    assert fits["gpipe"] is False and fits["1f1b"] is False  # 1F1B holds p = 4 microbatches on rank 0
    code, _, err = _run(capsys, "solve", "-p", "cap.json", "-m", "8", "--mem-limit", "capacity", "--no-milp", "-o", "s.json")
    assert code in (0, None), err
    assert max(json.loads((work / "s.json").read_text())["predicted"]["peak_memory"]) <= 3.0


def test_stage_extra_fields_are_kept(work):
    doc = _profile_doc()
    doc["stages"] = [{**s, "note": "measured"} for s in doc["stages"]]
    (work / "extra.json").write_text(json.dumps(doc))
    prof = zb.load_profile(work / "extra.json")
    zb.save_profile(prof, work / "back.json")
    assert json.loads((work / "back.json").read_text())["stages"][0]["note"] == "measured"


# -- as a process ----------------------------------------------------------------------------------
def test_usage_error_from_the_command_is_one_line(tmp_path):
    r = subprocess.run([*cli_command(), "schedule", "1f1b", "--bogus"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "No such option" in r.stderr
    assert list(tmp_path.iterdir()) == []


_INTERRUPT_WHILE_LOADING = """
import sys
class Interrupt:  # Ctrl-C arriving while the command line's modules load
    def find_spec(self, name, path=None, target=None):
        if name == "zbsearch.app.cli":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
from zbsearch.app import main
main()
"""


def test_ctrl_c_while_the_command_line_loads_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-c", _INTERRUPT_WHILE_LOADING], capture_output=True, text=True, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (130, "interrupted\n")


def test_importing_zbsearch_is_cheap_and_every_public_name_resolves():
    # importing the submodules that hold the public names must not hide any of them
    probe = ("import sys, types, zbsearch; print('pydantic' in sys.modules); import zbsearch.prediction, zbsearch.layout; "
             "print(not any(isinstance(getattr(zbsearch, n), types.ModuleType) for n in zbsearch.__all__))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["False", "True"]
    # the imports type checkers read name exactly the lazily loaded names
    import ast

    tree = ast.parse(Path(zb.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If))
    declared = {(("." * imp.level) + (imp.module or ""), a.name) for imp in guarded.body for a in imp.names}
    assert declared == {(mod, name) for name, mod in zb._SOURCES.items()}


def _interruptible() -> None:
    """Ctrl-C as a terminal delivers it, even where the tests themselves run in a background job
    (a shell starts those with SIGINT ignored, and Python then keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line_and_no_file(tmp_path):
    proc = subprocess.Popen([*cli_command(), "solve", "-p", "28.3b-m128", "-m", "128", "-t", "120", "-o", "s.json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=_interruptible)
    time.sleep(10)  # started and solving (an interrupt while Python imports is Python's own)
    assert proc.poll() is None, "finished before the interrupt: pick a longer solve"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and lines[-1] == "interrupted" and "Traceback" not in err, err
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.slow
def test_ctrl_c_during_demo_start_up_is_quiet_and_leaves_no_folder(tmp_path):
    # a terminal's Ctrl-C reaches the whole process group: the demo and its worker ranks
    proc = subprocess.Popen([*cli_command(), "demo", "-o", "out"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, start_new_session=True, preexec_fn=_interruptible)
    time.sleep(8)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.splitlines()[-1] == "interrupted", err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not (tmp_path / "out").exists()
