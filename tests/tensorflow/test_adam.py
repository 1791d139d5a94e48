"""Keras' Adam and AdamW taken over (hvd_dgc/tensorflow/adam.py) on 2 real Horovod
ranks (horovodrun --gloo), Keras 2 (tf_keras, and its legacy Adam) and Keras 3: the
NumPy reference step by step (the one the PyTorch side is held to), model.fit on digits,
a checkpoint, and what is refused."""

import pytest

from harness.hvdrun import run
from tests.torch.test_adam import assert_taken_back_at_their_size
from tests.torch.test_optimizer import _checked

# tests/tensorflow/tf_adam.py's bodies, run by tf_dgc's suite ("module.name"): the take-over
# itself (the reference at density one), fit, a checkpoint and the refusals on both Keras
# versions; the exchange's features from the freeze on (delay, refresh, sign, the dense
# decline, its own steps at a checkpoint), whose Keras-specific part is that take-over,
# on one version each, which keeps each launch well inside its limit on a slow CI machine
SCENARIOS = ["tf_adam.reference_equivalence", "tf_adam.fit_digits", "tf_adam.checkpoint",
             "tf_adam.refusals", "tf_adam.taken_back_at_their_size"]
ONE_VERSION = {"keras2": ["tf_adam.refresh_reference", "tf_adam.sign_reference"],
               "keras3": ["tf_adam.checkpoint_between_exchanges",
                          "tf_adam.delay_reference", "tf_adam.declined_on_a_fast_link",
                          "tf_adam.zero_one_fit", "tf_adam.zero_one_embedding"]}


def _launch(legacy, ckdir):
    return run("tests.tensorflow.tf_dgc:suite", np=2, controller="gloo", timeout=840,
               env={"TF_USE_LEGACY_KERAS": "1" if legacy else "0"},
               kwargs={"names": SCENARIOS + ONE_VERSION["keras2" if legacy else "keras3"],
                       "kwargs": {"tf_adam.checkpoint": {"ckdir": ckdir},
                                  "tf_adam.checkpoint_between_exchanges": {"ckdir": ckdir}}})


@pytest.fixture(scope="module")
def keras2(tmp_path_factory):
    return _launch(True, str(tmp_path_factory.mktemp("adam_keras2")))


@pytest.fixture(scope="module")
def keras3(tmp_path_factory):
    return _launch(False, str(tmp_path_factory.mktemp("adam_keras3")))


@pytest.fixture(params=["keras2", "keras3"])
def results(request):
    return request.getfixturevalue(request.param), request.param


def test_keras_adam_taken_over_equals_the_reference_at_density_one(results):
    outs, version = results
    classes = ("AdamW", "Adam") + (("legacy.Adam",) if version == "keras2" else ())
    for out in _checked(outs, "tf_adam.reference_equivalence"):
        assert set(out) == {f"{c}.{v}" for c in classes
                            for v in ("dense", "allgather_clipped")}
        for name, res in out.items():
            assert res["moved"] > 1e-3, (name, "nothing moved after the freeze")
            # float32 rounding only: a mistake in the maths is off by a step (lr 0.01)
            assert max(res["diffs"]) < 2e-5, (name, res["diffs"])
            assert res["identical"], name
            assert res["phases"] == ["exact Adam"] * 2 + ["frozen variance"] * 6, name
            # one frozen scale per variable, set at the freeze (ones before)
            assert res["scales"] == 4 and res["scales_set"], (name, res["scales"])
        # 4 variables a step, 8 steps; allgather: the 480-value kernel from the freeze
        assert out["AdamW.dense"]["paths"] == {"dense": 4 * 8}
        assert out["AdamW.allgather_clipped"]["paths"]["sparse"] > 0
        # clip_norm moved the reference off the unclipped one, and the weights matched it
        assert all(out[f"{c}.allgather_clipped"]["clipped"] for c in classes)


