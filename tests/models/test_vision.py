"""The ViT and the ResNet-style conv stack cut into stages: one step of every schedule kind on
2 gloo ranks gives every parameter the gradient, every microbatch the loss and every
BatchNorm the running statistics of the whole model run microbatch after microbatch in one
process; and the builders refuse what they cannot build in one line."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.toy import uniform_profile
from zbsearch import build_classic
from zbsearch.distributed import run_local
from zbsearch.errors import ZbError
from zbsearch.models import ResNetConfig, ViTConfig, image_batch, image_loss, resnet_stages, vit_stages
from zbsearch.models.resnet import build_resnet
from zbsearch.models.vit import build_vit

M, MB = 4, 2
KINDS = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "solver"]


def _stages(model: str, n: int):
    if model == "vit":
        return vit_stages(ViTConfig(image=16, patch=4, hidden=32, heads=4, layers=4, classes=6, microbatch_size=MB,
                                    stages=n), seed=3)
    return resnet_stages(ResNetConfig(image=16, width=8, groups=2, blocks_per_group=2, classes=6, microbatch_size=MB,
                                      stages=n), seed=3)


def _batch():
    return image_batch(16, 3, 6, M * MB, seed=4)


def _schedule(kind: str, p: int):
    if kind == "solver":
        from zbsearch.solver.solve import solve

        return solve(uniform_profile(p), M, "2p", time_limit=2, milp=False).schedule
    return build_classic(kind, uniform_profile(p), M)


def _state(stages: dict) -> tuple[dict, dict]:
    grads = {f"{s}.{n}": p.grad for s, st in stages.items() for n, p in st.named_parameters()}
    buffers = {f"{s}.{n}": b for s, st in stages.items() for n, b in st.named_buffers()}
    return grads, buffers


def _worker(rank, world, send, out):
    from zbsearch.runtime import PipelineRuntime

    images, labels = _batch()
    for model in ("vit", "resnet"):
        for kind in KINDS:
            schedule = _schedule(kind, world)
            n = schedule.num_stages
            mine = {s: st for s, st in enumerate(_stages(model, n)) if schedule.stage_to_rank[s] == rank}
            with PipelineRuntime(schedule, mine, image_loss if n - 1 in mine else None, timeout=60) as rt:
                losses = rt.step(images if 0 in mine else None, labels if n - 1 in mine else None)
            grads, buffers = _state(mine)
            torch.save(dict(losses=losses, grads=grads, buffers=buffers), os.path.join(out, f"{model}-{kind}-{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vision"))
    run_local(_worker, 2, out, timeout=300)
    return out


def _reference(model: str, n: int):
    """One process, one thread as each rank has (more threads sum weight gradients in another order)."""
    stages = _stages(model, n)
    images, labels = _batch()
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in zip(images.chunk(M), labels.chunk(M)):
            for st in stages:
                x = st(x)
            loss = image_loss(x, y)
            (loss / M).backward()
            losses.append(loss.detach())
    finally:
        torch.set_num_threads(threads)
    return torch.stack(losses), *_state(dict(enumerate(stages)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", ["vit", "resnet"])
def test_every_schedule_kind_equals_one_process(runs, model, kind):
    n = _schedule(kind, 2).num_stages
    ref_losses, ref_grads, ref_buffers = _reference(model, n)
    seen = set()
    for rank in range(2):
        got = torch.load(os.path.join(runs, f"{model}-{kind}-{rank}.pt"))
        if got["losses"] is not None:
            assert torch.equal(got["losses"], ref_losses)
        for name, g in got["grads"].items():
            assert torch.equal(g, ref_grads[name]), f"{model} {kind} {name}"
            seen.add(name)
        for name, b in got["buffers"].items():
            assert torch.equal(b, ref_buffers[name]), f"{model} {kind} {name}"
    assert seen == set(ref_grads)
    if model == "resnet":
        assert any("running_mean" in k for k in ref_buffers)


@pytest.mark.parametrize("build", [build_vit, build_resnet])
def test_builders_follow_the_profilers_contract(build):
    from zbsearch.profiler import as_model

    spec = as_model(build(stages=2, microbatch_size=3), build.__name__)
    assert len(spec.stages) == 2 and spec.microbatch[0].shape[0] == 3
    x = spec.microbatch
    for st in spec.stages:
        x = (st(*x),)
    assert x[0].shape == (3, 10) and spec.loss_fn(x[0], spec.target).ndim == 0


def test_a_model_learns_the_synthetic_task():
    stages = resnet_stages(ResNetConfig(image=16, width=8, groups=2, blocks_per_group=1, classes=6, stages=2), seed=3)
    params = [p for st in stages for p in st.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    first = last = None
    for step in range(30):
        images, labels = image_batch(16, 3, 6, 16, seed=step)
        x = images
        for st in stages:
            x = st(x)
        loss = image_loss(x, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < 0.5 * first


@pytest.mark.parametrize("make,message", [
    (lambda: vit_stages(ViTConfig(image=30, patch=8)), "image size 30 is not a multiple of the patch size 8"),
    (lambda: vit_stages(ViTConfig(hidden=30, heads=4)), "hidden size 30 is not a multiple of the 4 heads"),
    (lambda: vit_stages(ViTConfig(layers=3, stages=4)), "3 blocks cannot fill 4 stages"),
    (lambda: vit_stages(ViTConfig(classes=0)), "classes must be at least 1, not 0"),
    (lambda: resnet_stages(ResNetConfig(image=30, groups=3)), "image size 30 cannot be halved 2 times"),
    (lambda: resnet_stages(ResNetConfig(groups=1, blocks_per_group=2, stages=3)), "2 blocks cannot fill 3 stages"),
])
def test_bad_configs_are_refused_in_one_line(make, message):
    with pytest.raises(ZbError, match=message):
        make()
