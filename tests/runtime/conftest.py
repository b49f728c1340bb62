"""Fixtures of the runtime tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank():
    """A one-rank gloo process group for this test (world size 1)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
