"""Placement: the layouts the classic schedules and the solver use."""

import pytest

from zbsearch import ZbError
from zbsearch.layout import placement


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_layouts(p):
    assert placement(p) == placement(p, 1, "v") == list(range(p))
    assert placement(p, 3) == [s % p for s in range(3 * p)]  # rank r holds r, r+p, r+2p
    v = placement(p, 2, "v")
    assert all(v[r] == v[2 * p - 1 - r] == r for r in range(p))  # rank r holds r and 2p-1-r
    for layout in ("looped", "v"):
        for chunks in (1, 2, 3):  # every rank holds `chunks` stages
            got = placement(p, chunks, layout)
            assert sorted(got) == sorted(list(range(p)) * chunks)


def test_bad_requests():
    with pytest.raises(ZbError, match="at least 1"):
        placement(4, 0)
    with pytest.raises(ZbError, match="layout"):
        placement(4, 2, "zigzag")
