"""hvd_dgc.tensorflow (DistributedGradientTape) and hvd_dgc.tensorflow.keras
(DistributedOptimizer, model.fit under Keras 2 and Keras 3) on 2 real ranks."""

import math

import numpy as np
import pytest

from harness.hvdrun import run
from tests.torch.test_compressors import assert_users_compressor
from tests.torch.test_dga import assert_auto_delay_trace
from tests.torch.test_optimizer import _checked

TAPE = ["tape_dense_equivalence", "tape_sparse_in_tf_function", "tape_bad_inputs",
        "tape_inconsistent_config", "tf_dga.tape_delay_dense_matches_formula",
        "tf_dga.keras_delay_dense_matches_formula",
        "tf_dga.tape_delay_sparse_flush_equals_synchronous", "tf_dga.delay_bad_inputs",
        "tf_dga.nonfinite_skips_the_step", "tf_dga.keras_nonfinite_skips_the_step",
        "tf_dga.delayed_nonfinite_is_dropped_on_its_rank",
        "tf_dga.keras_delayed_nonfinite_is_dropped_on_its_rank", "tape_horovod_patterns",
        "tape_keras3_model", "tests.fp16_wire.tf_outlier", "keras_backward_passes",
        "tests.fp16_wire.tf_sparse_records", "tape_quantizers", "tape_quantizers_delayed",
        "tape_priced_dense", "tape_fixed_records",
        "tape_world_guard", "tf_local.keras_local_vars", "tf_keras_api.keras_passes",
        "tf_dga.keras_passes_with_delay", "tf_dga.period_matches_reference",
        "tf_dga.period_bad_inputs", "tf_dga.auto_delay_matches_reference",
        "tf_dga.auto_delay_checkpoint", "tape_users_compressor"]
# Keras 2: Horovod's dense and DGC; Keras 3: DGC, DGC with delayed averaging, EF-SignSGD,
# held to Keras 2's dense Horovod (the same model, data and seed)
FIT2 = {"keras_fit_digits": {}}
FIT3 = {"keras_fit_digits": {"delay": 2, "compressors": ["sign"], "dense": False}}


KERAS2 = {"TF_USE_LEGACY_KERAS": "1"}
KERAS3 = {"TF_USE_LEGACY_KERAS": "0"}


@pytest.fixture(scope="module")
def ckdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tf_checkpoints"))


def _ckpt(ckdir, phase, *names):
    return {name: {"ckdir": ckdir, "phase": phase} for name in names}


@pytest.fixture(scope="module")
def tape(ckdir):
    # verbose: the full plan at wrap time, whose words tape_horovod_patterns checks (the
    # default short line: tests/core/test_messages.py)
    return run("tests.tensorflow.tf_dgc:suite", np=2, timeout=600,
               env={**KERAS3, "HVD_DGC_VERBOSE": "1"}, kwargs={
        "names": TAPE + ["checkpoint_tape", "checkpoint_keras"],
        "kwargs": {**_ckpt(ckdir, "save", "checkpoint_tape", "checkpoint_keras"),
                   "tf_keras_api.keras_passes": {"how": "apply"},
                   "tf_dga.auto_delay_checkpoint": {"ckdir": ckdir + "/k3"}}})


@pytest.fixture(scope="module")
def keras2(ckdir):
    return run("tests.tensorflow.tf_dgc:suite", np=2, env=KERAS2, timeout=900, kwargs={
        "names": ["keras_dense_equivalence", "checkpoint_keras", "keras_fit_digits",
                  "keras_backward_passes", "tf_dga.keras_delay_dense_matches_formula",
                  "tf_dga.keras_nonfinite_skips_the_step", "tf_local.keras_local_vars",
                  "tf_keras_api.keras_compute_gradients", "tf_keras_api.keras_passes",
                  "tf_dga.keras_passes_with_delay", "tf_dga.period_matches_reference",
                  "tf_dga.auto_delay_matches_reference", "tf_dga.auto_delay_checkpoint"],
        "kwargs": {**_ckpt(ckdir, "save", "checkpoint_keras"), **FIT2,
                   "tf_keras_api.keras_passes": {"how": "compute"},
                   "tf_dga.auto_delay_checkpoint": {"ckdir": ckdir + "/k2"}}})


@pytest.fixture(scope="module")
def keras3():
    return run("tests.tensorflow.tf_dgc:suite", np=2, env=KERAS3, timeout=900,
               kwargs={"names": ["keras_fit_digits"], "kwargs": FIT3})


@pytest.fixture(scope="module")
def resumed3(tape, ckdir):
    """A new launch (new processes) resuming the Keras 3 / tape checkpoints."""
    return run("tests.tensorflow.tf_dgc:suite", np=2, env=KERAS3, timeout=600, kwargs={
        "names": ["checkpoint_tape", "checkpoint_keras"],
        "kwargs": _ckpt(ckdir, "resume", "checkpoint_tape", "checkpoint_keras")})


@pytest.fixture(scope="module")
def resumed2(keras2, ckdir):
    return run("tests.tensorflow.tf_dgc:suite", np=2, env=KERAS2, timeout=600, kwargs={
        "names": ["checkpoint_keras"], "kwargs": _ckpt(ckdir, "resume", "checkpoint_keras")})


def _assert_resumed(outs):
    for out in outs:
        assert out["restored"] == 0.0, out  # bit-identical to the uninterrupted run
        assert out["without_dgc_state"] > 1e-4, out  # the memory is what made it so


def test_a_users_own_compressor_follows_the_recipe(tape):
    """tests/torch/test_compressors.py's twin: a user's top-k by sorting, registered on
    TensorFlow's Compression, equals Compression.topk's run bit for bit."""
    assert_users_compressor(_checked(tape, "tape_users_compressor"))


