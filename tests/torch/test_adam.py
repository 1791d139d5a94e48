"""Adam and AdamW taken over (hvd_dgc/adam.py) on 2 real Horovod ranks (horovodrun --gloo):
the NumPy reference step by step, sparse runs, checkpoints."""

import pytest

from harness.hvdrun import run
from tests.torch.test_optimizer import _checked

SCENARIOS = ["reference_equivalence", "sparse_run", "checkpoint", "lagging_reference",
             "period_run", "late_tensor", "refresh_reference", "declined_on_a_fast_link",
             "sign_reference", "zero_one_default", "zero_one_checkpoint",
             "taken_back_at_their_size"]


@pytest.fixture(scope="module")
def gloo():
    # verbose: the full plan at wrap time, whose words the tests read (the default short
    # line: tests/core/test_messages.py)
    return run("tests.torch.torch_adam:suite", np=2, controller="gloo",
               kwargs={"names": SCENARIOS}, env={"HVD_DGC_VERBOSE": "1"})


def test_frozen_adam_equals_the_reference_at_density_one(gloo):
    for out in _checked(gloo, "reference_equivalence"):
        assert set(out) == {f"{cls}.{variant}" for cls in ("Adam", "AdamW")
                            for variant in ("dense", "allgather", "clipped")}
        for name, res in out.items():
            assert res["moved"] > 1e-3, (name, "nothing moved after the freeze")
            # float32 rounding in the warm-up, where torch's Adam orders its operations
            # otherwise (m by lerp_, the clip's norm) and a small |g| next to eps
            # amplifies it: far below a step (lr 0.01), which a mistake in the maths
            # would be off by; and the frozen steps add almost nothing to it
            diffs = res["diffs"]
            assert max(diffs) < 3e-5, (name, diffs)
            assert max(diffs[4:]) <= 1.1 * diffs[3] + 1e-6, (name, diffs)
            assert res["identical"], name
            assert res["phase"] == "frozen variance"
        # 6 tensors a step, 9 steps; allgather forced on the 3 weights (the biases: dense)
        assert out["AdamW.dense"]["paths"] == {"dense": 6 * 9}
        assert out["AdamW.allgather"]["paths"] == {"dense": 3 * 9, "sparse": 3 * 9}  # forced
        assert out["AdamW.clipped"]["clipped"] and out["Adam.clipped"]["clipped"]


def test_sparse_adamw_after_the_freeze(gloo):
    for out in _checked(gloo, "sparse_run"):
        assert out["identical"]
        assert out["phases"][:9] == ["exact Adam"] * 9
        assert out["phases"][9:] == ["frozen variance"] * 21
        # wide_mlp: 3 weights >= 1024 elements go sparse from the freeze, the biases dense
        assert out["paths"] == {"dense": 6 * 10 + 3 * 20, "sparse": 3 * 20}
        assert out["ratio"] > 1.5
        assert out["last"] < 0.8 * out["first"], (out["first"], out["last"])


def test_checkpoint_carries_the_frozen_variance(gloo):
    for out in _checked(gloo, "checkpoint"):
        assert out["scales"] == out["params"] == 6
        assert out["equal"]
        assert out["step"] == 18


def test_delayed_averaging_with_adamw_equals_the_reference(gloo):
    for out in _checked(gloo, "lagging_reference"):
        assert max(out["diffs"]) < 3e-5, out["diffs"]
        # synchronous to the freeze (step 4), then each rank applies its own part first
        assert out["identical"][:4] == [True] * 4 and not any(out["identical"][4:])
        assert out["apart"] > 1e-4
        assert out["in_flight"] == [0, 0, 0, 0, 1, 2, 2, 2, 2, 2]
        assert out["flushed_diff"] < 3e-5 and out["flushed_identical"]


def test_adamw_with_sign_compression_is_one_bit_adam_and_equals_the_reference(gloo):
    """compression=Compression.sign takes AdamW over as the sparse compressors do: dense
    exact Adam to the freeze (step 4), then the scaled sign of the memory, the rest kept
    (tests/reference.py ``sign_sent``), synchronous with refreshes, with delay=2, and
    with period=2 (0/1 Adam's local steps)."""
    for out in _checked(gloo, "sign_reference"):
        for name, res in out.items():
            # float32 rounding, as at density one; but a sign is not continuous: an
            # element the memory holds within rounding of 0 (|v| / mean|v| reaches 2.5e-6
            # here) may be sent with the other sign than the reference's, a step of
            # 2 lr mean|v| on that one coordinate, which error feedback then carries.
            # A run that sent the memory whole instead ends off in most coordinates
            # (dense_off, of 85,002), as would a mistake in the scale or the residual.
            assert max(res["diffs"][:4]) < 3e-5, (name, res["diffs"])  # exact Adam
            assert max(res["off"]) <= 20, (name, res["off"])
            assert res["flushed_off"] <= 20 and res["flushed_diff"] < 3e-6, (name, res)
            assert res["dense_off"] > res["numel"] // 2, (name, res["dense_off"])
            assert res["identical"], name
            assert res["phases"] == ["exact Adam"] * 3 + ["frozen variance"] * 8, name
            # 6 tensors; the 3 weights dense for the 4 exact steps, then sign at each of
            # the 7 steps after, or at every 2nd (steps 5, 7, 9), the biases dense beside
            exchanges = 3 if name == "period=2" else 7
            assert res["paths"] == {"dense": 6 * 4 + 3 * exchanges, "sign": 3 * exchanges}, \
                (name, res)
        assert out["delay=0"]["refreshes"] == 3 and out["delay=2"]["refreshes"] is None


