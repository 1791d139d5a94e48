"""The link watched while training (hvd_dgc/linkwatch.py, issue 33): when the step's own
waits call for a probe, when a probe's numbers replace the cost model, and the real thing
under horovodrun across an emulated link whose rate drops in the middle of the run."""

import json
import math
import os
import sys
import threading
import time

import pytest

from hvd_dgc.config import DGCConfig, unsupported_message
from hvd_dgc.costmodel import MEASURED_DENSE_PREFERENCE
from hvd_dgc.linkprobe import LinkMeasurement
from hvd_dgc.localcost import LocalCost
from hvd_dgc.linkwatch import LinkWatch, LinkWatchState, as_link_watch, changes_plan
from hvd_dgc.paths import PathKind
from hvd_dgc.plan import Planner, TensorInfo
from hvd_dgc.torch.compression import Compression
from hvd_dgc.torch.optimizer import TORCH
from tests.core.test_plan import ARGS

from harness.hvdrun import REPO
ON = ("dense", 0)  # what fixed the step's paths: (density, the plan's generation)


def run_windows(state, means, on=ON, window=10):
    """Feed whole windows of ``means`` (seconds a step waited) as the optimizer does:
    each window's agreed sums are read one window later. Returns the windows (0-based)
    after which a probe ran, and the way the waits had moved, [(window, 1 or -1)]."""
    probes, pending = [], None
    for i, mean in enumerate(means):
        for _ in range(window):
            state.observe(mean)
        assert state.window_done()
        sums = state.take_window()
        moved = state.decide(pending, on, on) if pending is not None else 0
        if moved:
            probes.append((i, moved))
            state.probed(False, i)
        pending = sums
    return probes


def test_steady_waits_never_probe_and_noise_inside_the_band_is_noise():
    state = LinkWatchState(LinkWatch(window=10))
    # baseline 20 ms; 25-39 ms and 10-20 ms are inside (2x + 2 ms, and (b - 2 ms) / 2)
    assert run_windows(state, [0.020, 0.020, 0.025, 0.039, 0.015, 0.0095, 0.020]) == []
    assert state.baseline == pytest.approx(0.020)


def test_a_slower_link_probes_one_window_after_the_evidence_is_agreed():
    state = LinkWatchState(LinkWatch(window=10))
    # window 0 sets the baseline (read at window 1's end); window 3 waits 5x: it is
    # read at window 4's end, which probes
    assert run_windows(state, [0.020, 0.020, 0.020, 0.100, 0.100]) == [(4, 1)]


def test_a_faster_link_probes_too_but_not_where_the_step_barely_waits():
    state = LinkWatchState(LinkWatch(window=10))
    assert run_windows(state, [0.100, 0.100, 0.030, 0.030]) == [(3, -1)]
    quiet = LinkWatchState(LinkWatch(window=10))  # 1.5 ms -> 0: under the 2 ms floor
    assert run_windows(quiet, [0.0015, 0.0015, 0.0, 0.0, 0.0]) == []


def test_probes_that_find_nothing_back_off_and_a_new_baseline_follows_each():
    state = LinkWatchState(LinkWatch(window=1, backoff=3))
    # the wait doubles and stays: each probe finds the link as it was (probed(False)),
    # and the window after it becomes the baseline; so a lasting change probes once
    assert run_windows(state, [0.01] * 3 + [0.05] * 12, window=1) == [(4, 1)]
    # a wait that keeps moving: probes 1, 2, 4 windows of quiet apart (and a baseline)
    flapping = LinkWatchState(LinkWatch(window=1, backoff=3))
    means = [0.01, 0.01] + [0.05, 0.01] * 12
    probes = [i for i, _ in run_windows(flapping, means, window=1)]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # after each: a window sets the baseline, 2**n - 1 stay quiet, and the next that
    # differs probes: gaps of 1 + 1 + 2, 1 + 3 + 2, 1 + 7 + 2 windows
    assert gaps == [4, 6, 10], probes
    assert flapping.probes == len(probes) and flapping.relinked == []


