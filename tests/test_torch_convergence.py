"""DGC at 99.9% sparsity (with the paper's warm-up) trains as well as dense Horovod:
a small CNN on scikit-learn's digits, 2 ranks under horovodrun --gloo."""

from tests.hvdrun import run


def test_digits_cnn_dgc_within_one_point_of_dense():
    results = run("tests.workers.torch_convergence:compare", np=2, kwargs={"epochs": 30},
                  timeout=600)
    for out in results:
        assert out["dense"] > 0.95, "the dense baseline itself did not learn"
        assert out["dgc"] >= out["dense"] - 0.01, out
        assert out["dense_identical"] and out["dgc_identical"]
        assert out["final_density"] == 0.001
        # warm-up included, the whole run sent under 2% of the coordinates
        assert out["dgc_density"] < 0.02 and out["dgc_ratio"] > 30