def test_tape_dense_fp16_beyond_its_range_matches_the_reference(tape):
    """The PyTorch test's steps (tests/torch/test_optimizer.py) through the TF tape inside
    tf.function: the same weights after every step as the NumPy reference, so as
    PyTorch's; TF kept no fp16 rounding in its residual before, and lost the step."""
    from tests.fp16_wire import reference
    weights, clipped = reference()
    for rank, out in enumerate(_checked(tape, "tests.fp16_wire.tf_outlier")):
        assert out["skipped"] == 0
        np.testing.assert_array_equal(out["weights"], weights)
        assert out["clipped"] == clipped[rank] > 0


def test_tape_fp16_records_match_the_reference(tape):
    from tests.fp16_wire import record_reference
    expected = record_reference()
    for out in _checked(tape, "tests.fp16_wire.tf_sparse_records"):
        # every step's average: the float32 sum of everyone's fp16 values, bit for bit
        np.testing.assert_array_equal(out["averages"], expected)
        # 41 positions among 4,096 coded (44 bytes), then 41 fp16 values, as PyTorch's
        assert out["record_bytes"] == out["delayed_record_bytes"] == (44 + 2 * 41) / 41
        # delayed averaging then flush ends where synchronous training does (only if its
        # own is the fp16 value the others read; fp16's rounding is ~5e-4 of the weights)
        assert out["delayed_vs_sync"] <= 1e-6 * out["weights_scale"], out
        assert out["switch_fp16_values"] and out["switch_name"] == "dgc"


def test_tape_dgc_hands_the_allgather_k_records_every_step(tape):
    """The allgather's input is k records every step (a selection that chose fewer is
    padded with records that add nothing), as PyTorch's: Horovod's response cache then
    answers, and a synchronous step over a 100 ms link waits fewer round trips
    (bench/round_trips.py --framework tf). The records are coded (positions.py: 300
    positions among 30,000 in Elias-Fano, 8-bit values and a scale): 626 bytes, the
    padding counted."""
    for out in _checked(tape, "tape_fixed_records"):
        k, block = out["k"], out["block"]
        assert block == 626 < 8 * k
        assert out["shapes"] and all(s == (block,) for s in out["shapes"]), out["shapes"]
        assert all(row["elements"] <= k and row["bytes"] == block for row in out["steps"])
        assert any(row["elements"] < k for row in out["steps"]), out  # padding was needed
        assert out["identical"]


def test_tape_powersgd_sends_one_approximation_and_keeps_the_rest(tape):
    """PowerSGD rank 2 on a 60 x 50 weight, 2 ranks: what each rank's memory gave up is
    the averaged approximation P Q^T, the same on both ranks and equal to the average
    returned; the residual keeps the rest; 4 (60 + 50) 2 bytes a step, not 4 * 3000."""
    ranks = [out["powersgd"] for out in _checked(tape, "tape_quantizers")]
    for step in range(3):
        rows = [r["steps"][step] for r in ranks]
        np.testing.assert_array_equal(rows[0]["avg"], rows[1]["avg"])
        for row in rows:
            sent = row["v"] - row["residual"]
            np.testing.assert_allclose(sent, row["avg"], rtol=1e-5,
                                       atol=1e-6 * np.abs(row["avg"]).max())
        # a rank-2 approximation of the mean, not the mean: the rest waits in the memories
        mean = (rows[0]["v"] + rows[1]["v"]) / 2
        assert 0.05 < np.linalg.norm(rows[0]["avg"] - mean) / np.linalg.norm(mean) < 1
    for r in ranks:
        assert r["bytes"] == 3 * (4 * (60 + 50) * 2 + 8 * 4)
        assert r["paths"] == {"exchange": 3, "dense": 3} and r["identical"]


def test_tape_sign_priced_dense_averages_as_dense_averaging(tape):
    """The planner's pricing of a payload compressor's allgather (plan.py ExchangeGroup)
    holds in TensorFlow as in PyTorch: where the allgather is the dearer, sign sends
    every tensor dense, bit for bit what density=1.0 sends, and keeps nothing."""
    for out in _checked(tape, "tape_priced_dense"):
        assert out["paths"] == {"dense": 3}, out
        assert out["avg_diff"] == 0.0 and out["w_diff"] == 0.0, out
        assert out["residual"] == 0.0, out


@pytest.mark.parametrize("name", ["sign", "bf16", "qsgd"])
def test_tape_quantizers_with_delay_then_flush_end_where_synchronous_training_does(tape, name):
    for out in _checked(tape, "tape_quantizers_delayed"):
        got = out[name]
        assert got["in_flight_before_flush"] == 2 and got["identical"], got
        assert got["max_diff"] <= 1e-6 * got["scale"], got


