"""The step's timeline (hvd_dgc/overlap.py): what the backward pass hides, each tensor's
path chosen by the time the step takes, and the profile every rank agrees on. Timelines
worked by hand; framework-free."""

import dataclasses

import pytest

from hvd_dgc import CostModel
from hvd_dgc.overlap import (BackwardProfile, Candidate, PlanTrial, ProfileRecorder,
                             choose_paths, exchange_ends, profile_from, timeline_differs)
from hvd_dgc.packing import gather_index_bytes
from hvd_dgc.paths import PathKind
from hvd_dgc.plan import Planner, TensorInfo
from hvd_dgc.torch import Compression
from tests.core.test_plan import _planner

DENSE, SPARSE = PathKind.DENSE, PathKind.ALLGATHER


def test_the_timeline_by_hand():
    """Two dense transfers of 50 ms: the first, ready 100 ms before the backward pass
    ends, runs from -100 to -50 ms; the second, ready at the end, 0 to 50: 50 ms exposed.
    DGC's 30 ms of work in the first hook makes the second ready at 30 ms, and the
    first's 5 ms transfer hides: 80 ms exposed."""
    order = [("a", 0.1), ("b", 0.0)]
    dense = Candidate(DENSE, 0.05)
    assert exchange_ends(order, {"a": dense, "b": dense}) == pytest.approx(0.05)
    sparse = Candidate(SPARSE, 0.005, local=0.03)
    assert exchange_ends(order, {"a": sparse, "b": dense}) == pytest.approx(0.08)
    # one link: a 150 ms transfer ready at -100 ms holds the next back to 50 ms
    assert exchange_ends(order, {"a": Candidate(DENSE, 0.15), "b": dense}) == \
        pytest.approx(0.1)
    # a path launched at synchronize hides nothing, however early its gradient
    assert exchange_ends(order, {"a": Candidate(DENSE, 0.05, at_end=True), "b": dense}) == \
        pytest.approx(0.1)
    assert exchange_ends([], {}) == 0.0


def test_a_hidden_dense_transfer_beats_a_sparse_path_the_sums_prefer():
    """Tensor a, ready 200 ms early: dense 100 ms against sparse 10 + 30 ms of work. The
    sums say sparse (40 < 100); the timeline says dense (hidden: 0 against 30 ms of work
    on the training thread). Tensor b, ready at the end, cannot hide: sparse (40 < 100)."""
    order = [("a", 0.2), ("b", 0.0)]
    both = [Candidate(SPARSE, 0.01, 0.03), Candidate(DENSE, 0.1)]
    plan = choose_paths(order, {"a": both, "b": both})
    assert plan.paths == {"a": DENSE, "b": SPARSE}
    assert plan.exposed == pytest.approx(0.04)  # b: 30 ms of work, then 10 ms on the link
    assert plan.exposed == pytest.approx(exchange_ends(order, {"a": both[1], "b": both[0]}))


def test_a_busy_link_sends_the_next_tensor_sparse():
    """a's 100 ms dense transfer, ready 100 ms early, keeps the link to the end; b, ready
    50 ms early, would wait for it (dense ends at 100 ms), so it goes sparse (20 ms of work,
    10 on the link from 20 ms... the link is free at 0: ends at 30 ms, work at 20)."""
    order = [("a", 0.1), ("b", 0.05)]
    plan = choose_paths(order, {"a": [Candidate(DENSE, 0.1)],
                                "b": [Candidate(SPARSE, 0.01, 0.02), Candidate(DENSE, 0.1)]})
    assert plan.paths == {"a": DENSE, "b": SPARSE}
    assert plan.exposed == pytest.approx(0.02)  # b ready at -30 ms, link free at 0: 0-10 ms


def test_equal_times_keep_the_candidates_order():
    order = [("a", 0.5)]
    plan = choose_paths(order, {"a": [Candidate(SPARSE, 0.1), Candidate(DENSE, 0.2)]})
    assert plan.paths == {"a": SPARSE} and plan.exposed == 0.0  # both hidden: the first


