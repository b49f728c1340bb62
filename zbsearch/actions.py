"""Compact action notation: ``{stage}{op}{microbatch}``, e.g. ``2F0`` or ``0BW3``.

The same letters as torch.distributed.pipelining where they mean the same thing:
F forward, B gradient w.r.t. the stage input, W gradient w.r.t. the stage weights,
BW a fused full backward (B immediately followed by W, as in GPipe/1F1B). torch has no
letter for recomputation: R re-runs the forward of a stage whose F ran checkpointed (kept only
what recomputation needs) to rebuild its activations before its backward, RS does the same
for the modules selected for selective recomputation only (``zbsearch.costs``).

An overlapped pair, a forward and another microbatch's backward that a rank runs together so
that each one's all-to-all hides behind the other's compute (``zbsearch.costs``), is written
with a ``+``: ``0F3+5B1`` (``pair_text``, ``parse_row``). A schedule file keeps the two
actions apart and lists where the pairs are (``Schedule.overlapped``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from .errors import ZbError

__all__ = ["Op", "Action", "RECOMPUTES", "PAIR_SEP", "parse_action", "pair_text", "row_text", "parse_row"]


class Op(str, Enum):
    """A pass type: F forward, B input gradient, W weight gradient, BW fused backward (B then W),
    R full recomputation of a checkpointed forward, RS selective recomputation."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    R = "R"
    RS = "RS"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One pass of one microbatch on one stage, written ``{stage}{op}{mb}`` (``str(Action(2, Op.F, 0))``
    is ``"2F0"``). Stages are virtual stages, numbered along the pipeline; which rank runs a
    stage is the schedule's ``stage_to_rank``."""

    stage: int
    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    def parts(self) -> tuple[Op, ...]:
        """The basic passes this action performs (BW performs B then W)."""
        return (Op.B, Op.W) if self.op is Op.BW else (self.op,)


_ACTION_RE = re.compile(r"^(\d+)(BW|RS|F|B|W|R)(\d+)$")
RECOMPUTES = (Op.R, Op.RS)
"""The recompute passes: a schedule that has one for (stage, microbatch) runs that microbatch's
F there checkpointed."""
PAIR_SEP = "+"
"""Joins the forward and the backward of an overlapped pair in the compact text: ``0F3+5B1``."""
_OPS = {op.value: op for op in Op}  # a dict lookup: Op(text) is slow, and schedules hold many actions


def parse_action(text: str) -> Action:
    """The action ``text`` spells, e.g. ``parse_action("0BW3")``.

    Raises:
        ZbError: ``text`` is not ``{stage}{F|B|W|BW|R|RS}{microbatch}``.
    """
    m = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ZbError(f"bad action {text!r}: expected {{stage}}{{F|B|W|BW|R|RS}}{{microbatch}}, e.g. '2F0'")
    stage, op, mb = m.groups()
    return Action(int(stage), _OPS[op], int(mb))


def pair_text(f: Action, b: Action) -> str:
    """The compact text of an overlapped pair, the forward first: ``"0F3+5B1"``."""
    return f"{f}{PAIR_SEP}{b}"


def row_text(row: list[Action], pairs: list[int] | tuple[int, ...] = ()) -> list[str]:
    """One rank's actions as compact texts, each overlapped pair (a forward at a position in
    ``pairs``, the backward after it) joined into one: ``["0F0", "0F1+5B0", ...]``."""
    starts = set(pairs)
    out: list[str] = []
    i = 0
    while i < len(row):
        if i in starts and i + 1 < len(row):
            out.append(pair_text(row[i], row[i + 1]))
            i += 2
        else:
            out.append(str(row[i]))
            i += 1
    return out


def parse_row(texts: list[str]) -> tuple[list[Action], list[int]]:
    """One rank's actions from compact texts (``row_text``'s inverse): the actions, and the
    positions of the forwards that start overlapped pairs.

    Raises:
        ZbError: a text that is neither an action nor two joined by ``+``.
    """
    actions: list[Action] = []
    pairs: list[int] = []
    for text in texts:
        if isinstance(text, str) and PAIR_SEP in text:
            parts = text.split(PAIR_SEP)
            if len(parts) != 2:
                raise ZbError(f"bad pair {text!r}: expected a forward and a backward joined by '+', e.g. '0F3+5B1'")
            pairs.append(len(actions))
            actions += [parse_action(parts[0]), parse_action(parts[1])]
        else:
            actions.append(parse_action(text))
    return actions, pairs
