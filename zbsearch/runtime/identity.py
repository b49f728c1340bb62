"""What a profile records of the model it measured, so that a runtime can tell it runs that model.

Why: a schedule is solved for the times and memory of one model cut one way, at one sequence
length and microbatch size. Run on another model (another config, another cut) or on other
shapes, it still runs, silently planned for something else. The profiler records, per stage,
a fingerprint of its parameters' names and shapes (not their dtype: ``--dtype`` may cast them,
nor their values: training changes them) and the dtype and shape of one microbatch's inputs
and targets; ``PipelineRuntime`` compares its stages when it is built and the microbatches
it is given at each step, and refuses a mismatch in one line. Profiles without a record (made
by hand, from the paper, or before it was recorded) are not checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .errors import PipelineError

__all__ = ["model_identity", "stage_fingerprint", "signature", "check_stage", "check_batch"]


def stage_fingerprint(stage: nn.Module) -> str:
    """A short hash of the stage's parameter names and shapes, in order."""
    text = ";".join(f"{name}:{tuple(p.shape)}" for name, p in stage.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def signature(value: Any) -> list[list] | None:
    """``[[dtype, shape], ...]`` of a tensor or a tuple of tensors (None for anything else)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        return None
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in items]


def model_identity(stages: Sequence[nn.Module], microbatch: Any, target: Any = None) -> dict:
    """The record a profile keeps: stage fingerprints, a microbatch's inputs and targets."""
    return {"stages": [stage_fingerprint(s) for s in stages], "inputs": signature(microbatch), "target": signature(target)}


def check_stage(identity: dict | None, stage: int, module: nn.Module, profile: str) -> None:
    """Refuse a stage whose parameters (names and shapes) differ from those the profile recorded."""
    if not identity or stage >= len(identity.get("stages") or []):
        return
    if stage_fingerprint(module) != identity["stages"][stage]:
        raise PipelineError(
            f"stage {stage} is not the model the schedule was made for: its parameters (names and shapes) differ from "
            f"those profiled in {profile!r}; profile this model (or pass check_model=False to run it anyway)"
        )


def check_batch(identity: dict | None, key: str, microbatch: Any, profile: str) -> None:
    """``key``: "inputs" (first stage) or "target" (last stage)."""
    want = (identity or {}).get(key)
    if not want:
        return
    got = signature(microbatch)
    if got != want:
        show = lambda sig: ", ".join(f"{d}{tuple(s)}" for d, s in sig) if sig else "none"  # noqa: E731
        raise PipelineError(
            f"the schedule was made for microbatch {key} of {show(want)} (profile {profile!r}), step() was given "
            f"{show(got)}: another sequence length or microbatch size needs its own profile (or check_model=False)"
        )