def test_refreshed_variance_equals_the_reference_synchronous_and_delayed(gloo):
    for out in _checked(gloo, "refresh_reference"):
        for delay in (0, 2):
            res = out[f"delay={delay}"]
            assert max(res["diffs"]) < 3e-5, (delay, res["diffs"])
            assert res["refreshed"] > 1e-4, delay  # the refreshes changed the run
            # refreshed at the ends of steps 6, 8 and 10 (Adam's count), each one dense
            # exchange more than the step's own
            assert res["refreshes"] == [0] * 5 + [1, 1, 2, 2, 3, 3], res["refreshes"]
            extra = [round(s - 1.0, 6) for s in res["dense_steps_sent"]]
            assert extra == [0.0] * 5 + [1.0, 0.0] * 3, extra
            assert res["flushed_diff"] < 3e-5 and res["identical"], delay
        sparse = out["sparse"]
        assert sparse["identical"] and sparse["refresh"] == "auto"
        assert sparse["refreshes"] == 2  # at steps 10 and 20 of a freeze at 5
        assert sparse["last"] < 0.8 * sparse["first"], (sparse["first"], sparse["last"])


def test_adamw_is_left_exact_while_every_tensor_goes_dense(gloo):
    """A link on which the cost model sends every tensor dense even at the final density,
    or only a small one sparse: freezing Adam's variance would buy (next to) nothing, so
    AdamW stays exact, every tensor dense, and equals Horovod's own, bit for bit, past
    the default freeze; said on rank 0's line. Where
    only the first stages go dense, the freeze moves to the first sparse one."""
    for rank, out in enumerate(_checked(gloo, "declined_on_a_fast_link")):
        assert out["diff"] == 0.0, out["diff"]
        assert out["phase"].startswith("exact Adam (not taken over") and out["freeze"] is None
        assert out["paths"] == {"dense": 6 * 30}
        assert out["slow_phase"] == "exact Adam" and not out["slow_declined"]  # 1 Gbit/s
        # with no option AdamW runs 0/1 Adam (the sign, period 4) where it is taken over,
        # and where it is declined the period goes too: Horovod's step, every step
        assert (out["slow_compressor"], out["slow_period"]) == ("SignCompressor", 4)
        assert (out["compressor"], out["period"]) == ("SignCompressor", 1)
        if rank == 0:
            assert "an exchange every 4 steps (period=4), each rank stepping on its own " \
                   "between: 0/1 Adam (Lu et al.), Adam's default" in out["slow_line"], \
                out["slow_line"]
            assert "period=" not in out["line"], out["line"]
        # only the classifier (2,560 of 85,002 weights) would go sparse: under a tenth of
        # the gradient, so declined too, every tensor dense, Horovod's AdamW bit for bit
        few = out["few"]
        assert few["diff"] == 0.0 and few["paths"] == {"dense": 6 * 30}, few
        assert few["phase"].startswith("exact Adam (not taken over") and \
            few["share"] == 2560 / 85002, few
        if rank == 0:
            assert "Adam not taken over: 3.0% of the gradient would go sparse on this " \
                   "link (under 10%: every tensor goes dense)" in few["line"], few["line"]
        if rank == 0:
            assert "Adam not taken over: every tensor goes dense on this link" in out["line"]
            assert "second moment frozen" not in out["line"], out["line"]
        # a first stage that goes dense on this link: the freeze moves from step 4 to 10,
        # where the sparse stage starts; Horovod's AdamW bit for bit until then
        later = out["later"]
        assert later["freeze"] == 10 and later["identical"], later
        assert later["diffs"][:10] == [0.0] * 10 and min(later["diffs"][10:]) > 0, later
        assert later["phases"][:9] == ["exact Adam"] * 9, later["phases"]
        assert later["phases"][10:] == ["frozen variance"] * 4, later["phases"]
        assert later["paths"] == {"dense": 6 * 10 + 3 * 4, "sparse": 3 * 4}, later["paths"]
        if rank == 0:
            assert "exact Adam to step 10 (every tensor dense on this link before it)" in \
                later["line"], later["line"]


