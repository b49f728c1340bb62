"""The worker: a configuration that runs past its time is stopped, and the next one runs."""

from __future__ import annotations

import time

import pytest

from zbsearch.planner import llama_layers
from zbsearch.tuner import Cluster, Mesh, OptimizerSetup
from zbsearch.tuner.costing import on_cluster
from zbsearch.tuner.evaluate import Task
from zbsearch.tuner.space import Config
from zbsearch.tuner.worker import Worker


@pytest.mark.slow  # two worker processes start, one builds schedules for a second
def test_a_configuration_past_its_time_is_stopped_and_the_next_runs():
    big = llama_layers(40, 1024, 32000, heads=8, seq=512, microbatch_size=1, tflops=100)
    cluster = Cluster(ranks=16, ranks_per_node=16, intra_node_gbs=100.0, inter_node_gbs=10.0)
    opt = OptimizerSetup("adamw")
    # a V of 32 pieces and 256 microbatches: building its first schedules takes far longer than a second
    slow = Config(Mesh(16, 1, 1), 1, 256, "v", "none")
    small = Config(Mesh(2, 8, 1), 1, 4, "one", "none")
    with Worker() as worker:
        worker.start()
        t0 = time.monotonic()
        got = worker.evaluate(Task(slow, on_cluster(big, slow.mesh, cluster), cluster, opt, 0.3, 0.0), 1.0,
                              time.monotonic() + 120)
        waited = time.monotonic() - t0
        assert got is None and waited < 60  # the worker's start (its imports) and one second
        ev = worker.evaluate(Task(small, on_cluster(big, small.mesh, cluster), cluster, opt, 0.3, 0.0), 60.0,
                             time.monotonic() + 120)
        assert ev is not None and ev.status == "costed" and ev.costed.iteration > 0
