"""Saved activations under our control, so B can free what W does not need.

Autograd keeps every tensor a backward node saved until the node dies. After an input-gradient
pass (B) run with ``retain_graph=True`` the nodes the weight-gradient pass (W) re-runs keep
their children alive, and with them every activation below: without intervention nothing is
freed until W, and the measured memory would not follow the schedule's model (B frees
M_B - M_W, W frees M_W). So forward runs under ``saved_tensors_hooks`` that put each saved
activation in a small holder. After B the split backward finds the holders W will read and
empties all the others; after W it empties the rest.

Parameters and buffers are not activations: they are saved as they are, outside any holder.
A holder keeps the tensor's version, and reading it back checks it as autograd checks a saved
tensor (which it does not do for tensors saved through hooks): an activation changed in place
after it was saved raises autograd's error instead of giving a wrong gradient (parameters and
buffers are kept with their version too).
The meter counts live activation bytes per rank (each storage once, however many nodes save
it), which the runtime records after every action. A tensor subclass that wraps others (a
DTensor, whose data on this rank is its local shard) counts as the storages of what it wraps:
what the rank holds, not the global size it stands for (``storages``).

Selective recomputation (``selective``) uses two more states of the same hooks: while a selected
module's forward runs, an activation it saves is not kept but left as an empty holder
(``diverted``), and its recompute pass fills those holders in the same order (``refilled``);
from then on they are ordinary saved activations.

A pass whose backward is one ordinary autograd call (a fused BW, a first stage's) needs the
hooks only to count; once its module and input signature have shown what they save, it runs
without them and is charged the same bytes (``footprint``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .errors import PipelineError

__all__ = ["ActivationMeter", "SavedActivations", "own_storage", "storages"]


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``t``'s data on this rank: its own, or, for a tensor subclass that
    wraps other tensors (a DTensor wraps its local shard), those of the tensors it wraps."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]  # a DTensor's also names its (non-tensor) mesh
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    return [t.untyped_storage()]


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a microbatch of its own: a copy where it is a view of a larger storage (a
    slice of the step's batch), else itself. The meter counts a saved tensor's whole storage,
    so a stage that saves a microbatch's token ids or labels (an embedding, a loss) is charged
    that microbatch's bytes, as the profiler measured them, and not the whole batch's."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


class ActivationMeter:
    """Live bytes of saved activations on this rank, each storage counted once.

    ``replay``: count unsplit passes from their module's footprint once it is known (the same
    bytes as the hooks, see ``footprint``); False: meter every pass with the hooks.
    """

    def __init__(self, replay: bool = True) -> None:
        self.replay = replay
        self.bytes = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [holders, nbytes]
        self._lock = threading.Lock()  # an overlapped pair's two passes save and free at once

    def add(self, ptr: int, nbytes: int) -> None:
        """Count a storage once, however many saved tensors share it."""
        with self._lock:
            entry = self._refs.get(ptr)
            if entry is None:
                self._refs[ptr] = [1, nbytes]
                self.bytes += nbytes
                self.peak = max(self.peak, self.bytes)
            else:
                entry[0] += 1

    def remove(self, ptr: int) -> None:
        """Drop one reference to a storage; its bytes leave the count with the last one."""
        with self._lock:
            entry = self._refs[ptr]
            entry[0] -= 1
            if entry[0] == 0:
                del self._refs[ptr]
                self.bytes -= entry[1]

    def reset_peak(self) -> None:
        """Start a new peak from the bytes held now."""
        self.peak = self.bytes


class _Holder:
    __slots__ = ("tensor", "ptrs", "version", "waits")

    def __init__(self, tensor: torch.Tensor, ptrs: tuple[int, ...]) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.ptrs = ptrs  # the storages counted for it
        self.version = tensor._version
        self.waits: tuple | None = None  # an empty holder: the (shape, dtype, device) it waits for

    @classmethod
    def empty(cls, t: torch.Tensor) -> _Holder:
        """A holder that will keep nothing until it is filled (selective recomputation); it
        references ``t``, uncounted, until ``SavedActivations.settle``."""
        h = cls.__new__(cls)
        h.tensor, h.ptrs, h.version, h.waits = t, (), t._version, _meta(t)
        return h


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device)


class _Kept:
    """A parameter or buffer (or a view of one) saved for backward: not an activation, kept as it
    is, but with its version, checked when it is read back."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version


