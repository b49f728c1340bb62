"""Compact action notation: ``{stage}{op}{microbatch}``, e.g. ``2F0`` or ``0BW3``.

The same letters as torch.distributed.pipelining where they mean the same thing:
F forward, B gradient w.r.t. the stage input, W gradient w.r.t. the stage weights,
BW a fused full backward (B immediately followed by W, as in GPipe/1F1B).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from .errors import ZbError

__all__ = ["Op", "Action", "parse_action"]


class Op(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, order=True)
class Action:
    stage: int
    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    def parts(self) -> tuple[Op, ...]:
        """The basic passes this action performs (BW performs B then W)."""
        return (Op.B, Op.W) if self.op is Op.BW else (self.op,)


_ACTION_RE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)$")
_OPS = {op.value: op for op in Op}  # a dict lookup: Op(text) is slow, and schedules hold many actions


def parse_action(text: str) -> Action:
    m = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ZbError(f"bad action {text!r}: expected {{stage}}{{F|B|W|BW}}{{microbatch}}, e.g. '2F0'")
    stage, op, mb = m.groups()
    return Action(int(stage), _OPS[op], int(mb))
