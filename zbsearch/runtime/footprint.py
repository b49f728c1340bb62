"""Metering the activations of an unsplit pass without saved-tensor hooks.

The activation meter (``memory``) counts what a forward saves through ``saved_tensors_hooks``:
a Python call for every tensor saved in forward and again for every one unpacked in backward.
For the split backward the hooks do work (B frees what W does not read); for a pass whose
backward is one ordinary autograd call (a fused BW, a first stage's whole backward) they only
count, and at small sizes that Python call per tensor is a visible share of the pass.

So such a pass is counted from a *footprint*: two forwards of the same module on the same input
signature run under the hooks, each recording what it saved (storage pointer, bytes, a weak
reference) in order, and if the two saved the same things, later forwards of that signature run
without hooks and are charged what the footprint says, at the same points (the forward adds it,
the release of the pass removes it). The meter counts each storage once, however many live
passes save it, so the footprint keeps where each saved storage came from:

* a stage input's, a stage output's, or a tensor bound into the loss (``post`` given as a
  ``functools.partial``, as the runtime does: the microbatch's targets): at replay the current
  tensor's storage, by pointer, shared with whoever else saves it (the next stage on the same
  rank saves this stage's output; a first stage's microbatches are views of one batch);
* a storage that outlived the first forward and was saved again by the second (a cached table,
  a target held by a ``lambda``): that same storage, as long as it is alive;
* anything else, the pass's own activations: their bytes, under a key no other pass shares.

Later passes see exactly the bytes the hooks would have counted as long as a signature's forward
saves the same tensors each time, which is what two identical forwards are taken to show: the
shapes of what a module saves follow from its input shapes, and its private activations are its
own. Wherever that is not shown, the hooks meter: a module whose signature changes (checked on
every forward, split or not), whose two forwards differ, or whose cached storage died.

Where the count can differ from the hooks', for as long as the passes involved live: a module
that replaces a kept storage during a forward of an unchanged signature (that pass is charged
the new one as its own, and later hooked passes count it again), or while an earlier pass still
holds the old one (then nothing tells the two apart, and the new one is not counted until the
old one dies and the signature is learnt again); and a module whose saved sizes follow the data
but happened to agree on the two forwards it was learnt from.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .memory import SavedActivations, storages

__all__ = ["forward_counted", "see_signature"]

# Forwards that may disagree before a module's signature is metered by hooks for good: a module
# whose saved tensors depend on the data (token routing, say) would never settle.
_TRIES = 4

_private = itertools.count(1)  # keys for a pass's own activations (negative: never a pointer)


@dataclass
class _Observed:
    """What one hooked forward saved, in order: where each storage came from, and the storages."""

    roles: list[tuple]  # ("in" | "out" | "post", index) or ("own", first position of that storage)
    saved: list[tuple[int, int, StorageWeakRef]]  # (pointer, bytes, weak reference)


@dataclass
class _Footprint:
    shared: list[tuple[int, int]]  # (0: input, 1: output, 2: post tensor; index)
    kept: list[tuple[int, int, StorageWeakRef]]  # storages saved by every forward: (pointer, bytes, ref)
    own: int  # bytes of the pass's own activations

    def alive(self) -> bool:
        return not any(ref.expired() for _, _, ref in self.kept)


@dataclass
class _Book:
    """One module's learning: the signature it is on, the last hooked forward, the footprint."""

    key: tuple
    last: _Observed | None = None
    footprint: _Footprint | None = None
    misses: int = 0


_BOOKS: weakref.WeakKeyDictionary[nn.Module, _Book] = weakref.WeakKeyDictionary()


def see_signature(module: nn.Module, key: tuple) -> None:
    """Every forward of ``module`` reports its signature: a new one forgets what was learnt (a
    cache the module keeps may have been rebuilt for it)."""
    book = _BOOKS.get(module)
    if book is None or book.key != key:
        _BOOKS[module] = _Book(key)


