"""Point-to-point transfers between pipeline ranks that cannot deadlock or mismatch.

Every cross-rank message of a step is known from the schedule: the activations of stage s for
microbatch j (sent after F) and their gradient (sent after B or BW of stage s+1). Per direction
of each link (rank a to rank b) the messages go in the order a produces them, which is a's
action order, and both ends derive that order from the same schedule file:

* a send is issued as soon as its message is produced, so a sender never waits;
* receives from a peer are issued in that peer's sending order, a few actions ahead of the
  action that needs them, so transfers overlap compute. NCCL runs the ops of one communicator
  in issue order on one stream: each direction gets its own communicator (a second process
  group for messages from higher to lower ranks), so the k-th receive always meets the k-th
  send, and activations and gradients crossing one link in opposite directions (V schedules)
  never queue behind each other. A wait can then only be for a message its sender will produce
  without help from the waiting rank, so a valid schedule cannot deadlock;
* each message has a tag unique within the step, so gloo, which matches by tag, cannot hand
  one message's bytes to another. No barrier separates steps, so a peer may already send
  step n+1's messages while this rank still receives step n's: the step's parity is part of
  the tag, so they cannot meet step n's receives. (A gloo send completes only once its
  receive is posted, so no sender gets two steps ahead of its peer.)

Shapes and dtypes: the first activation message across each stage boundary is preceded by a
small header describing its tensors; later ones must match it (checked before sending).
Gradients have the shapes of the activations they belong to and need no header; instead each
gradient message ends with a small mask (in the header's tag slot) saying which entries are
"no gradient" (None, as autograd gives for an output that ignores an input): those travel as
zeros and are handed back as None, so earlier stages leave unreached parameters' .grad None
exactly as one process does, rather than accumulating zeros.

Only plain tensors travel. A stage parallelized with torch's tensor-parallel API returns local
tensors (``use_local_output=True``); the output of a collective still in flight
(``AsyncCollectiveTensor``) is waited for and sent as the tensor it holds (``plain``); a DTensor
crossing a boundary is refused by the runtime before it is sent (``refuse_subclass``): its
placements and mesh would not be rebuilt on the other side.

Every send, receive and wait goes through ``errors.post``/``errors.wait``: a wait has a
timeout, and any failure (a peer gone, a hang) is a PipelineError naming the rank, the action,
the message, the peer and the time waited.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ..dependencies import ACT, GRAD, remote_outputs
from ..formats.schedule import Schedule
from .errors import PipelineError, post, wait

__all__ = ["ACT", "GRAD", "Message", "TensorMeta", "comm_plan", "P2P", "plain", "refuse_subclass"]

_MAX_TENSORS, _MAX_DIMS = 32, 8
_HEADER = 1 + (3 + _MAX_DIMS) * _MAX_TENSORS
_TAGS_PER_MESSAGE = _MAX_TENSORS + 1  # one per tensor, then the header
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


@dataclass(frozen=True)
class Message:
    """Tensors crossing the boundary after ``stage``: activations (to stage+1) or their gradient."""

    kind: str
    stage: int
    mb: int
    src: int
    dst: int
    index: int  # position in the plan; the tag base

    @property
    def key(self) -> tuple[str, int, int]:
        """The (kind, stage, microbatch) that identifies this message within a step."""
        return (self.kind, self.stage, self.mb)

    def describe(self) -> str:
        """The message in words, for errors."""
        return f"{self.kind} of stage {self.stage} microbatch {self.mb}"


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a tensor before it arrives."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        """The metadata of ``t``."""
        return cls(tuple(t.shape), t.dtype, t.requires_grad)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the plain tensor that travels: the result of a collective still in flight (a
    tensor-parallel layer's output, an input gradient reduced across tensor-parallel ranks)
    waited for; any other tensor as it is."""
    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


def refuse_subclass(tensors: list[torch.Tensor], what: str) -> None:
    """Refuse (PipelineError, naming ``what``: the stage's outputs, say) a tensor subclass other
    than a collective in flight: only plain tensors cross between stages."""
    for i, t in enumerate(tensors):
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or isinstance(t, AsyncCollectiveTensor):
            continue
        placements = getattr(t, "placements", None)
        kind = type(t).__name__ + (f" with placements {tuple(placements)}" if placements is not None else "")
        raise PipelineError(
            f"{what} {i} is a {kind}; only plain tensors cross between stages: return local tensors from the stage "
            "(use_local_output=True in its tensor-parallel plan, or .to_local() / .full_tensor())"
        )


def comm_plan(schedule: Schedule) -> list[Message]:
    """All cross-rank messages of one step, each rank's in its action order
    (``dependencies.remote_outputs``, the counterpart of what each action receives)."""
    owner = schedule.stage_to_rank
    plan: list[Message] = []
    for r, row in enumerate(schedule.rank_actions):
        for a in row:
            for t in remote_outputs(a, owner):
                plan.append(Message(t.kind, t.boundary, t.mb, r, owner[t.dst_stage], len(plan)))
    return plan


