"""Host time of messages (the profile's optional ``t_send`` / ``t_recv``): old profiles are
unchanged, and the cost model charges each pass exactly the messages it sends and receives
across ranks, as counted independently by ``dependencies`` (the runtime's message plan)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

import zbsearch as zb
from tests.helpers import make_profile
from zbsearch.costs import CostModel
from zbsearch.dependencies import remote_input, remote_outputs
from zbsearch.formats.edit import updated
from zbsearch.layout import placement


def test_a_profile_without_message_costs_loads_and_costs_what_it_did(tmp_path):
    prof = make_profile(3, t_comm=[0.1, 0.2])
    path = tmp_path / "p.json"
    zb.save_profile(prof, path)
    assert "t_send" not in path.read_text() or '"t_send": null' in path.read_text()
    loaded = zb.load_profile(path)
    assert loaded.t_send is None and loaded.t_recv is None
    with_zero = updated(prof, t_send=0.0, t_recv=[0.0, 0.0])
    assert CostModel.from_profile(loaded, [0, 1, 2]) == CostModel.from_profile(with_zero, [0, 1, 2])
    assert loaded.compute_only() == loaded


@pytest.mark.parametrize("bad", [{"t_send": [0.1]}, {"t_recv": -0.1}, {"t_send": [0.1, -1.0]}])
def test_message_costs_are_checked_like_link_times(bad):
    doc = make_profile(3).model_dump() | bad
    with pytest.raises(ValidationError):
        zb.Profile.model_validate(doc)


def _cases(n):
    rng = random.Random(3)
    for _ in range(n):
        p = rng.choice([2, 3, 4])
        send = [rng.uniform(0, 0.5) for _ in range(p - 1)]
        recv = [rng.uniform(0, 0.5) for _ in range(p - 1)]
        kind = rng.choice(["1f1b", "zb-h1", "gpipe", "interleaved", "zb-v"])
        prof = make_profile(p, stages=[(rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.2, 1)) for _ in range(p)],
                            t_comm=0.1)
        yield kind, updated(prof, t_send=send, t_recv=recv), rng.choice([p, 2 * p])


@pytest.mark.parametrize("kind,prof,m", list(_cases(30)), ids=lambda x: x if isinstance(x, str) else None)
def test_each_pass_costs_the_messages_it_sends_and_receives_across_ranks(kind, prof, m):
    sched = zb.build_classic(kind, prof, m)
    owner = sched.stage_to_rank
    cost = CostModel.from_profile(prof, owner)
    plain = CostModel.from_profile(prof.compute_only(), owner)
    k = len(owner) // prof.num_stages  # virtual stages per profile stage

    def host(kind_: str, boundary: int) -> float:  # the profile's value for a virtual boundary
        return prof.comm((boundary + 1) // k - 1, kind_) if (boundary + 1) % k == 0 else prof.mean_comm(kind_)

    for row in sched.rank_actions:
        for a in row:
            want = sum(host("t_send", t.boundary) for t in remote_outputs(a, owner))
            got_in = remote_input(a, owner)
            want += host("t_recv", got_in.boundary) if got_in is not None else 0.0
            assert cost.time(a.stage, a.op) - plain.time(a.stage, a.op) == pytest.approx(want, abs=1e-12), a
    # the step is never shorter, and longer by at most all the message time there is
    extra = sum(cost.time(a.stage, a.op) - plain.time(a.stage, a.op) for row in sched.rank_actions for a in row)
    tl, tl0 = zb.simulate(sched.rank_actions, cost), zb.simulate(sched.rank_actions, plain)
    assert tl0.makespan - 1e-9 <= tl.makespan <= tl0.makespan + extra + 1e-9


def test_pieces_of_a_v_profile_pay_only_at_the_boundaries_between_ranks():
    prof = updated(make_profile(4, t_comm=[0.1, 0.0, 0.1]), placement=placement(2, 2, "v"),
                   t_send=[0.3, 0.0, 0.5], t_recv=[0.2, 0.0, 0.4])
    c = CostModel.from_profile(prof, prof.placement)
    # piece 0 -> 1 (rank 0 -> 1), piece 1 -> 2 on rank 1 (local), piece 2 -> 3 (rank 1 -> 0)
    assert c.t_f == pytest.approx((1.3, 1.2, 1.5, 1.4))
    assert c.t_b == pytest.approx((1.2, 1.3, 1.4, 1.5))
    assert c.t_w == pytest.approx((1.0,) * 4)