def test_keras_adam_with_delay_equals_the_reference_on_each_rank(keras3):
    """delay=2, dense, frozen at step 3: synchronous exact Adam to the freeze, then each
    rank's own frozen-Adam step now and the average two steps later in its place (the
    reference PyTorch's is held to, with Keras' eps and decay); flush() applies what is
    in flight at Adam's count then, no decay, and leaves the ranks identical."""
    outs, classes = keras3, ("AdamW", "Adam")
    for out in _checked(outs, "tf_adam.delay_reference"):
        nan = out.pop("nan_in_warm_up")
        periods = {name: out.pop(name) for name in list(out) if ".period" in name}
        assert set(out) == set(classes)
        # period=3 (delay 0) and period=2 with delay=1 from the freeze on (step 3): the
        # reference step by step; identical right after an exchange applied at once
        assert set(periods) == {"AdamW.period3.delay0", "AdamW.period2.delay1"}
        for name, res in periods.items():
            assert max(res["diffs"]) < 2e-5, (name, res["diffs"])
            assert res["flushed_diff"] < 2e-5 and res["flushed_identical"], (name, res)
            assert res["identical"][:3] == [True] * 3, name
            assert res["iterations"] == 9 and res["phase"] == "frozen variance", name
        # the reference's ranks after step 8: its exchange just applied (period 3: own
        # steps taken back at their step sizes, the ranks equal to rounding), or its own
        # step, the last exchange's average one step away (period 2, delay 1)
        assert periods["AdamW.period3.delay0"]["apart"] < 1e-6, periods
        assert periods["AdamW.period2.delay1"]["apart"] > 1e-4, periods
        p3 = periods["AdamW.period3.delay0"]
        # steps 3 and 4 local, 5 exchanges (applied at once), 6 and 7 local, 8 exchanges
        assert p3["in_flight"] == [0, 0, 0, 1, 2, 0, 1, 2, 0], p3["in_flight"]
        assert not p3["flushed"]  # nothing in flight after step 8's exchange
        p2 = periods["AdamW.period2.delay1"]
        # exchanges at 3 (the first frozen step, alone), 5 (with 4) and 7 (with 6), each
        # applied one step later
        assert p2["in_flight"] == [0, 0, 0, 1, 1, 2, 1, 2, 1], p2["in_flight"]
        assert p2["flushed"]  # step 8's own, taken back
        # a NaN on rank 1 in the exact warm-up skipped the step on every rank
        assert nan["nonfinite_steps"] == 1 and nan["step"] == nan["iterations"] == 9, nan
        assert nan["diff"] < 2e-5, nan
        for name, res in out.items():
            assert max(res["diffs"]) < 2e-5, (name, res["diffs"])
            # identical through the exact warm-up, apart while averages are in flight
            assert res["identical"][:3] == [True] * 3 and not any(res["identical"][3:]), name
            assert res["apart"] > 1e-4, name  # (the reference's ranks differ too)
            assert res["in_flight"] == [0, 0, 0, 1, 2, 2, 2, 2, 2], (name, res["in_flight"])
            assert res["phase"] == "frozen variance" and res["flushed"], name
            assert res["iterations"] == 9, name  # the flush is not a step
            assert res["flushed_diff"] < 2e-5 and res["flushed_identical"], (name, res)


def test_keras_adamw_with_sign_compression_is_one_bit_adam_and_equals_the_reference(keras2):
    """compression=Compression.sign takes Keras' AdamW over as the sparse compressors do:
    dense exact Adam to the freeze (step 3), then the scaled sign of the memory, the
    rest kept (the reference PyTorch's is held to), synchronous with refreshes, with
    delay=2 and with period=2; a run that sent the memory whole would end off in most
    coordinates."""
    for out in _checked(keras2, "tf_adam.sign_reference"):
        for name, res in out.items():
            # float32 rounding only (a sign flipped by rounding would move one coordinate
            # by 2 lr mean|v|: not seen in these 766 elements, as in PyTorch's test)
            assert max(res["diffs"]) < 2e-5, (name, res["diffs"])
            assert res["flushed_off"] == 0 and res["identical"], name
            assert res["dense_off"] > res["numel"] // 2, (name, res["dense_off"])
            assert res["phases"] == ["exact Adam"] * 2 + ["frozen variance"] * 8, name
            # 4 variables; the 2 kernels dense for the 3 exact steps, then sign at each
            # of the 7 steps after, or at every 2nd (steps 3, 5, 7, 9), the biases beside
            exchanges = 4 if name == "period=2" else 7
            assert res["paths"] == {"dense": 4 * 3 + 2 * exchanges,
                                    "exchange": 2 * exchanges}, (name, res)
        assert out["delay=0"]["refreshes"] == 3 and out["delay=2"]["refreshes"] is None


