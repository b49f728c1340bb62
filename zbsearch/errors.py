"""The one exception type that means "the user gave us something wrong".

The CLI prints these as a single line and exits non-zero; anything else is a bug
and keeps its traceback.
"""

__all__ = ["ZbError"]


class ZbError(Exception):
    """A user-facing error: bad input, infeasible request, missing file."""
