"""One model's per-layer profiles at several microbatch sizes, and its costs at any size.

``zbsearch profile --per-layer`` measures at one microbatch size (``-b``); measure it again at
other sizes and give ``tune`` every file. A unit's cost at a microbatch size b:

* measured at b: as measured;
* between two measured sizes: linear interpolation between the two nearest around it;
* below the smallest or above the largest: linear extrapolation through the two nearest
  measured sizes; from one measured size alone, in proportion to b (twice the sequences, twice
  the time and the activations).

The rule is the same for every pass time, every activation memory delta and what a unit sends
to the next. A linear combination of balanced memory deltas is balanced, so interpolated units
are as consistent as measured ones; an extrapolated time is kept positive and an extrapolated
memory delta within what a pass can allocate, and W then frees what F and B left. Parameters do
not depend on the size: the profiles must agree on them, as they must on the units. Nor does the
runtime's host time per action (``t_action``): the nearest measured size's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ZbError
from ..formats.layers import LayerProfile, Unit
from ..formats.profile import MIN_TIME_MS

__all__ = ["SizedLayers", "HOW_SIZES_SCALE"]

HOW_SIZES_SCALE = ("measured where given; between two measured sizes linear interpolation; outside them linear "
                   "extrapolation through the two nearest (in proportion to the size from one measured size)")

# fields of a unit that scale with the microbatch size
_TIMES = ("t_f", "t_b", "t_w", "t_bw", "t_ff", "t_fc", "t_r", "t_rf", "t_fs", "t_rs")
_POSITIVE = ("t_f", "t_b", "t_bw", "t_ff", "t_fc", "t_r", "t_rf", "t_fs", "t_rs")
_MEMORY = ("m_f", "m_b", "m_fc", "m_fs")
# fields that must agree between the sizes: the same model
_FIXED = ("name", "kind", "params", "param_bytes", "frozen_bytes", "tied")


class SizedLayers:
    """Per-layer profiles of one model measured at different microbatch sizes (``at``: the
    profile at any size, by the rule of the module).

    Raises:
        ZbError: a profile without its microbatch size, two at one size, or profiles of
            different models (units, parameters, or which recomputation costs they carry).
    """

    def __init__(self, profiles: Sequence[LayerProfile]) -> None:
        if not profiles:
            raise ZbError("give at least one per-layer profile")
        by_size: dict[int, LayerProfile] = {}
        for prof in profiles:
            b = prof.microbatch_size
            if b is None:
                raise ZbError(f"per-layer profile {prof.name!r} does not say its microbatch size (microbatch_size); "
                              "measure it with zbsearch profile --per-layer -b N")
            if b in by_size:
                raise ZbError(f"per-layer profiles {by_size[b].name!r} and {prof.name!r} are both at microbatch size {b}: "
                              "give one per size")
            by_size[b] = prof
        self.by_size = dict(sorted(by_size.items()))
        first = next(iter(self.by_size.values()))
        for prof in self.by_size.values():
            _same_model(first, prof)
        self.reference = first

    @property
    def measured(self) -> list[int]:
        """The microbatch sizes measured, in order."""
        return list(self.by_size)

    def how(self, b: int) -> str:
        """How the costs at size ``b`` are found: measured, interpolated or extrapolated."""
        if b in self.by_size:
            return "measured"
        sizes = self.measured
        if len(sizes) == 1:
            return "proportional"
        return "interpolated" if sizes[0] < b < sizes[-1] else "extrapolated"

    def at(self, b: int) -> LayerProfile:
        """The per-layer profile at microbatch size ``b`` (see the module)."""
        if b < 1:
            raise ZbError(f"a microbatch holds at least 1 sequence, not {b}")
        if b in self.by_size:
            return self.by_size[b]
        lo, hi = self._around(b)
        weights: list[tuple[int, float]]
        if hi is None:  # one measured size: in proportion
            weights = [(lo, b / lo)]
        else:
            x = (b - lo) / (hi - lo)
            weights = [(lo, 1 - x), (hi, x)]
        units = [_combine([self.by_size[s].units[i] for s, _ in weights], [w for _, w in weights])
                 for i in range(self.reference.num_units)]
        near = self.by_size[min(self.by_size, key=lambda s: (abs(s - b), s))]
        comm = None
        if all(self.by_size[s].t_comm is not None for s, _ in weights):
            given = [(w, self.by_size[s].t_comm or []) for s, w in weights]
            comm = [max(0.0, sum((w * tc[k] for w, tc in given), 0.0)) for k in range(self.reference.num_units - 1)]
        model = dict(near.model or {})
        if model:
            model["microbatch_size"] = b
            model.pop("identity", None)  # the fingerprints name the measured microbatch's shape
        return near.model_copy(update={
            "name": f"{near.name}-b{b}-{self.how(b)}", "units": units, "t_comm": comm, "microbatch_size": b,
            "model": model or None, "measured": None,
        })

    def _around(self, b: int) -> tuple[int, int | None]:
        """The two measured sizes b is interpolated or extrapolated between (one, with None)."""
        sizes = self.measured
        if len(sizes) == 1:
            return sizes[0], None
        if b < sizes[0]:
            return sizes[0], sizes[1]
        if b > sizes[-1]:
            return sizes[-2], sizes[-1]
        hi = next(s for s in sizes if s > b)
        return sizes[sizes.index(hi) - 1], hi


def _combine(units: list[Unit], weights: list[float]) -> Unit:
    """The unit whose scaled fields are ``sum(w * u.field)``, clamped where extrapolated."""
    base = units[0]
    update: dict[str, float | None] = {}
    for f in (*_TIMES, *_MEMORY, "output_bytes"):
        values = [getattr(u, f) for u in units]
        if any(v is None for v in values):
            update[f] = None
            continue
        v = sum(w * x for w, x in zip(weights, values))
        if f in _POSITIVE:
            v = max(v, MIN_TIME_MS)
        elif f in ("t_w", "m_f", "output_bytes"):
            v = max(v, 0.0)
        update[f] = v
    m_f = update["m_f"] or 0.0
    update["m_b"] = max(update["m_b"] or 0.0, -m_f)  # B frees at most what F allocated
    for f in ("m_fc", "m_fs"):
        if update[f] is not None:
            update[f] = min(max(update[f] or 0.0, 0.0), m_f)
    update["m_w"] = -(m_f + (update["m_b"] or 0.0))  # W frees the rest
    return Unit.model_validate({**base.model_dump(), **update})


def _same_model(a: LayerProfile, b: LayerProfile) -> None:
    """One line where ``b`` is not a profile of ``a``'s model at another size."""
    where = f"per-layer profiles {a.name!r} and {b.name!r}"
    if a.names != b.names:
        raise ZbError(f"{where} have different units ({a.num_units} and {b.num_units}, first difference "
                      f"{next((x, y) for x, y in zip([*a.names, None], [*b.names, None]) if x != y)}): give profiles "
                      "of one model")
    for ua, ub in zip(a.units, b.units):
        for f in _FIXED:
            if getattr(ua, f) != getattr(ub, f):
                raise ZbError(f"{where} differ in unit {ua.name!r}'s {f} ({getattr(ua, f)} and {getattr(ub, f)}): "
                              "give profiles of one model, measured in one dtype")
        for f in ("t_r", "t_rs"):
            if (getattr(ua, f) is None) != (getattr(ub, f) is None):
                kind = "full" if f == "t_r" else "selective"
                raise ZbError(f"{where}: unit {ua.name!r} has {kind} recomputation costs in one and not the other: "
                              "measure every size with the same --recompute")
    if a.tied != b.tied:
        raise ZbError(f"{where} differ in their tied parameters: give profiles of one model")
