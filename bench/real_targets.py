"""The targets for real passes, as verdicts on the figures ``bench/real.py`` measured.

Kept apart from the measuring, without torch, so that the verdict logic is tested on synthetic
figures (``tests/bench/test_real_targets.py``): a wrong verdict would otherwise show only on
the one quiet run that is meant to settle the question.

Targets (on a quiet machine):
1. measured / predicted within 5% for every zbsearch schedule: the runtime trace's makespan
   (first pass to last, what the simulator predicts) against the simulator on the profile;
2. whenever zbsearch predicts a schedule more than 3% faster than 1F1B, it is measured faster
   (the median wall time of a step, barrier to barrier: what a user pays);
3. our ZB-2p at least as fast as torch's zero-bubble schedule on the same stages (wall time).
A run whose 1-minute load average went above the core count at any point was taken on a busy
machine: its verdicts are printed, marked as such, and do not settle the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TOLERANCE", "CLAIM", "Spread", "Result", "Verdict", "verdicts", "busy", "report_lines"]

TOLERANCE = 0.05  # target 1: |measured / predicted - 1| at most this
CLAIM = 0.03  # target 2: a predicted speed-up above 1 + CLAIM is a claim that must show


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of repeated measurements, in ms."""

    median: float
    q1: float
    q3: float

    @property
    def half_iqr(self) -> float:
        """Half the interquartile range relative to the median: how far one step strays."""
        return (self.q3 - self.q1) / 2 / self.median


@dataclass(frozen=True)
class Result:
    """One schedule's figures: its step wall time, and for zbsearch's schedules the trace's
    makespan; ``predicted`` the simulator's makespan for the order it ran (None: none)."""

    wall: Spread
    predicted: float | None = None
    makespan: Spread | None = None


@dataclass(frozen=True)
class Verdict:
    target: str
    schedule: str
    met: bool
    detail: str  # the numbers behind the verdict


def _ratio_note(a: Spread, b: Spread, ratio: float) -> str:
    """Whether a ratio of two medians is within the steps' own spread (then not a clear result)."""
    return " (within the steps' spread)" if abs(ratio - 1) <= a.half_iqr + b.half_iqr else ""


def verdicts(results: dict[str, Result], ours: list[str], baseline: str, zb2p: str, torch_zb: str) -> list[Verdict]:
    """The verdicts, one per (target, schedule): ``ours`` the zbsearch schedules (target 1),
    ``baseline`` our 1F1B (target 2), ``zb2p`` and ``torch_zb`` the pair of target 3."""
    out = []
    for name in ours:
        r = results[name]
        assert r.makespan is not None and r.predicted is not None, f"{name}: a zbsearch schedule has a trace and a prediction"
        ratio = r.makespan.median / r.predicted
        out.append(Verdict(
            f"measured/predicted within {TOLERANCE:.0%}", name, abs(ratio - 1) <= TOLERANCE,
            f"{ratio:.3f} (makespan {r.makespan.median:.1f} ms, predicted {r.predicted:.1f} ms)",
        ))
    base = results[baseline]
    assert base.predicted is not None
    for name in ours:
        r = results[name]
        if name == baseline:
            continue
        assert r.predicted is not None
        predicted = base.predicted / r.predicted
        measured = base.wall.median / r.wall.median
        detail = f"predicted {predicted:.3f}x, measured {measured:.3f}x (wall){_ratio_note(base.wall, r.wall, measured)}"
        claim = predicted > 1 + CLAIM  # without a claim the target holds whatever is measured
        out.append(Verdict(f"predicted > {CLAIM:.0%} faster than 1F1B is measured faster", name, measured > 1 or not claim,
                           detail + ("" if claim else f"; no claim (predicted within {CLAIM:.0%})")))
    a, b = results[zb2p], results[torch_zb]
    ratio = b.wall.median / a.wall.median
    out.append(Verdict(
        "ZB-2p at least as fast as torch's zero bubble", f"{zb2p} vs {torch_zb}", ratio >= 1,
        f"{ratio:.3f}x (wall {a.wall.median:.1f} ms vs {b.wall.median:.1f} ms; > 1: ours faster)"
        + _ratio_note(a.wall, b.wall, ratio),
    ))
    return out


def busy(loads: list[float], cores: int) -> bool:
    """A run is busy when the 1-minute load average went above the cores at any reading."""
    return max(loads) > cores


def report_lines(found: list[Verdict], loads: list[float], cores: int) -> list[str]:
    """What the bench prints: one line per verdict, then the summary with the machine's state."""
    lines = [f"{'met   ' if v.met else 'MISSED'} {v.target}: {v.schedule}: {v.detail}" for v in found]
    missed = sum(not v.met for v in found)
    state = (f"BUSY machine (load average up to {max(loads):.1f} on {cores} cores): waiting for a core is in every "
             f"figure; these verdicts do not settle the targets, run again on a quiet machine"
             if busy(loads, cores) else f"quiet machine (load average at most {max(loads):.1f} on {cores} cores)")
    lines.append(f"targets: {len(found) - missed} met, {missed} missed; {state}")
    return lines