@pytest.mark.parametrize("name", ["sign", "bf16", "qsgd"])
def test_tape_quantizers_average_what_pytorchs_codecs_decode(tape, name):
    """TF's quantisers send PyTorch's payloads: the average of 2 ranks equals the mean of
    PyTorch's decode(encode(v)) of each rank's v (bf16 bit for bit; sign within its
    scale's last bit: the L1 mean is summed in another order); error feedback keeps the
    rest; QSGD (its own noise stream) within its quantisation bound."""
    import torch
    from hvd_dgc.packing import qsgd_payload_bytes, sign_payload_bytes
    from hvd_dgc.torch.compression import Compression as TorchCompression
    codec = getattr(TorchCompression, name)
    ranks = [out[name] for out in _checked(tape, "tape_quantizers")]
    numel, steps = 3000, 3
    for step in range(steps):
        rows = [r["steps"][step] for r in ranks]
        sent = [row["v"] - row["residual"] for row in rows]  # what error feedback took
        np.testing.assert_array_equal(rows[0]["avg"], rows[1]["avg"])  # the same everywhere
        if name == "qsgd":
            np.testing.assert_allclose(rows[0]["avg"], (sent[0] + sent[1]) / 2, rtol=1e-5,
                                       atol=1e-6 * np.abs(rows[0]["avg"]).max())
            for row, s in zip(rows, sent):  # |error| < one level of its bucket's norm
                norms = np.linalg.norm(row["v"][:2944].reshape(-1, 128), axis=1)
                assert np.all(np.abs(s - row["v"])[:2944].reshape(-1, 128)
                              <= norms[:, None] / 7 * 1.0001)
                assert not np.array_equal(s, row["v"])  # it did quantise
            continue
        decoded = [codec.decode(codec.encode(torch.from_numpy(row["v"].astype(np.float32))),
                                numel, torch.float32).numpy() for row in rows]
        expected = (decoded[0] + decoded[1]) / 2
        if name == "bf16":
            np.testing.assert_array_equal(rows[0]["avg"], expected)
        else:
            np.testing.assert_allclose(rows[0]["avg"], expected, rtol=0,  # ~2 ulps of scale
                                       atol=2.5e-7 * np.abs(expected).max())
        for s, d in zip(sent, decoded):
            np.testing.assert_allclose(s, d, rtol=1e-6, atol=1e-6 * np.abs(d).max())
    payload = {"sign": sign_payload_bytes(numel), "bf16": 2 * numel,
               "qsgd": qsgd_payload_bytes(numel, 7, 128)}[name]
    for r in ranks:
        assert r["bytes"] == steps * (payload + 8 * 4)  # + the 8-element bias, dense fp32
        assert r["paths"] == {"exchange": steps, "dense": steps} and r["identical"]


def test_a_step_in_another_world_than_planned_stops_with_a_clear_error(tape):
    """A step traced for another world than it runs in (an elastic reset without
    hvd_dgc's KerasState, or a tape outside horovodrun's elastic mode) would
    average with a wrong plan (paths, 1/N scales), so it stops before any collective,
    eagerly and in tf.function, naming what does work (tests/tensorflow/test_elastic.py)."""
    for out in _checked(tape, "tape_world_guard"):
        for mode in ("eager", "function"):
            assert "hvd_dgc: this step was traced for 3 ranks" in out[mode], out
            assert "hvd.elastic.KerasState" in out[mode], out


def _layout(kind, sizes=(960, 48, 2304, 48, 240, 5)):
    """hvd_dgc's variables in a checkpoint, as every release has written them (the
    statistics' ``counters`` and ``nonfinite``, the memory, step and epoch; more where
    a path needs it: hvd_dgc/tensorflow/statistics.py): a checkpoint written before
    must restore, so the keys and shapes stay. ``memory/apart`` (each tensor's distance
    from a settled memory, hvd_dgc/tensorflow/memory.py) came later: a checkpoint
    without it restores with every tensor unsettled, its residual sent in full."""
    prefix = "dgc/exchange_*/" if kind == "tape" else "dgc/"
    memory = ["u", "v"] if kind == "keras" else ["v"]  # Keras: SGD's momentum taken over
    keys = [("counters", [6]), ("epoch", []), ("nonfinite", []), ("step", []),
            ("memory/apart", [len(sizes)])] + [
        (f"memory/{m}/{i}", [n]) for m in memory for i, n in enumerate(sizes)]
    return sorted([f"{prefix}{key}/.ATTRIBUTES/VARIABLE_VALUE", shape] for key, shape in keys)


def _assert_saved(outs, kind):
    for out in outs:
        assert out["saved"] and out["layout"] == _layout(kind), out


def test_tape_memory_checkpoint_resumes_bit_identically(tape, resumed3):
    _assert_saved(_checked(tape, "checkpoint_tape"), "tape")
    _assert_resumed(_checked(resumed3, "checkpoint_tape"))


def test_keras3_optimizer_memory_checkpoint_resumes_bit_identically(tape, resumed3):
    _assert_saved(_checked(tape, "checkpoint_keras"), "keras")
    _assert_resumed(_checked(resumed3, "checkpoint_keras"))


def test_keras2_optimizer_memory_checkpoint_resumes_bit_identically(keras2, resumed2):
    _assert_saved(_checked(keras2, "checkpoint_keras"), "keras")
    _assert_resumed(_checked(resumed2, "checkpoint_keras"))


def test_tape_at_density_one_equals_horovods_tape_exactly(tape):
    for out in _checked(tape, "tape_dense_equivalence"):
        assert out["moved"] > 1e-2
        assert out["max_diff"] == 0.0 and out["identical"]


def test_tape_dgc_inside_tf_function_keeps_ranks_identical(tape):
    for out in _checked(tape, "tape_sparse_in_tf_function"):
        assert out["identical"] == [True] * 8
        stats = out["stats"][-1] if isinstance(out["stats"], list) else out["stats"]
        # 2 of 6 tensors are >= 1024 elements: sparse at 1%, the rest dense (folded into
        # the allgathers), 8 steps
        assert stats["paths"] == {"sparse": 16, "dense": 32}
        assert stats["current_density"] == 0.01 and stats["step"] == 8
        assert stats["compression_ratio"] > 8
        # what the step's graph holds, as a long trace is judged (switch.long_trace_line):
        # 2 tensors compressed at the one stage
        assert out["compressed"] == (2, 2, 1), out["compressed"]
        # why the bytes went (hvd_dgc/stats.py): the records' positions coded (26 among
        # 2,560 in 28 bytes, 164 among 16,384 in 176), their values in 8 bits and a
        # scale a tensor, and the small tensors, dense (folded into the allgathers, their
        # values alone): all of them
        causes = stats["bytes_by_cause"]
        assert set(causes) == {"positions", "values", "small tensors dense"}, causes
        assert causes["positions"] == 8 * (28 + 176), causes
        assert causes["values"] == 8 * (26 + 164 + 2 * 4), causes
        assert sum(causes.values()) == stats["bytes_sent"], (causes, stats["bytes_sent"])


