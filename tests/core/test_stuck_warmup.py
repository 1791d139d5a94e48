"""An epoch-counted warm-up whose epoch never moves is noticed: in PyTorch, Keras'
``model.fit`` and TensorFlow's tape on 2 real ranks (``horovodrun --gloo``), rank 0
warns once, naming the fix, rank 1 says nothing; a script that sets the epoch is not
told; Horovod's callbacks as hvd_dgc re-exports them (no ``DGCCallback``) carry the
Keras warm-up through its stages epoch by epoch. The ranks check after 10 steps
(``HVD_DGC_CHECK_STEPS``), not the default 200, so each run takes seconds."""

import pytest

from harness.hvdrun import run
from hvd_dgc.schedule import CHECK_STEPS, DensitySchedule, as_schedule, \
    counts_epochs, epoch_check_steps, stuck_epoch_message

CHECK = {"HVD_DGC_CHECK_STEPS": "10"}
STAGES = [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]  # warmup=4 epochs, then 0.001
STUCK = [0.25] * 6


def test_which_schedules_are_checked(monkeypatch):
    """Only a warm-up counted in epochs: not steps, not none, not the default (steps),
    and Adam's take-over is looked inside; the count comes from the environment."""
    from hvd_dgc.adam import FrozenAdamSchedule
    monkeypatch.delenv("HVD_DGC_CHECK_STEPS", raising=False)
    epochs = as_schedule(0.001, 4, "epoch")
    assert counts_epochs(epochs) and epoch_check_steps(epochs) == CHECK_STEPS == 200
    assert counts_epochs(FrozenAdamSchedule(20, epochs))
    for other in (as_schedule(0.001, 4, "step"), as_schedule(0.001, 0), as_schedule(),
                  as_schedule(lambda step, epoch: 0.01)):
        assert not counts_epochs(other) and epoch_check_steps(other) == 0
    monkeypatch.setenv("HVD_DGC_CHECK_STEPS", "0")
    assert epoch_check_steps(epochs) == 0
    monkeypatch.setenv("HVD_DGC_CHECK_STEPS", "ten")
    with pytest.raises(ValueError, match="HVD_DGC_CHECK_STEPS='ten'.*whole number"):
        epoch_check_steps(epochs)


def test_message_names_the_state_and_the_fixes():
    text = stuck_epoch_message(DensitySchedule(0.001, 4, "epoch"), 200, 0.0,
                               "Call optimizer.set_epoch(epoch) at the start of each epoch")
    assert "warmup=4" in text and "by step 200" in text and "density 0.25" in text
    assert "set_epoch(epoch)" in text and "warmup_unit='step'" in text


NEVER_SET = "nothing has set the epoch"


def _about(said, phrase):
    return [text for text in said if phrase in text]


def _said_once_on_rank0(results, name, fix, phrase=NEVER_SET):
    """Rank 0 said ``phrase`` once, naming ``fix``; rank 1 said nothing at all."""
    rank0 = _about(results[0][name]["said"], phrase)
    assert len(rank0) == 1, results[0][name]["said"]
    assert fix in rank0[0], rank0[0]
    if phrase == NEVER_SET:
        assert "warmup_unit='step'" in rank0[0], rank0[0]
        assert "by step 10: it is still at epoch 0, density 0.25" in rank0[0], rank0[0]
    assert results[1][name]["said"] == []


@pytest.fixture(scope="module")
def torch_runs():
    return run("tests.core.stuck_warmup:torch_scenarios", np=2, env=CHECK, timeout=240)


@pytest.fixture(scope="module")
def tf_runs():
    return run("tests.core.stuck_warmup:tf_scenarios", np=2,
               env={**CHECK, "TF_USE_LEGACY_KERAS": "0"}, timeout=300)


def test_torch_never_set_epoch_warns_once_on_rank0(torch_runs):
    _said_once_on_rank0(torch_runs, "never", "optimizer.set_epoch(epoch)")
    for out in torch_runs:
        assert out["never"]["densities"] == STUCK and out["never"]["epoch"] == 0.0


def test_torch_set_epoch_is_not_told_and_falls_through_the_stages(torch_runs):
    for out in torch_runs:
        assert _about(out["set_epoch"]["said"], NEVER_SET) == []
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


