"""A private gloo group among some ranks that cannot hang on how other groups were created.

Why not ``dist.new_group(ranks, use_local_synchronization=True)``: that call names the new
group after its ranks and the number of groups *this process* knows, and ranks outside a
group created with local synchronisation never learn of it. After any such subgroup (the
user's, or another library's) the members of the next group compute different names,
rendezvous under different store keys and wait for each other forever. Without local
synchronisation every rank of the world would have to call, in the same order.

``PrivateGloo`` needs neither: its members agree on a store prefix from what they all know
(a tag, the member ranks, how many such groups with this tag and these ranks this process has
made before), check in on the default store, and wait for each other with a timeout; a member
that does not come is named in a one-line ``PipelineError``. The gloo backend is built directly
on that prefix and used through its own collectives, so it is never registered with (nor
counted by) ``torch.distributed``.

Every store operation and every collective goes through this class, so that a store that is
gone (under env:// launchers rank 0 hosts it: its death takes the store along) or a member
that died is a one-line ``PipelineError``, never a raw ``DistNetworkError``. ``close()``
shuts the backend down (its threads joined while the process is still whole; left to the
interpreter's exit, their teardown can abort the process); groups not closed by their owner
are closed at exit (``close_all``).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import pickle
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from .errors import PipelineError, first_line

__all__ = ["PrivateGloo", "default_store", "close_all"]

_made: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()
_live: weakref.WeakSet[PrivateGloo] = weakref.WeakSet()
T = TypeVar("T")


def close_all() -> None:
    """Close every private group of this process that is still open (at exit, or before the
    default process group is destroyed)."""
    for group in list(_live):
        group.close()


atexit.register(close_all)


def default_store() -> dist.Store:
    """The store of the default process group, on which private groups are rendezvoused."""
    # Private in torch, but the store every process group is built on; a fresh one would
    # need an address and a port the caller would have to provide.
    return dist.distributed_c10d._get_default_store()


class PrivateGloo:
    """A gloo backend over ``ranks`` (global ranks, this one included), made by each of them.

    Members must create their ``PrivateGloo`` objects with the same ``tag`` and ranks in the
    same order (they count them); other groups, made before or after, do not matter.
    ``timeout`` (seconds) bounds the set-up and every ``wait``.
    """

    def __init__(self, tag: str, ranks: list[int], timeout: float) -> None:
        self.ranks = sorted(ranks)
        me = dist.get_rank()
        if me not in self.ranks:
            raise PipelineError(f"rank {me} is not one of the ranks {self.ranks} of its {tag} group")
        self.index = self.ranks.index(me)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.tag = tag
        key = (tag, tuple(self.ranks))
        self.prefix = f"zbsearch/{tag}/{'-'.join(map(str, self.ranks))}/{_made[key]}/"
        _made[key] += 1
        self.backend: dist.ProcessGroupGloo | None = None
        self.store = dist.PrefixStore(self.prefix, default_store())
        self._store("setting up", self.store.set, f"here/{me}", "1")
        try:
            self.store.wait([f"here/{r}" for r in self.ranks], self.timeout)
        except Exception:
            missing = [r for r in self.ranks if not self._store("setting up", self.store.check, [f"here/{r}"])]
            raise PipelineError(
                f"rank {me}: ranks {missing} did not set up the {tag} group within {timeout:g}s "
                f"(each of ranks {self.ranks} must create it, in the same order as the others)"
            ) from None
        try:
            self.backend = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", self.store), self.index, len(self.ranks),
                                                 self.timeout)
        except Exception as err:
            raise PipelineError(f"rank {me}: connecting the {tag} group with ranks {self.ranks} failed: "
                                f"{first_line(err)}") from None
        _live.add(self)

    def _store(self, what: str, op: Callable[..., T], *args) -> T:
        """A store operation; a store gone or unreachable is a one-line PipelineError."""
        try:
            return op(*args)
        except Exception as err:
            raise self._unreachable(what, err) from None

    def _unreachable(self, what: str, err: BaseException) -> PipelineError:
        return PipelineError(
            f"rank {dist.get_rank()}: {what} of the {self.tag} group: the store is unreachable (under an env:// "
            f"launcher rank 0 holds it: is it gone?): {first_line(err)}"
        )

    def _open(self) -> dist.ProcessGroupGloo:
        if self.backend is None:
            raise PipelineError(f"rank {dist.get_rank()}: the {self.tag} group is closed")
        return self.backend

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` on the store; its new value."""
        return self._store(f"counting {key}", self.store.add, key, amount)

    def delete(self, key: str) -> None:
        """Remove a key this group wrote to the store."""
        self._store(f"deleting {key}", self.store.delete_key, key)

    def close(self) -> None:
        """Shut the backend down (idempotent); the group cannot be used after."""
        backend, self.backend = self.backend, None
        if backend is not None:
            _live.discard(self)
            try:
                backend.shutdown()
            except Exception:  # a peer already gone: nothing left to release cleanly
                pass

    @property
    def size(self) -> int:
        """Members in the group."""
        return len(self.ranks)

    def exchange(self, name: str, obj: object) -> list:
        """Every member's ``obj`` (picklable), in member order, through the store."""
        self._open()
        self._store(f"sending {name}", self.store.set, f"{name}/{self.index}", pickle.dumps(obj))
        keys = [f"{name}/{i}" for i in range(self.size)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as err:
            if isinstance(err, dist.DistNetworkError):
                raise self._unreachable(f"receiving {name}", err) from None
            raise PipelineError(
                f"rank {dist.get_rank()}: {name} of the {self.tag} group not received from all of ranks {self.ranks}"
                f" within {self.timeout.total_seconds():g}s"
            ) from None
        return [pickle.loads(self._store(f"receiving {name}", self.store.get, k)) for k in keys]

    def all_gather(self, tensor: torch.Tensor) -> tuple[dist.Work, list[torch.Tensor]]:
        """Start gathering a CPU tensor from every member: (work, outputs in member order)."""
        out = [torch.empty_like(tensor) for _ in self.ranks]
        backend = self._open()
        try:
            return backend.allgather([out], [tensor]), out  # type: ignore[attr-defined]  # bound in C++, not in the stub
        except Exception as err:
            raise PipelineError(f"rank {dist.get_rank()}: starting an all-gather of the {self.tag} group with ranks "
                                f"{self.ranks} failed: {first_line(err)}") from None

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` with the timeout; a failure is a one-line ``PipelineError``."""
        try:
            ok = work.wait(self.timeout)
        except Exception as err:
            raise PipelineError(
                f"rank {dist.get_rank()}: {what} with ranks {self.ranks} failed or timed out after "
                f"{self.timeout.total_seconds():g}s: {first_line(err)}"
            ) from None
        if ok is False:
            raise PipelineError(
                f"rank {dist.get_rank()}: {what} with ranks {self.ranks} timed out after {self.timeout.total_seconds():g}s"
            )
