"""How long one process waits for another before it reports it gone: one place for each wait.

A rank that waits without a limit hangs the whole job when its peer dies or stalls; a limit
turns that into an error naming what was awaited. The limits are generous: a wait that ends
by timing out means something went wrong, so its only cost is how long a failure takes to
surface.
"""

from __future__ import annotations

__all__ = ["PEER_TIMEOUT_S", "LOCAL_RUN_TIMEOUT_S", "CONNECT_TIMEOUT_S", "LINK_ESTIMATE_TIMEOUT_S"]

PEER_TIMEOUT_S = 300.0
"""Seconds a rank waits for a message from another rank (the runtime's sends and receives, the
profiler's link exchange) before it fails with an error."""

LOCAL_RUN_TIMEOUT_S = 600.0
"""Seconds ``run_local`` waits, by default, for all its local ranks to finish."""

CONNECT_TIMEOUT_S = 60.0
"""Seconds a local rank waits to reach the rendezvous store of ``run_local``."""

LINK_ESTIMATE_TIMEOUT_S = 120.0
"""Seconds the profiler's link estimate (two local processes timing messages) may take in all."""
