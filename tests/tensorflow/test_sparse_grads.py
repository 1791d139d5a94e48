"""IndexedSlices gradients (an Embedding / tf.nn.embedding_lookup) through
hvd_dgc.tensorflow on 2 real ranks: averaged as Horovod averages them (allgather of
rows and indices, no DGC), held to Horovod's own tape and Keras optimizer on the same
data; sparse_as_dense=True; DGC on the other variables; delay; non-finite steps.

Two launches: Keras 3 (tapes on plain tf.Variables, model.fit against Horovod's
allreduce by hand: Horovod's Keras optimizer does not run there) and Keras 2
(model.fit against Horovod's Keras DistributedOptimizer)."""

import pytest

from harness.hvdrun import run
from tests.torch.test_optimizer import _checked

STEPS = 4  # tape_equivalence / tape_dgc_rows default steps
FIT_STEPS = 8  # keras_fit_equivalence: 32 samples per rank, batch 8, 2 epochs


@pytest.fixture(scope="module")
def keras3():
    return run("tests.tensorflow.tf_sparse:suite", np=2, env={"TF_USE_LEGACY_KERAS": "0"},
               timeout=400, kwargs={
                   "names": ["tape_equivalence", "tape_dgc_rows", "tape_delay_error",
                             "keras_fit_equivalence", "keras_fit_dgc", "keras_delay_error",
                             "keras_nonfinite_embedding"],
                   "kwargs": {"keras_fit_equivalence": {"configs": ["sgd.slices", "adam.slices"]},
                              "keras_nonfinite_embedding": {"kinds": ["adam"]}}})


@pytest.fixture(scope="module")
def keras2():
    return run("tests.tensorflow.tf_sparse:suite", np=2, env={"TF_USE_LEGACY_KERAS": "1"},
               timeout=400, kwargs={
                   "names": ["keras_fit_equivalence", "keras_fit_dgc", "keras_delay_error",
                             "keras_nonfinite_embedding"],
                   "kwargs": {"keras_fit_equivalence": {
                       "configs": ["sgd.slices", "adam.slices", "sgd.dense"]},
                       "keras_nonfinite_embedding": {"kinds": ["sgd"]}}})


@pytest.fixture(params=["keras2", "keras3"])
def launch(request):
    return request.getfixturevalue(request.param)


def _assert_equal_to_horovod(out):
    assert out["max_diff"] <= 1e-5, out
    assert out["moved"] > 1e-2, out  # the run trained: equality is not of two idle runs
    assert out["identical"]


def test_tape_averages_embedding_slices_as_horovods_tape(keras3):
    """(a) density=1.0: weights equal Horovod's DistributedGradientTape, for SGD with
    momentum 0.9 (eager) and Adam (tf.function); the table's gradient stays
    IndexedSlices and takes the sparse_grad path, one per step."""
    for out in _checked(keras3, "tape_equivalence"):
        for config in ("sgd.slices", "adam.slices"):
            _assert_equal_to_horovod(out[config])
            assert out[config]["returned"] == "IndexedSlices", config
            assert out[config]["paths"] == {"dense": 2 * STEPS, "sparse_grad": STEPS}


def test_tape_sparse_as_dense_equals_horovods(keras3):
    """(b) sparse_as_dense=True: densified before the exchange, as Horovod does."""
    for out in _checked(keras3, "tape_equivalence"):
        _assert_equal_to_horovod(out["sgd.dense"])
        assert out["sgd.dense"]["returned"] != "IndexedSlices"
        assert out["sgd.dense"]["paths"] == {"dense": 3 * STEPS}


def test_keras_fit_with_embedding_equals_horovod(launch):
    """(a) model.fit at density=1.0 with an Embedding equals Horovod (its Keras
    optimizer under Keras 2, its allreduce by hand under Keras 3), for SGD with momentum
    0.9 (taken over: the table's momentum comes from the memory's velocity) and Adam."""
    for out in _checked(launch, "keras_fit_equivalence"):
        for config in ("sgd.slices", "adam.slices"):
            _assert_equal_to_horovod(out[config])
            # 3 variables: table (sliced), Dense kernel and bias (dense)
            assert out[config]["paths"] == {"dense": 2 * FIT_STEPS, "sparse_grad": FIT_STEPS}


