"""Delayed gradient averaging in hvd_dgc.torch.DistributedOptimizer, 2 ranks under horovodrun."""

import pytest

from harness.hvdrun import launch, run
from tests.torch.test_optimizer import _checked

SCENARIOS = ["delay_zero_is_synchronous", "delay_two_matches_simulation", "flush_in_synchronize",
             "checkpoint_after_flush_resumes_exactly", "bad_delay", "period_matches_simulation",
             "bad_period", "auto_delay_matches_simulation", "period_against_reference"]


@pytest.fixture(scope="module")
def gloo():
    return run("tests.torch.torch_dga:suite", np=2, controller="gloo",
               kwargs={"names": SCENARIOS})


def test_delay_zero_is_synchronous_training_bit_for_bit(gloo):
    for out in _checked(gloo, "delay_zero_is_synchronous"):
        assert out["equal_each_step"] == [True] * 20
        assert out["moved"] > 1e-2 and out["in_flight"] == 0


@pytest.mark.parametrize("variant", ["dense_sgd", "dense_momentum", "dense_momentum_bpps2",
                                     "topk_momentum_warmup"])
def test_delay_two_equals_simulated_dga_and_flush_makes_ranks_identical(gloo, variant):
    for out in _checked(gloo, "delay_two_matches_simulation"):
        res = out[variant]
        assert res["moved"] > 1e-2
        assert res["sim_workers_agree"] < 1e-6  # the simulation's own flush identity
        assert res["max_diff_vs_simulation"] < 1e-6, res
        assert res["identical_after_flush"]
        # while averages are in flight each rank holds its own last D local updates
        assert not any(res["identical_before_flush"][2:])
        assert res["in_flight_before_flush"] == 2 and res["in_flight_after_flush"] == 0
    if variant.startswith("topk"):
        assert res["paths"]["sparse"] > 0


def test_synchronize_flush_equals_step_then_flush(gloo):
    for out in _checked(gloo, "flush_in_synchronize"):
        assert out["max_diff"] < 1e-6
        assert out["in_flight"] == [0, 0] and out["identical"] == [True, True]


def test_checkpoint_after_flush_resumes_bit_identically(gloo):
    for out in _checked(gloo, "checkpoint_after_flush_resumes_exactly"):
        assert "flush()" in out["refused_in_flight"]
        assert out["resumed_equal"]


def test_bad_delay_arguments_give_clear_errors(gloo):
    for out in _checked(gloo, "bad_delay"):
        for case in ("negative", "float", "bool"):
            assert "delay must be an int >= 0" in out[case], out[case]
        # Adam is linear once its variance is frozen (the default, with DGC or a
        # quantiser: 1-bit Adam); not with it off, nor under dense averaging
        assert "needs torch.optim.SGD or Adam/AdamW with its variance frozen" in out["adam"]
        assert "Adam is not. Use delay=0, or freeze_variance='auto'" in out["adam"], out["adam"]
        assert "or a compressor (DGC, the default, or sign: 1-bit Adam) with " \
            "freeze_variance='auto'" in out["adam_dense"], out["adam_dense"]
        assert out["adam_sign"] == "NO EXCEPTION", out["adam_sign"]
        assert "grad_scaler" in out["grad_scaler"]
        assert "after optimizer.step()" in out["flush_before_step"]


# -- temporally sparse updates (period=p, issue 17) -------------------------------------
@pytest.mark.parametrize("variant", ["dense_p3", "dense_p3_delay2", "dense_p2_delay3",
                                     "topk_p2_delay1"])
def test_period_equals_simulated_rule_and_flush_makes_ranks_identical(gloo, variant):
    for out in _checked(gloo, "period_matches_simulation"):
        res = out[variant]
        period, delay = res["period"], res["delay"]
        assert res["moved"] > 1e-2
        assert res["sim_workers_agree"] < 1e-6
        assert res["max_diff_vs_simulation"] < 1e-6, res
        assert res["identical_after_flush"]
        # an exchange's average is applied `delay` steps after it: from then until the
        # next local step the ranks agree (up to rounding); in between they differ
        applied = [s + delay for s in range(len(res["spread"])) if (s + 1) % period == 0]
        for i, spread in enumerate(res["spread"]):
            if i in applied and (delay == 0 or period == 1):
                assert spread < 1e-6, (i, res["spread"])
            elif i not in applied:
                assert spread > 1e-6, (i, res["spread"])
        # steps waiting for an average: those after the last exchange already applied
        last = max(a - delay for a in applied if a < len(res["spread"]))
        assert res["in_flight"][-1] == len(res["spread"]) - 1 - last
        steps = len(res["spread"])
        exchange = max(s for s in range(steps) if (s + 1) % period == 0)
        if exchange + delay >= steps:  # a collective in flight: its average cannot be saved
            assert "flush()" in res["refused_state_dict"] and \
                "period=" in res["refused_state_dict"], res["refused_state_dict"]
        else:  # only own steps in flight (between exchanges): saved with the rest
            assert res["refused_state_dict"] == "NO EXCEPTION", res["refused_state_dict"]
        # collectives only on exchange steps: one per tensor per exchange
        exchanges = len(res["spread"]) // period
        assert sum(res["paths"].values()) == res["tensors"] * exchanges, res["paths"]
    if variant.startswith("topk"):
        assert res["paths"]["sparse"] > 0


