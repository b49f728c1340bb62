"""A profile of a mixture-of-experts model on an expert-parallel group: passes and their all-to-all.

``profile_expert_parallel`` starts ``ep`` local processes (gloo), joins them in one expert group
(``zbsearch.models.moe.ExpertGroups``) and builds the model there with its experts sharded over
it. Every process then profiles the stages one after the other as ``profile_one_device`` does,
each F and B exchanging tokens with the other processes as they will in training, and times
the expert all-to-all calls of each stage's F and B with the runtime's own split passes
(``all_to_all_time``): per stage, ``a_f`` is the median milliseconds of collectives inside one
F (dispatch and combine), ``a_b`` inside one B (their mirrors). They are part of t_f and t_b,
not added to them (and at most them): the schedule's overlapped pairs hide them behind
another pass's compute. Then each stage's ``pair_exposed``: how much of what a pair hides still
costs time, the stage's F and another microbatch's B run at once as the runtime runs a pair,
timed against the two alone (``zbsearch.profiler.pairs``).
The profile of the group's first process is returned, with ``ep`` recorded (in its mesh
section). ``layers_expert_parallel`` measures a model cut into its units the same way, as
``profile_layers`` measures them, and returns the per-layer profile with each unit's ``a_f``,
``a_b`` and the ``ep`` (for ``zbsearch plan`` and ``zbsearch tune``).

Every process runs the same passes in the same order, so each all-to-all meets its peers; the
processes share the machine's cores, as ranks of one node do. On CUDA each process takes a GPU
of its own (NCCL, process r on cuda:r): with fewer GPUs than ``ep`` the processes would share
one and exchange their tokens through the host, timing neither the GPUs' passes nor their
links, so that is refused. The profile's mode says where the group ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..distributed import run_local
from ..errors import ZbError
from ..formats.layers import LayerProfile, UnitKind
from ..formats.profile import Profile, StageCost
from .layers import profile_layers
from .links import LinkModel, estimate_link
from .pairs import pair_rounds
from .run import profile_one_device
from .settings import Settings, resolve_device, resolve_dtype
from .stages import ModelSpec, leaves, run_stage

__all__ = ["profile_expert_parallel", "layers_expert_parallel", "expert_group", "all_to_all_ms"]

S = TypeVar("S", bound=StageCost)


def profile_expert_parallel(build: Callable, ep: int, settings: Settings, *, name: str | None = None,
                            link: LinkModel | None = None) -> Profile:
    """The profile of ``build(groups)`` (a module-level function returning a ``ModelSpec`` with
    its experts sharded over ``groups``) measured on ``ep`` local processes, with each stage's
    ``a_f`` and ``a_b``.

    Raises:
        ZbError: ``ep`` below 2, or a model whose experts do not split over ``ep`` ranks.
    """
    got = _on_group(build, ep, settings, name, link, False, None)
    assert isinstance(got, Profile)
    return got


def layers_expert_parallel(build: Callable, ep: int, settings: Settings, *, kinds: Sequence[UnitKind] | None = None,
                           name: str | None = None, link: LinkModel | None = None) -> LayerProfile:
    """The per-layer profile of ``build(groups)``, whose stages are the model's units (``kinds``:
    theirs, as for ``profile_layers``), measured on ``ep`` local processes, with each unit's
    ``a_f`` and ``a_b`` and the ``ep``.

    Raises:
        ZbError: as ``profile_expert_parallel``, or fewer than two units.
    """
    got = _on_group(build, ep, settings, name, link, True, None if kinds is None else list(kinds))
    assert isinstance(got, LayerProfile)
    return got


def _on_group(build: Callable, ep: int, settings: Settings, name: str | None, link: LinkModel | None, units: bool,
              kinds: list[UnitKind] | None) -> Profile | LayerProfile:
    """What ``_measure`` returns on the group's first process."""
    settings.check()
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 2:
        raise ZbError(f"--ep must be a whole number of at least 2 (expert-parallel processes), not {ep!r}")
    backend, local = expert_group(settings, ep)
    if link is None:
        link = estimate_link(resolve_device(settings.device))
    return run_local(_measure, ep, build, local, name, link, units, kinds, backend=backend,
                     timeout=max(600.0, 20 * settings.timeout))[0]