def test_torch_link_watch_asked_for_where_it_cannot_act_is_said(torch_runs):
    """``link_watch=LinkWatch(...)`` with the link not measured (the suite's assumed
    cost model): rank 0 says why it does nothing and how to change that."""
    _said_once_on_rank0(torch_runs, "never", "drop cost_model",
                        phrase="link_watch=LinkWatch(window=20")
    assert "does nothing here: the link is not measured" in \
        _about(torch_runs[0]["never"]["said"], "link_watch=")[0]


def test_keras_lagging_never_flushed_is_said_and_broadcast_callback_silences_it(tf_runs):
    """delay=2 in a fit with no hvd_dgc callback: nothing flushes before evaluation or at
    the end; rank 0 says so once, naming the callbacks and flush(). With hvd_dgc's
    BroadcastGlobalVariablesCallback (which flushes) nothing is said."""
    _said_once_on_rank0(tf_runs, "keras_delay_none",
                        "hvd.callbacks.BroadcastGlobalVariablesCallback(0)",
                        phrase="nothing has flushed by step 10")
    assert "optimizer.flush()" in tf_runs[0]["keras_delay_none"]["said"][0]
    for out in tf_runs:
        assert out["keras_delay_broadcast"]["said"] == []


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


def _warned(body):
    """hvd_dgc's warnings while ``body()`` runs (as rank 0: no launcher here)."""
    import warnings
    from hvd_dgc import say
    say.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        body()
    return [str(w.message) for w in caught if str(w.message).startswith("hvd_dgc:")]


def test_warmup_densities_without_a_warmup_is_said_once():
    said = _warned(lambda: [as_schedule(0.001, None, "epoch", (0.5, 0.1)) for _ in range(3)])
    assert said == ["hvd_dgc: warmup_densities=(0.5, 0.1) has no effect without a warm-up "
                    "(density=0.001, warmup=None): pass warmup=N (epochs) to go through "
                    "them, or drop warmup_densities."]
    # used: by a warm-up, or by the default (step-counted) one
    assert _warned(lambda: (as_schedule(0.001, 4, "epoch", (0.5, 0.1)),
                            as_schedule(None, None, "epoch", (0.5, 0.1)))) == []


def test_outer_loop_names_the_options_it_ignores():
    from hvd_dgc.config import DGCConfig
    from hvd_dgc.outer import OuterLoop, check_outer
    said = _warned(lambda: check_outer(OuterLoop(), DGCConfig(density=0.1, log_every=5,
                                                                clip_norm=1.0), True, True))
    assert said == ["hvd_dgc: outer=OuterLoop(...) uses density and min_compress_size only; "
                    "clip_norm=1.0, log_every=5 do nothing here: drop them."]
    assert _warned(lambda: check_outer(OuterLoop(), DGCConfig(density=0.1,
                                                              min_compress_size=64),
                                       True, True)) == []


def test_outer_momentum_overlapped_is_warned_once_as_the_zoo_saw_it_lose():
    """The model zoo's worst outer setting (bench/results/zoo.md: +7.3% on the GPT-style
    LM, +4.4 points on the CNN): outer momentum over averages applied a round late."""
    from hvd_dgc.config import DGCConfig
    from hvd_dgc.outer import OuterLoop, check_outer
    said = _warned(lambda: [check_outer(OuterLoop(overlap=True), DGCConfig(), True, True)
                            for _ in range(2)])
    assert said == ["hvd_dgc: OuterLoop(overlap=True, momentum=0.9) applies momentum to "
                    "averages one round late: it lost 7.3% loss on a GPT-style LM and 4.4 "
                    "points on a CNN (bench/results/zoo.md). Use OuterLoop() (no overlap), "
                    "or overlap with momentum=0.0, lr=1.0."]
    # what held: DiLoCo's defaults, not overlapped; overlapped, averaged
    assert _warned(lambda: check_outer(OuterLoop(), DGCConfig(), True, True)) == []
    assert _warned(lambda: check_outer(OuterLoop(steps=128, overlap=True, lr=1.0,
                                                 momentum=0.0, nesterov=False),
                                       DGCConfig(), True, True)) == []