@pytest.mark.parametrize("variant", ["dense_p3", "topk_p2_delay1", "dense_p2_delay3"])
def test_period_equals_the_reference_tensorflow_is_held_to(gloo, variant):
    """The same runs as TensorFlow's period test (tests/lagged.py: gradients that
    do not depend on the weights), each step against tests/reference.py's lagged_update
    and the flush against its lagged_flush: both frameworks, one reference."""
    for out in _checked(gloo, "period_against_reference"):
        res = out[variant]
        assert res["moved"] > 1e-2
        assert res["max_diff_each_step"] < 1e-5 and res["max_diff_after_flush"] < 1e-5, res
        assert sum(res["paths"].values()) == 3 * (res["steps"] // res["period"]), res
        if variant.startswith("topk"):
            assert res["paths"].get("sparse", 0) > 0, res["paths"]


def test_bad_period_arguments_give_clear_errors(gloo):
    for out in _checked(gloo, "bad_period"):
        for case in ("zero", "float", "bool"):
            assert "period must be an int >= 1" in out[case], out[case]
        assert "period=4 needs torch.optim.SGD" in out["adam"] and "period=1" in out["adam"]
        assert "RMSprop is not. Use period=1." in out["rmsprop"], out["rmsprop"]
        assert "grad_scaler" in out["grad_scaler"] and "period=1" in out["grad_scaler"]
        assert "period=2 does not work with compression" in out["powersgd"]
        assert "\"auto\"" in out["delay_word"] and "'sometimes'" in out["delay_word"]
        assert "delay=auto needs torch.optim.SGD" in out["auto_adam"]
        assert "max_delay must be an int >= 1" in out["auto_max"]
        assert "start=3 is above max_delay=2" in out["auto_start"]


# -- delay="auto" (issue 17) ---------------------------------------------------------
@pytest.mark.parametrize("variant", ["down", "up", "up_period2"])
def test_auto_delay_same_on_every_rank_and_equal_to_the_rule_it_chose(gloo, variant):
    for out in _checked(gloo, "auto_delay_matches_simulation"):
        res = out[variant]
        assert_auto_delay_trace(res, variant)
        assert res["max_diff_vs_simulation"] < 1e-6, res
        assert res["identical_after_flush"] and res["moved"] > 1e-2


def assert_auto_delay_trace(res, variant):
    """The D of every step of a delay="auto" run (tests/lagged.py AUTO): the
    same on every rank, and moving the way its measurements say (TensorFlow's test
    holds its runs to this too)."""
    trace = res["trace"]
    assert all(t == trace for t in res["traces"]), res["traces"]  # every rank, every step
    assert res["decisions"], res
    if variant == "down":  # no wait worth the name: one step less per window, to 1
        assert trace[0] == 4 and trace[-1] == 1, trace
        assert all(a >= b for a, b in zip(trace, trace[1:])), trace
    else:  # every wait counts: up by the margin each window, to max_delay
        assert trace[0] == 1 and trace[-1] == 4, trace
        assert all(a <= b for a, b in zip(trace, trace[1:])), trace


@pytest.mark.parametrize("config", ["sign, delay=4", "dgc, delay=4", "outer, overlap"])
def test_a_script_that_ends_without_flush_ends_cleanly_on_every_rank(config):
    """Rank 0 ends first, with collectives in flight that rank 1 submits later: it waits
    for them at exit instead of shutting Horovod down under rank 1 (at_exit.py)."""
    job = launch("tests.torch.torch_dga:ends_apart", np=2, controller="gloo",
                 kwargs={"config": config}, timeout=240)
    assert job.returncode == 0 and sorted(job.results) == [0, 1], job.output()
    # something was in flight when each rank's script ended: delay=4 holds 4 steps,
    # the overlapped loop its last round
    expected = 1 if config.startswith("outer") else 4
    assert [r["in_flight"] for r in (job.results[0], job.results[1])] == [expected] * 2
