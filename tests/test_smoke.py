"""Horovod really runs: 2 ranks, both controllers, both frameworks, real values."""

import pytest

from harness.hvdrun import run


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_torch_allreduce_and_variable_allgather(controller):
    res = run("tests.workers.smoke:torch_collectives", np=2, controller=controller)
    for r, out in enumerate(res):
        assert out["rank"] == r and out["size"] == 2
        assert out["avg"] == [1.5, 15.0]
        # rank 0 sends [0], rank 1 sends [100, 101]: dim 0 differs per rank
        assert out["gathered"] == [0.0, 100.0, 101.0]
        # uint8 records of 6 bytes, 2 + 3 rows: hvd_dgc's sparse payload format
        assert out["packed_shape"] == [5, 6]
        assert out["packed_sum"] == 3 * 6 * 1


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_tf_allreduce_and_variable_allgather(controller):
    res = run("tests.workers.smoke:tf_collectives", np=2, controller=controller)
    for r, out in enumerate(res):
        assert out["rank"] == r and out["size"] == 2
        assert out["avg"] == [1.5, 15.0]
        assert out["gathered"] == [0.0, 100.0, 101.0]
