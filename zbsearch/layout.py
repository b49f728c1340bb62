"""Placement: which rank holds each virtual stage (``stage_to_rank``).

With ``chunks`` virtual stages per rank the model is cut into p * chunks stages. Two layouts:

* looped (Megatron's interleaved 1F1B): rank r holds stages r, r+p, r+2p, ...; one chunk is
  one stage per rank;
* v (ZB-V): the chunks go down the ranks and back up in turn, so with two chunks rank r holds
  stages r and 2p-1-r and rank 0 holds both the first and the last stage.
"""

from __future__ import annotations

from typing import Literal

from .errors import ZbError

__all__ = ["Layout", "placement"]

Layout = Literal["looped", "v"]


def placement(num_ranks: int, chunks: int = 1, layout: Layout = "looped") -> list[int]:
    """stage -> rank for ``num_ranks`` ranks holding ``chunks`` stages each."""
    if chunks < 1:
        raise ZbError(f"the number of chunks per rank must be at least 1, not {chunks}")
    down = list(range(num_ranks))
    if layout == "looped":
        return down * chunks
    if layout == "v":
        return [r for c in range(chunks) for r in (down if c % 2 == 0 else down[::-1])]
    raise ZbError(f"unknown placement layout {layout!r}: 'looped' or 'v'")
