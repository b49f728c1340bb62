"""A profile of a mixture-of-experts model on an expert-parallel group: passes and their all-to-all.

``profile_expert_parallel`` starts ``ep`` local processes (gloo), joins them in one expert group
(``zbsearch.models.moe.ExpertGroups``) and builds the model there with its experts sharded over
it. Every process then profiles the stages one after the other as ``profile_one_device`` does,
each F and B exchanging tokens with the other processes as they will in training, and times
the expert all-to-all calls of each stage's F and B with the runtime's own split passes
(``all_to_all_time``): per stage, ``a_f`` is the median milliseconds of collectives inside one
F (dispatch and combine), ``a_b`` inside one B (their mirrors). They are part of t_f and t_b,
not added to them (and at most them): the schedule's overlapped pairs hide them behind
another pass's compute.
The profile of the group's first process is returned, with ``ep`` recorded.

Every process runs the same passes in the same order, so each all-to-all meets its peers; the
processes share the machine's cores, as ranks of one node do.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ..distributed import run_local
from ..errors import ZbError
from ..formats.profile import Profile
from .links import LinkModel, estimate_link
from .run import profile_one_device
from .settings import Settings, resolve_device, resolve_dtype
from .stages import ModelSpec, leaves, run_stage

__all__ = ["profile_expert_parallel", "all_to_all_ms"]


def profile_expert_parallel(build: Callable, ep: int, settings: Settings, *, name: str | None = None,
                            link: LinkModel | None = None) -> Profile:
    """The profile of ``build(groups)`` (a module-level function returning a ``ModelSpec`` with
    its experts sharded over ``groups``) measured on ``ep`` local processes, with each stage's
    ``a_f`` and ``a_b``.

    Raises:
        ZbError: ``ep`` below 2, or a model whose experts do not split over ``ep`` ranks.
    """
    settings.check()
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 2:
        raise ZbError(f"--ep must be a whole number of at least 2 (expert-parallel processes), not {ep!r}")
    if link is None:
        link = estimate_link(resolve_device(settings.device))
    got = run_local(_measure, ep, build, settings, name, link, timeout=max(600.0, 20 * settings.timeout))
    return got[0]


def _measure(rank: int, world: int, send, build: Callable, settings: Settings, name: str | None,
             link: LinkModel) -> Profile:
    from ..models.moe import ExpertGroups

    groups = ExpertGroups.new(range(world))
    spec: ModelSpec = build(groups)
    prof = profile_one_device(spec, settings, name=name, link=link)
    a_f, a_b = all_to_all_ms(spec, settings)
    # timed in passes of their own: on a loaded machine a wait for a peer can outlast the pass it is
    # part of in the profile's timing, and what a pass spends in its all-to-all is part of its time
    stages = [st.model_copy(update={"a_f": min(f, st.t_f), "a_b": min(b, st.t_b)})
              for st, f, b in zip(prof.stages, a_f, a_b)]
    mesh = prof.made_for.model_copy(update={"ep": world})
    return prof.model_copy(update={"stages": stages, "mesh": mesh, "name": name or f"{prof.name}-ep{world}"})


def all_to_all_ms(spec: ModelSpec, settings: Settings) -> tuple[list[float], list[float]]:
    """Per stage, the median ms of expert all-to-all inside one F and inside one B, run with the
    runtime's split passes (``warmup`` untimed then ``repeat`` timed repetitions); collective:
    every process of the expert group runs it."""
    from ..models.moe import all_to_all_time
    from ..runtime.split import backward_input, backward_weight, forward_pass

    device, dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
    spec.to(device, dtype)
    a_f: list[float] = []
    a_b: list[float] = []
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
            x = run_stage(spec, s, inputs)
    for stage in spec.stages:
        stage.zero_grad(set_to_none=True)
    return a_f, a_b