def test_keras_adam_refreshed_variance_equals_the_reference(keras2):
    """refresh_variance=2 after a freeze at step 3: refreshed at the ends of steps 5, 7
    and 9 (each one dense exchange of the second moments more), the reference PyTorch's
    refresh is held to, with Keras' forms, synchronous and with delay=2."""
    outs, classes = keras2, ("AdamW", "Adam", "legacy.Adam")
    for out in _checked(outs, "tf_adam.refresh_reference"):
        assert set(out) == {f"{c}.delay0" for c in classes} | {"AdamW.delay2"}
        for name, res in out.items():
            assert max(res["diffs"]) < 2e-5, (name, res["diffs"])
            assert res["refreshed"] > 1e-4, name  # the refreshes changed the run
            assert res["refreshes"] == [0] * 4 + [1, 1, 2, 2, 3, 3], (name, res["refreshes"])
            extra = [round(s - 1.0, 4) for s in res["dense_steps_sent"]]
            assert extra == [0.0] * 4 + [1.0, 0.0] * 3, (name, extra)
            assert res["flushed_diff"] < 2e-5 and res["identical"], (name, res)


def test_keras_adamw_is_left_exact_while_every_tensor_goes_dense(keras3):
    """As PyTorch's: where the cost model sends every tensor dense, AdamW is not taken
    over and equals dense averaging (density=1.0) past the default freeze; on the
    assumed 1 Gbit/s it is taken over; where only the first stage goes dense, the
    freeze moves to the first sparse one."""
    for out in _checked(keras3, "tf_adam.declined_on_a_fast_link"):
        assert out["diff"] == 0.0, out
        assert out["phase"].startswith("exact Adam (not taken over") and out["freeze"] is None
        assert set(out["paths"]) == {"dense"}, out["paths"]
        assert out["slow_phase"] == "frozen variance", out
        # no option: 0/1 Adam (the sign, period 4) where taken over (the assumed 1 Gbit/s),
        # and where declined its period goes too: dense averaging every step
        assert out["periods"] == {"fast": 1, "slow": 4}, out["periods"]
        assert out["compressors"] == {"fast": "SignCompressor", "slow": "SignCompressor"}
        # a first stage that goes dense on this link: the freeze moves from step 3 to 7,
        # where the sparse stage starts; dense averaging's weights until then
        later = out["later"]
        assert later["freeze"] == 7 and later["diffs"][:7] == [0.0] * 7, later
        assert min(later["diffs"][7:]) > 0 and later["paths"].get("sparse", 0) > 0, later
        assert later["phases"][:6] == ["exact Adam"] * 6, later["phases"]
        assert set(later["phases"][6:]) == {"frozen variance"}, later["phases"]


def test_keras_adamw_switched_by_one_line_is_zero_one_adam_in_fit(keras3):
    """AdamW with no option in model.fit, hvd_dgc's BroadcastGlobalVariablesCallback the
    only one of hvd_dgc's (a Horovod script switched by one line): 0/1 Adam, the sign at
    every 4th step after the freeze; each epoch ends between exchanges, each rank on its
    own weights, and the callback flushes: a callback after it sees every rank's weights
    equal, one before it does not; equal after fit; it learns."""
    for out in _checked(keras3, "tf_adam.zero_one_fit"):
        assert out["period"] == 4 and out["phase"] == "frozen variance", out
        assert out["seen"]["before"] == [False] * 4, out["seen"]
        assert out["seen"]["after"] == [True] * 4, out["seen"]
        assert out["identical"] and out["in_flight"] == 0, out
        # 4 tensors dense for the 20 exact steps; then the 4,096-weight kernel's sign and
        # the 3 small tensors dense at the 18 exchanges of steps 23, 27, ..., 91
        assert out["step"] == 4 * 23, out
        assert out["paths"] == {"dense": 4 * 20 + 3 * 18, "exchange": 18}, out["paths"]
        assert out["accuracy"] > 0.9, out


def test_keras_default_with_an_embedding_sends_the_sign_every_step(keras3):
    """An Embedding's IndexedSlices gradient cannot take 0/1 Adam's local steps back:
    with no option the sign goes every step (1-bit Adam), said once on rank 0,
    instead of refusing a period the script never asked for; every rank identical at
    every step."""
    for rank, out in enumerate(_checked(keras3, "tf_adam.zero_one_embedding")):
        assert out["period"] == 1 and out["compressor"] == "SignCompressor", out
        if rank == 0:
            assert len(out["said"]) == 1 and "period=4" in out["said"][0] and \
                "sparse_as_dense=True" in out["said"][0], out["said"]
        else:
            assert out["said"] == [], out["said"]
        assert out["identical"] == [True] * 26, out["identical"]
        assert out["phase"] == "frozen variance" and out["paths"].get("exchange", 0) > 0, out


