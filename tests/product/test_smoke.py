"""Horovod really runs: 2 ranks, both controllers, both frameworks, real values; and each
framework's seam (hvd_dgc/seam.py ``HorovodCollectives``) keeps one contract over it,
checked by one function for both, with ``Alone`` (no Horovod job) beside them."""

import pytest

from harness.hvdrun import run
from hvd_dgc.consistency import check_consistent
from hvd_dgc.linkprobe import probe_link
from hvd_dgc.seam import Alone, host_peers


def _check_seam(res):
    """The seam's contract on 2 ranks of one host (tests/product/smoke.py ``_seam``)."""
    for r, out in enumerate(res):
        seam = out["seam"]
        assert seam["size"] == 2 and seam["ranks"] == [0, 1]
        assert seam["bytes"] == ["", "abc"]  # an empty blob, in rank order
        assert seam["max"] == [1.0, 0.0] and seam["async"] == [10.0]
        assert all(0.0 < t < 10.0 for t in seam["timed"]), seam["timed"]
        assert seam["peers"] == [0, 1]
        # each rank's message names the two settings that differ, rank by rank
        assert seam["refused"].startswith("hvd_dgc: odd was configured differently"), seam
        assert "density: rank 0=0.001, rank 1=0.002" in seam["refused"]
        assert "tensors differ (e.g. \"b\")" in seam["refused"]
        # a line fitted to loopback's timings (how close it is: tests/core/test_linkprobe.py;
        # on a busy machine loopback has been timed at under 1 MB/s)
        alpha, bandwidth = seam["link"]
        assert 0.0 <= alpha < 0.5 and bandwidth > 1e4, seam["link"]
    assert res[0]["seam"]["link"] == res[1]["seam"]["link"]  # agreed: the same numbers


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_torch_allreduce_and_variable_allgather(controller):
    res = run("tests.product.smoke:torch_collectives", np=2, controller=controller)
    for r, out in enumerate(res):
        assert out["rank"] == r and out["size"] == 2
        assert out["avg"] == [1.5, 15.0]
        # rank 0 sends [0], rank 1 sends [100, 101]: dim 0 differs per rank
        assert out["gathered"] == [0.0, 100.0, 101.0]
        # uint8 records of 6 bytes, 2 + 3 rows: hvd_dgc's sparse payload format
        assert out["packed_shape"] == [5, 6]
        assert out["packed_sum"] == 3 * 6 * 1
    _check_seam(res)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_tf_allreduce_and_variable_allgather(controller):
    res = run("tests.product.smoke:tf_collectives", np=2, controller=controller)
    for r, out in enumerate(res):
        assert out["rank"] == r and out["size"] == 2
        assert out["avg"] == [1.5, 15.0]
        assert out["gathered"] == [0.0, 100.0, 101.0]
    _check_seam(res)


def test_alone_is_the_seam_of_one_process():
    """``python -m hvd_dgc.predict`` measures DGC's work with no Horovod job: each
    collective returns this process's own values, the config check passes, the link is
    None (one rank: no link)."""
    alone = Alone()
    assert alone.allgather_bytes(b"xy", "n") == [b"xy"]
    assert alone.wait(alone.max_async([2, 3], "n")) == alone.max([2, 3], "n") == [2.0, 3.0]
    assert host_peers(alone, 5) == (0,)
    check_consistent(alone, {"density": 0.001}, "alone")
    assert probe_link(alone) is None