def test_the_recorder_leaves_out_hvd_dgcs_own_work_and_the_first_steps():
    """Step 0 settles; steps 1-2 measured (settle=1, steps=2). In step 1, a is ready at
    10.0 s and its hook works 0.3 s; b is ready at 10.5 s, which is 10.2 s in the clock
    without that work: h_a = 0.2, h_b = 0."""
    rec = ProfileRecorder(settle=1, steps=2)
    rec.ready("a", 1.0)
    rec.own(5.0)  # (not measuring: ignored)
    rec.end_step()
    assert rec.measuring and not rec.done and rec.sums == {}
    rec.ready("a", 10.0)
    rec.own(0.3)
    rec.ready("b", 10.5)
    rec.end_step()
    rec.ready("b", 19.0)  # step 2: two backward passes (accumulated): the last counts,
    rec.ready("b", 20.0)  # b first, a 0.1 s later
    rec.ready("a", 20.1)
    rec.end_step()
    assert rec.done and not rec.measuring
    assert rec.sums == pytest.approx({"a": 0.2, "b": 0.1})
    assert rec.backward == pytest.approx(0.3)
    totals = rec.totals(["a", "b", "c"])
    assert totals == [200000, 100000, 0, 300000] and all(isinstance(t, int) for t in totals)
    # two ranks' totals summed (as the allreduce does), then the mean per rank and step
    profile = profile_from(["a", "b", "c"], [2 * t for t in totals], ranks=2, steps=2)
    assert profile.hide == pytest.approx({"a": 0.1, "b": 0.05, "c": 0.0})
    assert profile.backward == pytest.approx(0.15) and profile.steps == 2
    assert "150.0 ms" in profile.words()


FC = TensorInfo(0, "fc.weight", 1 << 20, (1024, 1024))
CONV = TensorInfo(1, "conv.weight", 1 << 20, (1024, 1024))
BIAS = TensorInfo(2, "fc.bias", 512, (512,))


def _measured(world=2, **options):
    """A planner as the measured cost model leaves it: 1 Gbit/s, DGC's work 2 ns an
    element, a sparse path wanted twice as cheap as dense."""
    resolved = _planner(world, **options).resolved
    planner = Planner(resolved, [FC, CONV, BIAS], world)
    planner.cost_model = CostModel(select_element_seconds=2e-9, dense_preference=2.0)
    planner.replan(world)
    return planner


def test_the_profile_replaces_the_dense_preference():
    """2 ranks, 1 Gbit/s, 2^20-element weights: an allreduce is 33.6 ms; at 25% an
    allgather 9.5 ms (an fp32 value and half a byte of coded position a record) plus
    8.4 ms of DGC's work (8 ns an element). By the sums weighed twice: dense (35.8 >
    33.6). With a profile where fc (ready first) has 50 ms of backward after it, its
    allreduce hides (0 against 8.4 ms of work): dense; conv, ready last, hides nothing:
    sparse (17.9 < 33.6). At 1%: fc still hidden, dense; conv sparse. (fp32 values,
    ``value_bits=32``: in 8 bits the allgather is cheaper still.)"""
    planner = _measured(density=0.01, warmup=0, compression=Compression.dgc(value_bits=32))
    planner.cost_model = model = CostModel(select_element_seconds=8e-9, dense_preference=2.0)
    planner.replan(2)
    dense = model.dense_seconds(FC.numel, 2, 4)
    gather = model.sparse_seconds(262144, 2, 4, gather_index_bytes(
        planner.compressor, FC.numel, 262144))
    work = model.local_seconds(FC.numel, 262144, 2)
    assert (dense, gather, work) == pytest.approx((0.0336, 0.0095, 0.0084), abs=2e-4)
    assert planner.path(FC, 0.25) == DENSE and planner.path(CONV, 0.25) == DENSE
    assert planner.path(FC, 0.01) == SPARSE and planner.path(CONV, 0.01) == SPARSE
    generation = planner.generation
    planner.overlapped(BackwardProfile({0: 0.05, 1: 0.0, 2: 0.0}, 0.05, 5))
    assert planner.path(CONV, 0.25) == DENSE  # the sums' plan until the timeline's is used
    assert timeline_differs(planner, 0.25) and timeline_differs(planner, 0.01)
    planner.use_timeline(True)
    assert planner.generation == generation + 1
    assert planner.path(FC, 0.25) == DENSE and planner.path(CONV, 0.25) == SPARSE
    assert planner.path(FC, 0.01) == DENSE and planner.path(CONV, 0.01) == SPARSE
    assert planner.path(BIAS, 0.25) == DENSE
    # fc's transfer ends at -16.4 ms; conv's work (2.1 ms), its allgather, then the
    # bias's allreduce (ready at the end, after conv in the planner's order)
    bias = model.dense_seconds(BIAS.numel, 2, 4)
    assert planner.timeline.plan(planner, 0.25).exposed == pytest.approx(work + gather + bias)