def test_tape_bad_inputs_give_clear_errors(tape):
    for out in _checked(tape, "tape_bad_inputs"):
        assert "counter" in out["int_variable"] and "floating-point" in out["int_variable"]
        assert out["sparse_as_dense_rows"] == [1.0, 2.0, 0.0]  # averaged over 2 equal ranks
        assert "density" in out["density"]
        assert "not a compressor name" in out["bad_name"] and "'topk'" in out["bad_name"]


def test_tape_reads_horovods_compression_as_dgc_and_says_so(tape):
    """tensorflow2 examples pass compression=hvd.Compression.fp16 / none to the tape: DGC
    (fp16 dense path), a name resolves, density=1.0 is dense; rank 0 says which."""
    for rank, out in enumerate(_checked(tape, "tape_horovod_patterns")):
        for tag in ("fp16", "name", "dense"):
            assert out[tag]["identical"], tag
        if rank == 0:
            fp16 = out["fp16"]["printed"]
            assert fp16.count("[hvd_dgc] tensorflow: DGC at density 0.001, warm-up 0.25 "
                              "to step 160, 0.0625 to step 640") == 1, fp16
            # as PyTorch: the records' values in 8 bits (fp16_values caps them at 16)
            assert "fp8 records" in fp16 and "fp16 allreduce" in fp16
            assert "topk at density 0.001" in out["name"]["printed"]
            assert "dense averaging (density=1.0), fp32 values" in out["dense"]["printed"]
        else:
            assert all(out[t]["printed"] == "" for t in ("fp16", "name", "dense"))


def test_tape_trains_a_keras3_model(tape):
    """DistributedGradientTape over a Keras 3 model's variables (no .ref(): Horovod's own
    tape fails on them): ranks stay identical on the exchanged variables, DGC compresses."""
    for out in _checked(tape, "tape_keras3_model"):
        assert out["keras_version"].startswith("3") and not out["has_ref"]
        assert out["identical"]
        assert out["ratio"] > 1.5, out["ratio"]
        assert all(math.isfinite(v) for v in out["losses"])


def test_tape_inconsistent_config_is_named_not_hung(tape):
    for out in _checked(tape, "tape_inconsistent_config"):
        assert "density" in out and "rank 0=" in out and "rank 1=" in out, out


@pytest.mark.parametrize("version", ["keras3", "keras2"])
def test_keras_backward_passes_per_step_sums_passes_as_horovod(version, tape, keras2):
    for out in _checked(tape if version == "keras3" else keras2, "keras_backward_passes"):
        for how in ("sum", "mean"):
            got = out[how]
            # every 2nd call: bit for bit the run fed the two calls' sum (or mean)
            assert got["max_diff"] == 0.0, got
            assert got["moved_between"] == [False, False, False], got
            assert got["iterations"] == 8 and got["summed_iterations"] == 4, got
            assert got["exchanges"] == 4 and got["identical"], got


def test_keras2_optimizer_at_density_one_equals_horovods(keras2):
    for out in _checked(keras2, "keras_dense_equivalence"):
        assert out["momentum"] < 1e-6 and out["nesterov"] < 1e-6, out


def _assert_fit(out, dense):
    """DGC within a point of ``dense`` (the baseline's record), delayed averaging (when
    run) within two; every rank identical after fit (DGCCallback flushed the last D
    steps when it ended)."""
    dgc = out["dgc"]
    assert dense["accuracy"] > 0.95, "the dense baseline itself did not learn"
    assert dgc["accuracy"] >= dense["accuracy"] - 0.01, (dgc, dense)
    assert dense["identical"] and dgc["identical"]
    compressed = [dgc]
    if "dga" in out:  # D=2 on top of DGC: within 2 points (measured 0-1.4 below dense)
        dga = out["dga"]
        assert dga["accuracy"] >= dense["accuracy"] - 0.02, (dga, dense)
        assert dga["identical"] and dga["in_flight"] == 0
        compressed.append(dga)
    for stats in (run["stats"] for run in compressed):
        assert stats["current_density"] == 0.001 and stats["density"] < 0.02
        assert stats["compression_ratio"] > 30


def _assert_metrics_averaged(outs):
    """MetricAverageCallback in fit (as Horovod's Keras examples): every rank's History
    holds the same numbers, although each rank trained on its own shard."""
    for tag in ("dense", "dgc", "dga"):
        if tag not in outs[0]:
            continue
        first, second = (out[tag]["history_last"] for out in outs)
        for metric in ("loss", "accuracy"):  # (dgc_density: each rank's own statistics)
            assert first[metric] == second[metric], (tag, metric, first, second)


def test_keras2_fit_digits_dgc_within_one_point_of_horovod(keras2):
    for out in _checked(keras2, "keras_fit_digits"):
        assert out["legacy"] and out["keras"] == "2"
        _assert_fit(out, out["dense"])
    _assert_metrics_averaged(_checked(keras2, "keras_fit_digits"))


def test_keras3_fit_digits_dgc_within_one_point_of_horovod(keras3, keras2):
    """Horovod's own Keras optimizer cannot run under Keras 3 (horovod #4290): DGC, DGC
    with delayed averaging and EF-SignSGD under Keras 3 are held to Keras 2's dense
    Horovod run (the same model, data and seed)."""
    horovod_dense = _checked(keras2, "keras_fit_digits")[0]["dense"]
    for out in _checked(keras3, "keras_fit_digits"):
        assert not out["legacy"] and out["keras"].startswith("3.")
        _assert_fit(out, horovod_dense)
        # EF-SignSGD (hvd_dgc/tensorflow/quantize.py), 1 bit an element, with momentum
        # correction: within 2 points of dense, every rank identical
        sign = out["sign"]
        assert sign["identical"] and sign["stats"]["paths"]["exchange"] > 0, sign
        assert sign["accuracy"] >= horovod_dense["accuracy"] - 0.02, (sign, horovod_dense)
    _assert_metrics_averaged(_checked(keras3, "keras_fit_digits"))


