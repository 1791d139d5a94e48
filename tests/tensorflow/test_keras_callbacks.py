"""Horovod's Keras callbacks from hvd_dgc.tensorflow.keras.callbacks in model.fit on 2
real ranks, Keras 2 (tf_keras) and Keras 3, against Horovod's documented behaviour; and
Keras 2 legacy optimizers under hvd_dgc's DistributedOptimizer. One launch per Keras
version (tests/tensorflow/tf_callbacks.py runs every scenario in it)."""

import math

import numpy as np
import pytest

from harness.hvdrun import run
from tests.tensorflow.tf_callbacks import STEPS_PER_EPOCH as SPE

SIZE = 2
GRAD = 1.5  # the 1-weight probe's gradient averaged over ranks (1 and 2)
COMMON = ["signatures", "lr_warmup", "lr_schedule", "lr_refusals", "metric_average", "broadcast_local",
          "best_checkpoint"]
KERAS2_ONLY = ["lr_legacy_momentum_correction", "legacy_sgd_takeover", "legacy_fit_digits"]


def _checked(results, name):
    """Each rank's result of scenario ``name``; a rank that raised fails the test."""
    for rank, out in enumerate(results):
        if isinstance(out[name], dict) and "error" in out[name]:
            pytest.fail(f"rank {rank} raised in scenario {name}:\n{out[name]['error']}")
    return [out[name] for out in results]


@pytest.fixture(scope="module")
def ckdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("best_checkpoint"))


@pytest.fixture(scope="module")
def keras2(ckdir):
    return run("tests.tensorflow.tf_callbacks:suite", np=2, env={"TF_USE_LEGACY_KERAS": "1"},
               timeout=420, kwargs={"names": COMMON + KERAS2_ONLY, "kwargs": {
                   "lr_schedule": {"optimizers": ("keras", "legacy")},
                   "best_checkpoint": {"ckdir": ckdir}}})


@pytest.fixture(scope="module")
def keras3(ckdir):
    return run("tests.tensorflow.tf_callbacks:suite", np=2, env={"TF_USE_LEGACY_KERAS": "0"},
               timeout=420, kwargs={"names": COMMON,
                                    "kwargs": {"best_checkpoint": {"ckdir": ckdir}}})


@pytest.fixture(params=["keras2", "keras3"])
def results(request):
    return request.getfixturevalue(request.param)


def test_horovod_signatures_and_import_paths(results):
    """Every Horovod parameter in its place with its default; hvd_dgc may add keyword
    parameters after them and a default where Horovod requires a value (root_rank=0)."""
    for out in _checked(results, "signatures"):
        assert len(out) == 5
        for name, sig in out.items():
            assert sig["same_object"], name
            ours = sig["hvd_dgc"][:len(sig["horovod"])]
            for (h_name, h_default, _), (o_name, o_default, _) in zip(sig["horovod"], ours):
                assert h_name == o_name, (name, sig)
                assert h_default == o_default or (h_default == "<required>" and
                                                  (name, h_name) == ("BroadcastGlobal"
                                                                     "VariablesCallback",
                                                                     "root_rank")), (name, sig)
            assert all(kind == "KEYWORD_ONLY" for _, _, kind in
                       sig["hvd_dgc"][len(sig["horovod"]):]), (name, sig)


def _steps(probe):
    """The step the optimizer took at each batch (w[t-1] - w[t])."""
    return -np.diff(probe["weights"])


def _warmup_lrs(initial_lr, warmup_epochs, epochs):
    """Horovod's warm-up: lr/size * (e (size-1)/warmup + 1), e = epoch + (batch+1)/spe;
    left at its last value after the warm-up."""
    lrs, lr = [], None
    for epoch in range(epochs):
        for batch in range(SPE):
            if epoch < warmup_epochs:
                e = epoch + (batch + 1) / SPE
                lr = initial_lr / SIZE * (e * (SIZE - 1) / warmup_epochs + 1)
            lrs.append(lr)
    return np.array(lrs)


def _per_epoch_end(lrs):
    return list(np.asarray(lrs)[SPE - 1::SPE])


