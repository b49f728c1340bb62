"""profile --link-bandwidth / --link-latency: on one device the user gives the link between
ranks (a GPU cluster's NVLink, where this machine has one GPU and could only time its host),
and every boundary costs latency + bytes over bandwidth, in the profile and in its costs."""

from __future__ import annotations

import random

import pytest
import torch

import zbsearch as zb
from tests.helpers import run_main
from zbsearch.costs import CostModel
from zbsearch.formats.layers import load_layers
from zbsearch.profiler import links

_ARGS = ["--builtin", "gpt", "--hidden", "32", "--heads", "2", "--seq", "16", "-b", "2",
         "--warmup", "1", "--repeat", "3", "--rounds", "1", "--threads", "1"]


@pytest.mark.parametrize("seed", range(4))
def test_a_given_link_prices_every_boundary(tmp_path, capsys, seed, monkeypatch):
    monkeypatch.setattr(links, "run_local", lambda *a, **k: pytest.fail("a given link is not estimated"))
    rng = random.Random(seed)
    bandwidth, latency = rng.uniform(1, 900), rng.choice([None, rng.uniform(0, 0.1)])
    stages = rng.choice([2, 3])
    extra = ["--link-bandwidth", f"{bandwidth!r}", *(["--link-latency", f"{latency!r}"] if latency is not None else [])]
    code, _, err = run_main(capsys, "profile", *_ARGS, "--layers", str(stages), "--stages", str(stages), *extra,
                            "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    prof = zb.load_profile(tmp_path / "p.json")
    assert prof.links is not None and prof.links.method == "given"
    assert (prof.links.bandwidth_gb_s, prof.links.latency_ms) == (bandwidth, latency or 0.0)
    assert prof.measured is not None
    sent = prof.measured.boundary_bytes
    want = [(latency or 0.0) + b / (bandwidth * 1e6) for b in sent]
    assert len(sent) == stages - 1 and all(b > 0 for b in sent)
    assert prof.t_comm == pytest.approx(want, rel=1e-12)
    costs = CostModel.from_profile(prof, list(range(stages)))
    assert [costs.comm(b, b + 1) for b in range(stages - 1)] == pytest.approx(want, rel=1e-12)
    assert not any("--link-bandwidth" in w for w in prof.measured.warnings)


def test_a_given_link_lands_in_a_per_layer_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(links, "run_local", lambda *a, **k: pytest.fail("a given link is not estimated"))
    code, _, err = run_main(capsys, "profile", *_ARGS, "--layers", "2", "--per-layer", "--link-bandwidth", "450",
                            "--link-latency", "0.02", "-o", str(tmp_path / "l.json"))
    assert code == 0, err
    layers = load_layers(tmp_path / "l.json")
    assert (layers.link.method, layers.link.bandwidth_gb_s, layers.link.latency_ms) == ("given", 450.0, 0.02)
    nbytes = layers.units[0].output_bytes
    assert layers.link.time_ms(nbytes) == pytest.approx(0.02 + nbytes / 450e6)


@pytest.mark.parametrize(("gpus", "device", "warned"), [(1, "cuda", True), (2, "cuda", False), (0, "cpu", False)])
def test_a_link_estimated_through_the_host_on_a_gpu_says_so(monkeypatch, gpus, device, warned):
    """With one GPU the estimate's two processes talk through the host (gloo over TCP), far
    slower than any GPU interconnect: the link carries a caveat (the profile's warning) that
    names the option giving the real link; with two GPUs (NCCL) or on CPU it does not."""
    used = {}

    def fake_run_local(fn, world, where, backend, timeout):
        used["backend"] = backend
        return [([0.05] * 30, [4.0] * 10), None]

    monkeypatch.setattr(links, "run_local", fake_run_local)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    link = links.estimate_link(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    assert used["backend"] == ("nccl" if gpus >= 2 else "gloo")
    assert link.method == "estimated" and link.latency_ms == 0.05
    assert (link.caveat is not None) == warned
    if warned:
        assert "--link-bandwidth" in link.caveat and "gloo" in link.caveat and "\n" not in link.caveat


def test_under_torchrun_a_given_link_is_refused(tmp_path, capsys, monkeypatch):
    """Under torchrun the links are measured between the ranks: a given one is one line."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run_main(capsys, "profile", *_ARGS, "--link-bandwidth", "100", "-o", str(tmp_path / "x.json"))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "under torchrun the links" in err
    assert not (tmp_path / "x.json").exists()
