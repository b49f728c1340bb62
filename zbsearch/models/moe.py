"""Mixture-of-experts layers with expert parallelism, and a built-in GPT whose MLPs are experts.

A ``MoE`` layer routes each token to ``top_k`` of ``experts`` feed-forward experts (a router
Linear, softmax, the top k renormalised) and sums their outputs weighted by the router's
probabilities. Under expert parallelism (``ExpertGroups`` of e ranks) each rank holds E/e of
the experts: the tokens bound for another rank's experts are sent there with one
``all_to_all`` (dispatch) and their outputs come back with another (combine). Both are
autograd functions whose backward is the mirror all-to-all, so gradients are those of one
process holding every expert.

Two process groups over the same ranks carry the collectives: every all-to-all of a forward
(F, or the forward that R repeats) on ``ExpertGroups.forward``, every mirror of a backward (B,
BW) on ``ExpertGroups.backward``. The pipeline runtime runs an overlapped pair's forward and
backward in two threads; since every rank of an expert-parallel group runs the same schedule,
each group sees the same sequence of collectives on every member, and the two never
interleave on one group.

Expert parameters are marked (``is_expert``): they differ between the ranks of an expert group,
so the runtime's data-parallel reduction leaves them out; each holder's gradient already
counts the tokens of every rank of its group.

``all_to_all_time`` measures the seconds this process spends in the all-to-all calls, what the
profiler records as a pass's ``a_f`` / ``a_b``.

Load balancing without an auxiliary loss (DeepSeek-V3, arXiv 2412.19437, section 2.1.2): each
``MoE`` layer adds a per-expert bias to the router's probabilities when it picks the top k (the
weights stay the probabilities), and counts the tokens each expert was given in the step's
training forwards (a recompute pass repeats a forward's routing and is not counted again).
``balance_experts`` after the optimizer step sums the counts over the data-parallel replicas
and moves each bias by ``rate`` towards balance: up for an expert given fewer tokens than the
mean, down for one given more. The bias is not trained and changes no gradient formula, so a
pipeline and one process holding the whole batch route alike and agree step by step.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..errors import ZbError
from ..runtime.data_parallel import is_expert, mark_expert
from ..runtime.recompute import recompute_mode
from .gpt import Attention, Embedding, GPTConfig, Head

__all__ = [
    "ExpertGroups", "MoE", "MoEConfig", "moe_stages", "is_expert", "mark_expert", "expert_parallel", "all_to_all_time",
    "AllToAllClock", "exchange", "shard_hf_experts", "balance_experts", "ExpertLoad",
]

_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True)
class ExpertGroups:
    """The expert-parallel group of this rank: ``size`` ranks, this one at ``rank``; two process
    groups over them, one for the forward passes' all-to-all and one for the backward passes'."""

    forward: dist.ProcessGroup
    backward: dist.ProcessGroup

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return dist.get_world_size(self.forward)

    @property
    def rank(self) -> int:
        """This rank's place in the group."""
        return dist.get_rank(self.forward)

    @classmethod
    def new(cls, ranks: Sequence[int], backend: str | None = None) -> ExpertGroups:
        """Two new groups over ``ranks`` (global ranks). Like ``dist.new_group``, every process
        must call it, in the same order, for every group (``distributed.mesh.expert_groups``
        does, for a mesh)."""
        if len(set(ranks)) != len(ranks):
            raise ZbError(f"expert group ranks repeat: {list(ranks)}")
        fwd = dist.new_group(list(ranks), backend=backend)
        bwd = dist.new_group(list(ranks), backend=backend)
        return cls(fwd, bwd)


class AllToAllClock:
    """Seconds spent in all-to-all calls while it is active (``all_to_all_time``), split into
    forward (dispatch and combine) and backward (their mirrors)."""

    def __init__(self) -> None:
        self.forward = 0.0
        self.backward = 0.0
        self._lock = threading.Lock()

    def add(self, backward: bool, seconds: float) -> None:
        """Count ``seconds`` of one call."""
        with self._lock:
            if backward:
                self.backward += seconds
            else:
                self.forward += seconds


_CLOCKS: list[AllToAllClock] = []


