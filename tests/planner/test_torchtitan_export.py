"""``export --to torchtitan``: the overrides split the model as planned, whatever its units are named.

torchtitan (0.3.0) reads ``--parallelism.module_fqns_per_model_part`` as one token per model part,
each split on commas (its ``ConfigManager``'s rule for a list of strings), and ``pipeline_llm``
builds each part with ``_split_module``: its decoder holds ``tok_embeddings``, ``layers`` (a
``ModuleDict`` keyed ``"0"``, ``"1"``, ... by position), ``norm`` and ``lm_head``; a part keeps the
``layers`` keys its ``layers.*`` names give, none where they name no such key, and any other child
only if named. It says nothing about names it does not know. ``_torchtitan_split`` is that rule;
where torchtitan is installed, its own ``_split_module`` is checked against it too.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import zbsearch as zb
from tests.helpers import run_main as _run
from zbsearch.formats.layers import LayerProfile, save_layers
from zbsearch.planner import llama_layers

_FLAG = "--parallelism.module_fqns_per_model_part"
_TOP = ("tok_embeddings", "norm", "lm_head")


def _named(layers: int, name) -> LayerProfile:
    """A small Llama-like per-layer profile whose i-th decoder layer (from 0) is named ``name(i)``."""
    L = llama_layers(layers, 256, 1000, heads=4, kv_heads=4, ffn=512, seq=64, tflops=100)
    units, i = [], 0
    for u in L.units:
        if u.kind == "layer":
            u, i = u.model_copy(update={"name": name(i)}), i + 1
        units.append(u)
    return L.model_copy(update={"units": units})


def _parts(args: list[str]) -> list[list[str]]:
    """The module names per part as torchtitan's config loading reads them: the tokens after the
    flag up to the next option, each split on commas."""
    i = args.index(_FLAG) + 1
    j = next((k for k in range(i, len(args)) if args[k].startswith("--")), len(args))
    return [tok.split(",") for tok in args[i:j]]


def _torchtitan_split(parts: list[list[str]], num_layers: int) -> list[tuple[list[str], list[str], list[str]]]:
    """Per part: the layer keys, the other children torchtitan's ``_split_module`` keeps, and the
    names it ignores (see the module)."""
    keys = [str(i) for i in range(num_layers)]
    out = []
    for names in parts:
        asked = {n.split(".", 1)[1] for n in names if n.startswith("layers.")}
        kept = [k for k in keys if k in asked]
        tops = [t for t in _TOP if t in names]
        ignored = [n for n in names if n not in _TOP and not (n.startswith("layers.") and n.split(".", 1)[1] in keys)]
        out.append((kept, tops, ignored))
    return out


@pytest.mark.parametrize("layers, placement, name", [
    (4, "one", lambda i: f"block_{i}"),
    (4, "one", lambda i: f"layer_{i + 1}"),  # counted from 1
    (4, "one", lambda i: f"layer.{3 - i}"),  # digits that are not the position
    (8, "v", lambda i: f"layer_{i + 1}"),
], ids=["block_i", "layer_from_1", "reversed_digits", "v"])
def test_torchtitan_splits_renamed_layers_as_planned(tmp_path, monkeypatch, capsys, layers, placement, name):
    monkeypatch.chdir(tmp_path)
    save_layers(_named(layers, name), "layers.json")
    code, _, err = _run(capsys, "plan", "-l", "layers.json", "-r", "2", "-m", "4", "--memory", "none", "-t", "1",
                        "--placement", placement, "-o", "plan.json")
    assert code == 0, err
    part = zb.load_schedule(tmp_path / "plan.json").partition
    assert part is not None and part.placement == placement
    code, text, err = _run(capsys, "export", "plan.json", "--to", "torchtitan", "-o", "tt")  # a relative folder
    assert code == 0, err
    args = shlex.split((tmp_path / "tt" / "args.txt").read_text())
    assert shlex.split(text) == args

    split = _torchtitan_split(_parts(args), layers)
    assert [len(kept) for kept, _, _ in split] == part.layers_per_stage
    assert [k for kept, _, _ in split for k in kept] == [str(i) for i in range(layers)]
    assert [tops for _, tops, _ in split] == [["tok_embeddings"], *[[]] * (len(split) - 2), ["norm", "lm_head"]]
    assert all(not ignored for _, _, ignored in split)
    # the CSV is named so that torchtitan finds it from any folder
    csv = Path(args[args.index("--parallelism.pipeline_parallel_schedule_csv") + 1])
    assert csv.is_absolute() and csv.read_text() == (tmp_path / "tt" / "schedule.csv").read_text()


def test_the_split_rule_is_torchtitans():
    """torchtitan's own ``_split_module`` on a stand-in of its decoder keeps what the rule says."""
    pp = pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="torchtitan is not installed")
    import torch

    class Decoder(torch.nn.Module):  # torchtitan's decoder's children (models/common/decoder.py)
        def __init__(self, n: int) -> None:
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(8, 4)
            self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(n)})
            self.norm = torch.nn.LayerNorm(4)
            self.lm_head = torch.nn.Linear(4, 8)

    parts = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.block_3", "layers.x"],
             ["layers.3", "norm", "lm_head"], ["layers.layer_1", "output"]]
    for names, (kept, tops, _) in zip(parts, _torchtitan_split(parts, 4)):
        chunk = pp._split_module(Decoder(4), names)
        assert list(chunk.layers.keys()) == kept
        assert [t for t in _TOP if getattr(chunk, t) is not None] == tops


def test_units_torchtitan_has_no_module_for_are_refused():
    from zbsearch.planner.torchtitan import torchtitan_modules

    assert torchtitan_modules(["e", "a", "b", "h"], ["embedding", "layer", "layer", "head"]) == {
        "e": ["tok_embeddings"], "a": ["layers.0"], "b": ["layers.1"], "h": ["norm", "lm_head"]}
    for kinds, words in ((["layer", "layer", "head"], "the model's units are layer, head"),
                         (["embedding", "layer", "head", "layer"], "the model's units are embedding, layer, head, layer"),
                         (["embedding", "unit", "head"], "unit 'b' is not an embedding, a decoder layer or a head")):
        with pytest.raises(zb.ZbError, match=words):
            torchtitan_modules(list("abcd"[:len(kinds)]), kinds)