def test_keras_adamw_in_fit_on_digits_compresses_after_the_freeze(results):
    outs, _ = results
    for out in _checked(outs, "tf_adam.fit_digits"):
        dense = out["dense"]
        assert dense["ratio"] == 1.0 and dense["phase"] is None  # density=1.0: not taken
        assert dense["identical"] and dense["accuracy"] > 0.9, dense
        for tag in ("dgc", "dgc_delay"):  # synchronous, and with delay=2 (flushed by fit)
            dgc = out[tag]
            assert dgc["phase"] == "frozen variance" and dgc["step"] > 100, (tag, dgc)
            assert dgc["scales"] == 4
            assert dgc["paths"].get("sparse", 0) > 0
            # (the digits CNN's small tensors, 434 of 552 path-steps, ride in the
            # allgathers where the cost model folds them: their indices counted)
            assert dgc["ratio"] > 2.0, (tag, dgc)
            assert dgc["identical"], tag
            assert dgc["accuracy"] > dense["accuracy"] - 0.04, (tag, dense, dgc)


def test_keras_adam_checkpoint_carries_the_frozen_variance_and_momentum(results):
    outs, version = results
    for out in _checked(outs, "tf_adam.checkpoint"):
        assert out["restored"]["max_diff"] == 0.0, out
        assert out["restored"]["phase"] == "frozen variance" and out["restored"]["step"] == 8
        assert out["model_only"]["step"] == 3  # from step 0: exact Adam to the freeze again
        assert out["model_only"]["max_diff"] > 1e-4, out
        if version == "keras2":  # DGC's memory is saved with the optimizer
            assert out["without_memory"]["max_diff"] == 0.0, out
        else:  # the momentum seeded at the freeze is lost with DGC's memory
            assert out["without_memory"]["max_diff"] > 1e-5, out


def test_keras_checkpoint_between_exchanges_carries_the_own_steps(keras3):
    """0/1 Adam's own steps in flight at a checkpoint (hvd_dgc/tensorflow/delayed.py
    OwnStepsInCheckpoint): the restored run equals the uninterrupted one to rounding (the
    checkpoint holds their sum at the last one's step size; Adam's bias correction moves
    every step here); without them (what the checkpoint held before) it ends off; writing changes nothing
    in the run; with delay, a checkpoint over an average in flight is refused. Keras 3:
    the own steps are the exchange's whichever Keras (the take-over's checkpoint runs on
    both: test_keras_adam_checkpoint_carries_the_frozen_variance_and_momentum)."""
    for out in _checked(keras3, "tf_adam.checkpoint_between_exchanges"):
        assert out["period"] == 4 and out["in_flight"] == 2, out  # own steps 4 and 5
        assert out["in_flight_after_writing"] == 2, out
        carried = out["carried"]
        assert carried["max_diff"] < 1e-6 and (carried["step"], carried["in_flight"]) == \
            (12, 0), out
        assert out["left_out"]["max_diff"] > 1e-2, out  # each rank's steps 4, 5 kept
        assert "await an average (delay=2, period=4)" in out["delay_refused"], out
        assert "opt.flush()" in out["delay_refused"], out
        assert out["delay_written_after_flush"] is True, out


def test_keras_own_steps_are_taken_back_at_the_size_they_were_applied_with(results):
    """After every exchange the ranks agree to float rounding, where the step size moves
    between a local step and its exchange (Adam's bias correction after the freeze with
    Keras' decoupled decay; a schedule that changes SGD's rate every step), both Keras
    versions; a rate of 0 at an exchange is said once (tests/torch/test_adam.py's twin)."""
    outs, _ = results
    for rank, out in enumerate(_checked(outs, "tf_adam.taken_back_at_their_size")):
        assert_taken_back_at_their_size(out, rank)


def test_keras_adam_refusals_name_the_option_and_the_fix(results):
    outs, _ = results
    for out in _checked(outs, "tf_adam.refusals"):
        assert "Adam(clipnorm=1.0) cannot be taken over" in out["clipnorm"]
        assert "clip_norm=" in out["clipnorm"] and "freeze_variance=False" in out["clipnorm"]
        assert "AdamW(use_ema=True) cannot be taken over" in out["ema"]
        # Keras clips in apply_gradients, each rank by its own norm: delay would drift
        assert out["sgd_clip_delay"].startswith("hvd_dgc: SGD(clipnorm=1.0) with delay=2:")
        assert "clip_norm=" in out["sgd_clip_delay"] and "delay=0" in out["sgd_clip_delay"]
        assert "needs a Keras SGD optimizer" in out["delay_unfrozen"]
        assert not out["error_feedback_taken"]
        assert out["error_feedback_said"] == "Adam not taken over: error feedback on its " \
                                             "raw gradient"