@contextlib.contextmanager
def all_to_all_time() -> Iterator[AllToAllClock]:
    """Within the block, the seconds this process spends in expert all-to-all calls (on a GPU
    the collective's own time: while a clock is active the device is synchronised around each
    call, where NCCL's wait would return before the exchange ran)."""
    clock = AllToAllClock()
    _CLOCKS.append(clock)
    try:
        yield clock
    finally:
        _CLOCKS.remove(clock)


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, backward: bool) -> torch.Tensor:
    """One all_to_all_single: ``send[r]`` rows of ``x`` to rank r, ``recv[r]`` rows from it."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    timed = bool(_CLOCKS) and x.is_cuda  # on a GPU a clock times the device's collective: synchronise around it
    if timed:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    work = dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=True)
    assert work is not None
    work.wait(_COLLECTIVE_TIMEOUT)
    if timed:
        torch.cuda.synchronize(x.device)
    for clock in _CLOCKS:
        clock.add(backward, time.perf_counter() - start)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` exchanged across the expert group; the backward sends the gradients back
    the way they came, on the backward passes' group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], groups: ExpertGroups) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.groups = send, recv, groups
        return _exchange(x, send, recv, groups.forward, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.groups.backward, backward=True), None, None, None


class MoE(nn.Module):
    """Top-k routed feed-forward experts: ``experts`` GELU MLPs of width ``inner``, of which this
    rank holds ``held`` (all of them until ``shard``). (tokens..., hidden) -> the same shape."""

    balance_bias: torch.Tensor  # buffers: the routing bias of ``balance_experts`` and its token counts
    balance_load: torch.Tensor

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ZbError(f"moe: top_k must be between 1 and the {experts} experts, not {top_k}")
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = mark_expert(nn.Parameter(torch.randn(experts, hidden, inner) * hidden ** -0.5))
        self.b_in = mark_expert(nn.Parameter(torch.zeros(experts, inner)))
        self.w_out = mark_expert(nn.Parameter(torch.randn(experts, inner, hidden) * inner ** -0.5))
        self.groups: ExpertGroups | None = None
        self.register_buffer("balance_bias", torch.zeros(experts))
        self.register_buffer("balance_load", torch.zeros(experts), persistent=False)

    @property
    def held(self) -> int:
        """Experts held on this rank."""
        return self.w_in.shape[0]

    def shard(self, groups: ExpertGroups) -> None:
        """Keep only this rank's share of the experts (``size`` consecutive blocks, in rank order)
        and exchange tokens across ``groups`` from now on."""
        size, rank = groups.size, groups.rank
        if self.held != self.num_experts:
            raise ZbError("moe: the experts are already sharded")
        if self.num_experts % size:
            raise ZbError(f"moe: {self.num_experts} experts do not split over an expert group of {size} ranks")
        n = self.num_experts // size
        keep = slice(rank * n, (rank + 1) * n)
        for name in ("w_in", "b_in", "w_out"):
            old = getattr(self, name)
            setattr(self, name, mark_expert(nn.Parameter(old.detach()[keep].clone(), requires_grad=old.requires_grad)))
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each token through its top-k experts, weighted by the router."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(-1)
        chosen = (probs.detach() + self.balance_bias).topk(self.top_k, dim=-1).indices
        weight = probs.gather(-1, chosen)
        weight = weight / weight.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.training and recompute_mode() != "recompute":
            self.balance_load += counts.to(self.balance_load.dtype)
        ys = self._experts(x[token], counts)
        out = torch.zeros_like(x).index_add(0, token, ys * weight.reshape(-1)[order].unsqueeze(-1))
        return out.reshape(shape)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by global expert (``counts`` per expert) -> their experts' outputs."""
        return exchange(rows, counts, self.groups, self.held, self._local)

    def _local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by the held experts (``counts`` each) through them."""
        outs = []
        for e, part in enumerate(rows.split(counts)):
            outs.append(F.gelu(part @ self.w_in[e] + self.b_in[e]) @ self.w_out[e])
        return torch.cat(outs) if outs else rows


@dataclass(frozen=True)
class ExpertLoad:
    """One ``MoE`` layer's step, as ``balance_experts`` saw it: the tokens each expert was given
    over the replicas, and the routing bias after the update."""

    name: str
    tokens: list[int]
    bias: list[float]

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean (1 when balanced; 0 with no tokens)."""
        total = sum(self.tokens)
        return max(self.tokens) * len(self.tokens) / total if total else 0.0


