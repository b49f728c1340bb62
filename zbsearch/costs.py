"""Cost model: what each pass costs on each virtual stage, under a given placement.

A profile describes the model cut into P stages. A profile that records a ``placement`` was
measured as pieces for that placement (e.g. 2P pieces of a V on P ranks): a schedule with as
many stages takes each piece's costs as they are (piece costs do not depend on the rank), and
no other schedule can use it. Otherwise a schedule may cut the model finer into S = k*P
virtual stages (interleaved or V placement): each profile stage is then split into k equal
consecutive virtual stages, each taking 1/k of its time and memory. Communication costs the
profile's boundary time between virtual stages on different ranks, zero between virtual
stages on the same rank (a local hand-over); boundaries created by the split (inside one
profile stage) cost the profile's mean boundary time, because activations between layers of
one model have the same size wherever the cut is.

A message between ranks also costs each end host time (the profile's optional ``t_send`` and
``t_recv``, per boundary, mapped like its link time): it is added to the pass that sends or
receives it, so the simulator, solver and bounds all see a pass as long as it holds its rank.
Likewise the runtime's own host time per action (the profile's optional ``t_action``: handing
outputs on, posting receives, bookkeeping between two actions) is added to every pass, F, B,
W, BW and recompute passes alike. It is the runtime's per action, not the model's: a stage cut
into k pieces pays it whole on each piece's passes, not 1/k of it, so a V, with twice the
actions of one stage per rank, pays it twice as often.

A fused backward (BW) costs the profile's ``t_bw`` (one autograd call, no split analysis), not
t_b + t_w, and the forward of that microbatch costs ``t_ff``: the runtime runs it without the
deferral a split backward needs (``forward_pass(split=False)``), a few percent cheaper than t_f.
So what an F costs depends on the schedule, not only on its type: ``durations`` is the one
place that prices a concrete schedule's actions (the simulator and the pass-time comparison
call it; emulated stages sleep t_ff exactly where the runtime runs such a forward; the solver's
searches price the fused and split backwards they choose the same way). A schedule may run a
microbatch either way, so anything that must hold for every schedule (busy time, lower bounds)
takes the cheaper of the two for F and for the backward (``for_bounds``).

Recomputation. Where the profile offers it, a microbatch's F on a stage may run checkpointed:
it keeps only what recomputation needs (``Recompute.keep``: the stage input and RNG state, or,
for selective recomputation, all but the selected modules' activations), and a recompute pass
(R full, RS selective) re-runs the forward before the backward and allocates the rest. A
schedule says which microbatches it recomputes by holding their R or RS passes; the F of such
a microbatch then costs ``Recompute.t_f`` and allocates ``keep`` (``durations`` and
``memory_deltas`` price a concrete schedule). Before a fused backward R re-runs the plain
forward (``forward_pass(split=False)``), cheaper as t_ff is than t_f: it costs the profile's
``t_rf`` there (``Recompute.time``), t_r before a split one, and anything that must hold for
every schedule takes the cheaper (``Recompute.least``). Where a profile stage is cut into k virtual
stages, times and selective memory take 1/k each, but what a fully checkpointed forward keeps
is its stage's input, whose size does not depend on how many layers follow it: each piece
keeps the profile stage's ``m_fc`` (the first piece) or their mean (a cut inside a stage, as
for communication), at most the piece's m_f.

Overlapped pairs. Where the profile records expert-parallel all-to-all inside the passes
(``a_f`` inside F and R, ``a_b`` inside B and BW; split 1/k like times), a rank may run the
forward of one (stage, microbatch) and the backward (B or BW) of another as one overlapped
pair: each pass's all-to-all is in flight while the other computes. ``pair_time`` is the one
rule for what such a pair costs: the two passes' times (as ``durations`` prices them) less
what each one's all-to-all hides behind the other's compute,
``t_F + t_B - min(a_F, t_B - a_B) - min(a_B, t_F - a_F)`` (``hidden_all_to_all``). Hidden is
not always free: where the profile measured a stage's ``pair_exposed`` share e, what a pass's
all-to-all hides costs e of itself still (the host's cores serve the collective while the other
pass computes, a waiting peer wakes late), and the pair costs
``t_F + t_B - (1 - e_F) min(a_F, t_B - a_B) - (1 - e_B) min(a_B, t_F - a_F)``, each share that of
the pass's own stage; absent, e = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .actions import RECOMPUTES, Action, Op
from .errors import ZbError
from .formats.profile import Profile, profile_misfit
from .tolerances import EPS_MS

__all__ = ["CostModel", "Recompute", "MAX_PASSES", "hidden_all_to_all"]

# The most passes (3 per stage per microbatch) one iteration may have: beyond it a schedule's
# actions take gigabytes to hold in Python, and a run would exhaust memory rather than fail.
MAX_PASSES = 2_000_000


def hidden_all_to_all(t_f: float, t_b: float, a_f: float, a_b: float) -> tuple[float, float]:
    """What an overlapped pair of a forward taking ``t_f`` with all-to-all ``a_f`` inside and a
    backward taking ``t_b`` with ``a_b`` inside hides: the forward's all-to-all behind the
    backward's compute, and the backward's behind the forward's (ms each)."""
    return min(a_f, max(0.0, t_b - a_b)), min(a_b, max(0.0, t_f - a_f))


