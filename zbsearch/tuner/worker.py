"""A process that evaluates configurations one at a time, stopped where one runs past its time.

``plan`` keeps to its time limit in its own phases, but one solve of a large configuration can
take longer than any share of a search (a V of many stages and microbatches builds its first
schedules for minutes). ``tune`` therefore evaluates each configuration in this worker and
ends it where it runs past its deadline: the search's time limit holds whatever a single
configuration costs. A new worker starts for the next configuration.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from .evaluate import Evaluation, Task, evaluate

__all__ = ["Worker", "serve"]

_START_S = 300.0  # the longest a worker may take to start (its imports, on a loaded machine)


def serve(read_fd: int, write_fd: int) -> None:
    """The worker's loop on two pipe ends: a task in, its evaluation out, until None."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    outbox.send(("ready", None))  # imported: the caller's clock starts now
    while True:
        try:
            task = inbox.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            outbox.send(("ok", evaluate(task)))
        except Exception:  # a bug: its traceback goes to the caller, which raises it there
            outbox.send(("error", traceback.format_exc()))


class Worker:
    """One evaluating process (``start``, or started on first use; see the module). It is a fresh
    interpreter running this package, not a copy of the caller: a script that calls ``tune``
    needs no ``if __name__ == "__main__"`` guard."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self._ready = False

    def start(self) -> None:
        """Start the worker's process, not waiting for it: it imports while the caller works."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        child_in, parent_out = os.pipe()  # (read end, write end)
        parent_in, child_out = os.pipe()
        root = str(Path(__file__).resolve().parents[2])  # this zbsearch, whatever sys.path the caller has
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        code = f"from zbsearch.tuner.worker import serve; serve({child_in}, {child_out})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child_in, child_out), env=env,
                                      stdin=subprocess.DEVNULL)
        os.close(child_in)
        os.close(child_out)
        self._send, self._recv = Connection(parent_out, readable=False), Connection(parent_in, writable=False)
        self._ready = False

    def _wait_ready(self, latest: float) -> bool:
        """Whether the worker has started by ``latest`` (a ``time.monotonic()`` instant)."""
        assert self._recv is not None
        if not self._ready:
            try:
                self._ready = (self._recv.poll(max(0.0, min(latest - time.monotonic(), _START_S)))
                               and self._recv.recv()[0] == "ready")
            except (EOFError, OSError):
                self._ready = False
        return self._ready

    def evaluate(self, task: Task, seconds: float, latest: float) -> Evaluation | None:
        """``evaluate(task)`` in the worker, or None where it has not answered ``seconds`` after
        the worker was ready, or by ``latest`` (a ``time.monotonic()`` instant); the worker is
        then stopped, and another started. Both infinite: wait for the answer (or the worker's
        end)."""
        self.start()
        if not self._wait_ready(latest):
            self.close()
            self.start()
            return None
        assert self._send is not None and self._recv is not None
        deadline = min(time.monotonic() + seconds, latest)
        try:
            self._send.send(task)
            answered = self._recv.poll(None if math.isinf(deadline) else max(0.0, deadline - time.monotonic()))
            status, value = self._recv.recv() if answered else (None, None)
        except (EOFError, OSError):  # the worker died (out of memory): as if it ran out of time
            status, value = None, None
        if status is None:
            self.close()
            self.start()  # the next one imports while the caller goes on
            return None
        if status == "error":
            raise RuntimeError(f"evaluating a configuration failed in the worker:\n{value}")
        return value

    def close(self) -> None:
        """Stop the worker (at once where it is busy)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        for conn in (self._send, self._recv):
            if conn is not None:
                conn.close()
        self._proc, self._send, self._recv, self._ready = None, None, None, False

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
