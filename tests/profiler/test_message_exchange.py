"""The profiler's host time per message: timed through the runtime's own message path, both
directions, every rank of the group taking part (those at neither end only in the barriers)."""

from __future__ import annotations

import torch

from zbsearch.distributed import run_local
from zbsearch.profiler.links import busy_exchange, exchange_plan
from zbsearch.runtime.p2p import P2P

WARMUP, REPEAT = 1, 3


def _exchange(rank: int, world: int, send, src: int, dst: int, with_grad: bool):
    torch.set_num_threads(1)
    # what stage 1 sends: a float activation (a gradient comes back for it when with_grad) and
    # an integer tensor that never has one
    x = torch.arange(12.0).reshape(3, 4).requires_grad_(with_grad)
    ids = torch.arange(5)
    calls = [0]

    def work():
        calls[0] += 1
        return torch.ones(64, 64) @ torch.ones(64, 64)

    comm = P2P(exchange_plan([(1, src, dst)], WARMUP + REPEAT), rank, None, torch.device("cpu"), 60.0)
    comm.start_step()
    lead = True if rank == src else False if rank == dst else None
    got = busy_exchange(comm, 1, [x, ids] if lead is not None else [], lead, work, warmup=WARMUP, repeat=REPEAT)
    comm.finish_step()
    meta = [(m.shape, m.dtype, m.requires_grad) for m in comm.meta.get(1, [])]
    return {k: len(v) for k, v in got.items()}, calls[0], meta


def test_both_directions_are_timed_on_the_runtime_path_and_bystanders_only_wait():
    # the boundary runs from rank 2 down to rank 1 (as a V's way back), rank 0 at neither end
    out = run_local(_exchange, 3, 2, 1, True, timeout=120)
    pairs = 2 * (WARMUP + REPEAT)  # with and without a message, per kind
    sender, receiver, bystander = out[2], out[1], out[0]
    # each end sends one kind and receives the other: activations one way, gradients back
    assert sender[0] == receiver[0] == {"send": REPEAT, "recv": REPEAT}
    assert sender[1] == receiver[1] == 2 * pairs
    assert bystander == ({"send": 0, "recv": 0}, 0, [])
    # the receiver learnt the activations' layout from the runtime's header, flags included
    assert receiver[2] == sender[2] == [((3, 4), torch.float32, True), ((5,), torch.int64, False)]


def test_without_a_gradient_only_activations_travel():
    out = run_local(_exchange, 2, 0, 1, False, timeout=120)
    pairs = 2 * (WARMUP + REPEAT)
    assert out[0][:2] == ({"send": REPEAT, "recv": 0}, pairs)
    assert out[1][:2] == ({"send": 0, "recv": REPEAT}, pairs)
