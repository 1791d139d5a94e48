"""hvd_dgc's Keras DistributedOptimizer under elastic Horovod (Keras 2 and 3):
``hvd.elastic.KerasState`` commits and restores hvd_dgc's state with the model's and
the optimizer's, and ``model.fit`` goes on in the new world after a worker leaves or
joins (horovodrun's elastic mode, a host-discovery script, real ranks)."""

import math

import pytest

from harness.hvdrun import elastic_launch, run

KERAS = {"keras3": {"TF_USE_LEGACY_KERAS": "0"}, "keras2": {"TF_USE_LEGACY_KERAS": "1"}}


def _fit_job(tmp_path, version, worker, np, before, after, max_np=2):
    job = elastic_launch(f"tests.tensorflow.tf_elastic:{worker}", tmp_path, np, before, after,
                         max_np=max_np, env=KERAS[version], timeout=300)
    assert job.returncode == 0, job.output()
    return job


def _joined(job):
    """A join's two ranks and the step the newcomer joined at (after step 8), once what
    every join shows holds: no step lost or done twice on either rank."""
    assert sorted(job.results) == [0, 1], job.output()
    first, newcomer = job.results[0], job.results[1]
    joined = newcomer["log"][0]["step"]
    assert joined > 8, joined
    assert [e["step"] for e in first["log"]] == list(range(1, len(first["log"]) + 1))
    assert [e["step"] for e in newcomer["log"]] == \
        list(range(joined, first["log"][-1]["step"] + 1))
    return first, newcomer, joined


