import pytest

from tests.helpers import make_profile


@pytest.fixture
def unit4():
    return make_profile(4)
