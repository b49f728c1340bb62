"""Shared by the runtime and export tests: a tiny model cut into stages, and a way to run ranks.

The model has what the runtime must get right: an embedding, LayerNorm, attention, biases, a
buffer, a Linear applied twice (one parameter used twice in a stage), and a stage boundary of
three tensors, one of them integer (the token ids, which need no gradient).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import torch
from torch import nn

import zbsearch as zb

VOCAB, WIDTH = 13, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Linear(WIDTH, WIDTH)  # applied twice
        self.register_buffer("gain", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, h, skip, ids):
        x = self.ln(h)
        a, _ = self.attn(x, x, x, need_weights=False)
        h = h + a
        h = h + self.mlp(torch.tanh(self.mlp(h))) * self.gain
        return h, 0.5 * skip + h, ids


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, 5, WIDTH) * 0.1)
        self.block = Block()

    def forward(self, ids):
        h = self.emb(ids) + self.pos
        return self.block(h, h, ids)


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, h, skip, ids):
        h, skip, _ = self.block(h, skip, ids)
        return self.head(self.ln(h + skip))


def toy_stages(num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    if num_stages == 1:
        return [nn.Sequential(First(), _Star(Last()))]
    return [First()] + [Block() for _ in range(num_stages - 2)] + [Last()]


class _Star(nn.Module):
    """Calls the wrapped module with a tuple input spread as positional arguments."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, args):
        return self.inner(*args)


def toy_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def toy_batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, 5), generator=g), torch.randint(0, VOCAB, (batch, 5), generator=g)


def reference_step(stages: list[nn.Module], ids, targets) -> torch.Tensor:
    """Loss and gradients of the whole model in one process, the runtime's yardstick."""
    x = (ids,)
    for st in stages:
        x = st(*x)
        x = x if isinstance(x, tuple) else (x,)
    loss = toy_loss(x[0], targets)
    loss.backward()
    return loss.detach()


def uniform_profile(p: int) -> zb.Profile:
    return zb.Profile(
        name="unit",
        memory_unit="activations",
        stages=[zb.StageCost(t_f=1.0, t_b=1.0, t_w=1.0, m_f=1.0, m_b=-0.6, m_w=-0.4)] * p,
    )


def copy_stages(stages):
    return [copy.deepcopy(s) for s in stages]


# -- running ranks ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, results, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException as err:  # report everything: the test decides what was expected
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # skip process-group teardown, which can hang once a peer is gone


def run_ranks(fn, world: int, *args, timeout: float = 120.0, wait_for=None) -> dict[int, tuple[str, object]]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined by gloo on CPU.

    Returns {rank: ("ok", result) or ("error", message)} once the ranks in ``wait_for`` (all by
    default) have reported, every live one has, or ``timeout`` seconds passed; a rank that
    reported nothing (dead or hung) is missing. Every process is gone when this returns.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args), daemon=True) for r in range(world)]
    for pr in procs:
        pr.start()
    wanted = set(range(world) if wait_for is None else wait_for)
    out: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while not wanted <= out.keys() and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                out[rank] = (status, value)
            except queue.Empty:
                if not any(pr.is_alive() for r, pr in enumerate(procs) if r not in out):
                    break
    finally:
        for r, pr in enumerate(procs):
            if r in out:  # it reported and is exiting
                pr.join(timeout=5)
            if pr.is_alive():
                pr.kill()
            pr.join()
    return out


def expect_ok(results: dict, world: int) -> list:
    problems = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    missing = [r for r in range(world) if r not in results]
    assert not problems and not missing, "\n".join(problems) + (f"\nno result from ranks {missing}" if missing else "")
    return [results[r][1] for r in range(world)]