def expert_group(settings: Settings, ep: int) -> tuple[str, Settings]:
    """The backend of ``ep`` local expert-parallel processes and the settings each measures
    with: gloo on CPU; on CUDA NCCL, process r on cuda:r.

    Raises:
        ZbError: on CUDA, fewer GPUs than ``ep`` (sharing one, the processes would exchange
            their tokens through the host: neither the GPUs' passes nor their links).
    """
    if resolve_device(settings.device).type != "cuda":
        return "gloo", settings
    gpus = torch.cuda.device_count()
    if gpus < ep:
        raise ZbError(f"--ep {ep} on {settings.device}: each expert-parallel process needs a GPU of its own and {gpus} "
                      f"are visible (sharing one, the processes would exchange tokens through the host); profile on "
                      f"{ep} GPUs, or with --device cpu")
    return "nccl", dataclasses.replace(settings, device="cuda")


def _measure(rank: int, world: int, send, build: Callable, settings: Settings, name: str | None,
             link: LinkModel, units: bool, kinds: list[UnitKind] | None) -> Profile | LayerProfile:
    """This process's profile: of the stages, or, with ``units``, of the stages as the units
    (of ``kinds``) of a per-layer profile."""
    from ..models.moe import ExpertGroups

    groups = ExpertGroups.new(range(world))
    spec: ModelSpec = build(groups)
    if units:
        layers = profile_layers(spec, settings, kinds=kinds, name=name, link=link)
        a_f, a_b, exposed = all_to_all_ms(spec, settings)
        return layers.model_copy(update={"units": _within(layers.units, a_f, a_b, exposed), "ep": world,
                                         "name": name or f"{layers.name}-ep{world}"})
    prof = profile_one_device(spec, settings, name=name, link=link)
    where = f"experts over {world} local processes ({torch.distributed.get_backend()})"
    a_f, a_b, exposed = all_to_all_ms(spec, settings)
    mesh = prof.made_for.model_copy(update={"ep": world})
    return prof.model_copy(update={"stages": _within(prof.stages, a_f, a_b, exposed), "mesh": mesh,
                                   "name": name or f"{prof.name}-ep{world}", "mode": f"{prof.mode}, {where}"})


def _within(stages: list[S], a_f: list[float], a_b: list[float], exposed: list[float | None]) -> list[S]:
    """Each stage (or unit) with its all-to-all, at most the pass it is part of (timed in passes
    of their own, on a loaded machine a wait for a peer can outlast the pass it is part of in
    the profile's timing), and the share of it a pair leaves exposed (none where it has none)."""
    def least(st: S, names: tuple[str, ...]) -> float:
        return min(t for t in (getattr(st, n) for n in names) if t is not None)

    return [st.model_copy(update={"a_f": min(f, least(st, ("t_f", "t_ff", "t_fc", "t_r", "t_rf"))),
                                  "a_b": min(b, least(st, ("t_b", "t_bw"))),
                                  "pair_exposed": e if f > 0 or b > 0 else None})
            for st, f, b, e in zip(stages, a_f, a_b, exposed)]


def all_to_all_ms(spec: ModelSpec, settings: Settings) -> tuple[list[float], list[float], list[float | None]]:
    """Per stage, the median ms of expert all-to-all inside one F and inside one B, run with the
    runtime's split passes (``warmup`` untimed then ``repeat`` timed repetitions), and the share
    of it an overlapped pair leaves exposed (``pair_rounds``; None: nothing to hide); collective:
    every process of the expert group runs it."""
    from ..models.moe import all_to_all_time
    from ..runtime.split import backward_input, backward_weight, forward_pass

    device, dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
    spec.to(device, dtype)
    a_f: list[float] = []
    a_b: list[float] = []
    exposed: list[float | None] = []
    x = spec.microbatch
    with torch.enable_grad():
        for s, stage in enumerate(spec.stages):
            inputs = leaves(x)
            fs, bs = [], []
            for i in range(settings.warmup + settings.repeat):
                with all_to_all_time() as clock:
                    fp = forward_pass(stage, inputs, post=spec.post(s))
                    forward = clock.forward
                    outs = fp.outputs
                    grads = [torch.ones_like(o) if o.requires_grad else None for o in outs]
                    _, w = backward_input(fp, grads)
                    backward = clock.backward
                    backward_weight(w)
                if i >= settings.warmup:
                    fs.append(forward * 1e3)
                    bs.append(backward * 1e3)
            a_f.append(statistics.median(fs))
            a_b.append(statistics.median(bs))
            rounds = pair_rounds([stage], [inputs], [spec.post(s)], None, settings.repeat, settings.warmup, device)
            exposed.append(rounds[0].exposed)
            x = run_stage(spec, s, inputs)
    for stage in spec.stages:
        stage.zero_grad(set_to_none=True)
    return a_f, a_b, exposed