@dataclass(frozen=True)
class Recompute:
    """What recomputing one microbatch on one stage costs: the checkpointed forward's time
    ``t_f``, the recompute pass's time ``t_r`` (before a split backward; ``t_rf`` before a
    fused one, None: t_r) and the memory ``keep`` the checkpointed forward allocates (the
    recompute pass allocates the rest, m_f - keep)."""

    t_f: float
    t_r: float
    keep: float
    t_rf: float | None = None

    def time(self, fused: bool) -> float:
        """The recompute pass's time before a fused (``fused``) or a split backward."""
        return self.t_rf if fused and self.t_rf is not None else self.t_r

    @property
    def least(self) -> float:
        """The least time the recompute pass can take, before a fused or a split backward."""
        return self.t_r if self.t_rf is None else min(self.t_r, self.t_rf)


@dataclass(frozen=True)
class CostModel:
    """What each pass costs on each virtual stage of one placement: times in ms, memory deltas
    in the profile's unit, one entry per stage (see the module for how a profile maps onto it).

    Made from a profile with ``CostModel.from_profile`` (or ``zbsearch.prediction.cost_model``
    for a schedule's own). The simulator, validator, bounds, builders and solver read costs
    from here only.
    """

    stage_to_rank: tuple[int, ...]
    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_w: tuple[float, ...]
    t_bw: tuple[float, ...]
    t_ff: tuple[float, ...]  # F of a microbatch whose backward is fused (BW) on its rank
    m_f: tuple[float, ...]
    m_b: tuple[float, ...]
    m_w: tuple[float, ...]
    comm_next: tuple[float, ...]  # delay from stage s to s+1 (and back); 0 on the same rank
    # per stage, (full, selective) recomputation where the profile offers it (empty: nowhere)
    recompute: tuple[tuple[Recompute | None, Recompute | None], ...] = ()
    # per stage, reducing its gradients across its data-parallel replicas after its last backward,
    # and its optimizer step after that (``zbsearch.reductions``; empty: the iteration ends at the
    # last pass)
    t_reduce: tuple[float, ...] = ()
    t_opt: tuple[float, ...] = ()
    # per stage, the expert-parallel all-to-all inside F (and R) and inside B (and BW), which an
    # overlapped pair can hide (empty: none anywhere)
    a_f: tuple[float, ...] = ()
    a_b: tuple[float, ...] = ()
    # per stage, the share of what a pair hides of its all-to-all that still costs time (empty: 0 everywhere)
    exposed: tuple[float, ...] = ()
    # per stage, gathering its sharded parameters at the step's start, before its first pass
    # (``zbsearch.reductions``; empty: none)
    t_gather: tuple[float, ...] = ()
    # per stage, the factor by which its reduction or gather slows its rank's passes while it
    # runs on the rank's lane (``zbsearch.reductions``; empty: no slowdown anywhere)
    slowdown: tuple[float, ...] = ()
    # per stage, the factor by which its reduction or gather runs slower on the rank's lane while
    # a pass of the rank computes beside it (``zbsearch.reductions``; empty: at its own speed)
    stretch: tuple[float, ...] = ()
    # lanes of different ranks on one link (a node's NICs, a host's cores): per rank, its link
    # (ranks with the same value share one), and how runs at once on it slow each other
    # (``reductions.share_rate``; 0 or empty: every lane at full speed)
    lane_link: tuple[int, ...] = ()
    lane_share: float = 0.0

    def __repr__(self) -> str:
        S = self.num_stages
        means = "/".join(f"{sum(t) / S:.4g}" for t in (self.t_f, self.t_b, self.t_w))
        links = [c for c in self.comm_next if c > 0]
        comm = f", mean link {sum(links) / len(links):.4g} ms" if links else ""
        return f"CostModel(ranks={self.num_ranks}, stages={S}, mean F/B/W {means} ms{comm})"

    @classmethod
    def from_profile(cls, profile: Profile, stage_to_rank: list[int] | tuple[int, ...]) -> CostModel:
        """The costs of ``profile`` with virtual stage s on rank ``stage_to_rank[s]``.

        Raises:
            ZbError: the profile cannot cost this placement (its stage count fits neither one
                profile stage per virtual stage nor one per rank, or its pieces were measured
                for another placement).
        """
        S, P = len(stage_to_rank), profile.num_stages
        if profile.placement is not None and S != P:
            raise ZbError(
                f"profile {profile.name!r} holds {P} pieces measured for {profile.num_ranks} ranks "
                f"({profile.chunks} per rank): it serves schedules of {P} stages ({profile.chunks} chunks per rank), "
                f"not of {S}; for those, profile {S} stages"
            )
        if profile.placement is not None and max(stage_to_rank) + 1 != profile.num_ranks:
            raise ZbError(
                f"profile {profile.name!r} holds {P} pieces measured for {profile.num_ranks} ranks "
                f"({profile.chunks} per rank); a schedule that puts its {S} stages on {max(stage_to_rank) + 1} ranks "
                f"needs a profile of {S} stages measured one per rank"
            )
        misfit = profile_misfit(P, S, max(stage_to_rank) + 1)
        if misfit:
            raise ZbError(misfit)
        k = S // P
        st = [profile.stages[s // k] for s in range(S)]

        def boundaries(kind: str) -> list[float]:  # per virtual boundary s -> s+1
            return [
                0.0 if stage_to_rank[s] == stage_to_rank[s + 1]
                else profile.comm((s + 1) // k - 1, kind) if (s + 1) % k == 0 else profile.mean_comm(kind)
                for s in range(S - 1)
            ]

        comm, send, recv = boundaries("t_comm"), boundaries("t_send"), boundaries("t_recv")
        kept = [c.m_fc for c in profile.stages if c.m_fc is not None]
        mean_kept = sum(kept) / len(kept) if kept else 0.0
        # host time of messages, on the passes that send or receive them: F gets its input from
        # stage s-1 and sends to s+1; B (and BW) gets its gradient from s+1 and sends to s-1
        host = profile.t_action or 0.0  # the runtime's own time per action, on every pass
        fwd = [host + (send[s] if s < S - 1 else 0.0) + (recv[s - 1] if s else 0.0) for s in range(S)]
        bwd = [host + (send[s - 1] if s else 0.0) + (recv[s] if s < S - 1 else 0.0) for s in range(S)]
        def recompute(s: int, selective: bool) -> Recompute | None:
            got = st[s].recompute(selective)
            if got is None:
                return None
            t_fc, t_r, keep = got
            if not selective and s % k:  # a cut inside the profile stage: activations between layers
                keep = mean_kept
            keep = keep / k if selective else keep
            rf = None if selective else st[s].t_rf
            t_rf = None if rf is None else rf / k + host
            return Recompute(t_fc / k + fwd[s], t_r / k + host, min(keep, st[s].m_f / k), t_rf)

        offers = tuple((recompute(s, False), recompute(s, True)) for s in range(S))
        return cls(
            stage_to_rank=tuple(stage_to_rank),
            t_f=tuple(c.t_f / k + h for c, h in zip(st, fwd)),
            t_b=tuple(c.t_b / k + h for c, h in zip(st, bwd)),
            t_w=tuple(c.t_w / k + host for c in st),
            t_bw=tuple(c.fused_backward / k + h for c, h in zip(st, bwd)),
            t_ff=tuple(c.fused_forward / k + h for c, h in zip(st, fwd)),
            m_f=tuple(c.m_f / k for c in st),
            m_b=tuple(c.m_b / k for c in st),
            m_w=tuple(c.m_w / k for c in st),
            comm_next=tuple(comm),
            recompute=offers if any(a or b for a, b in offers) else (),
            t_reduce=tuple((c.t_reduce or 0.0) / k for c in st) if profile.has_reductions else (),
            t_opt=tuple((c.t_opt or 0.0) / k for c in st) if profile.has_reductions else (),
            a_f=tuple(c.a_f / k for c in st) if profile.has_all_to_all else (),
            a_b=tuple(c.a_b / k for c in st) if profile.has_all_to_all else (),
            exposed=tuple(c.pair_exposed or 0.0 for c in st)
            if profile.has_all_to_all and any(c.pair_exposed for c in st) else (),
            t_gather=tuple((c.t_gather or 0.0) / k for c in st) if any(c.t_gather for c in st) else (),
            slowdown=tuple(c.reduce_slowdown or 1.0 for c in st)
            if profile.has_reductions and any((c.reduce_slowdown or 1.0) > 1.0 for c in st) else (),
            stretch=tuple(c.reduce_stretch or 1.0 for c in st)
            if profile.has_reductions and any((c.reduce_stretch or 1.0) > 1.0 for c in st) else (),
            **_lane_sharing(profile, max(stage_to_rank) + 1),
        )

    def check_microbatches(self, m: int) -> None:
        """One line for a microbatch count no schedule on these stages can have."""
        if m < 1:
            raise ZbError("the number of microbatches must be at least 1")
        if 3 * self.num_stages * m > MAX_PASSES:
            raise ZbError(f"{m} microbatches on {self.num_stages} stages is {3 * self.num_stages * m:,} passes; "
                          f"zbsearch handles at most {MAX_PASSES:,} per iteration")

    @property
    def num_stages(self) -> int:
        """Virtual stages."""
        return len(self.stage_to_rank)

    @property
    def num_ranks(self) -> int:
        """Ranks the stages are placed on."""
        return max(self.stage_to_rank) + 1

    def rank_stages(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in stage order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def time(self, stage: int, op: Op) -> float:
        """What a pass of this type costs, F as the split forward (t_f) and a recompute pass as
        before a split backward (t_r): the cost of every pass of a split-only schedule. A schedule
        with fused backwards or recomputation is priced by ``durations``. A recompute pass the
        profile does not offer on the stage costs inf (the validator rejects it)."""
        if op is Op.BW:
            return self.t_bw[stage]
        if op in RECOMPUTES:
            offer = self.offer(stage, op)
            return math.inf if offer is None else offer.t_r
        return _by_op(op, stage, self.t_f, self.t_b, self.t_w)

    def offer(self, stage: int, op: Op) -> Recompute | None:
        """What recomputing a microbatch on ``stage`` with ``op`` (R or RS) costs, None where the
        profile does not offer it."""
        if not self.recompute:
            return None
        return self.recompute[stage][0 if op is Op.R else 1]

    def recompute_ops(self, stage: int) -> tuple[Op, ...]:
        """The recompute passes the profile offers on ``stage`` (R, RS, both or none)."""
        return tuple(op for op in RECOMPUTES if self.offer(stage, op) is not None)

    @property
    def can_recompute(self) -> bool:
        """Whether the profile offers recomputation on some stage."""
        return bool(self.recompute)

    @property
    def has_reductions(self) -> bool:
        """Whether the iteration ends with reductions or optimizer steps after the passes."""
        return bool(self.t_reduce)

    @property
    def has_all_to_all(self) -> bool:
        """Whether some pass holds all-to-all an overlapped pair can hide (pairing can pay)."""
        return bool(self.a_f)

    def all_to_all(self, stage: int, op: Op) -> float:
        """The all-to-all time inside a pass of this type on ``stage`` (ms): a_f in F and R (which
        repeats the forward's), a_b in B and BW, none in W and RS."""
        if not self.a_f:
            return 0.0
        if op is Op.F or op is Op.R:
            return self.a_f[stage]
        if op is Op.B or op is Op.BW:
            return self.a_b[stage]
        return 0.0

    def exposed_share(self, stage: int) -> float:
        """The share of what a pair hides of ``stage``'s all-to-all that still costs time (0: all
        of it is free)."""
        return self.exposed[stage] if self.exposed else 0.0

    def hideable(self, stage: int, op: Op) -> float:
        """The most a pair can take off a pass of this type on ``stage``: its all-to-all less
        the share that stays exposed."""
        return (1.0 - self.exposed_share(stage)) * self.all_to_all(stage, op)

    def pair_time(self, f: Action, b: Action, t_f: float, t_b: float) -> float:
        """What the overlapped pair of forward ``f`` and backward ``b`` (B or BW) costs on their
        rank, the two passes taking ``t_f`` and ``t_b`` alone (``durations``): both computes plus
        the all-to-all neither hides, each pass's all-to-all hiding behind the other's compute,
        and of what is hidden the share each pass's stage leaves exposed (the module's rule)."""
        hid_f, hid_b = hidden_all_to_all(t_f, t_b, self.all_to_all(f.stage, Op.F), self.all_to_all(b.stage, b.op))
        return t_f + t_b - (1.0 - self.exposed_share(f.stage)) * hid_f - (1.0 - self.exposed_share(b.stage)) * hid_b

    def paired_floor(self) -> CostModel:
        """These costs with every forward (checkpointed or not) and backward (B or BW) shortened
        by what a pair can take off it (``hideable``: its all-to-all, less the share left
        exposed), and nothing left to overlap: what bounds are computed on where pairs may
        form. A pair takes at least its two passes' times less both of those (``pair_time``),
        so its forward maps onto such an F at the pair's start and its backward onto such a B
        right after it, both ending no later than the pair and in the same order:
        every schedule with pairs maps onto one of these costs, without pairs, whose passes end
        no later, and a bound on these holds for it. W and recompute passes, which no pair holds,
        keep their times. Without all-to-all, the costs themselves."""
        if not self.a_f:
            return self
        af = tuple(self.hideable(s, Op.F) for s in range(self.num_stages))
        ab = tuple(self.hideable(s, Op.B) for s in range(self.num_stages))

        def less(ts: tuple[float, ...], a: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(max(0.0, t - x) for t, x in zip(ts, a))

        def offer(o: Recompute | None, s: int) -> Recompute | None:
            return None if o is None else replace(o, t_f=max(0.0, o.t_f - af[s]))

        offers = tuple((offer(full, s), offer(sel, s)) for s, (full, sel) in enumerate(self.recompute))
        return replace(self, t_f=less(self.t_f, af), t_ff=less(self.t_ff, af), t_b=less(self.t_b, ab),
                       t_bw=less(self.t_bw, ab), recompute=offers, a_f=(), a_b=(), exposed=())

    def without_all_to_all(self) -> CostModel:
        """These costs with nothing for an overlapped pair to hide (pairs then cost their sum)."""
        return replace(self, a_f=(), a_b=(), exposed=()) if self.a_f else self

    def without_reductions(self) -> CostModel:
        """These costs with the iteration ending at the last pass."""
        if not self.t_reduce:
            return self
        return replace(self, t_reduce=(), t_opt=(), t_gather=(), slowdown=(), stretch=(), lane_link=(),
                       lane_share=0.0)

    @property
    def shares_lanes(self) -> bool:
        """Whether lanes of different ranks slow each other on a shared link (``lane_share``
        above 0 and two ranks on one link): the simulator then times every lane together."""
        lanes = self.has_reductions or bool(self.t_gather)
        return lanes and self.lane_share > 0 and len(set(self.lane_link)) < len(self.lane_link)

    @property
    def couples_lanes(self) -> bool:
        """Whether a rank's lane depends on the timing of passes (its own, or through a shared
        link other ranks'): lanes share a link (``shares_lanes``) or a run slows beside its rank's
        passes (``stretch``). The simulator then times every pass and lane together."""
        return self.shares_lanes or ((self.has_reductions or bool(self.t_gather)) and bool(self.stretch))

    def without_slowdown(self) -> CostModel:
        """These costs with every pass at its own speed beside the reductions, every run of a lane
        at its own speed beside the passes and every lane at full speed on its link: every
        schedule's times under them are no later than under these (``zbsearch.reductions``), so
        bounds and models that ignore the slowdown hold for these costs too."""
        if self.lane_share:
            return replace(self, slowdown=(), stretch=(), lane_link=(), lane_share=0.0)
        return replace(self, slowdown=(), stretch=()) if self.slowdown or self.stretch else self

    def without_recompute(self, keep: tuple[Op, ...] = ()) -> CostModel:
        """These costs with only the recompute passes in ``keep`` offered (none by default)."""
        if not self.recompute:
            return self
        offers = tuple((full if Op.R in keep else None, sel if Op.RS in keep else None) for full, sel in self.recompute)
        return replace(self, recompute=offers if any(a or b for a, b in offers) else ())

    def durations(self, rank_actions: list[list[Action]]) -> list[list[float]]:
        """What each action of a schedule costs (ms), as the runtime runs it: ``time``, except
        that the F of microbatch j on stage s costs t_ff[s] and its recompute pass t_rf when its
        rank's actions hold a BW of (s, j), because the runtime then runs that forward (and its
        recomputation) without the split's deferral, and the F costs the checkpointed forward's
        time when they hold a recompute pass of (s, j)."""
        by_type = {op: [self.time(s, op) for s in range(self.num_stages)] for op in Op}  # tables: schedules are long
        f, bw = Op.F, Op.BW  # bound once: an enum member's lookup is slow
        out = []
        for row in rank_actions:
            row_durations = [by_type[a.op][a.stage] for a in row]
            fused = {(a.stage, a.mb) for a in row if a.op is bw}
            if fused:
                for i, a in enumerate(row):
                    if (a.stage, a.mb) not in fused:
                        continue
                    if a.op is f:  # every such F, as the runtime runs it
                        row_durations[i] = self.t_ff[a.stage]
                    elif a.op in RECOMPUTES and (offer := self.offer(a.stage, a.op)) is not None:
                        row_durations[i] = offer.time(fused=True)
            if self.recompute:
                for i, offer in self._checkpointed_forwards(row):
                    row_durations[i] = offer.t_f
            out.append(row_durations)
        return out

    def _checkpointed_forwards(self, row: list[Action]) -> list[tuple[int, Recompute]]:
        """(index in ``row``, recompute offer) of each F whose microbatch ``row`` recomputes."""
        checkpointed = self._checkpointed(row)
        if not checkpointed:
            return []
        return [(i, offer) for i, a in enumerate(row)
                if a.op is Op.F and (offer := checkpointed.get((a.stage, a.mb))) is not None]

    def _checkpointed(self, row: list[Action]) -> dict[tuple[int, int], Recompute]:
        """(stage, microbatch) -> its recompute offer, for each recompute pass in ``row`` that
        the profile offers."""
        out = {}
        for a in row:
            if a.op in RECOMPUTES:
                offer = self.offer(a.stage, a.op)
                if offer is not None:
                    out[(a.stage, a.mb)] = offer
        return out

    def memory(self, stage: int, op: Op) -> float:
        """How a pass of this type changes its rank's activation memory (BW: B's change then W's;
        a recompute pass: what the checkpointed forward did not keep)."""
        if op in RECOMPUTES:
            offer = self.offer(stage, op)
            return 0.0 if offer is None else self.m_f[stage] - offer.keep
        return _by_op(op, stage, self.m_f, self.m_b, self.m_w)

    def memory_deltas(self, rank_actions: list[list[Action]]) -> list[list[float]]:
        """How each action of a schedule changes its rank's memory: ``memory``, except that the
        F of a microbatch its rank recomputes allocates only what the checkpointed forward keeps."""
        by_type = {op: [self.memory(s, op) for s in range(self.num_stages)] for op in Op}
        out = []
        for row in rank_actions:
            deltas = [by_type[a.op][a.stage] for a in row]
            if self.recompute:
                for i, offer in self._checkpointed_forwards(row):
                    deltas[i] = offer.keep
            out.append(deltas)
        return out

    def forward(self, stage: int) -> float:
        """Least time one microbatch's forward can take on ``stage``: before a fused or a split
        backward, checkpointed or not."""
        return min([self.t_f[stage], self.t_ff[stage], *(self.offer(stage, op).t_f for op in self.recompute_ops(stage))])  # type: ignore[union-attr]

    def backward(self, stage: int) -> float:
        """Least time one microbatch's backward can take on ``stage``: fused or split."""
        return min(self.t_bw[stage], self.t_b[stage] + self.t_w[stage])

    def fusing_may_pay(self) -> bool:
        """Whether some schedule can gain from fused backwards over the same schedule split: a
        BW cheaper than B + W, a forward or a recompute pass before it cheaper than before a
        split one, or a B that allocates (m_b > 0) what its W frees (a BW never holds that peak:
        its memory changes at once). Otherwise splitting every BW into B then W loses nothing,
        and split schedules suffice."""
        return any(self.fuse_saves(s) for s in range(self.num_stages))

    def fuse_saves(self, stage: int) -> bool:
        """Whether a fused backward on ``stage`` may pay (``fusing_may_pay``, on one stage)."""
        return (self.t_bw[stage] < self.t_b[stage] + self.t_w[stage] or self.t_ff[stage] < self.t_f[stage]
                or self.m_b[stage] > 0 > self.m_w[stage]
                or any(o.least < o.t_r for op in self.recompute_ops(stage) if (o := self.offer(stage, op))))

    def fuse_pays_in_pair(self, stage: int) -> bool:
        """Whether a BW of ``stage`` paired with a forward of its rank (plain, fused or
        checkpointed) takes less than that forward paired with its B and then its W: a longer
        backward hides more of the forward's all-to-all (``pair_time``), so splitting it may
        lose where the pair is worth more than what a W filling a gap gains. False without
        all-to-all."""
        if not self.a_f:
            return False
        for f in self.rank_stages(self.stage_to_rank[stage]):
            times = {self.t_f[f], self.t_ff[f], *(o.t_f for op in self.recompute_ops(f) if (o := self.offer(f, op)))}
            fwd, bw, b = Action(f, Op.F, 0), Action(stage, Op.BW, 1), Action(stage, Op.B, 1)
            split = (self.pair_time(fwd, b, t, self.t_b[stage]) + self.t_w[stage] for t in times)
            if any(self.pair_time(fwd, bw, t, self.t_bw[stage]) < x - EPS_MS for t, x in zip(times, split)):
                return True
        return False

    def for_bounds(self) -> CostModel:
        """A split-only cost model that no schedule beats, fused BW passes included.

        F costs min(t_f, t_ff), B min(t_b, t_bw) and W min(t_w, backward - B): a BW pass maps
        onto such a B then W that end no later than it (B's output was only ready at BW's end
        anyway), and an F or a split pass onto one no longer, so every schedule maps onto a
        schedule of this model with the same starts and no later ends. B changes memory by
        min(m_b, m_b + m_w) and W by the rest, so the mapped schedule holds no more memory after
        any of its passes than the original after the pass it maps (a BW's memory changes at
        once, with no peak between B and W). Bounds computed on it hold for schedules that
        fuse, split or mix.

        A checkpointed forward's time counts in F's least time too, and recompute passes cost
        nothing here: dropping a pass's time from a schedule ends no pass later. Memory keeps
        the uncheckpointed deltas and the recompute offers stay on: a bound that reasons about
        memory must look at ``can_recompute`` (``zbsearch.bounds``), and take a recompute
        pass's least time (``Recompute.least``).

        Where the passes hold all-to-all, this is ``paired_floor``'s: every pass at the least
        time an overlapped pair can give it, with no pairs left to form.
        """
        if self.a_f:
            return self.paired_floor().for_bounds()
        cheaper_f = any(self.forward(s) < self.t_f[s] for s in range(self.num_stages))
        if not self.fusing_may_pay() and not cheaper_f:
            return self
        t_f = tuple(self.forward(s) for s in range(self.num_stages))
        t_b = tuple(min(b, bw) for b, bw in zip(self.t_b, self.t_bw))
        t_w = tuple(min(w, self.backward(s) - b) for s, (b, w) in enumerate(zip(t_b, self.t_w)))
        m_b = tuple(min(mb, mb + mw) for mb, mw in zip(self.m_b, self.m_w))
        m_w = tuple(mb + mw - b for mb, mw, b in zip(self.m_b, self.m_w, m_b))
        return replace(self, t_f=t_f, t_ff=t_f, t_b=t_b, t_w=t_w, t_bw=tuple(b + w for b, w in zip(t_b, t_w)),
                       m_b=m_b, m_w=m_w)

    def comm(self, a: int, b: int) -> float:
        """Delay for a tensor passed between adjacent stages a and b (either direction)."""
        return self.comm_next[min(a, b)]

    def activation_unit(self, rank: int) -> float:
        """M_B of a rank: what one microbatch's forward through all of the rank's stages keeps."""
        return sum(self.m_f[s] for s in self.rank_stages(rank))

    def rank_busy(self, rank: int, num_microbatches: int) -> float:
        """Compute time one iteration needs on this rank, whatever the schedule."""
        return num_microbatches * sum(self.forward(s) + self.backward(s) for s in self.rank_stages(rank))


def _by_op(op: Op, stage: int, f: tuple[float, ...], b: tuple[float, ...], w: tuple[float, ...]) -> float:
    if op is Op.F:
        return f[stage]
    if op is Op.B:
        return b[stage]
    if op is Op.W:
        return w[stage]
    return b[stage] + w[stage]  # BW memory: B's change then W's


def _lane_sharing(profile: Profile, ranks: int) -> dict:
    """``lane_link`` and ``lane_share`` of ``ranks`` pipeline ranks from the profile's
    data-parallel section (``LaneSharing``; none: no sharing)."""
    dp = profile.data_parallel
    sharing = None if dp is None else dp.sharing
    if sharing is None or sharing.share <= 0 or not profile.has_reductions:
        return {}
    per = sharing.ranks_per_link or ranks
    return {"lane_link": tuple(r // per for r in range(ranks)), "lane_share": sharing.share}
