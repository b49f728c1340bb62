import pytest

from zbsearch import Profile, StageCost


def make_profile(p, t_f=1.0, t_b=1.0, t_w=1.0, m_w=0.4, t_comm=0.0, name="unit", stages=None):
    """A profile with memory in M_B units; ``stages`` overrides the per-stage (t_f, t_b, t_w)."""
    times = stages or [(t_f, t_b, t_w)] * p
    return Profile(
        name=name,
        memory_unit="activations",
        stages=[StageCost(t_f=f, t_b=b, t_w=w, m_f=1.0, m_b=-(1.0 - m_w), m_w=-m_w) for f, b, w in times],
        t_comm=t_comm,
    )


@pytest.fixture
def unit4():
    return make_profile(4)
