"""Which device the profiler measures on: a CUDA device it resolves is the current one (a GPU
faked on CPU: the calls torch makes are recorded, no kernel runs)."""

from __future__ import annotations

import random

import pytest
import torch

from zbsearch.errors import ZbError
from zbsearch.profiler.settings import resolve_device


class _FakeCuda:
    """torch.cuda's device bookkeeping for ``count`` GPUs, ``current`` the current one."""

    def __init__(self, count: int, current: int) -> None:
        self.count, self.current = count, current

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device) -> None:
        self.current = torch.device(device).index if isinstance(device, (str, torch.device)) else int(device)


@pytest.mark.parametrize("seed", range(20))
def test_a_resolved_cuda_device_is_made_current(monkeypatch, seed):
    """Whatever names it (cuda, cuda:i, torchrun's local rank), the device returned is the one
    made current, so the first backward's cuBLAS call finds its context; an index past the
    GPUs is one clear error and changes nothing."""
    rng = random.Random(seed)
    cuda = _FakeCuda(rng.randint(1, 8), 0)
    cuda.install(monkeypatch)
    cuda.current = rng.randrange(cuda.count)
    index = rng.randrange(cuda.count + 2)
    name, local = rng.choice([(f"cuda:{index}", None), ("cuda", index), ("cuda", None)])
    want = index if name != "cuda" or local is not None else cuda.current
    before = cuda.current
    if want >= cuda.count:
        with pytest.raises(ZbError, match=f"cuda:{want} requested but only {cuda.count} GPU"):
            resolve_device(name, local)
        assert cuda.current == before
        return
    device = resolve_device(name, local)
    assert device == torch.device("cuda", want) and cuda.current == want


def test_cpu_is_resolved_without_touching_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device on cpu"))
    assert resolve_device("cpu") == torch.device("cpu")