_ROLES = ("in", "out", "post")


def forward_counted(
    module: nn.Module, run: Callable[[], tuple[torch.Tensor, ...]], saved: SavedActivations,
    inputs: Sequence, extra: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """``run()`` (the forward and loss of an unsplit pass), its activations counted in ``saved``:
    from the footprint of ``module``'s signature (``see_signature`` first) once there is one,
    by the hooks until then. ``extra``: tensors the loss was given (their storages are shared)."""
    book = _BOOKS[module]
    fp = book.footprint
    if fp is not None:
        if fp.alive():
            outs = run()
            if not fp.alive():
                # A kept storage died in this very forward (rebuilt, the signature unchanged): what
                # replaced it is charged as the pass's own, and the signature is learnt again.
                fp = _Footprint(fp.shared, [], fp.own + sum(n for _, n, _ in fp.kept))
                _BOOKS[module] = _Book(book.key)
            saved.charge(_charges(fp, (inputs, outs, extra)))
            return outs
        book = _BOOKS[module] = _Book(book.key)  # a kept storage died since: learn again
    learning = book.misses < _TRIES
    record: list = []
    with saved.hooks(record if learning else None):
        outs = run()
    if learning:
        seen = _observe(record, (inputs, outs, extra))
        if book.last is not None:
            book.footprint = _compare(book.last, seen)
            book.misses += book.footprint is None
        book.last = seen
    return outs


def _storages(t) -> list[tuple[int, int]]:
    """(pointer, bytes) of each non-empty storage holding ``t`` on this rank (``memory.storages``)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return []
    return [(s.data_ptr(), s.nbytes()) for s in storages(t) if s.nbytes()]


def _observe(record: list, groups: tuple[Sequence, Sequence, Sequence]) -> _Observed:
    known: dict[int, tuple] = {}
    for g, tensors in enumerate(groups):
        for i, t in enumerate(tensors):
            for ptr, _ in _storages(t):
                known.setdefault(ptr, (_ROLES[g], i))
    roles: list[tuple] = []
    first: dict[int, int] = {}
    for k, (ptr, _, _) in enumerate(record):
        roles.append(known.get(ptr) or ("own", first.setdefault(ptr, k)))
    return _Observed(roles, record)


def _compare(a: _Observed, b: _Observed) -> _Footprint | None:
    """The footprint of two forwards that saved the same things; None where they differ."""
    if a.roles != b.roles:
        return None
    if any(r[0] == "own" and x[1] != y[1] for r, x, y in zip(b.roles, a.saved, b.saved)):
        return None
    alive_a = {ptr: k for k, (ptr, _, ref) in enumerate(a.saved) if not ref.expired()}
    shared: list[tuple[int, int]] = []
    kept: list[tuple[int, int, StorageWeakRef]] = []
    own = 0
    for k, role in enumerate(b.roles):
        if role[0] != "own":
            pair = (_ROLES.index(role[0]), role[1])
            if pair not in shared:
                shared.append(pair)
        elif role[1] == k:  # a storage's first save in the pass
            ptr, nbytes, ref = b.saved[k]
            was = alive_a.get(ptr)
            if was == k:  # the storage the first forward saved here, still alive: kept across passes
                kept.append((ptr, nbytes, ref))
            elif was is not None:  # the first forward's storage, saved at another place: not a footprint
                return None
            else:
                own += nbytes
    return _Footprint(shared, kept, own)


def _charges(fp: _Footprint, groups: tuple[Sequence, Sequence, Sequence]) -> dict[int, int]:
    """Storage key -> bytes of one replayed pass (each storage once)."""
    out: dict[int, int] = {}
    for g, i in fp.shared:
        out.update(_storages(groups[g][i]))
    for ptr, nbytes, _ in fp.kept:
        out[ptr] = nbytes
    if fp.own:
        out[-next(_private)] = fp.own
    return out