def test_a_window_measured_on_other_paths_says_nothing():
    state = LinkWatchState(LinkWatch(window=1))
    assert not state.decide((0.9, 1), ON, ON)           # the first window settles
    assert not state.decide((0.02, 1), ON, ON)          # the baseline
    assert not state.decide((0.5, 1), (0.25, 0), ON)    # measured at another density
    later = (0.0625, 0)
    assert not state.decide((0.9, 1), later, later)     # a new stage settles,
    assert not state.decide((0.5, 1), later, later)     # then a new baseline
    assert state.baseline == 0.5 and state.decide((1.2, 1), later, later) == 1
    state.probed(True, 7)
    assert state.stats() == {"link_probes": 1, "relinked_at": [7]} and state.quiet == 0


def test_a_measurement_replaces_the_model_only_past_the_change_factor_the_waits_way():
    assert not changes_plan(0.100, 0.140, 1.5) and not changes_plan(0.100, 0.070, 1.5)
    assert changes_plan(0.100, 0.160, 1.5) and changes_plan(0.100, 0.060, 1.5)
    assert changes_plan(0.0, 0.1, 1.5) and not changes_plan(0.0, 0.0, 1.5)
    # the waits said slower: a probe reading faster (a busy moment) is not believed
    assert changes_plan(0.100, 0.160, 1.5, 1) and not changes_plan(0.100, 0.060, 1.5, 1)
    assert changes_plan(0.100, 0.060, 1.5, -1) and not changes_plan(0.100, 0.160, 1.5, -1)
    assert not changes_plan(0.0, 0.1, 1.5, -1) and changes_plan(0.1, 0.0, 1.5, -1)


def _planner(local_size=0, aggregation="auto"):
    """fp32 values: hierarchical DGC's records are priced against the allgather's alike."""
    config = DGCConfig(density=0.01, aggregation=aggregation)
    resolved = config.resolve(TORCH, Compression.dgc(value_bits=32), ARGS, (True, "SGD"))
    tensors = [TensorInfo(0, "w", 1 << 20, (1024, 1024)), TensorInfo(1, "b", 1024, (1024,))]
    return Planner(resolved, tensors, 4, local_size)


def _link(mbit, alpha=50e-6):
    return LinkMeasurement(alpha, mbit * 1e6 / 8, 0.1, 1 << 20, mbit * 1e6 / 16)


def test_relink_chooses_the_paths_afresh_and_prices_the_step_on_them():
    planner = _planner()
    w, b = planner.tensors
    # a fast link: selecting 1% of w (5 ns an element) costs more than sending it dense
    planner.measured(_link(20000), LocalCost(5e-9, 0.0, 0.0))
    assert planner.path(w, 0.01) == PathKind.DENSE
    fast = planner.exchange_seconds(0.01, launches=2)
    wire = 2 * 3 / 4 * (w.numel + b.numel) * 4 / (20000e6 / 8)
    assert fast == pytest.approx(2 * 2 * 3 * 50e-6 + wire)
    slow_model = planner.priced(_link(10))
    assert slow_model.select_element_seconds == 5e-9  # this device's work, kept
    priced = planner.exchange_seconds(0.01, launches=2, model=slow_model)
    assert priced / fast > 1000  # dense on the slow link, priced by its numbers
    planner.relink(_link(10))
    # (4 ranks, positions coded on both sparse paths: region reduce's 2.25 k records a
    # rank receives over its two rounds cost less than the allgather's 3 k)
    assert planner.generation == 1 and planner.path(w, 0.01) == PathKind.REGION
    after = planner.exchange_seconds(0.01, launches=2)
    assert after < priced / 5  # the records the new paths send, not the dense bytes


def test_relink_keeps_a_hierarchical_tensors_path():
    """Its residual lives in slices across the host's ranks: it cannot go flat."""
    planner = _planner(local_size=2)
    w = planner.tensors[0]
    fast, local = _link(20000), LocalCost(5e-9, 0.0, 0.0)
    # a slow link of high latency: one round across hosts (region reduce's coded records
    # would take fewer bytes, in two rounds)
    planner.measured(_link(10, alpha=0.05), local)
    assert planner.path(w, 0.01) == PathKind.HIERARCHICAL
    planner.relink(fast)
    assert planner.path(w, 0.01) == PathKind.HIERARCHICAL
    fresh = _planner(local_size=2)  # what a wrap on the fast link would have chosen
    fresh.measured(fast, local)
    assert fresh.path(w, 0.01) == PathKind.DENSE


