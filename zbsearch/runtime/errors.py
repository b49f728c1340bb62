"""The runtime's one error type, and the two places where communication can fail.

Every send, receive and wait of the runtime goes through ``post`` and ``wait``, so a peer that
died (gloo: "Connection closed by peer", raised by ``isend``/``irecv`` or by ``wait``), hung
(the timeout) or broke the process group surfaces as a ``PipelineError`` that says what this
rank was doing, with which peer, and after how long, never as a raw backend ``RuntimeError``.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import ZbError

__all__ = ["PipelineError", "post", "wait", "first_line"]

W = TypeVar("W")


class PipelineError(ZbError):
    """A rank could not finish its part of a step: a peer died or hung, a stage raised, or the
    set-up is wrong. A ZbError, so the CLI and examples print it as one line; a backend or
    stage exception it stands for is its ``__cause__``."""


def first_line(err: BaseException) -> str:
    """An exception's first line (or its type name when it has no message), for one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def post(issue: Callable[[], W], what: str) -> W:
    """Issue a send or receive (``issue()``); a peer already gone makes it a PipelineError."""
    t0 = time.monotonic()
    try:
        return issue()
    except PipelineError:
        raise
    except Exception as err:  # gloo raises RuntimeError subclasses of several kinds
        elapsed = time.monotonic() - t0
        raise PipelineError(f"{what} failed after {elapsed:.3g}s (when posted): {first_line(err)}") from err


def wait(work, timeout: float, what: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; a failure or timeout is a PipelineError
    with the time actually waited (a dead peer fails a wait long before the timeout)."""
    t0 = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as err:
        elapsed = time.monotonic() - t0
        timed_out = elapsed >= 0.98 * timeout or "timed out" in str(err).lower()
        verdict = "timed out" if timed_out else "failed"
        raise PipelineError(f"{what} {verdict} after {elapsed:.3g}s (timeout {timeout:g}s): {first_line(err)}") from err
