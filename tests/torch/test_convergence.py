"""Convergence on scikit-learn's digits (ships with the package), 2 ranks under horovodrun
--gloo: DGC at 99.9% sparsity with the paper's warm-up trains as well as dense Horovod, and
so does delayed gradient averaging (delay=4), dense and with DGC."""

import pytest

from harness.hvdrun import run


@pytest.fixture(scope="module")
def runs():
    return run("tests.torch.torch_convergence:compare", np=2,
               kwargs={"epochs": 30, "delay": 4}, timeout=900)


def test_digits_cnn_dgc_within_one_point_of_dense(runs):
    for out in runs:
        dense, dgc = out["dense"], out["dgc"]
        assert dense["accuracy"] > 0.95, "the dense baseline itself did not learn"
        assert dgc["accuracy"] >= dense["accuracy"] - 0.01, out
        assert dense["identical"] and dgc["identical"]
        stats = dgc["stats"]
        assert stats["current_density"] == 0.001
        # warm-up included, the whole run sent under 2% of the coordinates
        assert stats["density"] < 0.02 and stats["compression_ratio"] > 30


def test_digits_cnn_delayed_averaging_within_one_point_of_synchronous(runs):
    for out in runs:
        # each delayed run against the same training without delay
        assert out["dense_delayed"]["accuracy"] >= out["dense"]["accuracy"] - 0.01, out
        assert out["dgc_delayed"]["accuracy"] >= out["dgc"]["accuracy"] - 0.01, out
        # and DGC + DGA stays within 2 points of plain dense Horovod
        assert out["dgc_delayed"]["accuracy"] >= out["dense"]["accuracy"] - 0.02, out
        assert out["dense_delayed"]["identical"] and out["dgc_delayed"]["identical"]
        assert out["dgc_delayed"]["stats"]["density"] < 0.02