@torch.no_grad()
def balance_experts(modules: nn.Module | Sequence[nn.Module], rate: float,
                    groups: dist.ProcessGroup | Sequence[dist.ProcessGroup] = ()) -> list[ExpertLoad]:
    """Call after each optimizer step on every rank: the ``MoE`` layers of ``modules`` (this
    rank's stages) sum the tokens their experts were given since the last call over ``groups``
    (the data-parallel groups of this pipeline position: every rank holding a copy of these
    stages, expert-group peers included; none for one process), move each expert's routing bias
    by ``rate`` towards balance (up where an expert was given fewer tokens than the mean, down
    where more, as DeepSeek-V3 does) and start counting again. Collective over ``groups``, with
    the same stages in the same order on every member. Returns each layer's load."""
    if not rate >= 0:
        raise ZbError(f"balance_experts: rate must be >= 0, not {rate}")
    group_list = [groups] if isinstance(groups, dist.ProcessGroup) else list(groups)
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    layers = [(f"{i}.{name}" if len(mods) > 1 else name, m)
              for i, mod in enumerate(mods) for name, m in mod.named_modules() if isinstance(m, MoE)]
    if not layers:
        return []
    loads = torch.cat([m.balance_load for _, m in layers])
    for g in group_list:
        if dist.get_world_size(g) > 1:
            work = dist.all_reduce(loads, group=g, async_op=True)
            assert work is not None
            work.wait(_COLLECTIVE_TIMEOUT)
    out, at = [], 0
    for name, m in layers:
        n = m.num_experts
        load = loads[at:at + n]
        at += n
        m.balance_bias += rate * torch.sign(load.mean() - load)
        m.balance_load.zero_()
        out.append(ExpertLoad(name, [int(v) for v in load.tolist()], m.balance_bias.tolist()))
    return out


