"""A Hugging Face model cut into units for the per-layer profiler, and a plan's cut of it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from zbsearch.models.hf import build  # noqa: E402


def test_units_are_the_embedding_each_layer_and_the_head_and_a_cut_joins_them():
    stages, microbatch, loss, labels = build("gpt2-tiny", units=True)
    assert len(stages) == 8 + 2
    x = microbatch
    for st in stages:
        x = st(*x)
        x = x if isinstance(x, tuple) else (x,)
    whole, *_ = build("gpt2-tiny", stages=3, layers_per_stage=[0, 8, 0])
    y = microbatch
    for st in whole:
        y = st(*y)
        y = y if isinstance(y, tuple) else (y,)
    assert (x[0] == y[0]).all()
