"""What a stage adds to the iteration on a data-parallel mesh: the bytes of gradients it
reduces across its replicas, and its optimizer step.

``zbsearch profile --dp N --dp-bandwidth GBS`` prices each stage's reduction as a ring
all-reduce of these bytes (``zbsearch.reductions``) and records the step of torch's AdamW on
the stage's parameters, timed on the profiling device, as its ``t_opt``.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ..formats.profile import Profile
from ..reductions import with_reductions

__all__ = ["gradient_bytes", "optimizer_step_ms", "with_data_parallel"]


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    """The module's parameters that get gradients, each once (a tied weight is one parameter)."""
    return [p for p in module.parameters() if p.requires_grad]


def gradient_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> float:
    """Bytes of the gradients ``module`` reduces: its trainable parameters' elements in
    ``dtype`` (None: each parameter's own)."""
    return float(sum(p.numel() * (dtype or p.dtype).itemsize for p in _trainable(module)))


def optimizer_step_ms(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None, *,
                      warmup: int = 2, repeat: int = 5) -> float:
    """Median time (ms) of an AdamW step over copies of ``module``'s trainable parameters on
    ``device`` (in ``dtype``; None: their own), with gradients in place."""
    params = [nn.Parameter(p.detach().to(device=device, dtype=dtype or p.dtype).clone()) for p in _trainable(module)]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + repeat):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def with_data_parallel(profile: Profile, stages: list[nn.Module], replicas: int, bandwidth_gbs: float,
                       device: torch.device, dtype: torch.dtype | None = None) -> Profile:
    """``profile`` whose stages end the iteration with the ring all-reduce of their gradients
    across ``replicas`` at ``bandwidth_gbs`` GB/s per rank, then their AdamW step (timed here)."""
    grads = [gradient_bytes(m, dtype) for m in stages]
    steps = [optimizer_step_ms(m, device, dtype) for m in stages]
    return with_reductions(profile, replicas, bandwidth_gbs, grads, t_opt=steps)