def _version_error(t: torch.Tensor, version: int) -> None:
    """Autograd's own error for a saved tensor changed in place (its check is off for tensors
    saved through hooks)."""
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead"
    )


class SavedActivations:
    """The activations one forward pass saved for backward.

    Use ``hooks()`` around the forward. ``keep_only(holders)`` frees every other activation,
    ``free()`` frees all; ``record()`` collects the holders that backward nodes unpack while it
    is active (reading a node's ``_saved_*`` attributes unpacks them). ``charge`` counts
    activations a forward saved without the hooks, until ``free()``.
    """

    def __init__(self, meter: ActivationMeter | None, module: torch.nn.Module) -> None:
        self._meter = meter
        self._module = module
        self._skip: set[int] = set()  # ids of the module's parameters and buffers, set by hooks()
        self._holders: list[_Holder] = []
        self._recording: set[int] | None = None
        self._consume = False
        self._saves: list | None = None
        self._charged: list[int] = []
        self._diverted: list[_Holder] | None = None  # activations saved now: empty holders, listed here
        self._refill: Iterator[_Holder] | None = None  # activations saved now fill these, in order

    def hooks(self, saves: list | None = None) -> torch.autograd.graph.saved_tensors_hooks:
        """``saves``: each activation saved is also listed there, in order, as (storage pointer,
        bytes, weak reference to the storage)."""
        self._saves = saves
        self._skip = {id(t) for t in (*self._module.parameters(), *self._module.buffers())}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def pack_hook(self):
        """The pack function ``hooks()`` installs (to tell its hooks from others)."""
        return self._pack

    def charge(self, storages: dict[int, int]) -> None:
        """Count storages (key -> bytes) a forward saved without the hooks, until ``free()``."""
        if self._meter is not None:
            for key, nbytes in storages.items():
                self._meter.add(key, nbytes)
                self._charged.append(key)

    def _pack(self, t: torch.Tensor):
        if id(t) in self._skip or (t._base is not None and id(t._base) in self._skip):
            return _Kept(t)  # a parameter or buffer, or a view of one
        if self._refill is not None:
            return self._fill(t)
        if self._diverted is not None:
            h = _Holder.empty(t)
            self._diverted.append(h)
            return h
        found = storages(t)
        h = _Holder(t, tuple(s.data_ptr() for s in found))
        self._holders.append(h)
        self._count(h, found)
        if self._saves is not None:
            self._saves.extend((s.data_ptr(), s.nbytes(), StorageWeakRef(s)) for s in found)
        return h

    def _count(self, h: _Holder, found: list[torch.UntypedStorage]) -> None:
        if self._meter is not None:
            for ptr, s in zip(h.ptrs, found):
                self._meter.add(ptr, s.nbytes())

    def diverted(self, into: list) -> contextlib.AbstractContextManager:
        """While active, an activation saved is not kept: an empty holder stands for it, listed
        in ``into`` (``refilled`` fills them)."""
        return _Divert(self, into)

    def refilled(self, holders: Sequence) -> contextlib.AbstractContextManager:
        """While active, each activation saved fills the next of ``holders`` (empty holders
        ``diverted`` listed), which then counts as saved; on leaving, every one must be full
        (PipelineError otherwise)."""
        return _Refill(self, holders)

    def settle(self, holders: Sequence, keep: Collection[int]) -> None:
        """At the end of a selected module's call, its empty ``holders``: those whose tensor lives
        in a storage of ``keep`` (the call's inputs and outputs, alive anyway: recomputing them
        would only make a copy) keep it as a saved activation, counted; the others let it go."""
        for h in holders:
            t = h.tensor
            if t is None or h.waits is None:
                continue
            if any(s.data_ptr() in keep for s in storages(t)):
                self._put(h, t)
            else:
                h.tensor = None

    def _put(self, h: _Holder, t: torch.Tensor) -> None:
        found = storages(t)
        h.tensor, h.ptrs, h.version, h.waits = t, tuple(s.data_ptr() for s in found), t._version, None
        self._holders.append(h)
        self._count(h, found)

    def _fill(self, t: torch.Tensor) -> _Holder:
        assert self._refill is not None
        h = next(self._refill, None)
        if h is None:
            raise PipelineError(
                "selective recomputation saved more tensors than the checkpointed forward did: the selected modules "
                "must run the same way on the same inputs"
            )
        had = h.waits if h.waits is not None else None if h.tensor is None else _meta(h.tensor)
        if had != _meta(t):
            got = "nothing" if had is None else f"a {tuple(had[0])} {had[1]} tensor"
            raise PipelineError(
                f"selective recomputation saved a {tuple(t.shape)} {t.dtype} tensor where the checkpointed forward saved "
                f"{got}: the selected modules must run the same way on the same inputs"
            )
        if h.waits is not None:  # else the forward kept it (``settle``)
            self._put(h, t)
        return h

    def hold(self, t: torch.Tensor):
        """Keep ``t`` for a later pass as a saved activation (counted, freed like the others);
        ``read`` gives it back."""
        return self._pack(t)

    def release(self, handles) -> None:
        """Let go of some of what ``hold`` kept (handles of this pass), before ``free``."""
        for h in handles:
            if type(h) is _Holder:
                self._release(h)

    def read(self, h) -> torch.Tensor:
        """The tensor behind a saved-tensor handle."""
        return self._unpack(h)

    def holds(self, h) -> bool:
        """Whether a handle is one of this pass's saved activations."""
        return isinstance(h, _Holder)

    def _unpack(self, h):
        if type(h) is _Holder:
            if self._recording is not None:
                self._recording.add(id(h))
                return h.tensor
            t = h.tensor
            if t is None and h.waits is not None:
                raise PipelineError(
                    "a selectively checkpointed forward's graph was asked for a tensor its selected modules did not keep: "
                    "run its recompute pass (RS) first"
                )
            if t is None:
                raise PipelineError(
                    "a saved activation was freed before the backward pass that needs it (run B before W, each once)"
                )
            if t._version != h.version:
                _version_error(t, h.version)
            if self._consume:
                self._release(h)
            return t
        if type(h) is _Kept:
            if self._recording is None and h.tensor._version != h.version:
                _version_error(h.tensor, h.version)
            return h.tensor
        return h

    def consuming(self) -> contextlib.AbstractContextManager:
        """For a backward that runs each node once (no ``retain_graph``): an activation is freed
        as soon as its node has read it, as plain autograd does, instead of at the end."""
        return _Consuming(self) if self._holders else contextlib.nullcontext()

    def record(self) -> _Recording:
        """A context that records which saved activations a backward reads."""
        return _Recording(self)

    def keep_only(self, keep: set[int]) -> None:
        """Release every saved activation except those in ``keep`` (what W still reads after B)."""
        kept = []
        for h in self._holders:
            if id(h) in keep:
                kept.append(h)
            else:
                self._release(h)
        self._holders = kept

    def free(self) -> None:
        """Release every saved activation and its bytes on the meter."""
        for h in self._holders:
            self._release(h)
        self._holders = []
        if self._meter is not None:
            for key in self._charged:
                self._meter.remove(key)
        self._charged = []

    def _release(self, h: _Holder) -> None:
        if h.tensor is not None:
            h.tensor = None
            if self._meter is not None:
                for ptr in h.ptrs:
                    self._meter.remove(ptr)