def _encode(metas: list[TensorMeta], device: torch.device) -> torch.Tensor:
    if len(metas) > _MAX_TENSORS or any(len(m.shape) > _MAX_DIMS for m in metas):
        raise PipelineError(f"stage outputs are limited to {_MAX_TENSORS} tensors of at most {_MAX_DIMS} dimensions")
    width = 3 + _MAX_DIMS
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0] = len(metas)
    for k, m in enumerate(metas):
        if m.dtype not in _DTYPES:
            raise PipelineError(f"cannot send tensors of dtype {m.dtype} between stages")
        row = [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
        h[1 + k * width: 1 + k * width + len(row)] = torch.tensor(row)
    return h.to(device)


def _decode(h: torch.Tensor) -> list[TensorMeta]:
    v = h.tolist()
    width = 3 + _MAX_DIMS
    out = []
    for k in range(v[0]):
        dt, rg, nd, *dims = v[1 + k * width: 1 + (k + 1) * width]
        out.append(TensorMeta(tuple(dims[:nd]), _DTYPES[dt], bool(rg)))
    return out


class _Recv:
    def __init__(self) -> None:
        self.header: tuple[dist.Work, torch.Tensor] | None = None
        self.works: list[dist.Work] = []
        self.tensors: list[torch.Tensor] | None = None


class P2P:
    """This rank's side of the plan, one step at a time (``start_step``, sends and receives,
    ``finish_step``)."""

    def __init__(
        self, plan: list[Message], rank: int, group: dist.ProcessGroup | None, device: torch.device, timeout: float
    ) -> None:
        self.rank, self.device = rank, device
        self.timeout = timeout
        self._incoming: dict[int, list[Message]] = defaultdict(list)  # peer -> its messages to us, in order
        self._where: dict[tuple[str, int, int], Message] = {}
        for msg in plan:
            if rank in (msg.src, msg.dst):
                self._where[msg.key] = msg
                if msg.dst == rank:
                    self._incoming[msg.src].append(msg)
        self._peers = sorted({m.src if m.dst == rank else m.dst for m in self._where.values()})
        self._group = group
        # NCCL: a second communicator per link, for messages from the higher rank to the lower
        self._down = group
        backend = dist.get_backend(group)
        if self._peers and "nccl" in backend:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            self._down = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
        self._global = {peer: dist.get_global_rank(group, peer) if group is not None else peer for peer in self._peers}
        self.meta: dict[int, list[TensorMeta]] = {}  # boundary stage -> its activations' metadata
        self._header_sent: set[int] = set()
        self._messages = len(plan)
        self._step = -1  # steps started; its parity is part of every tag
        self.action = "(none)"  # the action being run, for error messages

    def close(self) -> None:
        """Destroy the second communicator (NCCL), if this rank made one."""
        if self._down is not self._group:
            dist.destroy_process_group(self._down)
            self._down = self._group

    @property
    def peers(self) -> list[int]:
        """Ranks this rank exchanges messages with."""
        return self._peers

    def group_to(self, peer: int) -> dist.ProcessGroup | None:
        """The process group carrying messages from this rank to ``peer``."""
        return self._group if self.rank < peer else self._down

    def group_from(self, peer: int) -> dist.ProcessGroup | None:
        """The process group messages from ``peer`` travel on."""
        return self._group if peer < self.rank else self._down

    def start_step(self) -> None:
        """Reset the per-step message cursors before a step's first action."""
        self._step += 1
        self._cursor = {peer: 0 for peer in self._incoming}  # next incoming message to post
        self._recvs: dict[tuple[str, int, int], _Recv] = {}
        self._sends: list[tuple[Message, dist.Work, torch.Tensor]] = []

    # -- sending ------------------------------------------------------------------------------
    def send(
        self, kind: str, stage: int, mb: int, tensors: list[torch.Tensor | None], like: list[torch.Tensor] | None = None
    ) -> None:
        """Send a message; a gradient message may hold None entries (``like`` gives their shapes)."""
        msg = self._where[(kind, stage, mb)]
        if kind == GRAD:
            assert like is not None and len(like) == len(tensors)
            mask = torch.tensor([t is not None for t in tensors], dtype=torch.uint8, device=self.device)
            payload = [t if t is not None else torch.zeros_like(x) for t, x in zip(tensors, like)]
        else:
            payload = [t for t in tensors if t is not None]
            assert len(payload) == len(tensors), "activation messages hold no None"
            metas = [TensorMeta.of(t) for t in payload]
            known = self.meta.get(stage)
            if known is None:
                self.meta[stage] = metas
            elif [(m.shape, m.dtype) for m in metas] != [(m.shape, m.dtype) for m in known]:
                raise PipelineError(
                    f"rank {self.rank}: {self.action}: stage {stage} outputs {_fmt(metas)} but earlier microbatches "
                    f"had {_fmt(known)}; every microbatch must have the same shapes"
                )
            if stage not in self._header_sent:
                self._header_sent.add(stage)
                self._isend(_encode(self.meta[stage], self.device), msg, _MAX_TENSORS)
        for k, t in enumerate(payload):
            self._isend(plain(t).detach().contiguous(), msg, k)
        if kind == GRAD and payload:  # after the tensors: receives are posted in the same order
            self._isend(mask, msg, _MAX_TENSORS)

    def _isend(self, t: torch.Tensor, msg: Message, k: int) -> None:
        peer, tag = msg.dst, self._tag(msg, k)
        work = post(lambda: dist.isend(t, dst=self._global[peer], group=self.group_to(peer), tag=tag), self._what(msg, peer))
        assert work is not None  # isend returns None only on a rank outside the group
        self._sends.append((msg, work, t))

    def _tag(self, msg: Message, k: int) -> int:
        """Tensor k of ``msg`` in this step (k = ``_MAX_TENSORS``: its header)."""
        return ((self._step % 2) * self._messages + msg.index) * _TAGS_PER_MESSAGE + k

    def reap(self) -> None:
        """Drop finished sends (raising if one failed)."""
        pending = []
        for msg, work, t in self._sends:
            if work.is_completed():
                self._wait(work, msg, msg.dst)  # returns at once; raises if the send failed
            else:
                pending.append((msg, work, t))
        self._sends = pending

    # -- receiving ----------------------------------------------------------------------------
    def prepost(self, kind: str, stage: int, mb: int) -> None:
        """Post the receive of a message, and of those its sender sends before it, without
        blocking (a first message's payload waits for its header to arrive)."""
        msg = self._where[(kind, stage, mb)]
        self._advance(msg, block=False)

    def recv(self, kind: str, stage: int, mb: int) -> list[torch.Tensor | None]:
        """The message's tensors, waiting for them (with the timeout); a gradient message has
        None where its sender had no gradient."""
        msg = self._where[(kind, stage, mb)]
        self._advance(msg, block=True)
        rv = self._recvs.pop(msg.key)
        for w in rv.works:
            self._wait(w, msg, msg.src)
        assert rv.tensors is not None  # _advance(block=True) posted the receives
        if kind == GRAD and rv.tensors:
            *tensors, mask = rv.tensors
            return [t if m else None for t, m in zip(tensors, mask.tolist())]
        out: list[torch.Tensor | None] = list(rv.tensors)
        return out

    def _advance(self, until: Message, block: bool) -> None:
        peer = until.src
        seq = self._incoming[peer]
        while self._cursor[peer] < len(seq):
            msg = seq[self._cursor[peer]]
            if msg.index > until.index:
                return
            rv = self._recvs.setdefault(msg.key, _Recv())
            if not self._post(msg, rv, block):
                return
            self._cursor[peer] += 1

    def _post(self, msg: Message, rv: _Recv, block: bool) -> bool:
        """Post a message's receives; False if its header has not arrived yet (and ``block`` is off)."""
        metas = self.meta.get(msg.stage)
        if msg.kind == GRAD:
            if metas is None:  # known once we send these activations, which comes first
                if block:
                    raise PipelineError(
                        f"rank {self.rank}: internal error: {msg.describe()} awaited before its activations were sent"
                    )
                return False
            metas = [m for m in metas if m.requires_grad]  # gradients exist for these only
        elif metas is None:
            if rv.header is None:
                h = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                rv.header = (self._irecv(h, msg, _MAX_TENSORS), h)
            work, h = rv.header
            if not block and not work.is_completed():
                return False
            self._wait(work, msg, msg.src)
            self.meta[msg.stage] = metas = _decode(h)
        rv.tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        rv.works = [self._irecv(t, msg, k) for k, t in enumerate(rv.tensors)]
        if msg.kind == GRAD and metas:  # its mask of gradients that exist, sent last
            rv.tensors.append(torch.empty(len(metas), dtype=torch.uint8, device=self.device))
            rv.works.append(self._irecv(rv.tensors[-1], msg, _MAX_TENSORS))
        return True

    def _irecv(self, t: torch.Tensor, msg: Message, k: int) -> dist.Work:
        peer, tag = msg.src, self._tag(msg, k)
        work = post(lambda: dist.irecv(t, src=self._global[peer], group=self.group_from(peer), tag=tag), self._what(msg, peer))
        assert work is not None  # irecv returns None only on a rank outside the group
        return work

    # -- waiting ------------------------------------------------------------------------------
    def finish_step(self) -> None:
        """Wait for this step's sends (their buffers must live until then)."""
        for msg, work, _ in self._sends:
            self._wait(work, msg, msg.dst)
        self._sends = []

    def _wait(self, work: dist.Work, msg: Message, peer: int) -> None:
        wait(work, self.timeout, self._what(msg, peer))

    def _what(self, msg: Message, peer: int) -> str:
        incoming = msg.dst == self.rank
        return (f"rank {self.rank}: {self.action}: {'receiving' if incoming else 'sending'} {msg.describe()} "
                f"{'from' if incoming else 'to'} rank {peer}")


def _fmt(metas: list[TensorMeta]) -> str:
    return "[" + ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}" for m in metas) + "]"