@pytest.mark.parametrize("value, message", [
    ("yes", "link_watch must be None"),
    (LinkWatch(window=0), "LinkWatch window must be an int >= 1"),
    (LinkWatch(slower=1.0), "LinkWatch slower must be a number > 1"),
    (LinkWatch(floor=-1), "LinkWatch floor must be a number of seconds >= 0"),
])
def test_bad_link_watch_settings_name_the_fix(value, message):
    with pytest.raises(ValueError, match=message):
        DGCConfig(link_watch=value)


def test_link_watch_settings_run_in_keras_and_the_tape_refuses_them_with_the_fix():
    assert as_link_watch(None) == LinkWatch() and as_link_watch(False) is None
    for watch in (None, False, LinkWatch(window=5)):
        assert unsupported_message(DGCConfig(link_watch=watch), "tensorflow") is None
    pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (CI has it)")
    from hvd_dgc.tensorflow.exchange import GradientExchange
    with pytest.raises(ValueError, match="link_watch=LinkWatch\\(window=5.*traced into your "
                                         "tf.function.*use Keras' model.fit with "
                                         "hvd.callbacks.DGCCallback\\(\\)"):
        GradientExchange(link_watch=LinkWatch(window=5))  # a tape's (no optimizer)
    GradientExchange(link_watch=LinkWatch(window=5), optimizer=(True, "SGD"))  # Keras'
    GradientExchange(link_watch=False)


def _expected_path(seen, density, world=2):
    """The path the cost model's formulas give the worker's weight on ``seen``'s numbers
    (as tests/core/test_linkprobe.py checks the wrap-time choice)."""
    n = seen["numel"]
    k = max(1, math.ceil(n * density))
    sigma, rho_select, rho_record = seen["local"]
    dense = 2 * seen["alpha"] + 4 * n / seen["bandwidth"]
    sparse = seen["alpha"] + 8 * k / (seen["gather_bandwidth"] or seen["bandwidth"]) + \
        sigma * n + rho_select * k + rho_record * k * world
    return "dense" if sparse * MEASURED_DENSE_PREFERENCE > dense else "sparse"