def test_adamw_with_no_option_is_zero_one_adam(gloo):
    """The one-line switch with AdamW (adam.py ZERO_ONE_PERIOD): the run is
    ``compression=sign, period=4``'s bit for bit; between exchanges after the freeze at 20
    each rank holds its own weights (steps 20-22 of each 4); the 4th exchanges, and its
    average replaces the ranks' own steps (each taken back at the bias correction it was
    applied with: tests/reference.py ``lagged_update``), so the ranks agree to rounding
    after it; equal after flush(); period=1 or density chosen run what they say
    (period=1: the sign every step, 1-bit Adam)."""
    for rank, out in enumerate(_checked(gloo, "zero_one_default")):
        assert out["diffs"] == [0.0] * 30 and out["flushed_diff"] == 0.0, out["diffs"]
        spread = out["apart"]
        assert spread[:20] == [0.0] * 20, spread  # exact Adam on dense averages
        local = [s for s in range(20, 30) if (s + 1) % 4]
        assert min(spread[s] for s in local) > 1e-4, spread  # (lr 3e-3: local steps)
        assert spread[23] < 1e-6 and spread[27] < 1e-6, spread  # (4.5e-8, 7.5e-8)
        assert out["identical"]
        assert out["periods"] == [4, 4, 1, 1], out["periods"]
        assert out["compressors"] == ["SignCompressor"] * 3 + ["DGCCompressor"], \
            out["compressors"]  # (the 3rd: period=1, the 4th: density=0.01)
        # 6 tensors for the 20 exact steps; then the 3 weights' signs and the 3 biases
        # dense at the exchanges of steps 23 and 27 (the flush's of 28-29 is not a step)
        assert out["paths"] == {"dense": 6 * 20 + 3 * 2, "sign": 3 * 2}, out["paths"]
        assert out["phase"] == "frozen variance"
        if rank == 0:
            assert "compressor sign" in out["line"] and "0/1 Adam" in out["line"], out["line"]


def test_own_steps_are_taken_back_at_the_size_they_were_applied_with(gloo):
    """After every exchange the ranks agree to float rounding, where the step size moves
    between a local step and its exchange: Adam's bias correction just after the freeze
    with AdamW's decay (taken back at the exchange's size, as before, they ended 5e-2 to
    9e-2 apart on a smaller MLP), and a schedule that changes SGD's rate every step. A
    rate of 0 at an exchange cannot take anything back: said once, and the ranks stay
    apart until a flush."""
    for rank, out in enumerate(_checked(gloo, "taken_back_at_their_size")):
        assert_taken_back_at_their_size(out, rank)


def assert_taken_back_at_their_size(out, rank):
    """Both frameworks' ``taken_back_at_their_size``: exact Adam to the freeze, the ranks
    apart (> 1e-3) at each local step and equal to rounding (< 1e-6) after each exchange,
    for AdamW and the SGD schedule; the rate of 0 at step 7's exchange left the ranks
    apart, said once, on rank 0 (hvd_dgc/say.py)."""
    adamw, sgd, zero = (out[k]["spread"] for k in ("adamw", "sgd_schedule", "zero_rate"))
    assert adamw[:3] == [0.0] * 3, adamw  # exact Adam on dense averages
    for spread, local in ((adamw, range(4, 16)), (sgd, range(16))):
        exchanges = [s for s in local if (s + 1) % 4 == 0]
        assert max(spread[s] for s in exchanges) < 1e-6, spread
        assert min(spread[s] for s in local if s not in exchanges) > 1e-3, spread
    assert zero[3] < 1e-6 and zero[7] > 1e-3, zero  # lr 0 at the exchange of step 7
    assert len(out["zero_rate"]["said"]) == (rank == 0) and not out["sgd_schedule"]["said"], \
        out


def test_the_default_saved_between_exchanges_resumes_bit_for_bit(gloo):
    """A Horovod script saves without flush(): with 0/1 Adam's period that is between
    exchanges 3 times in 4. ``state_dict()`` takes this rank's own steps since the last
    exchange back first (their velocity is still in the memory), so the file holds the
    weights the ranks agree on and nothing in flight: the resumed run equals the one
    that saved, bit for bit; rank 0 saving alone leaves the ranks as close after the
    next exchange as never saving does."""
    for out in _checked(gloo, "zero_one_checkpoint"):
        assert out["period"] == 4
        (in_flight, apart), (left, close) = out["before"], out["after"]
        assert in_flight == 2 and left == 0, out
        assert apart > 1e-3 and close < 1e-6, out  # own steps taken back (to 3e-8)
        assert out["resumed"] == 0.0, out
        assert out["alone"] < 2 * out["never"] + 1e-6, out
        assert out["alone_flushed"] and out["never_flushed"], out


def test_period_with_adamw_exchanges_every_third_step_after_the_freeze(gloo):
    for out in _checked(gloo, "period_run"):
        assert out["exchanged"][:6] == [True] * 6
        assert out["exchanged"][6:] == [(s + 1) % 3 == 0 for s in range(6, 24)]
        assert out["identical"]
        assert out["last"] < 0.8 * out["first"], (out["first"], out["last"])


def test_a_tensor_without_gradient_in_the_warm_up_gets_the_typical_variance(gloo):
    for out in _checked(gloo, "late_tensor"):
        # (1 - beta1)/eps would be 1e7; the others' own scales are a few hundred at most
        assert out["uniform"] and out["late"] < 10 * out["others"], out
        assert out["finite"] and out["identical"] and out["moved"] > 1e-4
