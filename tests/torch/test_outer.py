"""The outer loop (hvd_dgc/outer.py, hvd_dgc/torch/outer.py): the update against the
NumPy reference (hand vectors, then whole runs replayed), synchronous training at H = 1,
AdamW inside, checkpoints, and the options it refuses. 2 ranks under horovodrun."""

import numpy as np
import pytest
import torch

from harness.hvdrun import run
from hvd_dgc.config import DGCConfig
from hvd_dgc.outer import OuterLoop, check_outer, outer_step
from tests import reference as ref
from tests.torch.test_optimizer import _checked

SCENARIOS = ["reference_quadratic", "sync_equivalence", "adamw_trains",
             "checkpoint_resumes_exactly", "elastic_sync_takes_rank_0s_round",
             "overlap_checkpoint_needs_flush"]


@pytest.fixture(scope="module")
def gloo():
    return run("tests.torch.torch_outer:suite", np=2, controller="gloo",
               kwargs={"names": SCENARIOS})


def test_outer_update_hand_vectors():
    """Nesterov, lr 0.5, momentum 0.9, by hand: round 1 b = a = (0.5, -1), step = a +
    0.9 b = (0.95, -1.9), anchor (1, 2) -> (0.525, 2.95); round 2 a = (1, 0): b = 0.9 b +
    a = (1.45, -0.9), step = (2.305, -0.81), anchor -> (-0.6275, 3.355). Heavy ball
    steps by b itself."""
    anchor, b = ref.outer_update([1.0, 2.0], [0.5, -1.0], None, 0.5, 0.9, nesterov=True)
    np.testing.assert_allclose(anchor, [0.525, 2.95], rtol=1e-6)
    anchor, b = ref.outer_update(anchor, [1.0, 0.0], b, 0.5, 0.9, nesterov=True)
    np.testing.assert_allclose(b, [1.45, -0.9], rtol=1e-6)
    np.testing.assert_allclose(anchor, [-0.6275, 3.355], rtol=1e-6)
    heavy, _ = ref.outer_update([1.0, 2.0], [0.5, -1.0], np.float32([1.0, 1.0]), 0.5, 0.9)
    np.testing.assert_allclose(heavy, [1 - 0.5 * 1.4, 2 - 0.5 * -0.1], rtol=1e-6)
    plain, none = ref.outer_update([1.0, 2.0], [0.5, -1.0], None, 1.0)
    np.testing.assert_allclose(plain, [0.5, 3.0]) and none is None
    # the framework-free step (what torch runs) is the reference's
    config = OuterLoop(steps=1, lr=0.5, momentum=0.9, nesterov=True)
    step, buffer = outer_step(config, np.float32([0.5, -1.0]), None)
    np.testing.assert_allclose(step, [0.95, -1.9], rtol=1e-6)
    step, buffer = outer_step(config, np.float32([1.0, 0.0]), buffer)
    np.testing.assert_allclose(step, [2.305, -0.81], rtol=1e-6)


def test_outer_average_hand_vectors():
    """Two ranks, one tensor of 4, k = 1: rank 0 sends its largest |v| (-3 at 1), rank 1
    its (2 at 3); the average is their sum / 2 and each keeps the rest."""
    residuals = [np.zeros(4, np.float32), np.float32([0, 0, 0, 1])]
    avg = ref.outer_average([np.float32([1, -3, 0.5, 0]), np.float32([0.5, 0, 0, 1])],
                            residuals, [4], [1])
    np.testing.assert_allclose(avg, [0, -1.5, 0, 1.0])
    np.testing.assert_allclose(residuals[0], [1, 0, 0.5, 0])
    np.testing.assert_allclose(residuals[1], [0.5, 0, 0, 0])
    # decayed (SparseLoCo, beta 0.5): rank 1's owed 1 at 3 counts 0.5, so its
    # v = (0.5, 0, 0, 1.5) sends 1.5 at 3 and keeps 0.5 at 0
    residuals = [np.zeros(4, np.float32), np.float32([0, 0, 0, 1])]
    avg = ref.outer_average([np.float32([1, -3, 0.5, 0]), np.float32([0.5, 0, 0, 1])],
                            residuals, [4], [1], decay=0.5)
    np.testing.assert_allclose(avg, [0, -1.5, 0, 0.75])
    np.testing.assert_allclose(residuals[1], [0.5, 0, 0, 0])
    # values in 2 bits: one tensor's sent (-3, 0.5, 1.25) arrive as -3, 0.5 and the
    # nearer of 0.5 and 3 for 1.25 (0.5); 3 bits: levels 0.5, 1.333.., 2.1666.., 3
    np.testing.assert_allclose(ref.low_bit([-3.0, 0.5, 1.25], 2), [-3, 0.5, 0.5])
    np.testing.assert_allclose(ref.low_bit([-3.0, 0.5, 1.25, 2.0], 8)[:2], [-3, 0.5])
    residuals = [np.zeros(4, np.float32)]
    avg = ref.outer_average([np.float32([1.25, -3, 0.5, 0])], residuals, [4], [3],
                            value_bits=2)
    np.testing.assert_allclose(avg, [0.5, -3, 0.5, 0])
    np.testing.assert_allclose(residuals[0], [0.75, 0, 0, 0])  # the rounding, owed