def test_warmup_learning_rate_at_every_batch(results):
    expected = _warmup_lrs(0.1, 2, 3)
    assert expected[0] == pytest.approx(0.1 / SIZE * (1 + 1 / (SPE * 2)))
    assert expected[2 * SPE - 1] == pytest.approx(0.1)  # the last warm-up batch
    for out in _checked(results, "lr_warmup"):
        np.testing.assert_allclose(out["lr_seen"], expected, rtol=1e-6)
        np.testing.assert_allclose(_steps(out), GRAD * expected, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(out["logged_lr"], _per_epoch_end(expected), rtol=1e-6)


def test_schedule_staircase_between_start_and_end_epoch(results):
    # optimizer built with 0.2; initial_lr 0.1, multiplier 0.5, epochs [1, 3)
    expected = np.repeat([0.2, 0.1, 0.05, 0.05], SPE)
    for out in _checked(results, "lr_schedule"):
        probe = out["staircase"]
        np.testing.assert_allclose(probe["lr_seen"], expected, rtol=1e-6)
        np.testing.assert_allclose(_steps(probe), GRAD * expected, rtol=1e-5, atol=1e-7)


def _smooth_lrs(epochs=2):
    return np.array([0.1 / (1 + e + b / SPE) for e in range(epochs) for b in range(SPE)])


def test_schedule_smooth_with_momentum_matches_horovods_correction(results):
    """Horovod's momentum correction scales Keras' lr-scaled velocity by new/old lr:
    v_t = m (lr_t / lr_(t-1)) v_(t-1) + lr_t g. hvd_dgc's SGD (DGC holds the momentum,
    lr-free) must take exactly those steps."""
    lrs = _smooth_lrs()
    v, prev, expected = 0.0, 0.1, []
    for lr in lrs:
        v = 0.9 * (lr / prev) * v + lr * GRAD
        prev = lr
        expected.append(v)
    uncorrected, v = [], 0.0
    for lr in lrs:  # what a momentum left uncorrected would do: must differ
        v = 0.9 * v + lr * GRAD
        uncorrected.append(v)
    assert np.max(np.abs(np.array(expected) - uncorrected)) > 1e-3
    outs = _checked(results, "lr_schedule")
    kinds = [k for k in outs[0] if k.startswith("smooth_momentum_")]
    assert "smooth_momentum_keras" in kinds  # Keras 2 adds the legacy SGD (asserted below)
    for out in outs:
        for kind in kinds:
            probe = out[kind]
            assert probe["dgc_momentum"] == 0.9
            np.testing.assert_allclose(probe["lr_seen"], lrs, rtol=1e-6)
            np.testing.assert_allclose(_steps(probe), expected, rtol=1e-5, atol=1e-7)


def test_keras2_legacy_optimizer_momentum_corrected_as_horovod(keras2):
    """A legacy RMSprop's momentum variable is scaled by new/old lr for each warm-up
    batch and restored after it; the weights follow RMSprop with that momentum."""
    lrs = _warmup_lrs(0.01, 2, 3)
    momenta, prev = [], 0.01
    for t, lr in enumerate(lrs):
        momenta.append(0.5 * lr / prev if t < 2 * SPE else 0.5)
        prev = lr
    ms = mom = 0.0
    expected = []
    for lr, m in zip(lrs, momenta):  # tf_keras legacy RMSprop (ResourceApplyRMSProp)
        ms = 0.9 * ms + 0.1 * GRAD ** 2
        mom = m * mom + lr * GRAD / math.sqrt(ms + 1e-7)
        expected.append(mom)
    for out in _checked(keras2, "lr_legacy_momentum_correction"):
        np.testing.assert_allclose(out["momentum_seen"], momenta, rtol=1e-6)
        assert out["momentum_after"] == pytest.approx(0.5)
        np.testing.assert_allclose(out["lr_seen"], lrs, rtol=1e-6)
        np.testing.assert_allclose(_steps(out), expected, rtol=1e-4, atol=1e-7)


def test_refusals_name_the_argument_and_the_fix(results):
    for out in _checked(results, "lr_refusals"):
        assert "momentum_correction=False" in out["momentum_constant"]
        assert "RMSprop" in out["momentum_constant"]
        assert out["momentum_off_ok"] is None
        assert "learning rate" in out["lr_schedule"] and "float" in out["lr_schedule"]
        assert "local_variables" in out["local_not_variable"]
        assert "initial_lr" in out["initial_lr_none"]


def test_metric_average_is_the_mean_over_ranks(results):
    outs = _checked(results, "metric_average")
    epochs = len(outs[0]["before"])
    assert epochs == 2
    for epoch in range(epochs):
        raw = [out["before"][epoch] for out in outs]
        keys = set(raw[0])
        assert {"loss", "mae", "val_loss", "val_mae", "rank_value"} <= keys
        assert raw[0]["loss"] != pytest.approx(raw[1]["loss"], rel=1e-3)  # ranks differ
        for out in outs:
            averaged = out["after"][epoch]
            assert set(averaged) == keys
            for key in keys:
                mean = np.mean([r[key] for r in raw])
                assert averaged[key] == pytest.approx(mean, rel=1e-6), key
                assert out["history"][key][epoch] == pytest.approx(mean, rel=1e-6), key
            assert averaged["rank_value"] == 5.0 + epoch


def test_broadcast_leaves_rank0_values_except_local_variables(results):
    outs = _checked(results, "broadcast_local")
    local = outs[0]["local"]
    assert outs[0]["n_optimizer_slots"] >= 4  # Adam's m and v of 4 variables
    for name, before0 in outs[0]["before"]["model"].items():
        before1 = outs[1]["before"]["model"][name]
        assert not np.allclose(before0, before1), name  # ranks started apart
        for rank, out in enumerate(outs):
            after = out["after"]["model"][name]
            want = out["before"]["model"][name] if name in local else before0
            np.testing.assert_array_equal(after, want, err_msg=f"{name} on rank {rank}")
    slots0 = outs[0]["before"]["optimizer"]
    assert any(not np.allclose(a, b) for a, b in zip(slots0, outs[1]["before"]["optimizer"]))
    for out in outs:
        for got, want in zip(out["after"]["optimizer"], slots0):
            np.testing.assert_array_equal(got, want)


def test_best_model_checkpoint_writes_on_rank0_only(results):
    outs = _checked(results, "best_checkpoint")
    # averaged score 3.5, 1.5, 2.5, 0.5: improvements at epochs 1, 2 and 4
    assert outs[0]["files"] == ["best-01.weights.h5", "best-02.weights.h5",
                                "best-04.weights.h5"]
    assert outs[0]["last_matches_final"] == 0.0
    assert outs[1]["files"] == []
    assert "filepath" in outs[0]["unset_error"]
    assert outs[1]["unset_error"] is None  # rank 1 writes nothing, needs no path


def test_keras2_legacy_sgd_momentum_taken_over_by_dgc(keras2):
    assert "smooth_momentum_legacy" in _checked(keras2, "lr_schedule")[0]  # checked above
    for out in _checked(keras2, "legacy_sgd_takeover"):
        assert out["own_momentum"] == 0.0 and out["dgc_momentum"] == 0.9
        assert out["moved"] > 1e-2
        assert out["max_diff"] < 1e-5, out


def test_keras2_legacy_optimizers_train_and_compress_under_fit(keras2):
    outs = _checked(keras2, "legacy_fit_digits")
    for out in outs:
        for name in ("sgd", "adam"):
            dense, dgc = out[f"{name}_dense"], out[f"{name}_dgc"]
            assert ".optimizers.legacy." in dgc["class"]
            assert dense["ratio"] == 1.0
            assert dgc["ratio"] > 1.5, dgc
            assert dgc["paths"].get("sparse", 0) > 0
            assert dense["identical"] and dgc["identical"]
            assert dense["accuracy"] > 0.85, dense
            assert dgc["accuracy"] > dense["accuracy"] - 0.04, (name, dense, dgc)
            assert dgc["loss"] < 2 * dense["loss"] + 0.05, (name, dense, dgc)
    assert outs[0]["sgd_dgc"]["accuracy"] == outs[1]["sgd_dgc"]["accuracy"]