def test_a_profile_keeps_forced_paths_and_follows_a_new_link():
    planner = _measured(density=0.01, warmup=0, aggregation="allgather")
    planner.overlapped(BackwardProfile({0: 10.0, 1: 10.0, 2: 0.0}, 10.0, 5))
    planner.use_timeline(True)
    assert not timeline_differs(planner, 0.01)
    assert planner.path(FC, 0.01) == SPARSE  # forced: the one candidate
    assert planner.path(FC, 1.0) == SPARSE  # (a forced sparse method runs at 1.0 too)
    planner = _measured(density=0.01, warmup=0)
    planner.overlapped(BackwardProfile({0: 0.05, 1: 0.0, 2: 0.0}, 0.05, 5))
    planner.use_timeline(True)
    assert planner.path(FC, 0.01) == DENSE
    # the link turns 100 times slower: fc's 3.4 s allreduce no longer hides
    slow = dataclasses.replace(planner.cost_model, bandwidth=1.25e6)
    planner.cost_model = slow
    planner.replan(2)
    assert planner.timeline is not None and planner.path(FC, 0.01) == SPARSE
    planner.use_timeline(False)  # the sums' plan back (the trial's verdict)
    assert planner.path(FC, 0.01) == planner.summed_path(FC, 0.01)


def test_the_trial_times_both_plans_and_keeps_the_faster():
    """3 steps a plan (the first settles). The plans differ from the second step on: the
    sums' plan runs steps 2-4 (3 and 4 timed: 1.0 s each), the timeline's 5-7 (6 and 7:
    0.9 s): agreed, 10% faster, kept. The same at 0.99 s a step: under the 3% margin, the
    sums' plan kept."""
    for timeline_seconds, kept in ((0.9, True), (0.99, False)):
        trial = PlanTrial(steps=3, margin=0.03)
        differ = iter([False, True])
        assert trial.end_step(5.0, 0.25, lambda: next(differ)) is None  # step 0: the same
        assert trial.end_step(5.0, 0.25, lambda: next(differ)) is None  # step 1: differ
        assert trial.phase == "sums"
        actions = [trial.end_step(s, 0.25, None) for s in (7.0, 1.0, 1.0)]  # steps 2-4
        assert actions == [None, None, "timeline"]
        actions = [trial.end_step(s, 0.25, None) for s in (7.0,) + (timeline_seconds,) * 2]
        assert actions == [None, None, "agree"]
        assert trial.timed == pytest.approx([2.0, 2 * timeline_seconds])
        assert trial.decide(trial.timed, 0.25) is kept
        assert trial.means == pytest.approx((1.0, timeline_seconds))
        assert trial.phase == "decided" and trial.end_step(1.0, 0.25, None) is None


def test_a_density_stage_during_the_trial_voids_it():
    trial = PlanTrial(steps=3)
    trial.end_step(1.0, 0.25, lambda: True)
    assert trial.end_step(1.0, 0.25, None) is None
    assert trial.end_step(1.0, 0.0625, None) == "sums" and trial.phase == "waiting"
    trial.end_step(1.0, 0.0625, lambda: True)  # tried again where they differ now
    for _ in range(6):
        action = trial.end_step(1.0, 0.0625, None)
    assert action == "agree" and trial.density == 0.0625
    assert trial.decide(trial.timed, 0.015625) is None and trial.phase == "waiting"