def _assert_follows_the_world(log, lagging=False, passes=1):
    """What every step of every rank must show, whatever the world did (``lagging``:
    delay or period, where ranks agree only at commits and alone; ``passes``: calls
    per exchange)."""
    # hvd_dgc's step came back and went on with the optimizer's (warm-up by step)
    assert all(e["dgc_step"] == e["step"] // passes for e in log), \
        [(e["step"], e["dgc_step"]) for e in log]
    # its epoch is the elastic state's global epoch, not fit's count from 0 after a reset
    assert all(e["dgc_epoch"] == e["epoch"] for e in log), [(e["step"], e["epoch"], e["dgc_epoch"]) for e in log]
    # the world it planned, scaled and clipped for is the world it ran in
    assert all(e["world_size"] == e["size"] for e in log)
    # every rank held the same weights after every step (lagging: on one rank)
    assert all(e["identical"] for e in log if not lagging or e["size"] == 1)
    assert all(math.isfinite(e["loss"]) for e in log)


@pytest.mark.parametrize("version", ["keras3", "keras2"])
def test_keras_fit_loses_a_worker_and_goes_on_in_the_smaller_world(tmp_path, version):
    """2 ranks, then 1 (the discovery script drops a slot after step 15, mid-epoch, in
    a 3-epoch warm-up): the survivor re-plans the exchange for one rank, fit traces its
    step again and trains to the last epoch from its current commit, no step lost or
    done twice; its warm-up goes on at the epoch it had reached."""
    out = _fit_job(tmp_path, version, "keras_drop_a_worker", 2, "localhost:2",
                   "localhost:1").results[0]
    log = out["log"]
    two = [e for e in log if e["size"] == 2]
    one = [e for e in log if e["size"] == 1]
    assert out["size"] == 1 and out["epoch"] == 4, (out["size"], out["epoch"])
    assert len(two) >= 15 and len(one) >= 10, [(e["step"], e["size"]) for e in log]
    assert [e["step"] for e in log] == list(range(1, len(log) + 1))
    _assert_follows_the_world(log)
    # the reset came mid-warm-up: the densities of epochs 1, 2, 3 ran in the small world
    assert {e["density"] for e in one} >= {0.0625, 0.015625, 0.01}, sorted({e["density"] for e in one})
    assert out["stats"]["world_size"] == 1 and out["stats"]["step"] == log[-1]["step"]
    assert all(math.isfinite(x) for x in out["final"])


def test_keras_fit_loses_a_whole_host(tmp_path):
    """Two hosts of two ranks (``localhost``, ``127.0.0.1``), then the discovery script
    drops the second after step 12: both its ranks go at once; the two survivors, on
    one host now, re-plan for 2 ranks and train to the end, bit-identical after every
    step before and after (Keras 3)."""
    job = _fit_job(tmp_path, "keras3", "keras_drop_a_host", 4, "localhost:2\\n127.0.0.1:2",
                   "localhost:2", max_np=4)
    # which host's ranks start as 0 and 1 is Horovod's choice (it varies): the survivors
    # are the localhost ranks, whatever they started as, ranks 0 and 1 after the reset
    finals = {out["rank"]: out for out in job.results.values()}
    assert len(job.results) == 2 and sorted(finals) == [0, 1], job.output()
    for out in finals.values():
        log = out["log"]
        four = [e for e in log if e["size"] == 4]
        two = [e for e in log if e["size"] == 2]
        assert len(four) >= 12 and len(two) >= 10, [(e["step"], e["size"]) for e in log]
        assert all(e["hosts"] == 2 and e["local_size"] == 2 for e in four)
        assert all(e["hosts"] == 1 and e["local_size"] == 2 for e in two)
        assert [e["step"] for e in log] == list(range(1, len(log) + 1))
        _assert_follows_the_world(log)
        assert out["size"] == 2 and out["epoch"] == 3
    assert finals[0]["final"] == finals[1]["final"]


@pytest.mark.parametrize("version", ["keras3", "keras2"])
def test_keras_fit_survives_a_worker_that_dies_mid_step(tmp_path, version):
    """Two hosts of one rank (``localhost``, ``127.0.0.1``), commits every 5 steps; rank 1
    dies (os._exit) at step 13. The survivor's collective fails, hvd_dgc's
    ``hvd.elastic.run`` sees it as a lost worker (Horovod's own returns None there, as
    if training had ended: hvd_dgc names its collectives), the survivor restores the
    commit of step 10 (weights, optimizer and DGC state together) and trains on alone."""
    out = _fit_job(tmp_path, version, "keras_crash_a_worker", 2, "localhost:1\\n127.0.0.1:1",
                   "localhost:1\\n127.0.0.1:1").results[0]
    log = out["log"]
    two = [e for e in log if e["size"] == 2]
    one = [e for e in log if e["size"] == 1]
    assert [e["step"] for e in two] == list(range(1, 14)), [(e["step"], e["size"]) for e in log]
    # back to the commit of step 10: steps 11.. again, DGC's step with the optimizer's
    assert [e["step"] for e in one] == list(range(11, 11 + len(one))) and len(one) >= 20
    # the first step redone starts from the committed weights: its loss (same batch) is
    # the one logged at step 11 before the crash, bit for bit
    assert one[0]["loss"] == two[10]["loss"], (one[0], two[10])
    _assert_follows_the_world(log)
    assert out["size"] == 1 and out["epoch"] == 3 and out["stats"]["world_size"] == 1


def test_keras_fit_with_delay_and_period_survives_a_worker_that_dies_mid_step(tmp_path):
    """The crash above with delay=2 and period=2 (Keras 3): averages in flight when rank
    1 dies. Every commit flushed first, so the survivor goes back to the weights both
    ranks agreed on at step 10, drops what was in flight (collectives of a world that
    is gone) and trains on alone; its first step redone sees the loss logged at step 11
    before the crash, bit for bit."""
    out = _fit_job(tmp_path, "keras3", "keras_crash_a_worker_delayed", 2,
                   "localhost:1\n127.0.0.1:1", "localhost:1\n127.0.0.1:1").results[0]
    log = out["log"]
    two = [e for e in log if e["size"] == 2]
    one = [e for e in log if e["size"] == 1]
    assert [e["step"] for e in two] == list(range(1, 14)), [(e["step"], e["size"]) for e in log]
    assert any(e["in_flight"] > 0 for e in two)  # averages were in flight
    assert not all(e["identical"] for e in two)  # and the ranks apart between commits
    assert [e["step"] for e in one] == list(range(11, 11 + len(one))) and len(one) >= 20
    assert one[0]["loss"] == two[10]["loss"], (one[0], two[10])
    _assert_follows_the_world(log, lagging=True)
    assert out["size"] == 1 and out["epoch"] == 3 and out["stats"]["world_size"] == 1
    assert out["stats"]["delay"] == 2 and out["stats"]["period"] == 2


def test_keras_fit_with_the_overlapped_outer_loop_survives_a_worker_that_dies(tmp_path):
    """The crash above with ``OuterLoop(steps=4, overlap=True)`` (Keras 3), commits at
    the 8th batch and the end of each 10-step epoch: rounds' exchanges in flight when
    rank 1 dies at step 13. Every commit flushed first, so the survivor goes back to
    the weights both ranks agreed on at step 10, drops what was in flight and trains on
    alone, its rounds now of one rank; its first step redone sees the loss logged at
    step 11 before the crash, bit for bit."""
    out = _fit_job(tmp_path, "keras3", "keras_crash_a_worker_outer", 2,
                   "localhost:1\n127.0.0.1:1", "localhost:1\n127.0.0.1:1").results[0]
    log = out["log"]
    two = [e for e in log if e["size"] == 2]
    one = [e for e in log if e["size"] == 1]
    assert [e["step"] for e in two][:13] == list(range(1, 14)), \
        [(e["step"], e["size"]) for e in log]
    assert any(e["in_flight"] > 0 for e in two)  # rounds' exchanges were in flight
    assert not all(e["identical"] for e in two)  # and the ranks apart inside rounds
    assert [e["step"] for e in one] == list(range(11, 11 + len(one))) and len(one) >= 20
    assert one[0]["loss"] == two[10]["loss"], (one[0], two[10])
    assert all(e["dgc_step"] == e["step"] for e in log)  # inner steps: the optimizer's
    assert all(e["world_size"] == e["size"] for e in log)
    assert all(math.isfinite(e["loss"]) for e in log)
    assert out["size"] == 1 and out["epoch"] == 3
    assert out["stats"]["world_size"] == 1 and out["stats"]["mode"] == "outer"
    assert out["stats"]["rounds"] >= log[-1]["step"] // 4  # (and a round ended by each
    # flush: DGCCallback's at each epoch's end, 10 steps)
    assert all(math.isfinite(x) for x in out["final"])


def test_keras_fit_with_the_overlapped_outer_loop_gains_a_worker(tmp_path):
    """1 rank, then 2, with ``OuterLoop(steps=4, overlap=True)`` (Keras 3), a commit at
    every round end: the newcomer takes rank 0's weights, shared weights, outer momentum
    and round; both train on with rounds in flight and end with the same weights
    (fit's last flush)."""
    job = _fit_job(tmp_path, "keras3", "keras_add_a_worker_outer", 1, "localhost:1",
                   "localhost:2")
    first, newcomer, joined = _joined(job)
    assert any(e["in_flight"] > 0 for e in newcomer["log"])
    for e in first["log"] + newcomer["log"]:
        assert e["dgc_step"] == e["step"] and e["world_size"] == e["size"]
        assert math.isfinite(e["loss"])
    assert newcomer["stats"]["rounds"] == first["stats"]["rounds"] >= \
        first["log"][-1]["step"] // 4
    assert [e["rounds"] for e in newcomer["log"]] == \
        [e["rounds"] for e in first["log"] if e["step"] >= joined]  # rank 0's round
    assert first["epoch"] == newcomer["epoch"] == 3
    assert first["final"] == newcomer["final"]


def test_keras_fit_gains_a_worker_with_the_link_measured_at_each_sync(tmp_path):
    """The join above with the default cost model (the link measured; Keras 3): a
    worker that joins builds alone, so every rank measures the new world's link in the
    elastic state's sync instead, with the same numbers, and the step is traced again
    where the paths changed; both train on in lock-step."""
    job = elastic_launch("tests.tensorflow.tf_elastic:keras_add_a_worker", tmp_path, 1,
                         "localhost:1", "localhost:2", max_np=2, timeout=300,
                         env=dict(KERAS["keras3"], HVD_DGC_COST_MODEL=""))
    assert job.returncode == 0, job.output()
    assert sorted(job.results) == [0, 1], job.output()
    first, newcomer = job.results[0], job.results[1]
    # measured at the first sync (1 rank: no link) and at the join's (2 ranks)
    # (rank 0's short line; the full story with verbose: tests/core/test_linkprobe.py)
    assert "[hvd_dgc] elastic sync at 2 ranks: link " in job.stdout, job.output()
    _assert_follows_the_world(first["log"] + newcomer["log"])
    assert first["final"] == newcomer["final"]


def test_keras_fit_with_backward_passes_survives_a_crash_and_a_join(tmp_path):
    """backward_passes_per_step=2 (Keras 3). A worker dying at step 17, commits every 5
    steps: the survivor's exchange at step 18 fails and it restores the commit of step
    15, which fell between two passes,
    with the first pass's sum and the count, and exchanges at step 16 as before the
    crash (DGC's step is half the optimizer's at every step; a count lost would move
    every later exchange by a call). A worker joining after step 8: the first calls after
    the reset agree on the count, so both exchange at the same call, in lock-step to the
    end with the same weights."""
    (tmp_path / "crash").mkdir()
    (tmp_path / "join").mkdir()
    out = _fit_job(tmp_path / "crash", "keras3", "keras_crash_a_worker_passes", 2,
                   "localhost:1\n127.0.0.1:1", "localhost:1\n127.0.0.1:1").results[0]
    log = out["log"]
    two = [e for e in log if e["size"] == 2]
    one = [e for e in log if e["size"] == 1]
    assert [e["step"] for e in two] == list(range(1, 18)), [(e["step"], e["size"]) for e in log]
    assert [e["step"] for e in one] == list(range(16, 16 + len(one))) and len(one) >= 10
    # (fit starts the epoch's batches again after a mid-epoch restore, so the redone
    # step's loss is another batch's; the count is what the restore must get right)
    _assert_follows_the_world(log, passes=2)
    job = _fit_job(tmp_path / "join", "keras3", "keras_add_a_worker_passes", 1, "localhost:1",
                   "localhost:2")
    first, newcomer, _ = _joined(job)
    _assert_follows_the_world(first["log"] + newcomer["log"], passes=2)
    assert first["final"] == newcomer["final"]


def test_keras_fit_with_delay_gains_a_worker(tmp_path):
    """1 rank, then 2, with delay=2 (Keras 3): the join comes at a commit, which
    flushed, so the newcomer takes weights every rank agrees on; both train on with
    averages in flight and end with the same weights (fit's last flush)."""
    job = _fit_job(tmp_path, "keras3", "keras_add_a_worker_delayed", 1, "localhost:1",
                   "localhost:2")
    first, newcomer, _ = _joined(job)
    assert any(e["in_flight"] > 0 for e in newcomer["log"])
    _assert_follows_the_world(first["log"] + newcomer["log"], lagging=True)
    assert first["epoch"] == newcomer["epoch"] == 3
    assert first["final"] == newcomer["final"]


@pytest.mark.parametrize("version", ["keras3", "keras2"])
def test_keras_fit_gains_a_worker_that_joins_in_step(tmp_path, version):
    """1 rank, then 2 (a slot offered after step 8, in a warm-up by step): the newcomer
    builds its optimizer alone (no wrap-time collective under elastic), takes rank 0's
    weights, optimizer variables and DGC step, and both train to the end in lock-step."""
    job = _fit_job(tmp_path, version, "keras_add_a_worker", 1, "localhost:1", "localhost:2")
    first, newcomer, joined = _joined(job)
    assert all(e["size"] == 1 for e in first["log"] if e["step"] < joined)
    assert all(e["size"] == 2 for e in first["log"] + newcomer["log"] if e["step"] >= joined)
    _assert_follows_the_world(first["log"] + newcomer["log"])
    # the newcomer stepped at rank 0's density: its warm-up was where rank 0's was
    by_step = {e["step"]: e["density"] for e in first["log"]}
    assert all(by_step[e["step"]] == e["density"] for e in newcomer["log"])
    assert first["epoch"] == newcomer["epoch"] == 3
    assert first["final"] == newcomer["final"]


def test_keras_fit_gains_a_worker_after_adamws_variance_froze(tmp_path):
    """AdamW taken over, frozen at step 5; a worker joins after step 8: it takes rank 0's
    frozen scales (optimizer variables) and step. Every rank applies the same average,
    so the weights agree either way; the scales are what a newcomer without them would
    get wrong (its gradients would enter the average unscaled: 10-1000x off)."""
    job = _fit_job(tmp_path, "keras3", "keras_add_a_worker_adamw", 1, "localhost:1",
                   "localhost:2")
    first, newcomer, joined = _joined(job)
    assert all(e["size"] == 2 for e in first["log"] + newcomer["log"] if e["step"] >= joined)
    _assert_follows_the_world(first["log"] + newcomer["log"])
    assert newcomer["stats"]["adam_phase"] == first["stats"]["adam_phase"] == "frozen variance"
    assert all(e["density"] == 0.01 for e in newcomer["log"])  # sparse from the freeze
    assert first["final"] == newcomer["final"]
    assert len(newcomer["scales"]) == 20 * 64 + 64 + 64 * 5 + 5
    assert newcomer["scales"] == first["scales"]  # rank 0's, not ones
    assert min(abs(s - 1.0) for s in first["scales"]) > 1e-3


def test_keras_fit_gains_a_worker_in_horovods_example_pattern(tmp_path):
    """Horovod's elastic Keras example fits one step before making its state and one in a
    reset callback, before the sync: the newcomer's first step is at DGC step 0 (here
    a dense warm-up stage) while the others are past it (sparse). The first step after a
    build or reset agrees on the largest step and epoch, so both take the same paths;
    without it this job hung (measured: killed at the 150 s limit)."""
    job = _fit_job(tmp_path, "keras3", "keras_add_a_worker_horovod_pattern", 1,
                   "localhost:1", "localhost:2")
    assert sorted(job.results) == [0, 1], job.output()
    first, newcomer = job.results[0], job.results[1]
    joined = newcomer["log"][0]["step"]
    assert joined > 25, joined
    # the others were past the dense stage (density 1.0) when the newcomer came
    assert all(e["density"] == (1.0 if e["epoch"] < 2 else 0.01) for e in first["log"])
    assert all(e["density"] == 0.01 for e in newcomer["log"])
    _assert_follows_the_world([e for e in first["log"] + newcomer["log"] if e["size"] == 2])
    assert first["epoch"] == newcomer["epoch"] == 4
    assert first["final"] == newcomer["final"]


@pytest.fixture(scope="module", params=["keras3", "keras2"])
def commits(request):
    return run("tests.tensorflow.tf_dgc:suite", np=2, env=KERAS[request.param], timeout=300,
               kwargs={"names": ["tf_elastic.keras_state_commit_restore_sync",
                                 "tf_elastic.plain_optimizer_state"]})


def test_keras_state_restores_the_dgc_memory_with_the_weights(commits):
    for out in commits:
        out = out["tf_elastic.keras_state_commit_restore_sync"]
        assert "error" not in out, out.get("error")
        restore = out["restore"]
        # a step after the commit moved everything; restore put back weights, iterations,
        # residuals and velocities, step and epoch, bit for bit
        assert restore["moved"] and restore["back"], restore
        assert restore["residual_norm"] > 0  # there was a residual to lose
        assert restore["python_epoch"] == 1.0


def test_keras_state_sync_gives_rank_0s_weights_and_step_and_keeps_residuals(commits):
    for out in commits:
        out = out["tf_elastic.keras_state_commit_restore_sync"]
        sync = out["sync"]
        # rank 1 had other weights, step 11 and epoch 9: now rank 0's
        assert sync["weights_identical"] and (sync["step"], sync["epoch"]) == (6, 1.0), sync
        # residuals are each rank's own: kept, and different across the ranks
        assert sync["own_memory_kept"] and sync["memories_differ"], sync
        assert out["after"] == {"step": 12, "iterations": 12}


def test_keras_state_refuses_what_it_cannot_carry(commits):
    refused = commits[0]["tf_elastic.keras_state_commit_restore_sync"]["refused"]
    assert refused["delay"] is None  # delay runs under elastic Keras now (flushed commits)
    assert refused["passes"] is None  # and backward_passes_per_step (sums committed)


def test_keras_state_with_a_plain_optimizer_syncs_restores_and_commits_as_horovods(commits):
    """Horovod's KerasState takes an unwrapped optimizer; so does hvd_dgc's."""
    outs = [out["tf_elastic.plain_optimizer_state"] for out in commits]
    for out in outs:
        assert "error" not in out, out.get("error")
    # each rank took one local Adam step from weights rank + 1: rank 1's differ
    assert outs[0]["synced"]["before"] != outs[1]["synced"]["before"]
    for out in outs:
        synced = out["synced"]  # rank 0's weights, batch and epoch everywhere
        assert synced["weights"] == outs[0]["synced"]["before"]
        assert (synced["batch"], synced["epoch"]) == (20, 10)
        assert synced["identical"] and synced["optimizer_identical"]
        assert out["restored"] == {"weights": synced["weights"], "batch": 20, "epoch": 10}
        assert out["committed"] == {"weights": [[[-5.0, -5.0]] * 3, [0.0, 0.0]],
                                    "batch": 22, "epoch": 12}


def _tape_follows_the_world(log):
    """A tape step under elastic Horovod, every step of every rank: no step lost or
    done twice, hvd_dgc's step and world size follow, every rank holds the same weights,
    and the user's tf.function was not traced again after a reset."""
    assert [e["step"] for e in log] == list(range(log[0]["step"], log[-1]["step"] + 1)), \
        [(e["step"], e["size"]) for e in log]
    assert all(e["dgc_step"] == e["step"] for e in log), [(e["step"], e["dgc_step"]) for e in log]
    assert all(e["world_size"] == e["size"] for e in log)
    assert all(e["identical"] for e in log)
    assert len({e["traced"] for e in log}) == 1, [(e["step"], e["traced"]) for e in log]
    assert all(math.isfinite(e["loss"]) for e in log)


@pytest.mark.parametrize("version", ["keras3", "keras2"])
def test_tape_in_horovods_elastic_example_loses_a_worker(tmp_path, version):
    """Horovod's TF2 elastic example (its tf.function made once, the tape inside it, a
    plain optimizer in TensorFlowKerasState), import switched: 2 ranks, then 1 after
    step 10. The step traced for two ranks runs on alone (it used to stop: "traced for
    2 ranks"), reading the number of ranks when it runs."""
    out = _fit_job(tmp_path, version, "tape_drop_a_worker", 2, "localhost:2",
                   "localhost:1").results[0]
    log = out["log"]
    assert out["size"] == 1 and log[0]["step"] == 1 and log[-1]["step"] == 30
    two = [e for e in log if e["size"] == 2]
    one = [e for e in log if e["size"] == 1]
    assert len(two) >= 10 and len(one) >= 5, [(e["step"], e["size"]) for e in log]
    _tape_follows_the_world(log)
    assert out["stats"]["world_size"] == 1 and out["stats"]["step"] == 30
    assert all(math.isfinite(x) for x in out["final"])


def test_tape_in_horovods_elastic_example_gains_a_worker(tmp_path):
    """The example, 1 rank then 2 after step 8, in a warm-up by step (Keras 3): the
    newcomer takes rank 0's weights and, before its first tape step makes its exchange,
    rank 0's DGC step; both train in lock-step at rank 0's density to the end."""
    job = _fit_job(tmp_path, "keras3", "tape_add_a_worker", 1, "localhost:1", "localhost:2")
    assert sorted(job.results) == [0, 1], job.output()
    first, newcomer = job.results[0]["log"], job.results[1]["log"]
    joined = newcomer[0]["step"]
    assert joined > 8 and first[-1]["step"] == newcomer[-1]["step"] == 30
    _tape_follows_the_world(first)
    _tape_follows_the_world(newcomer)
    by_step = {e["step"]: e["density"] for e in first}
    assert all(by_step[e["step"]] == e["density"] for e in newcomer)
    assert len({e["density"] for e in newcomer}) > 1  # the warm-up went on across the join
    assert job.results[0]["final"] == job.results[1]["final"]
    # refused at the first gradient, before any collective, naming the fix
    for rank in (0, 1):
        refused = job.results[rank]["refused"]
        assert sorted(refused) == ["delay", "fp16", "powersgd"], refused
        for name, message in refused.items():
            assert message.startswith("hvd_dgc: DistributedGradientTape under elastic "
                                      "Horovod"), (name, message)
            assert "hvd.elastic.KerasState" in message, message
        assert "delay=2" in refused["delay"] and "Compression.none" in refused["fp16"]
        assert "Compression.dgc" in refused["powersgd"]


def test_tape_in_horovods_elastic_example_survives_a_worker_that_dies(tmp_path):
    """The example on two hosts of one rank; rank 1 dies at step 13. The survivor's
    collective fails, it restores the commit of step 12 (a commit every 4 steps:
    weights, optimizer variables and the tape's DGC memory) and goes on alone; its first step redone sees the loss
    logged at step 13 before the crash, bit for bit."""
    out = _fit_job(tmp_path, "keras3", "tape_crash_a_worker", 2, "localhost:1\\n127.0.0.1:1",
                   "localhost:1\\n127.0.0.1:1").results[0]
    log = out["log"]
    two = [e for e in log if e["size"] == 2]
    one = [e for e in log if e["size"] == 1]
    assert [e["step"] for e in two] == list(range(1, 14)), [(e["step"], e["size"]) for e in log]
    assert [e["step"] for e in one] == list(range(13, 31))
    assert one[0]["loss"] == two[12]["loss"], (one[0], two[12])
    _tape_follows_the_world(two)
    _tape_follows_the_world(one)
    assert two[0]["traced"] == one[0]["traced"]  # (the restore traced nothing again)
    assert out["stats"]["world_size"] == 1