def _assert_dga_formula(out):
    assert out["moved"] > 0.1
    # every step equals w0 - lr * (sum own_i + sum_(j <= i-D) (avg_j - own_j)), in float64
    assert out["max_diff_each_step"] < 1e-5, out
    # while averages are in flight each rank holds its own last D updates
    assert not any(out["identical_before_flush"])
    assert out["in_flight_before_flush"] == 2 and out["flushed"]
    # after the flush: w0 - lr * sum of all averages, the same on every rank
    assert out["in_flight_after_flush"] == 0 and out["identical_after_flush"]
    assert out["max_diff_after_flush"] < 1e-5, out
    assert out["iterations"] == 7  # the flush is not an optimizer iteration


@pytest.mark.parametrize("version", ["keras2", "keras3"])
def test_keras_backward_passes_with_delay_follow_the_dga_update_over_their_sums(
        version, tape, keras2):
    """backward_passes_per_step=3 with delay=2 (Keras SGD, momentum taken over): every
    third call exchanges its passes' sum and the weights follow the DGA formula over
    the sums; DGC at 5% delayed then flushed ends where its synchronous run does."""
    for out in _checked(keras2 if version == "keras2" else tape,
                        "tf_dga.keras_passes_with_delay"):
        assert out["moved"] > 0.1 and out["moved_between"] == 0.0
        assert out["max_diff_each_exchange"] < 1e-5, out
        assert not any(out["identical_before_flush"])
        assert out["in_flight_before_flush"] == 2 and out["flushed"]
        assert out["identical_after_flush"] and out["max_diff_after_flush"] < 1e-5, out
        assert out["iterations"] == 15  # every call counts, as in Horovod
        # 5 exchanges, not 15: two tensors sparse and the bias dense each time
        assert out["sparse_paths"] == {"sparse": 10, "dense": 5}, out
        assert out["sparse_in_flight_before_flush"] == 2
        assert out["sparse_delayed_vs_sync"] <= 1e-6 and out["sparse_identical_after_flush"]


def test_tape_delay_two_follows_the_dga_update_and_flush_makes_ranks_identical(tape):
    for out in _checked(tape, "tf_dga.tape_delay_dense_matches_formula"):
        _assert_dga_formula(out)


@pytest.mark.parametrize("version", ["keras2", "keras3"])
def test_keras_delay_two_with_momentum_correction_follows_the_dga_update(version, tape, keras2):
    outs = _checked(keras2 if version == "keras2" else tape,
                    "tf_dga.keras_delay_dense_matches_formula")
    for out in outs:
        _assert_dga_formula(out)


def test_tape_dgc_delay_two_then_flush_equals_synchronous_dgc(tape):
    """Gradients that do not depend on the weights: both runs send the same values, so
    after the flush the delayed run's weights are the synchronous run's, with fp32
    values (the bias dense) and with the default 8-bit values (every tensor sparse: the
    two steps round alike, and keep what the rounding loses in the memory)."""
    for outs in _checked(tape, "tf_dga.tape_delay_sparse_flush_equals_synchronous"):
        assert sorted(outs) == ["32 bits", "8 bits"]
        for bits, out in outs.items():
            assert out["identical_sync"] == [True] * 8, bits
            assert not any(out["identical_delayed_before_flush"]), bits
            assert out["in_flight_before_flush"] == 2 and out["flushed"], bits
            assert out["identical_after_flush"], bits
            assert out["max_diff_vs_synchronous"] < 1e-5, (bits, out)
        assert any(p.get("sparse", 0) >= 16 for p in outs["32 bits"]["paths"]), outs
        # every tensor sparse at 8 bits: 3 tensors x 8 steps, in both runs
        assert outs["8 bits"]["paths"] == [{"sparse": 24}] * 2, outs["8 bits"]["paths"]


def test_delay_bad_inputs_give_clear_errors(tape):
    for out in _checked(tape, "tf_dga.delay_bad_inputs"):
        assert "delay must be an int >= 0" in out["negative"] and "-1" in out["negative"]
        assert "delay must be an int >= 0" in out["float"]
        assert "delay=2 needs a Keras SGD optimizer or Adam/AdamW with its variance " \
            "frozen" in out["rmsprop"] and "RMSprop is not" in out["rmsprop"], out


@pytest.mark.parametrize("version", ["keras2", "keras3"])
@pytest.mark.parametrize("variant", ["keras_dense_p3", "keras_topk_p2_delay1",
                                     "tape_dense_p2_delay3"])
