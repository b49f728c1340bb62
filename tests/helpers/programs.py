"""Random stage modules, written the ways model code is: a generator of small programs.

``Program(rng, where)`` draws a recipe of steps and builds the module that runs it. Steps mix
what the split backward has to get right: ``nn.Linear`` on 2-D, 3-D and 4-D inputs in
several layouts, changed in place afterwards (``mul_``, ``relu_``, ``nn.ReLU(inplace=True)``,
``+=`` ...); in-place changes of an input (legal ones, and one autograd refuses); views;
``torch.utils.checkpoint`` around a few steps (reentrant or not); a Linear applied two or
three times, a weight used by a plain matrix product, a weight tied into a head; buffers;
frozen parameters; ``nn.MultiheadAttention``; 1-D and 2-D convolutions; LayerNorm, RMSNorm,
GroupNorm, BatchNorm; an embedding with ``padding_idx`` (of token ids passed alongside the
hidden state, or as a first stage's input); dropout; top-k routing to experts, combined with
``index_add_``, ``scatter_add_`` or ``index_put_``; bf16 autocast on the CPU; and rarely a
forward that changes one of its own parameters in place.

``where``: ``"first"`` (input: token ids), ``"middle"`` (input: hidden state and ids) or
``"last"`` (a loss in ``post``). ``describe()`` lists the recipe, to read a failing case.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["Program", "B", "T", "D", "V"]

B, T, D, V = 2, 4, 8, 11  # batch, tokens, width, vocabulary

_INPLACE = ["mul_", "relu_", "F.relu(inplace)", "nn.ReLU(inplace)", "+=", "tanh_", "masked_fill_", "clamp_"]
_RANKS = [2, 3, 4]
_LAYOUTS = ["contiguous", "transposed", "strided"]


class Program(nn.Module):
    """One random stage; ``steps`` is the recipe its forward runs."""

    def __init__(self, rng: random.Random, where: str, size: int | None = None, mutate: bool = False) -> None:
        super().__init__()
        self.where = where
        self.linears = nn.ModuleList()
        self.mods = nn.ModuleDict()
        self.register_buffer("gain", torch.linspace(0.5, 1.5, D))
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.steps: list[tuple] = []
        self._n = 0
        self._rng = rng
        self.steps = self._recipe(size if size is not None else rng.randint(3, 8), nested=False)
        if mutate:  # a forward that changes a parameter in place, before its use
            self.steps.insert(rng.randrange(len(self.steps) + 1), ("mutate", self._new_linear(True, False)))
        self.head = nn.Linear(D, V) if where == "last" and rng.random() < 0.5 else None
        self.tie_head = where == "last" and self.head is None and rng.random() < 0.5
        del self._rng

    # -- the recipe ---------------------------------------------------------------------------
    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def _new_linear(self, bias: bool, frozen: bool) -> int:
        lin = nn.Linear(D, D, bias=bias)
        if frozen:
            lin.requires_grad_(False)
        self.linears.append(lin)
        return len(self.linears) - 1

    def _pick_linear(self) -> int:
        rng = self._rng
        if self.linears and rng.random() < 0.3:  # applied again: a parameter used two or three times
            return rng.randrange(len(self.linears))
        return self._new_linear(rng.random() < 0.7, rng.random() < 0.15)

    def _recipe(self, n: int, nested: bool) -> list[tuple]:
        rng = self._rng
        kinds = ["linear"] * 6 + ["inplace-input", "view", "heavy", "elementwise", "norm", "attention", "conv1d",
                                   "conv2d", "embedding", "tied", "dropout", "moe", "activation"]
        if not nested:
            kinds += ["checkpoint", "checkpoint", "autocast"]
        steps: list[tuple] = []
        for _ in range(n):
            kind = rng.choice(kinds)
            if kind == "linear":
                op = rng.choice(_INPLACE + [None, None])
                extra = None
                if op == "nn.ReLU(inplace)":
                    extra = self._name("relu")
                    self.mods[extra] = nn.ReLU(inplace=True)
                steps.append(("linear", self._pick_linear(), rng.choice(_RANKS), rng.choice(_LAYOUTS), op, extra))
            elif kind == "inplace-input":
                steps.append(("inplace-input", rng.random() < 0.1, self._pick_linear()))  # True: one autograd refuses
            elif kind == "view":
                steps.append(("view", rng.choice(["transpose", "split-heads", "chunk-cat", "slice-pad"])))
            elif kind == "heavy":
                name = self._name("m")
                self.register_parameter(name, nn.Parameter(torch.randn(D, D) / D**0.5))
                steps.append(("heavy", name, rng.choice(["matmul", "einsum", "linear-t", "thrice"])))
            elif kind == "elementwise":
                scale, shift = self._name("scale"), self._name("shift")
                self.register_parameter(scale, nn.Parameter(torch.rand(D) + 0.5))
                self.register_parameter(shift, nn.Parameter(torch.randn(D) / 4))
                steps.append(("elementwise", scale, shift, rng.random() < 0.5))
            elif kind == "norm":
                norm = rng.choice(["layer", "rms", "group", "batch"])
                name = self._name(norm)
                self.mods[name] = {"layer": lambda: nn.LayerNorm(D), "rms": lambda: nn.RMSNorm(D),
                                   "group": lambda: nn.GroupNorm(2, D), "batch": lambda: nn.BatchNorm1d(D)}[norm]()
                steps.append(("norm", norm, name))
            elif kind == "attention":
                name = self._name("mha")
                self.mods[name] = nn.MultiheadAttention(D, 2, batch_first=True, bias=rng.random() < 0.7)
                steps.append(("attention", name, rng.random() < 0.5))
            elif kind == "conv1d":
                name = self._name("conv")
                self.mods[name] = nn.Conv1d(D, D, 3, padding=1, groups=rng.choice([1, 2]))
                steps.append(("conv1d", name))
            elif kind == "conv2d":
                name = self._name("conv")
                self.mods[name] = nn.Conv2d(1, 2, 3, padding=1)
                steps.append(("conv2d", name))
            elif kind == "embedding":
                steps.append(("embedding",))
            elif kind == "tied":
                steps.append(("tied",))
            elif kind == "dropout":
                steps.append(("dropout", rng.choice([0.0, 0.2])))
            elif kind == "moe":
                experts = rng.choice([2, 3])
                router = self._name("router")
                self.mods[router] = nn.Linear(D, experts, bias=False)
                names = []
                for _ in range(experts):
                    names.append(self._name("expert"))
                    self.mods[names[-1]] = nn.Sequential(nn.Linear(D, 2 * D), nn.SiLU(), nn.Linear(2 * D, D))
                steps.append(("moe", router, tuple(names), rng.choice([1, 2]), rng.choice(["index_add_", "scatter_add_",
                                                                                           "index_put_"])))
            elif kind == "activation":
                steps.append(("activation", rng.choice(["gelu", "silu", "tanh", "softmax", "sigmoid_"])))
            elif kind == "checkpoint":
                inner = self._recipe(rng.randint(1, 3), nested=True)
                steps.append(("checkpoint", rng.random() < 0.35, tuple(inner)))
            elif kind == "autocast":
                inner = self._recipe(rng.randint(1, 3), nested=True)
                steps.append(("autocast", tuple(inner)))
        return steps

    def describe(self) -> str:
        def lines(steps, indent):
            out = []
            for s in steps:
                if s[0] in ("checkpoint", "autocast"):
                    out.append(" " * indent + f"{s[0]}{'(reentrant)' if s[0] == 'checkpoint' and s[1] else ''}:")
                    out += lines(s[-1], indent + 2)
                else:
                    out.append(" " * indent + " ".join(map(str, s)))
            return out

        return "\n".join([f"{self.where} stage"] + lines(self.steps, 2)
                         + ([f"  head {'tied' if self.tie_head else 'linear' if self.head else 'none'}"]))

    # -- the forward --------------------------------------------------------------------------
    def forward(self, *args):
        if self.where == "first":
            (ids,) = args
            h = self.emb(ids)
        else:
            h, ids = args
        h = self._run(self.steps, h, ids)
        if self.where == "last":
            if self.head is not None:
                return self.head(h)
            return F.linear(h, self.emb.weight) if self.tie_head else h
        return h, ids

    def _run(self, steps, h, ids):
        for step in steps:
            h = getattr(self, "_step_" + step[0].replace("-", "_"))(h, ids, *step[1:])
        return h

    def _step_linear(self, h, ids, k, rank, layout, op, extra):
        lin = self.linears[k]
        x = h
        if layout == "transposed":
            x = x.transpose(0, 1)
        elif layout == "strided":
            x = torch.cat([x, x], -1)[..., ::2]
        shape = x.shape
        if rank == 2:
            x = x.reshape(-1, D)
        elif rank == 4:
            x = x.reshape(shape[0], 2, -1, D)
        u = lin(x)
        if op == "mul_":
            u.mul_(self.gain)
        elif op == "relu_":
            u.relu_()
        elif op == "F.relu(inplace)":
            F.relu(u, inplace=True)
        elif op == "nn.ReLU(inplace)":
            u = self.mods[extra](u)
        elif op == "+=":
            u += x
        elif op == "tanh_":
            u.tanh_()
        elif op == "masked_fill_":
            u.masked_fill_(u > 1.0, 1.0)
        elif op == "clamp_":
            u.clamp_(-2.0, 2.0)
        u = u.reshape(shape)
        if layout == "transposed":
            u = u.transpose(0, 1)
        return h + u

    def _step_inplace_input(self, h, ids, refused, k):
        c = h * 1.0
        if refused:  # the Linear saved c for its backward: autograd refuses the change
            u = self.linears[k](c)
            c.add_(1.0)
            return u + c
        d = c + 1.0  # an add saves nothing: changing c afterwards is legal
        c.mul_(2.0)
        return c + d

    def _step_view(self, h, ids, how):
        if how == "transpose":
            return h.transpose(0, 1).contiguous().transpose(0, 1)
        if how == "split-heads":
            return h.reshape(B, -1, 2, D // 2).transpose(1, 2).reshape(B, 2, -1).reshape(B, -1, D) * 1.0
        if how == "chunk-cat":
            a, b = h.chunk(2, dim=-1)
            return torch.cat([b, a * 0.5], -1)
        return F.pad(h[:, 1:], (0, 0, 0, 1))

    def _step_heavy(self, h, ids, name, how):
        m = getattr(self, name)
        if how == "matmul":
            return h @ m
        if how == "einsum":
            return torch.einsum("btd,de->bte", h, m)
        if how == "linear-t":
            return F.linear(h, m.t())
        return torch.tanh(h @ m) @ m + h @ m.T  # used three times

    def _step_elementwise(self, h, ids, scale, shift, with_buffer):
        h = h * getattr(self, scale) + getattr(self, shift)
        return h * self.gain if with_buffer else h

    def _step_norm(self, h, ids, kind, name):
        mod = self.mods[name]
        if kind == "group":
            return mod(h.transpose(1, 2)).transpose(1, 2)
        if kind == "batch":
            return mod(h.reshape(-1, D)).reshape(h.shape)
        return mod(h)

    def _step_attention(self, h, ids, name, causal):
        mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(1) if causal else None
        a, _ = self.mods[name](h, h, h, need_weights=False, attn_mask=mask)
        return h + a

    def _step_conv1d(self, h, ids, name):
        return h + self.mods[name](h.transpose(1, 2)).transpose(1, 2)

    def _step_conv2d(self, h, ids, name):
        out = self.mods[name](h.unsqueeze(1))  # (B, 2, T, D)
        return h + out.sum(1)

    def _step_embedding(self, h, ids):
        return h + self.emb(ids)

    def _step_tied(self, h, ids):
        logits = F.linear(h, self.emb.weight)
        return h + F.linear(logits.softmax(-1), self.emb.weight.t())

    def _step_dropout(self, h, ids, p):
        return F.dropout(h, p, training=self.training)

    def _step_moe(self, h, ids, router, experts, k, combine):
        flat = h.reshape(-1, D)
        weights, chosen = self.mods[router](flat).softmax(-1).topk(k, dim=-1)
        out = torch.zeros_like(flat)
        for e, name in enumerate(experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = (self.mods[name](flat[rows]) * weights[rows, slot].unsqueeze(-1)).to(out.dtype)
            if combine == "index_add_":
                out.index_add_(0, rows, y)
            elif combine == "scatter_add_":
                out = out.scatter_add(0, rows.unsqueeze(-1).expand(-1, D), y)
            else:
                out.index_put_((rows,), y, accumulate=True)
        return h + out.reshape(h.shape)

    def _step_activation(self, h, ids, how):
        if how == "sigmoid_":
            return (h * 1.0).sigmoid_()
        return {"gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "softmax": lambda x: x.softmax(-1)}[how](h)

    def _step_checkpoint(self, h, ids, reentrant, inner):
        run: Callable = lambda x: self._run(inner, x, ids)  # noqa: E731
        return checkpoint(run, h, use_reentrant=reentrant)

    def _step_autocast(self, h, ids, inner):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self._run(inner, h, ids)
        return out.float()

    def _step_mutate(self, h, ids, k):
        lin = self.linears[k]
        with torch.no_grad():
            lin.weight.clamp_(-10.0, 10.0)  # a weight clamp in forward: the values stay, the version moves
        return h + lin(h)
