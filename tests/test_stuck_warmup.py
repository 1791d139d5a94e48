"""An epoch-counted warm-up whose epoch never moves is noticed: in PyTorch, Keras'
``model.fit`` and TensorFlow's tape on 2 real ranks (``horovodrun --gloo``), rank 0
warns once, naming the fix, rank 1 says nothing; a script that sets the epoch is not
told; Horovod's callbacks as hvd_dgc re-exports them (no ``DGCCallback``) carry the
Keras warm-up through its stages epoch by epoch. The ranks check after 10 steps
(``HVD_DGC_EPOCH_CHECK_STEPS``), not the default 200, so each run takes seconds."""

import pytest

from harness.hvdrun import run
from hvd_dgc.schedule import EPOCH_CHECK_STEPS, DensitySchedule, as_schedule, \
    counts_epochs, epoch_check_steps, stuck_epoch_message

CHECK = {"HVD_DGC_EPOCH_CHECK_STEPS": "10"}
STAGES = [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]  # warmup=4 epochs, then 0.001
STUCK = [0.25] * 6


def test_which_schedules_are_checked(monkeypatch):
    """Only a warm-up counted in epochs: not steps, not none, not the default (steps),
    and Adam's take-over is looked inside; the count comes from the environment."""
    from hvd_dgc.adam import FrozenAdamSchedule
    monkeypatch.delenv("HVD_DGC_EPOCH_CHECK_STEPS", raising=False)
    epochs = as_schedule(0.001, 4, "epoch")
    assert counts_epochs(epochs) and epoch_check_steps(epochs) == EPOCH_CHECK_STEPS == 200
    assert counts_epochs(FrozenAdamSchedule(20, epochs))
    for other in (as_schedule(0.001, 4, "step"), as_schedule(0.001, 0), as_schedule(),
                  as_schedule(lambda step, epoch: 0.01)):
        assert not counts_epochs(other) and epoch_check_steps(other) == 0
    monkeypatch.setenv("HVD_DGC_EPOCH_CHECK_STEPS", "0")
    assert epoch_check_steps(epochs) == 0
    monkeypatch.setenv("HVD_DGC_EPOCH_CHECK_STEPS", "ten")
    with pytest.raises(ValueError, match="HVD_DGC_EPOCH_CHECK_STEPS='ten'.*whole number"):
        epoch_check_steps(epochs)


def test_message_names_the_state_and_the_fixes():
    text = stuck_epoch_message(DensitySchedule(0.001, 4, "epoch"), 200, 0.0,
                               "Call optimizer.set_epoch(epoch) at the start of each epoch")
    assert "warmup=4" in text and "by step 200" in text and "density 0.25" in text
    assert "set_epoch(epoch)" in text and "warmup_unit='step'" in text


def _said_once_on_rank0(results, name, fix):
    rank0, rank1 = results[0][name]["said"], results[1][name]["said"]
    assert len(rank0) == 1, rank0
    assert fix in rank0[0] and "warmup_unit='step'" in rank0[0], rank0[0]
    assert "by step 10: it is still at epoch 0, density 0.25" in rank0[0], rank0[0]
    assert rank1 == []


@pytest.fixture(scope="module")
def torch_runs():
    return run("tests.workers.stuck_warmup:torch_scenarios", np=2, env=CHECK, timeout=240)


@pytest.fixture(scope="module")
def tf_runs():
    return run("tests.workers.stuck_warmup:tf_scenarios", np=2,
               env={**CHECK, "TF_USE_LEGACY_KERAS": "0"}, timeout=300)


def test_torch_never_set_epoch_warns_once_on_rank0(torch_runs):
    _said_once_on_rank0(torch_runs, "never", "optimizer.set_epoch(epoch)")
    for out in torch_runs:
        assert out["never"]["densities"] == STUCK and out["never"]["epoch"] == 0.0


def test_torch_set_epoch_is_not_told_and_falls_through_the_stages(torch_runs):
    for out in torch_runs:
        assert out["set_epoch"]["said"] == []
        assert out["set_epoch"]["densities"] == STAGES and out["set_epoch"]["epoch"] == 5.0


def test_keras_fit_without_hvd_dgc_callbacks_warns_once_on_rank0(tf_runs):
    _said_once_on_rank0(tf_runs, "keras_none", "hvd.callbacks.DGCCallback()")
    for out in tf_runs:
        assert [d for d, _ in out["keras_none"]["densities"]] == STUCK


@pytest.mark.parametrize("name", ["keras_horovod", "keras_metric_only"])
def test_keras_horovods_callbacks_advance_the_warmup(tf_runs, name):
    """BroadcastGlobalVariablesCallback + MetricAverageCallback +
    LearningRateWarmupCallback (three in one fit: each epoch set once, the same), or
    MetricAverageCallback alone: the density falls one stage an epoch, no warning."""
    for out in tf_runs:
        assert out[name]["said"] == []
        assert out[name]["densities"] == [(d, float(e)) for e, d in enumerate(STAGES)]


def test_tape_never_set_epoch_warns_once_on_rank0(tf_runs):
    _said_once_on_rank0(tf_runs, "tape_never", "hvd.set_epoch(epoch)")
    for out in tf_runs:
        assert out["tape_never"]["densities"] == STUCK


def test_tape_set_epoch_is_not_told(tf_runs):
    """``hvd.set_epoch(0)`` before the tape's first step counts (the exchange is made
    at that step and starts from the epoch set)."""
    for out in tf_runs:
        assert out["tape_set_epoch"]["said"] == []
        assert out["tape_set_epoch"]["densities"] == STAGES
