"""The spread of a repeatedly timed quantity, as every format records it."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["Quartiles"]


class Quartiles(BaseModel):
    """A measured time's median, first and third quartile (ms), and its mean where recorded."""

    median: float
    q1: float
    q3: float
    mean: float | None = None  # recorded since links are costed at their mean; older files lack it