def exchange(rows: torch.Tensor, counts: torch.Tensor, groups: ExpertGroups | None, held: int,
             local: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """Rows grouped by global expert (``counts`` rows for each) through their experts, in the
    same order: ``local(rows, per_expert)`` runs the ``held`` experts of this rank on its rows
    grouped by expert. Across ``groups`` (rank r holds experts r*held ... (r+1)*held - 1) the
    rows travel there and back with one all-to-all each way, after one of the counts."""
    if groups is None or groups.size == 1:
        return local(rows, counts.tolist())
    size, n = groups.size, held
    send = counts.view(size, n).sum(1).tolist()
    theirs = torch.empty_like(counts)  # from each rank: its rows for each of my experts
    work = dist.all_to_all_single(theirs, counts, group=groups.forward, async_op=True)
    assert work is not None
    work.wait(_COLLECTIVE_TIMEOUT)
    grid = theirs.view(size, n)
    recv = grid.sum(1).tolist()
    got = _AllToAll.apply(rows, send, recv, groups)
    # received: by source rank, then by my expert; grouped by my expert for the matmuls
    label = torch.arange(n, device=rows.device).repeat(size).repeat_interleave(grid.reshape(-1))
    perm = label.argsort(stable=True)
    ys = local(got[perm], grid.sum(0).tolist())
    back = torch.empty_like(ys).index_copy(0, perm, ys)
    return _AllToAll.apply(back, recv, send, groups)


def _hf_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """A Hugging Face experts module's forward across its expert group (``shard_hf_experts``)."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=self.num_experts)

    def local(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs = []
        for e, part in enumerate(rows.split(per_expert)):
            gate, up = F.linear(part, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs)

    ys = exchange(hidden_states[token], counts, self._zbsearch_groups, self.gate_up_proj.shape[0], local)
    ys = ys * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, ys.to(hidden_states.dtype))


def shard_hf_experts(stages: Sequence[nn.Module], groups: ExpertGroups) -> int:
    """Shard the experts of Hugging Face MoE layers (Mixtral, Qwen2-MoE and the other families
    whose experts module holds ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) and is
    called with the router's top-k indices and weights) over ``groups``: each rank keeps its
    share, marked as expert parameters, and the module's forward exchanges the tokens. Cut the
    model first (``hf_stages`` runs it once, with every expert). Returns the modules sharded."""
    size, rank = groups.size, groups.rank
    done = 0
    for stage in stages:
        for m in stage.modules():
            w1, w2 = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
            if not (isinstance(w1, nn.Parameter) and isinstance(w2, nn.Parameter) and w1.dim() == 3
                    and hasattr(m, "num_experts") and hasattr(m, "act_fn")):
                continue
            if getattr(m, "gate_up_proj_bias", None) is not None or getattr(m, "has_bias", False):
                raise ZbError(f"{type(m).__name__}: experts with biases are not supported under expert parallelism")
            total = int(getattr(m, "num_experts"))  # noqa: B009  (an int attribute; nn.Module's typing says otherwise)
            if total % size:
                raise ZbError(f"{type(m).__name__}: {total} experts do not split over {size} ranks")
            n = total // size
            for name, p in (("gate_up_proj", w1), ("down_proj", w2)):
                setattr(m, name, mark_expert(nn.Parameter(p.detach()[rank * n:(rank + 1) * n].clone(),
                                                          requires_grad=p.requires_grad)))
            setattr(m, "_zbsearch_groups", groups)  # noqa: B010
            m.forward = types.MethodType(_hf_experts_forward, m)
            done += 1
            if stage is stages[0]:
                stage.split_first_stage = True  # type: ignore[assignment]  # (``expert_parallel``)
    return done


class MoEBlock(nn.Module):
    """Pre-LayerNorm transformer layer whose MLP is a ``MoE``."""

    def __init__(self, hidden: int, heads: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, 4 * hidden, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> the same shape."""
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """The built-in GPT with ``experts`` experts per layer in place of its MLP, ``top_k`` per token."""

    experts: int = 4
    top_k: int = 2

    def check(self) -> None:
        """Raise a one-line ZbError for a size the model cannot take."""
        super().check()
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ZbError(f"moe: {self.experts} experts and top_k {self.top_k}: need 1 <= top_k <= experts")

    def dense(self) -> GPTConfig:
        """The same sizes without experts."""
        d = asdict(self)
        d.pop("experts"), d.pop("top_k")
        return GPTConfig(**d)

    def units(self) -> MoEConfig:
        """This model cut into its units: the embedding, each layer, the head."""
        return replace(self, stages=self.layers + 2, cut=(0, *([1] * self.layers), 0))


def moe_stages(cfg: MoEConfig, seed: int = 0, groups: ExpertGroups | None = None) -> list[nn.Module]:
    """The model's ``cfg.stages`` stages; the same seed gives the same weights in every process.
    ``groups``: shard every layer's experts over this expert group (``expert_parallel``)."""
    cfg.check()
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    for s, n in enumerate(cfg.layers_per_stage()):
        parts: list[nn.Module] = [Embedding(cfg.vocab, cfg.hidden, cfg.seq)] if s == 0 else []
        parts += [MoEBlock(cfg.hidden, cfg.heads, cfg.experts, cfg.top_k) for _ in range(n)]
        if s == cfg.stages - 1:
            parts.append(Head(cfg.vocab, cfg.hidden))
        stages.append(nn.Sequential(*parts))
    if cfg.layers_per_stage()[0]:  # as ``expert_parallel`` says
        stages[0].split_first_stage = True  # type: ignore[assignment]
    if groups is not None:
        expert_parallel(stages, groups)
    return stages


def expert_parallel(stages: Sequence[nn.Module], groups: ExpertGroups) -> None:
    """Shard every ``MoE`` layer of ``stages`` over ``groups`` (each rank keeps its share of the
    experts). A first stage with experts runs its split backward as other stages do, so that
    its all-to-all mirrors run in B, where the schedule's costs put them."""
    for s, stage in enumerate(stages):
        layers = [m for m in stage.modules() if isinstance(m, MoE)]
        for m in layers:
            m.shard(groups)
        if s == 0 and layers:
            stage.split_first_stage = True  # type: ignore[assignment]
