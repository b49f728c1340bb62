"""The cut's mechanism on hand-written causal LMs whose forwards do what real families do, and
what they must not: each supported quirk gives the unsplit model's logits and gradients, each
unsupported one is refused in one line naming it (no transformers needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from zbsearch.errors import ZbError
from zbsearch.models.hf.stages import hf_stages

H, V, N = 8, 13, 4


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, hidden_states, attention_mask=None, gate=None, state=None):
        out = hidden_states + torch.tanh(self.lin(hidden_states)) * attention_mask[..., None].to(hidden_states.dtype)
        if gate is not None:
            out = out * gate
        if state is not None:
            out = out + state
        return (out, out.mean(-1, keepdim=True)) if self.returns_state else out

    returns_state = False


class Toy(nn.Module):
    """A causal LM in the shape of a transformers one; ``quirk`` picks what its forward does."""

    def __init__(self, quirk: str = "plain", tied: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type=f"toy-{quirk}", vocab_size=V, max_position_embeddings=16)
        self.quirk = quirk
        self.embed = nn.Embedding(V, H)
        self.pos = nn.Embedding(16, H)  # learned positions, added to the embedding
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer() for _ in range(N))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.tensor(1.5))  # a bare parameter on the model
        self.table = nn.Embedding(16, 1)  # a frozen position table feeding the layers
        self.table.weight.requires_grad_(False)
        if quirk == "state":
            for layer in self.model.layers:
                layer.returns_state = True

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None):
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        s = h.shape[1]
        pos = torch.arange(s, device=h.device)[None] if position_ids is None else position_ids
        h = (h + self.pos(pos)) * self.scale
        kw = {}
        if self.quirk == "frozen_table":
            kw["gate"] = torch.sigmoid(self.table(pos))
        if self.quirk == "param_context":
            kw["gate"] = torch.sigmoid(self.pos(pos)[..., :1])
        if self.quirk == "value_context":  # context from the hidden state's values: later stages cannot see them
            kw["gate"] = torch.sigmoid(h.detach().sum(-1, keepdim=True))
        if self.quirk == "mutates" and not self.training:  # as RWKV rescales its weights when switching modes
            with torch.no_grad():
                self.scale.mul_(1.0)
        state = None
        rounds = 2 if self.quirk == "twice" else 1
        for _ in range(rounds):
            for layer in self.model.layers:
                out = layer(h, attention_mask=attention_mask, state=state, **kw)
                if self.quirk == "state":
                    h, state = out
                else:
                    h = out
                if self.quirk == "between":
                    h = h * 0.5
        h = self.norm(h)
        logits = F.linear(h, self.embed.weight) if self.quirk == "functional_head" else self.head(h)
        return SimpleNamespace(logits=logits * 0.7)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


def _run(stages, *inputs):
    """Forward through the stages, each input a fresh leaf; backward of a sum of the logits."""
    x, outs, ins = inputs, [], []
    for st in stages:
        y = st(*x)
        y = y if isinstance(y, tuple) else (y,)
        outs.append(y)
        x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in y)
        ins.append(x)
    logits = outs[-1][0]
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    for i in range(len(outs) - 2, -1, -1):
        torch.autograd.backward(outs[i][0], ins[i][0].grad)
    return logits.detach()


@pytest.mark.parametrize("counts", [[1, 1, 1, 1], [2, 0, 2], [0, 4], [4, 0], [1, 0, 0, 3]])
@pytest.mark.parametrize("quirk,tied", [("plain", False), ("plain", True), ("frozen_table", False),
                                         ("functional_head", False)])
def test_supported_quirks_give_the_models_logits_and_gradients(quirk, tied, counts):
    torch.manual_seed(0)
    model = Toy(quirk, tied)
    ids, mask = _batch()
    ref = model(ids, mask).logits
    (ref * torch.linspace(-1, 1, ref.numel()).view_as(ref)).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    cut = hf_stages(model, len(counts), counts)
    assert cut.layers == counts and cut.layer_list == "model.layers"
    assert torch.equal(_run(cut.stages, ids, mask), ref.detach())
    for n, p in model.named_parameters():
        if n in want:
            assert torch.equal(p.grad, want[n]), n
    # every parameter the model trains is held by a stage; one held by several is declared tied
    held: dict[int, list[str]] = {}
    for s, st in enumerate(cut.stages):
        for name, p in st.named_parameters():
            held.setdefault(id(p), []).append(f"{s}.{name}")
    assert all(id(p) in held for n, p in model.named_parameters() if n in want)
    params = {id(p): p for p in model.parameters()}
    assert sorted(cut.tied) == sorted(tuple(v) for k, v in held.items() if len(v) > 1 and params[k].requires_grad)
    tied_expected = tied or quirk == "functional_head"
    assert any("embed.weight" in t[0] for t in cut.tied) == tied_expected


def test_stage_0_keeps_the_embedding_side_and_the_last_the_head_side():
    cut = hf_stages(Toy("plain"), 3)
    first, middle, last = ({n.split(".")[0] for n, _ in st.named_parameters()} for st in cut.stages)
    assert first == {"embed", "pos", "scale", "layers"}
    assert middle == {"layers"}
    assert last == {"layers", "norm", "head"}


def test_position_ids_travel_with_the_hidden_state_when_given():
    model = Toy("plain")
    ids, mask = _batch()
    pos = torch.arange(9).expand(3, 9).flip(1).contiguous() % 16
    cut = hf_stages(model, 2)
    out = cut.stages[0](ids, mask, pos)
    assert len(out) == 3 and out[2] is pos
    assert torch.equal(cut.stages[1](*out), model(ids, mask, position_ids=pos).logits)
    assert len(cut.stages[0](ids, mask)) == 2


@pytest.mark.parametrize("quirk,message", [
    ("between", "changes the hidden state between layers 0 and 1 of model.layers"),
    ("state", "layer 1 of model.layers takes state from layer 0's output"),
    ("param_context", "layer 0 takes gate, computed from parameters outside the layers"),
    ("twice", "no layer list whose layers run once each, in order"),
    ("value_context", "the stages' logits differ by up to"),
    ("mutates", r"its forward changes its parameters in place \(scale\): a stage cannot repeat that"),
])
def test_what_a_stage_cannot_repeat_is_refused_in_one_line(quirk, message):
    with pytest.raises(ZbError, match=message) as err:
        hf_stages(Toy(quirk), 2)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"hf_stages: toy-{quirk} (Toy): ")


def test_a_model_that_is_not_a_causal_lm_of_that_shape_is_refused():
    class NoMask(Toy):
        def forward(self, input_ids=None, inputs_embeds=None):
            return super().forward(input_ids, torch.ones_like(input_ids), inputs_embeds=inputs_embeds)

    with pytest.raises(ZbError, match="its forward takes no attention_mask"):
        hf_stages(NoMask(), 2)
    with pytest.raises(ZbError, match="is not a transformers model"):
        hf_stages(nn.Linear(2, 2), 2)
    multimodal = Toy()
    multimodal.config.vision_config = {}
    with pytest.raises(ZbError, match="a multimodal model"):
        hf_stages(multimodal, 2)
    with pytest.raises(ZbError, match=r"layers_per_stage \[3, 3\] must be 2 counts adding up to the 4 layers"):
        hf_stages(Toy(), 2, [3, 3])
    with pytest.raises(ZbError, match="4 layers cannot fill 5 stages; give layers_per_stage"):
        hf_stages(Toy(), 5)


def test_a_sequence_longer_than_the_positions_is_refused_in_one_line():
    cut = hf_stages(Toy(), 2)
    with pytest.raises(ZbError, match="sequence length 17 exceeds the model's max_position_embeddings = 16"):
        cut.stages[0](torch.zeros(1, 17, dtype=torch.long), torch.ones(1, 17, dtype=torch.long))


def test_the_model_is_left_as_it_was():
    model = Toy("plain")
    before = {n: type(m) for n, m in model.named_modules()}
    flags = {n: m.training for n, m in model.named_modules()}
    model.norm.eval()  # mixed training flags survive the probe
    flags["norm"] = False
    cut = hf_stages(model, 2)
    ids, mask = _batch()
    cut.stages[1](*cut.stages[0](ids, mask))
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(model(ids, mask).logits, model(ids, mask).logits)


def to_meta_except(model: nn.Module, keep: nn.Module) -> None:
    """Put every parameter and buffer of ``model`` that ``keep`` does not hold on the meta
    device: as on a rank whose other stages never left the CPU while its own went to a GPU."""
    held = {id(t) for t in list(keep.parameters()) + list(keep.buffers())}
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for k, t in store.items():
                if t is not None and id(t) not in held:
                    store[k] = nn.Parameter(t.to("meta"), t.requires_grad) if isinstance(t, nn.Parameter) else t.to("meta")


@pytest.mark.parametrize("stage", [1, 2])
def test_a_later_stage_runs_nothing_it_does_not_hold(stage):
    torch.manual_seed(0)
    model = Toy("frozen_table", tied=True)
    ids, mask = _batch()
    cut = hf_stages(model, 3)
    ins, x = [], (ids, mask)
    for st in cut.stages:
        ins.append(x)
        x = st(*x)
        x = tuple(t.detach() for t in x) if isinstance(x, tuple) else (x.detach(),)
    want = x if stage == 2 else cut.stages[stage](*ins[stage])
    to_meta_except(model, cut.stages[stage])
    got = cut.stages[stage](*ins[stage])
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
