import pytest

from tests.helpers import make_profile


@pytest.fixture
def unit4():
    return make_profile(4)


@pytest.fixture
def one_rank():
    """A one-process gloo group (world size 1) for runtime and optimizer tests in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