def _replay(start, steps, lr, outer, sizes, ks=None, world=2):
    """The whole run in NumPy: inner SGD on x - T per rank, a round every H steps (with
    ``overlap``, each round's average applied at the end of the next), then ``flush()``.
    Returns each rank's weights before the flush and after it."""
    anchor = np.float32(start)
    xs = [anchor.copy() for _ in range(world)]
    starts = [anchor.copy() for _ in range(world)]
    residuals = [np.zeros_like(anchor) for _ in range(world)]
    buffer = pending = None
    for step in range(steps):
        for r in range(world):
            t = np.concatenate([a.reshape(-1) for a in ref.outer_targets(step, r)])
            xs[r] = xs[r] - np.float32(lr) * (xs[r] - t)
        if (step + 1) % outer.steps == 0:
            own = [s - x for s, x in zip(starts, xs)]
            average = ref.outer_average(own, residuals, sizes, ks, outer.residual_decay,
                                        outer.value_bits)
            if not outer.overlap:
                anchor, buffer = ref.outer_update(anchor, average, buffer, outer.lr,
                                                  outer.momentum, outer.nesterov)
                starts = [anchor.copy() for _ in range(world)]
            else:
                if pending is not None:
                    anchor, buffer = ref.outer_update(anchor, pending, buffer, outer.lr,
                                                      outer.momentum, outer.nesterov)
                pending = average
                starts = [anchor - d for d in own]
            xs = [s.copy() for s in starts]
    before = [x.copy() for x in xs]
    if pending is not None:  # flush: what is in flight, then the round under way
        anchor, buffer = ref.outer_update(anchor, pending, buffer, outer.lr, outer.momentum,
                                          outer.nesterov)
    if steps % outer.steps:
        average = ref.outer_average([s - x for s, x in zip(starts, xs)], residuals, sizes, ks,
                                    outer.residual_decay, outer.value_bits)
        anchor, buffer = ref.outer_update(anchor, average, buffer, outer.lr, outer.momentum,
                                          outer.nesterov)
    return before, anchor


