"""Compact action notation: ``{stage}{op}{microbatch}``, e.g. ``2F0`` or ``0BW3``.

The same letters as torch.distributed.pipelining where they mean the same thing:
F forward, B gradient w.r.t. the stage input, W gradient w.r.t. the stage weights,
BW a fused full backward (B immediately followed by W, as in GPipe/1F1B). torch has no
letter for recomputation: R re-runs the forward of a stage whose F ran checkpointed (kept only
what recomputation needs) to rebuild its activations before its backward, RS does the same
for the modules selected for selective recomputation only (``zbsearch.costs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from .errors import ZbError

__all__ = ["Op", "Action", "RECOMPUTES", "parse_action"]


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
