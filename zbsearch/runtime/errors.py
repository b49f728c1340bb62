"""The runtime's one error type: a pipeline step that cannot go on, named by rank and action."""

from __future__ import annotations

from ..errors import ZbError

__all__ = ["PipelineError"]


class PipelineError(ZbError):
    """A rank could not finish its part of a step: a peer died or hung, or the set-up is wrong.

    A ZbError, so the CLI and examples print it as one line.
    """