def assert_as_replayed(ranks, variant):
    """Each rank's run ``variant`` of tests/reference.py ``OUTER_RUNS`` (a framework's
    worker) against the NumPy replay: its weights before and after ``flush()``, which
    ranks are identical, its counts and bytes. Returns the replay's settings."""
    steps, changes, _, ks = ref.OUTER_RUNS[variant]
    outer = OuterLoop(steps=3, lr=0.7, momentum=0.9, nesterov=True)._replace(**changes)
    xs, flushed = _replay(ranks[0]["start"], steps, 0.1, outer, [2000, 30], ks)
    for rank, out in enumerate(ranks):
        np.testing.assert_allclose(out["final"], xs[rank], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["flushed"], flushed, rtol=1e-5, atol=1e-5)
        assert out["stats"]["rounds"] == steps // 3 and out["stats"]["inner_steps"] == steps
        assert out["stats"]["in_flight"] == int(outer.overlap)
        assert out["identical_after_flush"] and out["flushed_stats"]["in_flight"] == 0
    # right after a round every rank holds the anchor, bit for bit; with overlap each
    # also holds its own change of that round, whose average is in flight
    assert all(out["identical"] for out in ranks) == (steps % 3 == 0 and not outer.overlap)
    stats = ranks[0]["flushed_stats"]
    assert stats["rounds"] == -(-steps // 3)  # the flush ended the round under way
    per_round = 2030 * 4 if ks is None else (
        sum(ks) * 8 if outer.value_bits == 32  # int32 positions, then fp32 values; or
        else sum(ks) * 4 + 2 * 8 + outer.value_bits * -(-sum(ks) // 8))  # lo, hi, planes
    assert stats["bytes_sent"] == stats["rounds"] * per_round
    assert stats["round_fp32_bytes"] == stats["rounds"] * 2030 * 4
    assert stats["dense_fp32_bytes"] == steps * 2030 * 4  # Horovod's, every inner step
    assert stats["compression_ratio"] == stats["dense_fp32_bytes"] / stats["bytes_sent"]
    assert stats["paths"] == {"dense" if ks is None else "sparse": 2 * stats["rounds"]}
    if "launched" in ranks[0]:  # PyTorch's: one Horovod operation a round, records packed
        one = "allreduce_async_" if ks is None else "allgather_async"
        for out in ranks:
            assert out["launched"] == {"allreduce_async_": 0, "allgather_async": 0,
                                       one: steps // 3}, out["launched"]
    return steps, outer


@pytest.mark.parametrize("variant", list(ref.OUTER_RUNS))
def test_torch_matches_the_reference_round_by_round(gloo, variant):
    ranks = [out[variant] for out in _checked(gloo, "reference_quadratic")]
    assert_as_replayed(ranks, variant)
    for out in ranks:  # the time the rounds' ends stood still for the link, counted
        assert 0 < out["stats"]["waited_seconds"] < 60, out["stats"]


def test_one_inner_step_a_round_with_outer_sgd_of_lr_1_is_synchronous_training(gloo):
    for out in _checked(gloo, "sync_equivalence"):
        assert out["moved"] > 1e-2
        assert max(out["diffs"]) < 2e-6, out["diffs"]  # float rounding of x - (x - lr g)
        assert all(out["identical"])


def test_adamw_inside_trains_and_ranks_meet_at_every_round(gloo):
    outs = _checked(gloo, "adamw_trains")
    for out in outs:
        log = out["log"]
        assert all(e["identical"] for e in log if e["step"] % 4 == 0)
        assert not any(e["identical"] for e in log if e["step"] % 4)  # local steps
        first, last = np.mean([e["loss"] for e in log[:4]]), np.mean([e["loss"] for e in
                                                                      log[-4:]])
        assert last < 0.8 * first, (first, last)
    stats, numels = outs[0]["stats"], outs[0]["numels"]
    assert stats["rounds"] == 10 and stats["steps_per_round"] == 4
    ks = [n if n < 1000 else max(1, int(np.ceil(0.05 * n))) for n in numels]
    assert stats["bytes_sent"] == 10 * 8 * sum(ks)
    # per inner step, against dense data-parallel's fp32 gradient every step
    assert stats["bytes_sent"] / (40 * 4 * sum(numels)) < 0.05


def test_checkpoint_in_the_middle_of_a_round_resumes_bit_for_bit(gloo):
    for out in _checked(gloo, "checkpoint_resumes_exactly"):
        assert out["equal"] and out["rounds"] == 3 and out["inner"] == 14


def test_with_overlap_a_checkpoint_asks_for_flush_first(gloo):
    for out in _checked(gloo, "overlap_checkpoint_needs_flush"):
        assert out["refused"].startswith("hvd_dgc: a round's exchange is in flight"), out
        assert "Call optimizer.flush() after step() before optimizer.state_dict()" in \
            out["refused"]
        assert out["saved"] and out["identical"]


def test_an_elastic_sync_hands_every_rank_rank_0s_round(gloo):
    for out in _checked(gloo, "elastic_sync_takes_rank_0s_round"):
        assert out["same"] and out["inner"] == 5 and out["weights_identical"]


@pytest.mark.parametrize("options,message", [
    ({"delay": 2}, "with delay=2: the outer loop already exchanges once every 8 steps"),
    ({"period": 4}, "with period=4"),
    ({"density": 0.01, "warmup": 2}, "takes density as a number in \\(0, 1\\]"),
    ({"density": lambda step, epoch: 0.1}, "takes density as a number"),
    ({"residual_decay": 0.95}, "with the change sent whole \\(density 1.0\\) nothing is "
                               "owed: pass density < 1"),
    ({"residual_decay": 0.95, "density": 1.0}, "pass density < 1"),
    ({"value_bits": 2}, "value_bits=2\\) sends the records' values in fewer bits; with "
                        "the change sent whole \\(density 1.0\\) there are no records"),
])
def test_options_that_mean_nothing_in_an_outer_loop_are_refused(options, message):
    options = dict(options)
    outer = OuterLoop(steps=8, residual_decay=options.pop("residual_decay", 1.0),
                      value_bits=options.pop("value_bits", 32))
    with pytest.raises(ValueError, match=message):
        check_outer(outer, DGCConfig(**options), True, True)


@pytest.mark.parametrize("outer,message", [
    (OuterLoop(steps=0), "steps=0\\): the inner steps per round must be an int >= 1"),
    (OuterLoop(steps=2.5), "must be an int >= 1"),
    (OuterLoop(lr=0.0), "lr=0.0\\): the outer learning rate"),
    (OuterLoop(momentum=1.0), "momentum=1.0\\) must be in \\[0, 1\\)"),
    (OuterLoop(momentum=0.0), "nesterov=True\\) needs momentum > 0"),
    (OuterLoop(overlap="yes"), "overlap='yes'\\) must be True or False"),
    (OuterLoop(residual_decay=0.0), "residual_decay=0.0\\) must be a number in \\(0, 1\\]"),
    (OuterLoop(residual_decay=1.5), "SparseLoCo uses 0.95"),
    (OuterLoop(value_bits=3), "value_bits=3\\) must be one of \\(32, 8, 4, 2\\)"),
    (OuterLoop(value_bits=True), "value_bits=True"),
])
def test_bad_outer_settings_name_the_fix(outer, message):
    with pytest.raises(ValueError, match=message):
        outer.check()


def test_the_wrapper_refuses_what_the_outer_loop_cannot_honour():
    import hvd_dgc.torch as hvd
    model = torch.nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="outer must be a hvd_dgc.OuterLoop"):
        hvd.DistributedOptimizer(sgd, outer=8)
    with pytest.raises(ValueError, match="sends the weights' change as DGC's records"):
        hvd.DistributedOptimizer(sgd, outer=OuterLoop(), compression=hvd.Compression.powersgd)
    with pytest.raises(ValueError, match="op must be Average"):
        hvd.DistributedOptimizer(sgd, outer=OuterLoop(), op=hvd.Sum)
