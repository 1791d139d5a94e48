"""The long-run LM benchmark's small version (bench/adam_lm.py; issue 32): AdamW on a
byte-level transformer over the standard library's sources, 2 ranks under horovodrun
--gloo, 400 steps, dense Horovod and hvd_dgc side by side on the same batches.

Measured (2026-11-26, this machine): validation loss at step 400, Horovod 2.1598;
hvd_dgc's top-k take-over (``compression="dgc"``: exact Adam to step 20, the variance
refreshed at 40, 80, 160, 320; the default before 2026-12-01) 2.2436 (+3.9%) sending
2.86x fewer bytes over the run; frozen once at step 200 (``refresh_variance=False``)
2.1896 (+1.4%) at 1.38x, equal to Horovod's to the last digit up to the freeze (exact
Adam on dense averages); ``density=0.01`` 2.2877 (+5.9%) at 5.7x. 0/1 Adam (1-bit Adam's
signs, exchanged every 4th step, local steps between: ``compression="sign", period=4``,
2026-11-27, and the default since 2026-12-01, adam.py ``ZERO_ONE_PERIOD``) 2.1972
(+1.7%) at 14.2x: better than the top-k take-over on both counts, as at 3,000 steps of
the larger model (bench/results/adam_lm_3000.md)."""

import math

import pytest

from harness.hvdrun import run

ONCE = 200  # hvd_dgc.adam.FROZEN_ONCE_FREEZE: freeze_variance="auto", refresh_variance=False
VARIANTS = {"default": {},  # (0/1 Adam: the sign, period 4)
            "top-k": {"compression": "dgc"},
            "frozen once": {"compression": "dgc", "refresh_variance": False},
            "density=0.01": {"density": 0.01, "warmup": 200, "warmup_unit": "step"}}


@pytest.fixture(scope="module")
def lm():
    results = run("tests.torch.adam_lm:side_by_side", np=2, controller="gloo",
                  kwargs={"variants": VARIANTS, "steps": 400})
    return results


def test_adamw_on_real_text_stays_close_to_horovod_with_fewer_bytes(lm):
    from hvd_dgc.adam import FROZEN_ONCE_FREEZE
    assert FROZEN_ONCE_FREEZE == ONCE
    for out in lm:
        curves, numel = out["curves"], out["numel"]
        dense = curves["horovod"]
        assert out["start"] > 0.9 * math.log(256) and dense[-1] < 2.3  # it learned
        whole = 4.0 * numel * out["steps"]
        # (label, loss bound at step 400 vs Horovod's, fewer bytes over the run)
        for label, bound, fewer in (("top-k", 0.06, 2.5), ("frozen once", 0.03, 1.3),
                                    ("density=0.01", 0.08, 5.0), ("default", 0.03, 12.0)):
            curve, res = curves[label], out[label]
            assert all(b < a for a, b in zip(curve, curve[1:])), (label, curve)
            assert curve[3] < (1 + bound) * dense[3], (label, curve[3], dense[3])
            assert whole / res["bytes"] > fewer, (label, whole / res["bytes"])
            assert res["phase"] == "frozen variance" and res["identical"], (label, res)
        # frozen once at 200: Adam itself on the dense average to the freeze (steps 100
        # and 200), then at least 2x fewer bytes than dense after it
        once, res = curves["frozen once"], out["frozen once"]
        assert max(abs(a - b) for a, b in zip(once[:2], dense[:2])) < 1e-4
        after = res["bytes"] - 4.0 * numel * ONCE
        assert 4.0 * numel * (out["steps"] - ONCE) / after > 2.0, after
        # refreshed: less than half the bytes of the 200-step warm-up
        assert out["top-k"]["bytes"] < 0.5 * res["bytes"]
        # the default, 0/1 Adam: closer to Horovod than the top-k take-over, with 1.5x
        # fewer bytes again (9.8 MB against 16.0, the top-k's positions coded and its
        # values in 8 bits)
        zero_one = out["default"]
        assert curves["default"][-1] < curves["top-k"][-1]
        assert zero_one["bytes"] < out["top-k"]["bytes"] / 1.5, (zero_one, out["top-k"])


def test_the_benchmarks_cosine_schedule_warms_up_then_ends_at_a_tenth():
    """bench/adam_lm.py ``--lr-schedule cosine`` (its torch LambdaLR and Keras schedule
    share harness/stdlib_lm.py's ``lr_factor``): 1/150 at step 0 of 3,000, the peak at 149-150, half-way down
    the cosine (0.55) at its middle, 0.1 at the last step."""
    from harness.stdlib_lm import lr_factor
    assert lr_factor(0, 3000) == 1 / 150 and lr_factor(149, 3000) == 1.0
    assert lr_factor(150, 3000) == 1.0
    assert math.isclose(lr_factor(150 + 2849 // 2, 3000), 0.55, abs_tol=1e-3)
    assert math.isclose(lr_factor(2999, 3000), 0.1)