def test_period_follows_the_reference_and_flush_makes_ranks_identical(version, variant, tape,
                                                                      keras2):
    """period=p (with delay=D) in TensorFlow, every step against tests/reference.py's
    lagged_update (the same rule PyTorch's test simulates): between exchanges each rank
    steps alone and sends nothing; an exchange's average replaces its period's own
    steps D steps later; the flush takes back the steps after the last exchange."""
    import tests.reference as ref
    for out in _checked(keras2 if version == "keras2" else tape,
                        "tf_dga.period_matches_reference"):
        res = out[variant]
        period, delay, steps = res["period"], res["delay"], res["steps"]
        assert res["moved"] > 1e-2
        assert res["max_diff_each_step"] < 1e-5, res
        due = ref.lag_due(steps, delay, period)
        applied = set(due.values())
        for i, spread in enumerate(res["spread"]):
            if i in applied and delay == 0:  # an exchange applied at once: one trajectory
                assert spread < 1e-6, (i, res["spread"])
            elif i not in applied:  # own steps (or an average still travelling)
                assert spread > 1e-6, (i, res["spread"])
        # steps waiting after each step: those whose exchange is not applied yet
        for i, waiting in enumerate(res["in_flight"]):
            pending = [j for j in range(i + 1)
                       if due.get(j + (-(j + 1)) % period, steps + delay) > i]
            assert waiting == len(pending), (i, res["in_flight"])
        assert res["flushed"] == (res["in_flight"][-1] > 0)
        assert res["in_flight_after_flush"] == 0 and res["identical_after_flush"]
        assert res["max_diff_after_flush"] < 1e-5, res
        # collectives only on exchange steps: one per tensor per exchange
        assert sum(res["paths"].values()) == res["tensors"] * (steps // period), res["paths"]
        if "topk" in variant:
            assert res["paths"].get("sparse", 0) > 0, res["paths"]


@pytest.mark.parametrize("version", ["keras2", "keras3"])
def test_auto_delay_is_kept_in_the_checkpoint(version, tape, keras2):
    """delay="auto"'s D is in ``dgc_state``: restored, a run goes on at the D it had
    reached (4) instead of climbing again from AutoDelay's start (1)."""
    for out in _checked(keras2 if version == "keras2" else tape,
                        "tf_dga.auto_delay_checkpoint"):
        assert out["saved"] == 4, out
        assert out["restored"] == [4, 4], out
        assert out["fresh"] == [1, 1], out


@pytest.mark.parametrize("version", ["keras2", "keras3"])
@pytest.mark.parametrize("variant", ["down", "up", "up_period2"])
def test_auto_delay_same_on_every_rank_and_equal_to_the_rule_it_chose(version, variant, tape,
                                                                      keras2):
    """delay=AutoDelay(max_delay=4, window=2) in Keras, as PyTorch's test: every rank runs
    the same D at every step (the window's sums agreed, max over ranks), D moves the way
    its measurements say, and the weights at every step and after the flush are the
    reference's (tests/reference.py) fed that same sequence of D."""
    for out in _checked(keras2 if version == "keras2" else tape,
                        "tf_dga.auto_delay_matches_reference"):
        res = out[variant]
        assert_auto_delay_trace(res, variant)
        assert res["max_diff_each_step"] < 1e-5 and res["max_diff_after_flush"] < 1e-5, res
        assert res["identical_after_flush"] and res["moved"] > 1e-2


def test_period_bad_inputs_give_clear_errors(tape):
    for out in _checked(tape, "tf_dga.period_bad_inputs"):
        assert "period must be an int >= 1" in out["zero"], out["zero"]
        assert "period=3 needs a Keras SGD optimizer" in out["rmsprop"] and \
            "Use period=1" in out["rmsprop"], out["rmsprop"]
        assert "period=2 does not work with compression" in out["powersgd"], out["powersgd"]
        assert out["elastic"] is None  # period runs under elastic Keras (commits flush)


def _assert_skipped(out):
    # the NaN never reached the memory: bit for bit the run that never had step 3
    assert out["max_diff_vs_run_without_the_step"] == 0.0, out
    assert out["nonfinite_steps"] == 1 and out["ref_nonfinite_steps"] == 0
    assert out["steps"] == out["ref_steps"] == 5  # the skipped step is not counted
    assert out["iterations"] == out["ref_iterations"] == 5
    assert out["weights_finite"] and out["identical"]


def test_tape_nonfinite_gradient_on_one_rank_is_skipped_everywhere(tape):
    outs = _checked(tape, "tf_dga.nonfinite_skips_the_step")
    for out in outs:
        _assert_skipped(out)
        # every rank got NaN gradients at step 3 (its own were finite on rank 0)
        assert out["finite_returned"] == [True, True, True, False, True, True]
        assert out["memory_finite_with_skip"]
    # control: with skip_nonfinite=False the NaN enters rank 1's memory and stays there
    # unseen (never selected, so the returned gradients look fine)
    assert outs[0]["memory_finite_without_skip"] and not outs[1]["memory_finite_without_skip"]
    assert all(out["finite_returned_without_skip"] == [True] * 6 for out in outs)


@pytest.mark.parametrize("version", ["keras2", "keras3"])
def test_keras_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(version, tape, keras2):
    for out in _checked(keras2 if version == "keras2" else tape,
                        "tf_dga.keras_nonfinite_skips_the_step"):
        _assert_skipped(out)


@pytest.mark.parametrize("kind", ["tape", "keras"])
def test_delayed_averaging_drops_a_nonfinite_gradient_on_its_rank(tape, kind):
    name = "delayed_nonfinite_is_dropped_on_its_rank"
    outs = _checked(tape, "tf_dga." + (name if kind == "tape" else "keras_" + name))
    assert [out["nonfinite_steps"] for out in outs] == [0, 1]  # counted where it happened
    for out in outs:
        assert out["memory_finite"] and out["weights_finite"] and out["identical_after_flush"]
    assert outs[1]["momentum"] == (kind == "keras")
    # the NaN rank's memory of that tensor did not move (v, and u with momentum), as in
    # PyTorch (tests/reference.py), where the other rank's did; its other tensor (a
    # dense one: v is emptied every step, u moves) went on as the other rank's
    n = 2 if kind == "keras" else 1
    assert outs[1]["moved"]["tensor0"] == [False] * n
    assert outs[0]["moved"]["tensor0"] == [True] * n
    assert outs[1]["moved"]["tensor1"] == outs[0]["moved"]["tensor1"] == [False, True][:n]


@pytest.mark.parametrize("launch", ["tape", "keras2"])  # Keras 3, Keras 2
def test_register_local_var_keeps_those_gradients_on_their_rank(launch, request):
    """Horovod's ``register_local_var``: a local variable steps on this rank's own
    gradient / N (``scale_local_gradients``), the others on the average; with SGD's
    momentum taken over by DGC, the local ones keep SGD's momentum too."""
    outs = _checked(request.getfixturevalue(launch), "tf_local.keras_local_vars")
    world, steps, lr = len(outs), 5, 0.1
    for tag, momentum in (("sgd", 0.0), ("momentum", 0.9)):
        per_rank = [out[tag] for out in outs]
        # u_t = m u_(t-1) + g with g constant: the weights move by lr g sum_t sum_(j<t) m^j
        factor = sum(sum(momentum ** j for j in range(t)) for t in range(1, steps + 1))
        for rank, out in enumerate(per_rank):
            for i, (start, final) in enumerate(zip(out["start"], out["final"])):
                if i < 2:  # local
                    g = np.float32(out["grads"][i]) / world
                else:
                    g = np.mean([np.float32(o["grads"][i]) for o in per_rank], axis=0)
                np.testing.assert_allclose(final, np.float32(start) - lr * factor * g,
                                           rtol=1e-5, atol=1e-6, err_msg=f"{tag} var {i}")
            assert "register_local_var" in out["late"] and "before training" in out["late"]
            assert out["exchanged"] == {"dense": 2 * steps}  # the shared two, each step
            assert len(out["velocity"]) == (2 if momentum else 0), out["velocity"]
        # the local variables differ across the ranks, the shared ones do not
        assert per_rank[0]["final"][0] != per_rank[1]["final"][0]
        assert per_rank[0]["final"][2:] == per_rank[1]["final"][2:]

def test_keras2_compute_gradients_hands_out_the_average_and_apply_does_not_exchange_again(
        keras2):
    """Horovod's aggregation API: ``_compute_gradients`` returns the gradients averaged
    over the ranks, and ``apply_gradients`` applies what it is given (here halved by
    the user in between) without a second exchange: one exchange per step. Keras'
    public ``compute_gradients`` returns this rank's own, exchanged by
    ``apply_gradients``, so a LossScaleOptimizer around DGC changes nothing (its
    scaled gradients never reach DGC's memory). A user's own subclass of Keras' SGD
    (density 1.0, lr 0.1, gradient the constant c(rank): w = w0 - 0.1 t mean(c))."""
    outs = _checked(keras2, "tf_keras_api.keras_compute_gradients")
    mean = [np.mean([np.float32(o["coef"][i]) for o in outs], axis=0) for i in range(2)]
    for out in outs:
        for mode, factor in (("eager", 1.0), ("function", 1.0), ("in_cond", 1.0),
                             ("public", 1.0), ("halved", 0.5)):
            res, steps = out[mode], len(out[mode]["returned"])
            assert res["exchanges"] == steps and res["iterations"] == steps, (mode, res)
            handed = [np.float32(c) for c in out["coef"]] if mode == "public" else mean
            for returned in res["returned"]:
                for i in range(2):
                    np.testing.assert_allclose(returned[i], factor * handed[i], rtol=1e-6,
                                               err_msg=mode)
            for i in range(2):
                np.testing.assert_allclose(
                    res["final"][i], np.float32(res["start"][i]) - 0.1 * steps * factor *
                    mean[i], rtol=1e-5, atol=1e-6, err_msg=f"{mode} var {i}")
        assert "apply_gradients got other variables than _compute_gradients" in \
            out["other_variables"], out["other_variables"]
        assert "`tape` is required" in out["no_tape"], out["no_tape"]  # Keras' own words
        # loss scale 2^10, doubled every step: DGC at 25% saw the same gradients bit for bit
        assert out["loss_scaled"] == out["unscaled"]
        assert out["unscaled"]["paths"] == {"sparse": 3, "dense": 3}
        assert out["unscaled"]["weights"] != outs[0]["eager"]["start"]  # (it trained)
        # the outer loop's inner steps are local: this rank's own gradients
        assert out["outer"]["returned"] == out["coef"] and out["outer"]["agg_helper"] is None


def _assert_passes(outs, with_returned, passes=3):
    """tests/tensorflow/tf_keras_api.py keras_passes: variable 0 local, 1 shared; every
    ``passes``-th call exchanges the sum (or mean) of the calls' gradients, the calls
    between move nothing and return the local sum so far; a non-finite pass makes every
    rank skip that exchange (its sum dropped, ``iterations`` not counted)."""
    world = len(outs)
    mean = np.mean([np.float32(o["coef"][1]) for o in outs], axis=0)
    for out in outs:
        own = [np.float32(c) for c in out["coef"]]
        for variant in ("sum", "mean", "nonfinite"):
            res = out[variant]
            calls = len(res["weights"])
            scale = 1.0 if variant == "mean" else float(passes)
            skipped = {3} if variant == "nonfinite" else set()
            assert res["counter"] == [k % passes for k in range(1, calls + 1)], res["counter"]
            skips = [sum(1 for s in skipped if s <= k) for k in range(1, calls + 1)]
            assert res["iterations"] == [k - s for k, s in zip(range(1, calls + 1), skips)]
            exchanges = calls // passes - len(skipped)
            assert res["exchanges"] == exchanges and res["paths"] == {"dense": exchanges}
            assert res["nonfinite"] == len(skipped)
            for k in range(1, calls + 1):
                applied = sum(1 for e in range(passes, k + 1, passes) if e not in skipped)
                local = own[0] * scale / world  # this rank's own / N (scale_local_gradients)
                np.testing.assert_allclose(
                    res["weights"][k - 1][0], np.float32(res["start"][0]) - 0.1 * applied *
                    local, rtol=1e-5, atol=1e-6, err_msg=f"{variant} call {k} local")
                np.testing.assert_allclose(
                    res["weights"][k - 1][1], np.float32(res["start"][1]) - 0.1 * applied *
                    scale * mean, rtol=1e-5, atol=1e-6, err_msg=f"{variant} call {k} shared")
                if not with_returned or variant == "nonfinite":
                    continue
                returned = res["returned"][k - 1]
                if k % passes:  # Horovod hands out the local sum so far
                    for i in range(2):
                        np.testing.assert_allclose(returned[i], (k % passes) * own[i],
                                                   rtol=1e-6)
                else:
                    np.testing.assert_allclose(returned[0], local, rtol=1e-6)
                    np.testing.assert_allclose(returned[1], scale * mean, rtol=1e-6)
            if variant == "nonfinite" and with_returned:
                assert np.all(np.isfinite(res["returned"][-1][1]))  # the next sums are clean


def test_keras2_compute_gradients_with_backward_passes_and_local_variables(keras2):
    """Horovod's aggregation API (``_compute_gradients``, ``_agg_helper.counter``) with
    ``backward_passes_per_step=3`` and a local variable, Keras 2."""
    _assert_passes(_checked(keras2, "tf_keras_api.keras_passes"), with_returned=True)


def test_keras3_backward_passes_with_local_variables_and_a_nonfinite_pass(tape):
    """The same through ``apply_gradients`` (``model.fit``'s path), Keras 3."""
    _assert_passes(_checked(tape, "tf_keras_api.keras_passes"), with_returned=False)


@pytest.fixture(scope="module")
def how_steps_leave():
    """One launch (2 ranks, Keras 3) for the tests of how a TF step's tensors leave."""
    return run("tests.tensorflow.tf_dgc:suite", np=2, timeout=400, env=KERAS3,
               kwargs={"names": ["tf_fold.folded_equals_apart", "tf_fold.buckets_across_stages",
                                 "tape_log_every"]})


def test_tape_folds_its_dense_tensors_and_buckets_its_step_into_one_operation(how_steps_leave):
    """A tape step whose biases the cost model folds (the defaults) holds no allreduce:
    the biases travel as their values alone (every index, known to every rank) in
    allgathers Horovod fuses with the kernels' (one Horovod operation a step instead of
    two: 4.9 round trips down to the floor over a 100 ms link,
    bench/results/round_trips.md); with the default ``fusion_threshold`` (Horovod's 64
    MiB) the six tensors are one bucket, one grouped allgather, as PyTorch's buckets. In
    fp32 its averaged gradients are those of the same step with them apart and alone (a
    cost model of no latency and a slow allgather) bit for bit, every rank ends
    identical, and it sent the same bytes."""
    for out in how_steps_leave:
        out = out["tf_fold.folded_equals_apart"]
        assert "error" not in out, out.get("error")
        assert out["bucketed"]["ops"] == {"allreduce": 0, "allgather": 1}, out["bucketed"]
        assert out["folded"]["ops"] == {"allreduce": 0, "allgather": 6}, out["folded"]["ops"]
        assert out["apart"]["ops"] == {"allreduce": 4, "allgather": 2}, out["apart"]["ops"]
        assert out["equal"] == {"bucketed": [True] * 6, "folded": [True] * 6}, out["equal"]
        for name in ("bucketed", "folded", "apart"):
            assert out[name]["identical"], name
            assert out[name]["paths"] == out["apart"]["paths"], name  # (counted as dense)
        assert out["bucketed"]["bytes"] == out["folded"]["bytes"]
        assert out["folded"]["bytes"] == out["apart"]["bytes"] > 4 * out["dense_numel"]


def test_buckets_follow_the_warm_up_stages_and_change_no_average(how_steps_leave):
    """Buckets per density stage (a switch on the stage every rank takes alike): the
    default threshold puts a stage's six tensors in one grouped allgather (2 in the
    traced step: one per stage), 6,000 bytes more (3: the records coded, in 8 bits), none
    one each (8: a sparse tensor's coded records have a size per stage, so each of the
    two has an allgather in each stage's branch; the four biases one each). Every step's
    averaged gradients, a NaN step skipped on every rank included, are bit-identical
    to each tensor alone; the same bytes and paths; ranks identical."""
    for out in how_steps_leave:
        out = out["tf_fold.buckets_across_stages"]
        assert "error" not in out, out.get("error")
        for name, gathers in (("default", 2), ("small", 3), ("alone", 8)):
            res = out[name]
            assert res["ops"] == {"allreduce": 0, "allgather": gathers}, (name, res["ops"])
            assert res["identical"] and res["nonfinite_steps"] == 1, (name, res)
            assert res["paths"] == {"dense": 4 * 7, "sparse": 2 * 7}, (name, res["paths"])
            assert res["bytes"] == out["alone"]["bytes"], name
        assert out["equal"] == {"default": [True] * 8, "small": [True] * 8}, out["equal"]


def test_log_every_prints_statistics_on_rank_zero_only(how_steps_leave):
    """As PyTorch's (tests/torch/test_optimizer.py): after steps 2 and 4 of 5, rank 0
    prints step, density and the statistics' line; rank 1 prints nothing. The tape in
    a tf.function and Keras 3's model.fit."""
    rank0, rank1 = (_checked(how_steps_leave, "tape_log_every")[r] for r in (0, 1))
    for name in ("tape", "keras"):
        lines = rank0[name]
        assert [line.split()[:3] for line in lines] == [["[hvd_dgc]", "step", "2:"],
                                                        ["[hvd_dgc]", "step", "4:"]], lines
        # the density in effect, the bytes since the start (labelled so), the paths
        assert all("density 0.01 now; sent " in line and "x less than dense fp32" in line
                   and "paths in " in line for line in lines), lines
        assert " MB in 2 steps " in lines[0] and " MB in 4 steps " in lines[1], lines
        assert rank1[name] == [], rank1
