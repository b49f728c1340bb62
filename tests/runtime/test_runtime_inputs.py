"""What the runtime refuses in one line before a step: microbatches of another size than the
profile's, dict batches, stage-0 inputs that need a gradient it would never give; and the
token-count normalisation's arithmetic against a one-process sum over the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import make_profile
from zbsearch import build_classic
from zbsearch.runtime import PipelineError, PipelineRuntime


def _runtime(microbatch_size=None, **kw):
    prof = make_profile(1).model_copy(update={"microbatch_size": microbatch_size})
    torch.manual_seed(0)
    return PipelineRuntime(build_classic("1f1b", prof, 2), {0: nn.Linear(3, 3)}, lambda out, y: ((out - y) ** 2).sum(), **kw)


def test_microbatch_size_checked_against_the_profile(one_rank):
    rt = _runtime(microbatch_size=2)
    rt.step(torch.randn(4, 3), torch.randn(4, 3))  # 2 microbatches of 2: as profiled
    with pytest.raises(PipelineError, match="microbatches of 3 .*measured with microbatches of 2"):
        rt.step(torch.randn(6, 3), torch.randn(6, 3))


def test_dict_and_grad_inputs_are_refused(one_rank):
    rt = _runtime()
    with pytest.raises(PipelineError, match=r"inputs: a dict \(input_ids\) is not taken"):
        rt.step({"input_ids": torch.randn(4, 3)}, torch.randn(4, 3))
    with pytest.raises(PipelineError, match=r"inputs\[0\] requires grad"):
        rt.step(torch.randn(4, 3, requires_grad=True), torch.randn(4, 3))
    with pytest.raises(PipelineError, match=r"inputs\[1\]: expected a tensor .* got NoneType"):
        rt.step((torch.randn(4, 3), None), torch.randn(4, 3))


def test_token_normalisation(one_rank):
    """loss_fn returns sums; the gradient is that of sum over the batch / counted tokens."""
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    y[0, 1] = -100  # counted out by the default count
    rt = _runtime(loss_normalization="tokens")
    rt.step(x, y)
    torch.manual_seed(0)
    ref = nn.Linear(3, 3)
    (((ref(x) - y) ** 2).sum() / 11).backward()
    torch.testing.assert_close(rt.stages[0].weight.grad, ref.weight.grad)
    with pytest.raises(PipelineError, match="must be 'mean'"):
        _runtime(loss_normalization="sum")
