"""Measure a model unit by unit: the per-layer profile (``zbsearch.layers``) a plan cuts.

The units are the stages of a ``ModelSpec`` cut as finely as the planner may cut it (the
embedding, each decoder layer, the final norm with the head and the loss: ``GPTConfig.units``,
``zbsearch.models.hf.hf_units``; or each module a build function returns). Each unit is
measured as a stage of its own on one device, fed the real outputs of the unit before, in
rounds, exactly as ``profile_one_device`` measures stages (the same passes, memory meter and
pooling); the link between two ranks is estimated as latency plus bytes over bandwidth, so a
cut anywhere costs its boundary's bytes.

With ``settings.recompute`` each unit's checkpointed forward and recompute pass are measured
too, as for stages (what it keeps: its input and the random generators' state, recorded once as
``checkpoint_state_bytes``), for ``zbsearch plan --recompute``.

Besides, per unit: its trainable parameters (elements and bytes), its frozen parameters and
buffers, and the bytes it sends on. A parameter object that several units use (an embedding
tied to the head) is recorded once under ``tied``, named by the first unit's name for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ZbError
from ..formats.layers import LayerProfile, LinkEstimate, TiedParams, Unit, UnitKind
from ..runtime.data_parallel import is_expert
from .links import LinkModel
from .run import Progress, profile_one_device
from .settings import Settings, resolve_device
from .stages import ModelSpec

__all__ = ["profile_layers", "unit_kinds", "unit_names"]


def unit_kinds(layers_per_unit: Sequence[int]) -> list[UnitKind]:
    """Kinds of units from the decoder layers each holds (a cut into units): a leading unit
    without a layer is the embedding, a trailing one the head, a unit with one layer a layer,
    anything else a plain unit."""
    n = len(layers_per_unit)
    kinds: list[UnitKind] = []
    for i, k in enumerate(layers_per_unit):
        if k == 1:
            kinds.append("layer")
        elif k == 0 and i == 0:
            kinds.append("embedding")
        elif k == 0 and i == n - 1:
            kinds.append("head")
        else:
            kinds.append("unit")
    return kinds


def unit_names(kinds: Sequence[UnitKind]) -> list[str]:
    """``embedding``, ``layer.0``, ``layer.1``, ..., ``head``; other units ``unit.<index>``."""
    out, layer = [], 0
    for i, k in enumerate(kinds):
        if k == "layer":
            out.append(f"layer.{layer}")
            layer += 1
        elif k in ("embedding", "head"):
            out.append(k)
        else:
            out.append(f"unit.{i}")
    return out


def profile_layers(
    spec: ModelSpec, settings: Settings, *, kinds: Sequence[UnitKind] | None = None, name: str | None = None,
    progress: Progress | None = None, link: LinkModel | None = None,
) -> LayerProfile:
    """Measure each unit of ``spec`` (its stages) on one device (see the module).

    Args:
        spec: the model cut into units.
        settings: how to measure (as for ``profile_model``).
        kinds: each unit's kind (default: ``unit`` for every one).
        link: the link between ranks (default: estimated between two local processes).

    Raises:
        ZbError: bad settings, fewer than two units, or kinds that do not match the units.
    """
    n = len(spec.stages)
    if n < 2:
        raise ZbError(f"a per-layer profile needs at least 2 units, the model has {n}")
    kinds = list(kinds) if kinds is not None else ["unit"] * n
    if len(kinds) != n:
        raise ZbError(f"{len(kinds)} unit kinds for {n} units")
    names = unit_names(kinds)
    prof = profile_one_device(spec, settings, name=name, progress=progress, link=link, units=True)
    owners: dict[int, str] = {}  # id of a parameter -> the first unit's name for it
    users: dict[int, set[int]] = {}
    for i, st in enumerate(spec.stages):
        for pname, p in st.named_parameters():
            owners.setdefault(id(p), f"{names[i]}.{pname}")
            users.setdefault(id(p), set()).add(i)
    shared = {pid for pid, us in users.items() if len(us) > 1}
    tied: dict[str, TiedParams] = {}
    units = []
    bytes_sent = (prof.measured.boundary_bytes if prof.measured is not None else []) + [0]
    for i, (st, cost) in enumerate(zip(spec.stages, prof.stages)):
        own = [p for p in _unique(st.parameters()) if p.requires_grad and id(p) not in shared]
        frozen = [p for p in _unique(st.parameters()) if not p.requires_grad]
        keys = []
        for p in _unique(st.parameters()):
            if id(p) in shared and p.requires_grad:
                key = owners[id(p)]
                keys.append(key)
                tied.setdefault(key, TiedParams(params=p.numel(), param_bytes=float(p.nbytes)))
        frozen_bytes = sum(p.nbytes for p in frozen) + sum(b.nbytes for b in st.buffers())
        units.append(Unit(
            **cost.model_dump(), name=names[i], kind=kinds[i], output_bytes=bytes_sent[i],
            params=sum(p.numel() for p in own), param_bytes=float(sum(p.nbytes for p in own)),
            expert_params=sum(p.numel() for p in own if is_expert(p)),
            expert_param_bytes=float(sum(p.nbytes for p in own if is_expert(p))),
            frozen_bytes=float(frozen_bytes), tied=sorted(set(keys)),
        ))
    links = prof.links
    assert links is not None and links.latency_ms is not None and links.bandwidth_gb_s is not None  # estimated
    return LayerProfile(
        name=prof.name, units=units, tied=tied,
        link=LinkEstimate(latency_ms=links.latency_ms, bandwidth_gb_s=links.bandwidth_gb_s, method=links.method,
                          how=links.how),
        microbatch_size=prof.microbatch_size, device=prof.device, torch=prof.torch, dtype=prof.dtype,
        model=prof.model, settings=prof.settings, selective=prof.selective,
        checkpoint_state_bytes=_generator_state_bytes(settings) if settings.recompute else None,
        # the stages the profiler measured are this profile's units
        measured=None if prof.measured is None else prof.measured.model_copy(
            update={"warnings": [w.replace("stage ", "unit ", 1) for w in prof.measured.warnings]}),
    )


def _generator_state_bytes(settings: Settings) -> float:
    """Bytes of the random generators' state a checkpointed forward keeps besides its inputs:
    the CPU generator's, and the device's on CUDA (``zbsearch.runtime.recompute``)."""
    total = torch.get_rng_state().nbytes
    device = resolve_device(settings.device)
    if device.type == "cuda":
        total += torch.cuda.get_rng_state(device.index if device.index is not None else torch.cuda.current_device()).nbytes
    return float(total)


def _unique(params) -> list[nn.Parameter]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())  # type: ignore[arg-type]
