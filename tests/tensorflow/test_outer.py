"""The outer loop in Keras (hvd_dgc/tensorflow/outer.py) on 2 real Horovod ranks
(horovodrun --gloo), Keras 2 (tf_keras) and Keras 3: whole runs against the NumPy
reference PyTorch's is held to (tests/torch/test_outer.py ``_replay``), synchronous training
at H = 1, AdamW in ``model.fit``, a checkpoint mid-round, an elastic sync, and what is
refused."""

import numpy as np
import pytest

from harness.hvdrun import run
from tests import reference as ref
from tests.torch.test_outer import assert_as_replayed
from tests.torch.test_optimizer import _checked

SCENARIOS = ["tf_outer.reference_quadratic", "tf_outer.sync_equivalence",
             "tf_outer.fit_adamw_digits", "tf_outer.checkpoint_resumes_exactly",
             "tf_outer.overlap_checkpoint_needs_flush",
             "tf_outer.elastic_sync_takes_rank_0s_round", "tf_outer.refusals"]


def _launch(legacy, ckdir):
    return run("tests.tensorflow.tf_dgc:suite", np=2, controller="gloo", timeout=480,
               env={"TF_USE_LEGACY_KERAS": "1" if legacy else "0"},
               kwargs={"names": SCENARIOS,
                       "kwargs": {"tf_outer.checkpoint_resumes_exactly": {"ckdir": ckdir},
                                  "tf_outer.overlap_checkpoint_needs_flush": {
                                      "ckdir": ckdir}}})


@pytest.fixture(scope="module")
def keras2(tmp_path_factory):
    return _launch(True, str(tmp_path_factory.mktemp("outer_keras2")))


@pytest.fixture(scope="module")
def keras3(tmp_path_factory):
    return _launch(False, str(tmp_path_factory.mktemp("outer_keras3")))


@pytest.fixture(params=["keras2", "keras3"])
def outs(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("variant", list(ref.OUTER_RUNS))
def test_keras_matches_the_reference_round_by_round(outs, variant):
    ranks = [out[variant] for out in _checked(outs, "tf_outer.reference_quadratic")]
    steps, outer = assert_as_replayed(ranks, variant)
    for out in ranks:
        assert out["in_flight"] == int(outer.overlap)  # (the optimizer's own count)
        assert out["ended"] == (outer.overlap or bool(steps % 3))
        assert not out["ended_again"]  # nothing left to end
        # the wait at rounds' ends: timed where it happens on a thread (overlap), not
        # inside a traced step
        waited = out["stats"]["waited_seconds"]
        assert (waited is None) if not outer.overlap else 0 < waited < 60, out["stats"]


def test_with_overlap_a_checkpoint_asks_for_flush_first(outs):
    for out in _checked(outs, "tf_outer.overlap_checkpoint_needs_flush"):
        assert out["refused"].startswith("hvd_dgc: a round's exchange is in flight"), out
        assert "Call optimizer.flush() after the step, before writing a checkpoint" in \
            out["refused"]
        assert out["in_flight"] == 1 and out["after_flush"] == 0
        assert out["saved"] and out["identical"]
        assert out["elastic"] == "NO EXCEPTION"  # elastic Keras takes it (flushed commits)


def test_one_inner_step_a_round_with_outer_sgd_of_lr_1_is_synchronous_training(outs):
    for out in _checked(outs, "tf_outer.sync_equivalence"):
        assert out["moved"] > 1e-2
        assert max(out["diffs"]) < 2e-6, out["diffs"]  # float rounding of x - (x - lr g)
        assert all(out["identical"])


def test_adamw_inside_model_fit_learns_digits_with_15x_fewer_bytes(outs):
    ranks = _checked(outs, "tf_outer.fit_adamw_digits")
    for out in ranks:
        assert out["identical"]  # DGCCallback ended the last round when fit ended
        assert out["accuracy"] > 0.85, out["accuracy"]
        assert out["loss"][-1] < 0.5 * out["loss"][0], out["loss"]
        assert out["logged_density"] == [0.05] * 4
    out = ranks[0]
    stats, numels, inner = out["stats"], out["numels"], 4 * out["steps_per_epoch"]
    assert stats["inner_steps"] == inner and stats["steps_per_round"] == 4
    assert stats["rounds"] == -(-inner // 4)  # the last one ended by the callback
    ks = [n if n < 1000 else int(np.ceil(0.05 * n)) for n in numels]
    assert stats["bytes_sent"] == stats["rounds"] * 8 * sum(ks)
    # against Horovod's allreduce every step: 4x from the rounds, 10x more on the two
    # 64x64 kernels (the small tensors go whole): 15.1x
    assert stats["compression_ratio"] > 14, stats


def test_a_checkpoint_in_the_middle_of_a_round_resumes_bit_for_bit(outs):
    for out in _checked(outs, "tf_outer.checkpoint_resumes_exactly"):
        assert out["equal"] and out["rounds"] == 3 and out["inner"] == 14
        names = " ".join(out["saved"])
        for part in ("anchor", "buffer", "residual", "inner", "round_began", "rounds", "started"):
            assert part in names, (part, out["saved"])


def test_an_elastic_sync_hands_a_joining_rank_rank_0s_round(outs):
    ranks = _checked(outs, "tf_outer.elastic_sync_takes_rank_0s_round")
    for out in ranks:
        assert out["counts"] == [6, 6, 3]  # rank 0's 5 steps and 2 rounds, then one more
        assert out["shared"] and out["weights_identical"]


def test_what_the_keras_outer_loop_cannot_honour_is_refused_with_the_fix(outs):
    for out in _checked(outs, "tf_outer.refusals"):
        assert "backward_passes_per_step=2" in out["passes"] and \
            "backward_passes_per_step=1" in out["passes"]
        assert "with delay=2: the outer loop already exchanges once every 8 steps" in \
            out["delay"]
        assert "sends the weights' change as DGC's records" in out["powersgd"]
        assert "op must be Average" in out["sum"]
        assert out["not_outer"].startswith("outer must be a hvd_dgc.OuterLoop")
        assert "register_local_var('mine" in out["local"] and \
            "an optimizer of its own" in out["local"]