def _drop_the_link(tmp_path, worker, rate_mbit=1, args=()):
    """``worker`` (a module of tests/core) on two ranks across the emulated link,
    unlimited until rank 0 says it is ready, then ``rate_mbit``; checks what both
    frameworks' watches must show and returns each rank's JSON line and rank 0's
    output."""
    from harness.wan import WanLink, available
    ok, why = available()
    if not ok:
        pytest.skip(f"WAN emulator unavailable here: {why}")
    from harness.launch import run_job
    results = []
    with WanLink() as link:
        job = threading.Thread(target=lambda: results.extend(run_job(
            link, [sys.executable, "-m", worker, str(tmp_path), *args],
            env={"PYTHONPATH": REPO, "HVD_DGC_COST_MODEL": "", "HVD_DGC_VERBOSE": "1"},
            timeout=300)))  # (verbose: the full line, whose numbers are read below)
        job.start()
        deadline = time.time() + 240
        while not (tmp_path / "ready").exists() and job.is_alive() and \
                time.time() < deadline:
            time.sleep(0.05)
        link.set_rate(rate_mbit)
        (tmp_path / "changed").touch()
        job.join()
    assert [code for code, _, _ in results] == [0, 0], results
    outs = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    steps, window = outs[0]["before_steps"], outs[0]["window"]
    for phase in ("before", "after"):  # every rank: the same numbers, paths, decisions
        ranks = [{k: v for k, v in out[phase].items() if k != "stats"} for out in outs]
        assert ranks[0] == ranks[1], ranks
    first, last = outs[0]["before"], outs[0]["after"]
    relinked = last["stats"]["relinked_at"]
    assert [o["after"]["stats"]["relinked_at"] for o in outs] == [relinked, relinked]
    assert last["generation"] == len(relinked)
    # before the drop the paths held, or changed once, where a probe took new numbers:
    # on a busy machine a window's jitter can call a probe that reads the fast link
    # slower or faster and is believed (the one large weight: bias, weight, ...)
    early = [s for s in relinked if s < steps]
    sparse_steps = first["stats"]["paths"].get("sparse", 0)
    assert len(early) <= 1 and sparse_steps in {0, steps}.union(
        *({r, steps - r} for r in early)), (relinked, first["stats"])
    # after it: the first window wholly on the slow link is read at most one window
    # later (two after a probe there that found nothing: the workers' BACKOFF), and a
    # probe there takes the slow link's numbers. (The workers drop it only where the
    # watch's baseline is on the fast link: tests/core/link_seen.py ``ready``.)
    after = [s for s in relinked if s >= steps]
    assert all(r + 2 * window <= steps for r in early), relinked
    assert len(after) == 1 and after[0] <= steps + 4 * window, (relinked, first, last)
    assert last["bandwidth"] <= min(first["bandwidth"] / 3, 1.2 * rate_mbit * 1e6 / 8), \
        (first, last)
    for seen in (first, last):  # the model's choice on the numbers in force
        assert seen["path"] == _expected_path(seen, outs[0]["density"]), seen
    line = results[0][1]
    said = f"hvd_dgc: at step {after[0]} the link measured "
    assert said in line and "hvd_dgc: at step" not in results[1][1], line
    expected = int(last["path"] == "sparse")
    assert f"chosen afresh: {expected} of 1 large tensors sparse at density" in line, line
    return outs, line


def test_a_link_that_drops_under_a_running_job_is_measured_again_and_the_paths_follow(
        tmp_path):
    """Two ranks across the emulated link, unlimited for 24 steps, then 1 Mbit/s: the
    steps' waits show it, every rank probes at the same step, the new numbers replace
    the model, and the paths are the model's choice on them."""
    _drop_the_link(tmp_path, "tests.core.link_watch")
    # every rank holds the same weights (compared after the job: a collective after
    # the last step would settle the watch's agreement still in flight at the end)
    import torch
    assert torch.equal(torch.load(tmp_path / "weights.0"), torch.load(tmp_path / "weights.1"))


@pytest.mark.parametrize("callbacks", ["horovod", "dgc"])
def test_keras_fit_follows_a_link_that_drops_and_traces_its_step_again(tmp_path, callbacks):
    """The same drop under Keras 3's ``model.fit``, the watch driven by the
    ``BroadcastGlobalVariablesCallback`` a Horovod script passes ("horovod": switched by
    one line, nothing added), or by ``DGCCallback`` beside it ("dgc": it claims the
    watch, so no step is observed twice: the same single probe after the drop): the
    whole train steps show it, every rank probes at the same batch, and where the paths
    changed ``fit`` made its train function again (once at the start, once per
    change)."""
    import numpy as np
    outs, line = _drop_the_link(tmp_path, "tests.core.keras_link_watch",
                                args=(callbacks,))
    # the plan, not only the large tensor's path: where the wrap-time probe read a slow
    # link (a loaded machine) the tensor is sparse before and after, and the drop moves
    # the buckets, which the step holds as well
    changed = outs[0]["before"]["plan"] != outs[0]["after"]["plan"]
    drop = outs[0]["after"]["stats"]["relinked_at"][-1]  # (any before: the step's too)
    said = [s for s in line.splitlines() if f"hvd_dgc: at step {drop} " in s]
    assert len(said) == 1 and ("the step is traced again" in said[0]) == changed, line
    for out in outs:
        assert out["train_functions"] == 1 + line.count("the step is traced again"), out
        assert out["observed_after_the_first"] == out["steps"] - 1, out  # once a step
    np.testing.assert_array_equal(np.load(tmp_path / "weights.0.npy"),
                                  np.load(tmp_path / "weights.1.npy"))
