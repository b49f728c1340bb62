"""HiGHS without its banner: a library call and ``solve -o -`` keep stdout their own.

HiGHS prints a banner to the process's stdout (file descriptor 1, past ``sys.stdout``) when a
model is created, before any option can silence it. ``stdout_muted`` points descriptor 1 at the
null device for a block; ``quiet_highs`` makes a silent ``highspy.Highs`` inside one.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["stdout_muted", "quiet_highs"]


@contextlib.contextmanager
def stdout_muted() -> Iterator[None]:
    """File descriptor 1 points at the null device inside the block (C code writes there
    directly, past ``sys.stdout``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def quiet_highs() -> Any:
    """A ``highspy.Highs`` that prints nothing."""
    import highspy  # here: it takes a while to import, and only the solver's models need it

    with stdout_muted():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h
