"""Hierarchical DGC in TensorFlow (hvd_dgc/tensorflow/paths.py HierarchicalPath) on real
Horovod ranks that Horovod places on two hosts: ``horovodrun -H localhost:2,127.0.0.1:2
--gloo`` gives local_size 2 and cross_size 2 on one machine (as
tests/torch/test_hierarchical.py does for PyTorch)."""

import pytest

from harness.hvdrun import launch
from tests.torch.test_optimizer import _checked

WORKER = "tests.tensorflow.tf_dgc:suite"
ALL = ["topology", "density_one", "sparse_steps", "conservation", "nonfinite_skip",
       "auto_choice", "delayed", "bad_inputs"]
ENV = {"TF_USE_LEGACY_KERAS": "1"}  # Horovod's own Keras optimizer (the reference): Keras 2


def _names(names):
    return {"names": ["tf_hierarchical." + n for n in names]}


@pytest.fixture(scope="module")
def two_by_two():
    job = launch(WORKER, 4, "gloo", _names(ALL), 600, ENV, launcher_args=[
        "-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo"])
    missing = [r for r in range(4) if r not in job.results]
    if job.returncode != 0 or missing:
        raise RuntimeError(f"hierarchical run (2 x 2) failed, ranks {missing} wrote no "
                           f"result:\n{job.output()}")
    return [job.results[r] for r in range(4)]


@pytest.fixture(scope="module")
def one_host():
    job = launch(WORKER, 2, "gloo", _names(["topology", "bad_inputs"]), 300, ENV)
    assert job.returncode == 0, job.output()
    return [job.results[r] for r in range(2)]


def _scenario(results, name):
    return _checked(results, "tf_hierarchical." + name)


def test_two_hosts_of_two_ranks(two_by_two):
    for rank, topo in enumerate(_scenario(two_by_two, "topology")):
        assert (topo["local_size"], topo["cross_size"]) == (2, 2), topo
        assert topo["cross_rank"] == rank // 2, topo


def test_density_one_hierarchical_equals_flat_and_horovods_tape_and_keras(two_by_two):
    """Every tensor forced hierarchical at density 1: the tape's averages are Horovod's
    (within float rounding: the host's sum, then the hosts'), and Keras' SGD momentum,
    held by the slice owners' memory, is Horovod's Keras optimizer's; bit-identical
    ranks after every step."""
    for out in _scenario(two_by_two, "density_one"):
        tape = out["tape"]
        assert tape["moved"] > 1e-2, "the reference did not train: comparison is empty"
        assert tape["hierarchical_vs_dense"] < 1e-6 and tape["hierarchical_vs_flat"] < 1e-6, tape
        assert all(tape["identical"]) and len(tape["identical"]) == 8
        assert tape["paths"] == {"hierarchical": 6 * 8}, tape["paths"]
        keras = out["keras"]
        assert keras["max_diff"] < 1e-5, keras
        assert all(keras["identical"]) and len(keras["identical"]) == 8
        assert keras["paths"] == {"hierarchical": 6 * 8}, keras["paths"]


def test_sparse_ranks_bit_identical_and_a_host_sends_half_of_flat_dgcs_records(two_by_two):
    """0.1%, every tensor sparse: every rank holds the same weights after every step; the
    records a host sends across are at most half of flat DGC's (its two ranks each send
    their slice's share of k, rounded up: at most one record more per slice)."""
    for out in _scenario(two_by_two, "sparse_steps"):
        for method, path in (("hierarchical", "hierarchical"), ("allgather", "sparse")):
            res = out[method]
            assert all(res["identical"]) and len(res["identical"]) == 10, method
            assert res["moved"] > 1e-3, res
            assert res["paths"] == {path: 60}, res["paths"]
        slack = 6 * 2  # six tensors, two slices each, one record more
        hier, flat = out["hierarchical"]["host_records"], out["allgather"]["host_records"]
        assert hier <= flat / 2 + slack and hier < flat / 1.5, (hier, flat)


def test_error_feedback_with_slice_owned_residuals_conserves_everything(two_by_two):
    """sum over ranks of (residual after - before - gradient) + N x average == 0: what a
    host did not send stays in the memory of the rank owning that slice, which holds
    that slice only."""
    for rank, out in enumerate(_scenario(two_by_two, "conservation")):
        assert max(out["errors"]) <= 1e-5 * out["scale"], out["errors"]
        assert out["peers"] == ([0, 1] if rank < 2 else [2, 3]), out["peers"]
        # the two large weights (2560, 16384) held in halves, the small tensors whole
        assert out["sizes"] == [1280, 128, 8192, 128, 640, 5], out["sizes"]
        assert out["stats"]["paths"] == {"hierarchical": 12, "dense": 24}, out["stats"]


def test_nonfinite_on_one_rank_skips_the_step_on_every_host(two_by_two):
    for out in _scenario(two_by_two, "nonfinite_skip"):
        skipped = [s["skipped"] for s in out["steps"]]
        assert skipped == [False, False, True, False], out
        assert out["steps"][2]["memory_same"] and out["steps"][2]["step_moved"] == 0, out
        assert not out["steps"][3]["memory_same"] and out["steps"][3]["step_moved"] == 1
        assert out["nonfinite_steps"] == 1


def test_auto_chooses_hierarchical_per_tensor_by_the_cost_model(two_by_two):
    """At 0.1% over 100 Mbit/s the cost model sends the large weights hierarchically,
    the whole warm-up through (a tensor cannot move between slice-owned and whole
    residuals), with delay as without; at 1 Gbit/s and with "flat" none."""
    for out in _scenario(two_by_two, "auto_choice"):
        chosen = [set(stages) for stages in out["auto"]["stages"]]
        assert {"hierarchical"} in chosen, out["auto"]
        assert all(len(s) == 1 or "hierarchical" not in s for s in chosen), chosen
        assert out["auto_delay"]["stages"] == out["auto"]["stages"], out["auto_delay"]
        for tag in ("auto_1gbit", "flat"):
            assert all("hierarchical" not in s for s in out[tag]["stages"]), (tag, out[tag])
        assert len(out["auto"]["peers"]) == 2 and out["flat"]["peers"] == []


def test_delayed_averaging_over_hierarchical_dgc_flushes_to_identical_ranks(two_by_two):
    """D=2: the host's sums in the step, the allgather across hosts delayed; a NaN on
    rank 1 dropped (it sends zeros to its host; nobody waits). After the flush every
    rank holds the same weights."""
    for rank, out in enumerate(_scenario(two_by_two, "delayed")):
        for tag in ("sparse", "dense"):
            res = out[tag]
            assert res["in_flight"] == 2 and res["after"] == 0, res
            assert res["identical"] and res["finite"] and res["moved"] > 1e-3, res
            assert res["paths"] == {"hierarchical": 6 * 6}, res
        assert out["sparse"]["nonfinite_steps"] == (1 if rank == 1 else 0), out["sparse"]


def test_forced_hierarchical_that_cannot_run_says_why(two_by_two, one_host):
    bad = _scenario(two_by_two, "bad_inputs")[0]
    for tag, words in (("period", "period=2"), ("adam", "in TensorFlow it does not run with "
                                                       "Adam")):
        err = bad[tag]
        assert err["type"] == "ValueError", err
        assert "aggregation='hierarchical'" in err["message"] and words in err["message"] \
            and "aggregation='auto'" in err["message"], err
    single = _scenario(one_host, "bad_inputs")[0]["single_host"]
    assert single["type"] == "ValueError", single
    assert "several hosts of several ranks" in single["message"] and \
        "local_size=2" in single["message"], single