def test_keras2_fit_sparse_as_dense_equals_horovods_optimizer(keras2):
    """(b) sparse_as_dense=True against Horovod's Keras DistributedOptimizer with
    sparse_as_dense=True (Keras 3's path is the tape's and the fit's above)."""
    for out in _checked(keras2, "keras_fit_equivalence"):
        _assert_equal_to_horovod(out["sgd.dense"])
        assert out["sgd.dense"]["paths"] == {"dense": 3 * FIT_STEPS}


def _assert_compressed(stats, steps):
    assert stats["compression_ratio"] > 5, stats
    assert stats["paths"]["sparse"] > 0 and stats["paths"]["sparse_grad"] == steps, stats
    assert stats["current_density"] == 0.01 and stats["nonfinite_steps"] == 0


def test_tape_dgc_with_embedding_compresses_and_averages_rows(keras3):
    """(c) density=0.01 in tf.function: the large weight goes sparse, ranks stay
    bit-identical, and each step the table's gradient is every rank's rows averaged."""
    for out in _checked(keras3, "tape_dgc_rows"):
        _assert_compressed(out["stats"], STEPS)
        assert out["identical"]
        assert max(out["row_errors"]) < 1e-6, out["row_errors"]
        assert set(out["returned"]) == {"IndexedSlices"}
        assert out["unseen_rows_moved"] == 0.0
        assert out["memory"]["v"][0] == 0 and min(out["memory"]["v"][1:]) > 0  # no residual
        assert out["memory"]["u"] == []  # a tape takes over no momentum


def test_keras_fit_dgc_with_embedding_compresses_and_averages_rows(launch):
    """(c) model.fit, SGD momentum 0.9 taken over, density=0.01: compresses, ranks end
    bit-identical, the first step moves the table by lr * (average of every rank's
    rows), rows nobody looked up never move; the table has a velocity, no residual."""
    for out in _checked(launch, "keras_fit_dgc"):
        _assert_compressed(out["stats"], 1 + 3 * 4)
        assert out["identical"]
        assert out["first_step_moved"] > 1e-4
        assert out["first_step_error"] < 1e-7, out
        assert out["unseen_rows_moved"] == 0.0
        assert out["memory"]["v"][0] == 0 and out["memory"]["v"][1:] == out["numels"][1:]
        assert out["memory"]["u"] == out["numels"]


@pytest.mark.parametrize("where", ["tape", "keras2", "keras3"])
def test_delay_with_an_indexedslices_gradient_names_the_variable_and_the_fix(
        where, keras2, keras3):
    """(d) delay=2: a clear ValueError naming the variable and both ways out."""
    outs = (_checked(keras3, "tape_delay_error") if where == "tape" else
            _checked(keras2 if where == "keras2" else keras3, "keras_delay_error"))
    for out in outs:
        assert out["type"] == "ValueError", out
        message = out["message"]
        assert ("'sp0" if where == "tape" else "embedding") in message, message
        assert "IndexedSlices" in message and "delay=2" in message
        assert "sparse_as_dense=True" in message and "delay=0" in message


def test_keras_nan_in_one_ranks_embedding_gradient_skips_the_step_everywhere(launch):
    """(e) rank 1's table gradient is NaN at the middle of 3 fit steps (the other
    variables' gradients finite): every rank skips it; the run equals, bit for bit,
    the run that never had that step (SGD+momentum under Keras 2: the velocity is
    restored; Adam under Keras 3: the slices pass the skip's tf.cond)."""
    outs = _checked(launch, "keras_nonfinite_embedding")
    for rank, res in enumerate(outs):
        for kind, out in res.items():
            assert out["sliced"]
            assert out["local_finite"] == ([True] * 3 if rank == 0 else [False, True, True])
            assert out["max_diff_vs_run_without_the_step"] == 0.0, out
            assert out["moved"] > 1e-3 and out["finite"] and out["identical"]
            assert out["nonfinite_with_nan"] == 1 and out["nonfinite_without_step"] == 0
            assert out["steps_with_nan"] == out["steps_without_step"] == 2
            assert out["iterations_with_nan"] == out["iterations_without_step"] == 2
