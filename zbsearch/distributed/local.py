"""Run a function on p local processes joined in one process group (gloo on 127.0.0.1).

The demo replays schedules on p ranks of one machine, the one-device profiler measures the
link between two local processes, and the tests and benchmarks run the runtime on local ranks;
all need processes that start, report back and are gone afterwards even when one of them
fails. Each worker runs with one CPU thread (ranks share the machine's cores) and may send
progress messages to the parent while it works.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import ZbError
from .timeouts import CONNECT_TIMEOUT_S, LOCAL_RUN_TIMEOUT_S

__all__ = ["run_local"]


def _worker(fn, rank, world, port, backend, results, args):
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        out = fn(rank, world, lambda msg: results.put(("msg", rank, msg)), *args)
        results.put(("ok", rank, out))
    except ZbError as err:
        results.put(("user", rank, str(err)))
    except BaseException as err:
        results.put(("bug", rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # skip process-group teardown, which can hang once a peer is gone


def run_local(
    fn: Callable,
    world: int,
    *args,
    backend: str = "gloo",
    on_message: Callable[[int, object], None] | None = None,
    timeout: float = LOCAL_RUN_TIMEOUT_S,
) -> list:
    """``fn(rank, world, send, *args)`` on ``world`` spawned processes; their results by rank.

    ``send(msg)`` hands ``msg`` to ``on_message(rank, msg)`` in this process. A ZbError in any
    rank is raised here as it is, and so is a rank that dies or a run past ``timeout`` seconds
    (a ZbError naming the rank: what the machine did, not a bug); any other failure in a rank
    is a bug and raises RuntimeError with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The rendezvous store lives here, on a port the OS picked and that stays ours: a port
    # merely found free could be taken by another program before rank 0 listens on it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, store.port, backend, results, args), daemon=True) for r in range(world)
    ]
    # Ctrl-C is for this process, which stops the workers: they start with SIGINT ignored (an
    # ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt
    # handler), so an interrupt never prints a traceback per worker or half-stops one.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread() else None
    try:
        for pr in procs:
            pr.start()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                kind, rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, pr in enumerate(procs) if r not in out and pr.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # a last message may still be in the pipe
                    if results.empty():
                        raise ZbError(f"rank {dead[0]} exited with status {procs[dead[0]].exitcode} without a result") from None
                if time.monotonic() > deadline:
                    raise ZbError(f"local ranks did not finish within {timeout:g}s") from None
                continue
            if kind == "msg":
                if on_message is not None:
                    on_message(rank, value)
            elif kind == "ok":
                out[rank] = value
            elif kind == "user":
                raise ZbError(value)
            else:
                raise RuntimeError(f"rank {rank} failed: {value}")
    finally:
        finished = len(out) == world  # else a rank failed: the others may wait for it forever
        for pr in procs:
            pr.join(timeout=5 if finished else 0.1)
            if pr.is_alive():
                pr.kill()
                pr.join()
        results.close()
    return [out[r] for r in range(world)]
