"""``--model pkg.mod:fn --model-arg key=value``: typed keyword arguments reach the function."""

from __future__ import annotations

import sys
import textwrap

import pytest

from zbsearch.errors import ZbError
from zbsearch.profiler import load_model, parse_model_args

MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    def sized(width=4, layers=1, scale=1.0, bias=True, name="x"):
        assert isinstance(width, int) and isinstance(scale, float) and isinstance(bias, bool), (width, scale, bias)
        stages = [nn.Sequential(*[nn.Linear(width, width, bias=bias) for _ in range(layers)]) for _ in range(2)]
        return stages, torch.randn(3, width) * scale
""")


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "zb_args_model.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("zb_args_model", None)


def test_values_are_typed():
    assert parse_model_args(["a=8", "b=0.5", "c=true", "d=False", "e=gpt2-tiny", "f=1e-3", "g="]) == {
        "a": 8, "b": 0.5, "c": True, "d": False, "e": "gpt2-tiny", "f": 1e-3, "g": ""}


@pytest.mark.parametrize("bad, words", [(["novalue"], "expected key=value"), (["1x=2"], "expected key=value"),
                                        (["a=1", "a=2"], "given twice")])
def test_bad_arguments(bad, words):
    with pytest.raises(ZbError, match=words):
        parse_model_args(bad)


def test_arguments_reach_the_function(module):
    spec = load_model("zb_args_model:sized", parse_model_args(["width=6", "layers=3", "scale=2.0", "bias=false"]))
    assert spec.microbatch[0].shape == (3, 6)
    assert len(spec.stages[0]) == 3 and spec.stages[0][0].bias is None
    assert spec.settings == {"model": "zb_args_model:sized", "args": {"width": 6, "layers": 3, "scale": 2.0, "bias": False}}


def test_an_unknown_argument_is_a_one_line_error(module):
    with pytest.raises(ZbError, match=r"sized\(depth=2\) raised TypeError: .*unexpected keyword argument 'depth'"):
        load_model("zb_args_model:sized", {"depth": 2})
