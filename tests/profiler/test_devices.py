"""Which device the profiler measures on: a CUDA device it resolves is the current one (a GPU
faked on CPU: the calls torch makes are recorded, no kernel runs)."""

from __future__ import annotations

import random
import warnings

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


def test_torchs_warning_of_a_missing_cuda_context_is_not_shown_once_a_device_is_resolved(monkeypatch):
    """Autograd's device thread warns at its first cuBLAS call even with the device current
    (seen on an H200, torch 2.11), then sets the context itself: resolving a device silences
    exactly that warning, and only it."""
    _FakeCuda(1, 0).install(monkeypatch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resolve_device("cuda")
        warnings.warn("Attempting to run cuBLAS, but there was no current CUDA context! Attempting to set the "
                      "primary context...", UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another warning"]


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


def _tiny_gpt():
    from zbsearch.models import GPTConfig
    from zbsearch.profiler import builtin_gpt

    return builtin_gpt(GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64, microbatch_size=2, stages=2))


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize(("replicas", "tp", "words"), [(2, 1, "--dp 2 on cuda"), (4, 1, "--dp 4 on cuda"),
                                                       (None, 2, "--tp 2 on cuda")])
def test_local_groups_on_a_gpu_are_refused_before_any_work(monkeypatch, gpus, replicas, tp, words):
    """Local --dp / --tp processes join a gloo group through the host and would share this
    process's GPU tensors (CUDA IPC): on CUDA they time the host's loopback, not the GPUs'
    links. One line naming what measures them instead, before any stage is measured."""
    from zbsearch.profiler import run

    _FakeCuda(gpus, 0).install(monkeypatch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name in ("profile_one_device", "_reductions_locally"):
        monkeypatch.setattr(run, name, lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr("zbsearch.profiler.tensor_parallel.profile_tensor_parallel",
                        lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(ZbError) as info:
        run.profile_model(_tiny_gpt(), run.Settings(device="cuda"), replicas=replicas, tp=tp)
    text = str(info.value)
    assert words in text and "torchrun" in text and "\n" not in text
    assert ("--dp-bandwidth" in text) == (replicas is not None)


@pytest.mark.parametrize(("gpus", "ep"), [(1, 2), (2, 2), (3, 4), (4, 4), (8, 2)])
def test_an_expert_parallel_group_on_cuda_takes_a_gpu_per_process_or_is_refused(monkeypatch, gpus, ep):
    """On CUDA each expert-parallel process runs on a GPU of its own with NCCL (process r on
    cuda:r); with fewer GPUs than --ep the processes would share one and exchange tokens through
    the host, so it is one clear line, before anything is measured."""
    from zbsearch.profiler import Settings, experts

    _FakeCuda(gpus, 0).install(monkeypatch)
    started = {}

    def fake_run_local(fn, world, build, settings, *args, backend="gloo", timeout=None):
        started.update(world=world, device=settings.device, backend=backend)
        return ["profile"]

    monkeypatch.setattr(experts, "run_local", fake_run_local)
    monkeypatch.setattr(experts, "estimate_link", lambda device: None)
    settings = Settings(device="cuda:0")
    if gpus < ep:
        with pytest.raises(ZbError, match=f"--ep {ep} on cuda:0: each expert-parallel process needs a GPU of its own"):
            experts.profile_expert_parallel(lambda groups: None, ep, settings)
        assert not started
        return
    experts._on_group(lambda groups: None, ep, settings, None, None, False, None)
    assert started == {"world": ep, "device": "cuda", "backend": "nccl"}


def test_an_expert_parallel_group_on_cpu_stays_on_gloo(monkeypatch):
    from zbsearch.profiler import Settings, experts

    started = {}
    monkeypatch.setattr(experts, "run_local", lambda fn, world, build, settings, *a, backend="gloo", timeout=None:
                        started.update(device=settings.device, backend=backend) or ["profile"])
    monkeypatch.setattr(experts, "estimate_link", lambda device: None)
    experts._on_group(lambda groups: None, 2, Settings(device="cpu"), None, None, False, None)
    assert started == {"device": "cpu", "backend": "gloo"}
