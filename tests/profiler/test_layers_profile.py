"""The per-layer profiler: units measured apart, their sizes, tied parameters, optimizer state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zbsearch.models import GPTConfig
from zbsearch.models.gpt import Block
from zbsearch.planner import Cut, parameter_bytes, stage_profile
from zbsearch.profiler import LinkModel, Settings, as_model, builtin_gpt, profile_layers, profile_one_device, unit_kinds

LINK = LinkModel(0.01, 10.0, "given")
QUICK = Settings(warmup=1, repeat=3, rounds=1, threads=1)
CFG = GPTConfig(layers=2, hidden=32, heads=4, seq=8, vocab=64, microbatch_size=2, stages=2)


def test_units_are_measured_with_their_sizes_and_compose_to_the_stage_memory():
    u = CFG.units()
    spec = builtin_gpt(u)
    layers = profile_layers(spec, QUICK, kinds=unit_kinds(list(u.cut or ())), link=LINK)
    assert layers.names == ["embedding", "layer.0", "layer.1", "head"]
    assert [x.kind for x in layers.units] == ["embedding", "layer", "layer", "head"]
    hidden_bytes = 2 * 8 * 32 * 4  # microbatch x seq x hidden, float32
    assert [x.output_bytes for x in layers.units] == [hidden_bytes] * 3 + [0]
    for unit, module in zip(layers.units, spec.stages):
        assert unit.params == sum(p.numel() for p in module.parameters())
        assert unit.param_bytes == 4 * unit.params and unit.tied == []
    assert layers.comm(0) == pytest.approx(LINK.time_ms(hidden_bytes))
    # the activation memory of a stage is its units' (bytes of tensors saved for backward)
    stages = profile_one_device(builtin_gpt(GPTConfig(**{**CFG.__dict__, "cut": (1, 1)})), QUICK, link=LINK)
    composed = stage_profile(layers, Cut((2, 2), "one"))
    for a, b in zip(composed.stages, stages.stages):
        assert a.m_f == pytest.approx(b.m_f, rel=0.01)


def test_units_measured_with_recomputation_compose_to_what_a_checkpointed_stage_keeps():
    """A stage's kept bytes composed from its units (the first unit's input and the generators'
    state) equal the stage profiler's measurement of the same cut."""
    settings = Settings(warmup=1, repeat=3, rounds=1, threads=1, recompute=True)
    u = CFG.units()
    layers = profile_layers(builtin_gpt(u), settings, kinds=unit_kinds(list(u.cut or ())), link=LINK)
    assert layers.checkpoint_state_bytes == torch.get_rng_state().nbytes
    assert all(x.t_r is not None and x.t_fc is not None and x.m_fc is not None for x in layers.units)
    for cut in ((1, 1), (2, 0)):
        stages = profile_one_device(builtin_gpt(GPTConfig(**{**CFG.__dict__, "cut": cut})), settings, link=LINK)
        composed = stage_profile(layers, Cut((1 + cut[0], cut[1] + 1), "one"))
        assert [a.m_fc for a in composed.stages] == [b.m_fc for b in stages.stages]


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 16)

    def forward(self, ids):
        return self.tok(ids)


class _Head(nn.Module):
    def __init__(self, embed: _Embed) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.weight = embed.tok.weight  # tied
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.norm(x) @ self.weight.t() * self.scale


def test_tied_parameters_are_recorded_once_and_frozen_bytes_apart():
    embed = _Embed()
    mid = nn.Sequential(nn.Linear(16, 16))
    mid[0].bias.requires_grad_(False)
    head = _Head(embed)
    ids = torch.randint(0, 64, (2, 4))
    spec = as_model(([embed, mid, head], ids), "test")
    layers = profile_layers(spec, QUICK, kinds=["embedding", "layer", "head"], link=LINK)
    key = "embedding.tok.weight"
    assert list(layers.tied) == [key] and layers.tied[key].params == 64 * 16
    assert layers.units[0].tied == [key] == layers.units[2].tied and layers.units[0].params == 0
    assert layers.units[2].params == 32  # the norm's weight and bias
    assert layers.units[1].params == 16 * 16 and layers.units[1].frozen_bytes == 16 * 4
    assert layers.units[2].frozen_bytes == 4  # the buffer


def test_optimizer_state_follows_the_rule_torch_keeps():
    block = Block(16, 4)
    params = [p for p in block.parameters()]
    n, nbytes = sum(p.numel() for p in params), sum(p.nbytes for p in params)
    for name, opt in (("sgd", torch.optim.SGD(params, lr=0.1, momentum=0.9)), ("adamw", torch.optim.AdamW(params))):
        block(torch.randn(2, 4, 16)).sum().backward()
        opt.step()
        state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        grads = sum(p.grad.nbytes for p in params)
        assert nbytes + grads + state == parameter_bytes(n, nbytes, name)
        block.zero_grad()


def test_a_planned_cut_builds_the_built_in_models():
    from zbsearch.errors import ZbError
    from zbsearch.models import gpt_stages, llama_stages

    cfg = GPTConfig(**{**CFG.__dict__, "layers": 3, "stages": 3, "cut": (0, 3, 0)})
    for build in (gpt_stages, llama_stages):
        stages = build(cfg)
        assert [len(list(st.children())) for st in stages] == [1, 3, 1]  # embedding; 3 layers; head
    with pytest.raises(ZbError, match=r"the cut \[1, 0, 2\] must be 3 layer counts adding up to 3"):
        GPTConfig(**{**cfg.__dict__, "cut": (1, 0, 2)}).check()
    with pytest.raises(ZbError, match="adding up to 3"):
        GPTConfig(**{**cfg.__dict__, "cut": (1, 1, 0)}).check()