class _Divert:
    def __init__(self, saved: SavedActivations, into: list) -> None:
        self._saved, self._into = saved, into

    def __enter__(self) -> None:
        self._outer = self._saved._diverted
        self._saved._diverted = self._into

    def __exit__(self, *exc) -> None:
        self._saved._diverted = self._outer


class _Refill:
    def __init__(self, saved: SavedActivations, holders: Sequence) -> None:
        self._saved, self._holders = saved, holders

    def __enter__(self) -> None:
        self._saved._refill = iter(self._holders)

    def __exit__(self, exc_type, *exc) -> None:
        rest = self._saved._refill
        self._saved._refill = None
        if exc_type is None and rest is not None and next(rest, None) is not None:
            raise PipelineError(
                "selective recomputation saved fewer tensors than the checkpointed forward did: the selected modules "
                "must run the same way on the same inputs"
            )


class _Consuming:
    def __init__(self, saved: SavedActivations) -> None:
        self._saved = saved

    def __enter__(self) -> None:
        self._saved._consume = True

    def __exit__(self, *exc) -> None:
        self._saved._consume = False


class _Recording:
    def __init__(self, saved: SavedActivations) -> None:
        self._saved = saved
        self.holders: set[int] = set()

    def __enter__(self) -> set[int]:
        self._saved._recording = self.holders
        return self.holders

    def __exit__(self, *exc) -> None:
        self._saved._recording = None
