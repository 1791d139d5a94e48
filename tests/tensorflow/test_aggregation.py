"""Sparse aggregation on the TensorFlow side on 4 real Horovod ranks (horovodrun
--gloo): region reduce (hvd_dgc/tensorflow/region.py) against the NumPy reference,
against "allgather" and against Horovod's own tape (issue 15)."""

import pytest

from harness.hvdrun import run
from tests.torch.test_optimizer import _checked

SCENARIOS = ["reference_parity", "reference_parity_fp16", "density_one", "conservation", "delayed_conservation",
             "nonfinite_skip", "keras_region", "bad_inputs"]
PATH = {"allgather": "sparse", "region": "region", "region_predivide": "region"}


@pytest.fixture(scope="module")
def four():
    return run("tests.tensorflow.tf_dgc:suite", np=4, controller="gloo",
               env={"TF_USE_LEGACY_KERAS": "0"},
               kwargs={"names": ["tf_aggregation." + s for s in SCENARIOS]}, timeout=600)


def _scenario(four, name):
    return _checked(four, "tf_aggregation." + name)


def test_region_reduce_equals_the_numpy_reference_bit_for_bit(four):
    """The same records, summed by TF's alltoall/allgather and by the reference (which
    hvd_dgc/torch/region.py is tested against too): the sum every rank gets and what
    this rank's region gives back, exactly; unbalanced owners and |sum| ties included."""
    for rank, cases in enumerate(_scenario(four, "reference_parity")):
        for case in cases:
            assert case["total_equal"] and case["returned_equal"], (rank, case)
            assert case["kept"] == case["kept_ref"], (rank, case)


def test_region_reduce_with_fp16_records_equals_the_reference_bit_for_bit(four):
    """fp16 values (6-byte records) in both rounds: the total is the reference's on the
    ranks' fp16 values with the kept sums rounded to fp16, and each owner gives back
    its sums not kept plus the kept ones' rounding (nothing lost), exactly."""
    rounded = 0
    for rank, cases in enumerate(_scenario(four, "reference_parity_fp16")):
        for case in cases:
            assert case["total_equal"] and case["returned_equal"], (rank, case)
            assert case["kept"] == case["kept_ref"], (rank, case)
            rounded += case["rounding_returned"]
    assert rounded > 0  # some kept sums did not fit fp16 exactly, and went back


def test_density_one_every_aggregation_equals_horovods_tape(four):
    for out in _scenario(four, "density_one"):
        for method in ("allgather", "region", "region_predivide"):
            res = out[method]
            assert res["moved"] > 1e-2, "the reference did not train: comparison is empty"
            assert res["max_diff"] < 1e-6, (method, res["max_diff"])
            assert res["identical"], method
            assert res["paths"] == {PATH[method]: 6 * 8}  # every tensor, every step


def test_error_feedback_conserves_what_was_sent(four):
    """sum over ranks of (memory after - before - gradient) + N * average == 0 each step:
    what region reduce's owners did not keep is in their memories (fails by the given
    back amount without memory.give_back); every rank gets the same average."""
    for out in _scenario(four, "conservation"):
        for method in ("allgather", "region"):
            res = out[method]
            assert max(res["errors"]) <= 1e-6 * res["scale"], (method, res["errors"])
            assert all(res["identical"]) and len(res["identical"]) == 6, method
            # 2 weights of >= 1024 elements by the method, the other 4 tensors dense, 6 steps
            assert res["stats"]["paths"] == {PATH[method]: 12, "dense": 24}, res["stats"]
        assert out["allgather"]["stats"]["returned_elements"] == 0
        assert out["region"]["stats"]["returned_elements"] > 0  # re-sparsified
        # region reduce's two rounds send more than the allgather's records; the
        # allgather also carries the 4 dense tensors (901 elements) folded, their
        # indices' 4 bytes each step counted (region reduce does not fold)
        folded = 4 * 901 * 6
        assert out["region"]["stats"]["bytes_sent"] > \
            out["allgather"]["stats"]["bytes_sent"] - folded


def test_delayed_averaging_with_region_reduce_loses_nothing(four):
    """delay=2: owners give back at the correction of step i-D and at the drain; N x
    (everything applied) + the memories == every gradient, nothing left in flight."""
    for out in _scenario(four, "delayed_conservation"):
        assert out["imbalance"] <= 1e-6 * out["scale"], out
        assert out["in_flight"] == 0
        assert out["stats"]["paths"] == {"region": 12, "dense": 24}
        assert out["stats"]["returned_elements"] > 0


def test_nonfinite_step_skipped_everywhere_with_region_reduce(four):
    for out in _scenario(four, "nonfinite_skip"):
        assert [s["skipped"] for s in out] == [False, False, True, False], out
        assert out[2]["memory_same"] and out[2]["returned_same"], out  # give-backs undone
        assert not out[1]["memory_same"] and not out[3]["returned_same"]  # others did move


def test_keras_optimizer_with_region_reduce_keeps_ranks_identical(four):
    for out in _scenario(four, "keras_region"):
        assert all(out["identical"]) and len(out["identical"]) == 6
        assert out["stats"]["paths"].get("region") == 6, out["stats"]  # the 20x128 kernel


def test_aggregation_typos_are_refused_naming_the_choices(four):
    out = _scenario(four, "bad_inputs")[0]
    for tag in ("tape", "keras"):
        assert out[tag]["type"] == "ValueError", out[tag]
        assert "aggregation must be one of ['allgather', 'auto', 'dense', 'flat', " \
            in out[tag]["message"], out[tag]