def test_link_watch_idle_reasons():
    from hvd_dgc.config import DGCConfig
    from hvd_dgc.linkwatch import LinkWatch, link_watch_idle
    asked = DGCConfig(link_watch=LinkWatch())
    assert link_watch_idle(asked, True, True) == ""
    assert "the link is not measured" in link_watch_idle(asked, False, True)
    assert "nothing is compressed" in link_watch_idle(asked, True, False)
    assert "with delay=2 a step does not wait" in link_watch_idle(
        DGCConfig(link_watch=LinkWatch(), delay=2), True, True)
    assert "elastic" in link_watch_idle(asked, True, True, elastic=True)
    assert "model.fit" in link_watch_idle(asked, True, True, tape=True)


def test_freeze_variance_with_an_optimizer_that_has_no_variance_is_said():
    """freeze_variance applies to Adam and AdamW only: with SGD it is said, once; with
    AdamW it is used and nothing is said."""
    pytest.importorskip("torch")
    from horovod.torch.mpi_ops import Adasum, Average, Sum
    from hvd_dgc.config import DGCConfig
    from hvd_dgc.resolve import HorovodArguments
    from hvd_dgc.torch.compression import Compression
    from hvd_dgc.torch.optimizer import TORCH

    def resolve(optimizer):
        return DGCConfig(freeze_variance=50).resolve(
            TORCH, Compression.dgc, HorovodArguments(Average, 1.0, 1, None,
                                                     (Average, Sum, Adasum)), optimizer)
    assert _warned(lambda: resolve((True, "SGD", False))) == [
        "hvd_dgc: freeze_variance=50 applies to Adam and AdamW; SGD has no variance to "
        "freeze, so it does nothing here: drop it."]
    assert _warned(lambda: resolve((False, "AdamW", True))) == []


def test_warmup_densities_beside_a_schedule_of_ones_own_is_said():
    assert _warned(lambda: as_schedule(DensitySchedule(0.01, 2, "step"), None, "epoch",
                                       (0.5,))) == [
        "hvd_dgc: warmup_densities=(0.5,) has no effect next to a density schedule of your "
        "own: put the stages in it, or drop warmup_densities."]


def test_momentum_masking_asked_for_without_momentum_is_said():
    from hvd_dgc.masking import masking_density_limit
    assert _warned(lambda: [masking_density_limit(True, 0.0) for _ in range(3)]) == [
        "hvd_dgc: momentum_masking=True does nothing here: the optimizer has no momentum "
        "(momentum=0), so nothing stale is left to mask; drop it."]
    assert _warned(lambda: (masking_density_limit(True, 0.9),
                            masking_density_limit("auto", 0.0))) == []


def test_warmup_unit_step_without_warmup_is_said():
    """``density=0.01, warmup_unit="step"`` reads like "the default warm-up by steps, to
    1%", but a given density drops the default warm-up: said once."""
    assert _warned(lambda: as_schedule(0.01, None, "step")) == [
        "hvd_dgc: warmup_unit='step' has no effect without warmup: density=0.01 runs from "
        "the first step (the default warm-up is dropped once density is given). Pass "
        "warmup=N (steps) for one."]
    assert _warned(lambda: (as_schedule(0.01, 300, "step"), as_schedule(0.01, 0, "step"),
                            as_schedule(None, None, "step"))) == []


def test_adam_takes_the_warmup_densities_it_is_given():
    """AdamW with only ``warmup_densities`` (DGC's top-k asked for): its stages after the
    freeze are those, by steps, not the default ones."""
    pytest.importorskip("torch")
    from horovod.torch.mpi_ops import Adasum, Average, Sum
    from hvd_dgc.config import DGCConfig
    from hvd_dgc.resolve import HorovodArguments
    from hvd_dgc.torch.compression import Compression
    from hvd_dgc.torch.optimizer import TORCH
    resolved = DGCConfig(warmup_densities=(0.5, 0.05)).resolve(
        TORCH, Compression.dgc, HorovodArguments(Average, 1.0, 1, None, (Average, Sum, Adasum)),
        (False, "AdamW", True))
    inner = resolved.schedule.inner
    assert inner.unit == "step" and inner.warmup_densities == (0.5, 0.05)
    assert inner.boundaries == (200.0, 10000.0)  # 10 sends at 5%, then at 0.1%
