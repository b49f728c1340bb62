"""Tied parameters (one weight used by several stages, e.g. GPT-2's embedding and LM head).

Why: in one process a tied weight is one ``Parameter`` and its gradient is the sum of every
use's gradient. Cut into stages on different ranks, each rank holds its own copy and sees only
its own uses: without a sum the copies get partial gradients and drift apart, silently.

A tie is declared by stage-qualified parameter names, ``"stage.path"`` as in
``stages[stage].get_parameter(path)``: ``tied=[("0.wte.weight", "7.lm_head.weight")]`` (a
group may have more than two names). ``TiedParameters`` resolves the names this rank holds,
and after the rank's last action of a step sums each group's gradients: first the distinct
local copies (two stages of one rank, as in V placement, may hold two copies or one shared
``Parameter``; a shared one already has the whole local gradient), then across the ranks that
hold the group, through a private gloo group (``groups.PrivateGloo``), every contribution
added in rank order so every copy gets the same bits. Then every copy holds the gradient the
one-process model has, and an optimizer stepping each copy keeps them equal.

The sum runs after the rank's last action, not at the tied stage's last W: a rank waiting
there could block a peer that still needs one of its later transfers (interleaved placement);
after the last action every transfer of the rank has been posted. Hooks of the stages holding
a tied parameter (``on_stage_done``: the optimizer step) fire after the sum.

``primary(...)``: the copy that counts in a global gradient norm (the one at the lowest
whole-model position, where ``model.parameters()`` yields a shared parameter once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .errors import PipelineError
from .groups import PrivateGloo

__all__ = ["TiedParameters", "parse_tied", "secondary_copies"]


def parse_tied(tied: Sequence[Sequence[str]], num_stages: int | None) -> list[list[tuple[int, str]]]:
    """``[[(stage, path), ...], ...]`` from the declaration, or a one-line error."""
    groups = []
    seen: set[tuple[int, str]] = set()
    for group in tied:
        if isinstance(group, str) or len(group) < 2:
            raise PipelineError(f"tied: each group needs at least two parameter names, got {group!r}")
        parsed = []
        for name in group:
            stage, dot, path = str(name).partition(".")
            if not dot or not stage.isdigit() or not path:
                raise PipelineError(f"tied: {name!r} is not a stage-qualified parameter name like '0.wte.weight'")
            if num_stages is not None and int(stage) >= num_stages:
                raise PipelineError(f"tied: {name!r} names stage {stage} but the schedule has {num_stages} stages")
            if (int(stage), path) in seen:
                raise PipelineError(f"tied: {name!r} appears twice")
            seen.add((int(stage), path))
            parsed.append((int(stage), path))
        groups.append(parsed)
    return groups


def _resolve(stages: Mapping[int, nn.Module], stage: int, path: str) -> nn.Parameter:
    try:
        return stages[stage].get_parameter(path)
    except AttributeError as err:
        raise PipelineError(f"tied: stage {stage} has no parameter {path!r} ({err})") from None


def _position(stages: Mapping[int, nn.Module], param: nn.Parameter) -> tuple[int, int]:
    """(stage, index in the stage's parameters()) of the first place ``param`` appears on this rank."""
    for s in sorted(stages):
        for i, p in enumerate(stages[s].parameters()):
            if p is param:
                return (s, i)
    raise AssertionError("a resolved parameter belongs to a stage")


def secondary_copies(tied: Sequence[Sequence[str]], stages: Mapping[int, nn.Module]) -> set[int]:
    """ids of this rank's tied copies that must not count in a global norm: all but the copy
    at the group's lowest whole-model position (the one-process model counts the weight once)."""
    out: set[int] = set()
    for group in parse_tied(tied, None):
        held = [_resolve(stages, s, path) for s, path in group if s in stages]
        if min(s for s, _ in group) in stages:
            keep = min(held, key=lambda p: _position(stages, p))
            out |= {id(p) for p in held if p is not keep}
        else:
            out |= {id(p) for p in held}
    return out


class TiedParameters:
    """This rank's part of the declared ties: which stages hold them, and the gradient sum."""

    def __init__(
        self, tied: Sequence[Sequence[str]], stages: Mapping[int, nn.Module], stage_to_rank: Sequence[int], timeout: float
    ) -> None:
        self.groups: list[tuple[list[tuple[int, str]], PrivateGloo | None]] = []
        self.stages: set[int] = set()
        self._modules = stages
        for i, group in enumerate(parse_tied(tied, len(stage_to_rank))):
            holders = sorted({stage_to_rank[s] for s, _ in group})
            mine = [_resolve(stages, s, path) for s, path in group if s in stages]
            if not mine:
                continue
            distinct = list({id(p): p for p in mine}.values())
            shapes = {tuple(p.shape) for p in distinct}
            if len(shapes) > 1:
                raise PipelineError(f"tied group {i}: parameters of different shapes {sorted(shapes)}")
            self.stages |= {s for s, _ in group if s in stages}
            gloo = PrivateGloo(f"tied{i}", holders, timeout) if len(holders) > 1 else None
            if gloo is not None:
                theirs = gloo.exchange("declaration", (group, tuple(distinct[0].shape), str(distinct[0].dtype)))
                if any(t != theirs[0] for t in theirs):
                    raise PipelineError(f"tied group {i}: ranks {holders} were given different declarations or shapes: {theirs}")
            # found again at each sum: under fully_shard the stage holds its gathered parameters during a step
            self.groups.append(([(s, path) for s, path in group if s in stages], gloo))

    def close(self) -> None:
        """Release the private groups of the sums (idempotent)."""
        for _, gloo in self.groups:
            if gloo is not None:
                gloo.close()

    @torch.no_grad()
    def reduce(self) -> None:
        """Give every copy of every group the sum of all copies' gradients (None if none has one)."""
        for names, gloo in self.groups:
            copies = list({id(p): p for p in (_resolve(self._modules, s, path) for s, path in names)}.values())
            grads = [p.grad for p in copies if p.grad is not None]
            local = None
            for g in grads:
                local = g.clone() if local is None else local.add_(g)
            if gloo is not None:
                ref = copies[0]
                # [has a gradient (0/1, exact in any float dtype), gradient...] in the gradient's dtype
                grad = local if local is not None else torch.zeros_like(ref)
                flag = torch.tensor([float(local is not None)], dtype=grad.dtype)
                work, got = gloo.all_gather(torch.cat([flag, grad.detach().reshape(-1).cpu()]))
                gloo.wait(work, "the tied-gradient sum")
                local = None
                for g in got:  # rank order: every rank adds the same numbers in the same order
                    if g[0].item():
                        part = g[1:].reshape(ref.shape)
                        local = part if local is None else local.add_(part)
                local = None if local is None else local.to(ref.device)
            if local is None:
                continue
            for p in copies:
                p.grad = local.clone()
