"""The cuts users make by hand today, as the plan's baselines.

Each is a rule for how many decoder layers each stage gets, the units before the first layer
(the embedding) on the first stage and those after the last (the head) on the last:

* ``even``: layers shared out evenly, earlier stages taking the remainder (the built-in models'
  and ``hf_stages``' default);
* ``torchtitan``: torchtitan's default split, which counts the embedding and the head as one
  layer each (``pipeline_parallel_first_stage_less_layers`` and ``..._last_stage_less_layers``,
  both 1): L + 2 "effective layers" shared out evenly, earlier stages taking the remainder, the
  first and the last stage one layer less;
* ``megatron``: Megatron-LM with ``--account-for-embedding-in-pipeline-split`` and
  ``--account-for-loss-in-pipeline-split``: the same L + 2 layers, which Megatron requires to
  divide evenly among the stages (else it refuses, and so does this rule).

With the V placement each rule cuts the 2P pieces as it would 2P stages. A model whose units
are not embedding, layers, head in that order (a build function's own units) has the even
split of its units only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.layers import LayerProfile
from .compose import Cut, Placement

__all__ = ["BaselineCut", "baseline_cuts"]


@dataclass(frozen=True)
class BaselineCut:
    """A baseline rule's cut, or why the rule does not apply (``cut`` None)."""

    name: str
    cut: Cut | None
    note: str | None = None


def _shape(layers: LayerProfile) -> tuple[int, int, int] | None:
    """(units before the first layer, layers, units after the last) if the units are that shape."""
    kinds = [u.kind for u in layers.units]
    if "layer" not in kinds:
        return None
    first = kinds.index("layer")
    last = len(kinds) - 1 - kinds[::-1].index("layer")
    if any(k != "layer" for k in kinds[first:last + 1]):
        return None
    return first, last - first + 1, len(kinds) - 1 - last


def _with_ends(per_stage: list[int], pre: int, post: int, placement: Placement) -> Cut:
    counts = list(per_stage)
    counts[0] += pre
    counts[-1] += post
    return Cut(tuple(counts), placement)


def _even(n: int, stages: int) -> list[int]:
    q, r = divmod(n, stages)
    return [q + (s < r) for s in range(stages)]


def baseline_cuts(layers: LayerProfile, num_ranks: int, placement: Placement) -> list[BaselineCut]:
    """The baseline cuts of ``layers`` on ``num_ranks`` ranks (see the module)."""
    S = num_ranks * (2 if placement == "v" else 1)
    shape = _shape(layers)
    if shape is None:
        if layers.num_units < S:
            return [BaselineCut("even", None, f"{layers.num_units} units cannot fill {S} stages")]
        return [BaselineCut("even", Cut(tuple(_even(layers.num_units, S)), placement))]
    pre, L, post = shape
    out: list[BaselineCut] = []
    even = _even(L, S)
    if min(even) < 1 and S > 2:
        out.append(BaselineCut("even", None, f"{L} layers cannot give each of {S} stages one"))
    else:
        cut = _with_ends(even, pre, post, placement)
        out.append(BaselineCut("even", cut) if min(cut.counts) >= 1 else
                   BaselineCut("even", None, f"{L} layers leave a stage empty"))
    eff = L + 2
    per = _even(eff, S)
    if min(per) < 1 or per[0] < 1 or per[-1] < 1 or eff // S < 1:
        out.append(BaselineCut("torchtitan", None, f"{S} stages exceed the {eff} effective layers"))
    else:
        tt = list(per)
        tt[0] -= 1
        tt[-1] -= 1
        cut = _with_ends(tt, pre, post, placement)
        if min(cut.counts) < 1 or min(tt) < 0:
            out.append(BaselineCut("torchtitan", None, f"torchtitan refuses {S} stages of {eff} effective layers"))
        else:
            out.append(BaselineCut("torchtitan", cut))
    if eff % S:
        out.append(BaselineCut("megatron", None, f"Megatron needs the {L} layers + embedding + loss = {eff} to divide "
                                                 f"evenly by {S} stages"))
    else:
        mg = [eff // S] * S
        mg[0] -= 1
        mg[-1] -= 1
        cut = _with_ends(mg, pre, post, placement)
        out.append(BaselineCut("megatron", cut) if min(cut.counts) >= 1 else
                   BaselineCut("megatron", None, f"{eff} layers on {S} stages leave the first or last stage empty"))
    return out
