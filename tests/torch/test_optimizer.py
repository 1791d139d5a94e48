"""hvd_dgc.torch.DistributedOptimizer on 2 real Horovod ranks (horovodrun --gloo, and --mpi).

Scenarios run in a few launches (module fixtures); each test asserts on one result.
"""

import numpy as np
import pytest

from harness.hvdrun import run
from hvd_dgc.packing import index_bytes
from hvd_dgc.torch.memory import aligned_size, fused_kernel_available
from tests.device import kind as device_kind

GLOO_SCENARIOS = ["dense_equivalence", "dense_fp16", "sparse_consistency", "backward_passes", "grouping",
                  "adam", "amp_pattern", "state_roundtrip", "bad_inputs", "inconsistent_config", "log_every",
                  "horovod_patterns", "sparse_embeddings", "fp16_outlier", "sparse_step",
                  "fp16_records", "fp8_records", "in_place"]


def _checked(results, name):
    for rank, out in enumerate(results):
        res = out[name]
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"rank {rank} raised in scenario {name}:\n{res['error']}")
    return [out[name] for out in results]


@pytest.fixture(scope="module")
def gloo():
    # verbose: the full plan at wrap time, whose words horovod_patterns checks (the
    # default short line: tests/core/test_messages.py)
    return run("tests.torch.torch_dgc:suite", np=2, controller="gloo",
               kwargs={"names": GLOO_SCENARIOS}, env={"HVD_DGC_VERBOSE": "1"})


@pytest.fixture(scope="module")
def mpi():
    return run("tests.torch.torch_dgc:suite", np=2, controller="mpi",
               kwargs={"names": ["dense_equivalence", "sparse_consistency"]})


def _assert_dense_equivalence(per_rank):
    for out in per_rank:
        for variant in ("momentum", "nesterov"):
            res = out[variant]
            assert res["moved"] > 1e-2, "the reference did not train: comparison is empty"
            assert res["max_diff"] < 1e-6, (variant, res["max_diff"])
            assert res["identical"]
            assert res["stats"]["paths"] == {"dense": 6 * 20}
            assert res["stats"]["compression_ratio"] == 1.0
        assert out["compression_none_max_diff"] < 1e-6


def _assert_sparse_consistency(per_rank):
    for out in per_rank:
        assert all(out["identical"]) and len(out["identical"]) == 12
        assert out["moved"] > 1e-3
        sparse = [c for c in out["counts"] if c["path"] == "sparse"]
        dense = [c for c in out["counts"] if c["path"] == "dense"]
        # 3 weights >= 1024 elements are sparse, the 3 biases dense, every step
        assert len(sparse) == 3 * 12 and len(dense) == 3 * 12
        for c in sparse:
            k = -(-c["numel"] // 1000)  # ceil(numel * 0.001)
            if device_kind() == "cpu":
                assert 0.8 * k <= c["sent"] <= k, c
            else:  # the GPU form sends exactly k records (compression.py)
                assert c["sent"] == k, c
        # each step's records: an 8-bit value per slot (the CPU's padded to k) and a
        # float32 scale per tensor, the positions coded over the launch's range (paths.py
        # AllgatherPath.coded)
        for step in range(12):
            cs = sparse[3 * step:3 * step + 3]
            ks = [-(-c["numel"] // 1000) for c in cs]
            spans = [aligned_size(c["numel"]) for c in cs]
            one_launch = sum(ks) + 4 * len(ks) + index_bytes(sum(spans), sum(ks))
            per_tensor = sum(k + 4 + index_bytes(n, k) for n, k in zip(spans, ks))
            assert sum(c["bytes"] for c in cs) in (one_launch, per_tensor), cs
            assert sum(c["bytes"] for c in cs) < 3 * sum(ks)  # int32 index: 8 per record
        for c in dense:
            assert c["numel"] < 1024 and c["sent"] == c["numel"]
        assert out["stats"]["compression_ratio"] > 50
        # why the bytes went: the weights' records, their positions coded (under 2 bytes
        # a slot) and their values in a byte a slot and a scale a tensor, the biases
        # dense (hvd_dgc/stats.py)
        causes = out["stats"]["bytes_by_cause"]
        assert set(causes) == {"positions", "values", "small tensors dense"}, causes
        assert causes["positions"] + causes["values"] == sum(c["bytes"] for c in sparse)
        slots = sum(-(-c["numel"] // 1000) for c in sparse)
        assert causes["values"] == slots + 4 * len(sparse), causes
        assert 0 < causes["positions"] < 2 * slots, causes
        assert causes["small tensors dense"] == sum(c["bytes"] for c in dense)
        assert out["own_compressor"]  # RNG state is per optimizer, not per shared default


def test_density_one_reproduces_horovod_momentum_sgd(gloo):
    _assert_dense_equivalence(_checked(gloo, "dense_equivalence"))


def test_plain_sgd_all_dense_is_stock_horovod_bit_for_bit(gloo):
    """Nothing of DGC's pending: the gradients go as stock Horovod sends them
    (paths.py ``InPlacePath.takes``), and the guard still skips a NaN step on every rank."""
    for out in _checked(gloo, "in_place"):
        assert out["moved"] > 1e-2
        assert out["max_diff"] == 0.0
        assert out["nan_step_unchanged"] and out["nonfinite_steps"] == 1
        assert out["identical"]


def test_residuals_from_a_checkpoint_leave_through_the_memory_before_in_place(gloo):
    for out in _checked(gloo, "in_place"):
        assert out["saved_residual"] > 1e-3, "no residual saved: the test proves nothing"
        assert out["checkpoint_same"]
        assert out["in_place_residual"] == 0.0 and out["memory_residual"] == 0.0


def test_sparse_ranks_bit_identical_and_threshold_in_window(gloo):
    _assert_sparse_consistency(_checked(gloo, "sparse_consistency"))


def test_mpi_controller(mpi):
    _assert_dense_equivalence(_checked(mpi, "dense_equivalence"))
    _assert_sparse_consistency(_checked(mpi, "sparse_consistency"))


def test_dense_fp16_path(gloo):
    for out in _checked(gloo, "dense_fp16"):
        assert out["ratio"] == 2.0
        assert out["identical"]
        assert out["ours_vs_fp32"] < 1e-3
        assert out["ours_vs_fp32"] <= out["stock_fp16_vs_fp32"]


def test_dense_fp16_beyond_its_range_is_clipped_not_lost(gloo):
    """A gradient of 1e5 with fp16 on the dense wire: before, inf on the wire, the step
    skipped on every rank and the gradient lost. Now each rank sends at most what two
    fp16 values may sum to, the rest leaves in the next steps: every step's weights are
    the NumPy reference's (hvd_dgc/fp16wire.py; the TF tape: tests/tensorflow/test_tf.py)."""
    from tests.fp16_wire import GRADS, reference
    weights, clipped = reference()
    for rank, out in enumerate(_checked(gloo, "fp16_outlier")):
        assert out["skipped"] == 0
        np.testing.assert_array_equal(out["weights"], weights)
        assert out["clipped"] == clipped[rank] > 0
        assert len(out["warnings"]) == 1 and "clipped to it" in out["warnings"][0]
        # all of the outlier arrived: 4 steps of at most 32736 carried 1e5 + 3
        total = -(np.float32(GRADS[0][0]) + np.float32(GRADS[0][1])) / 2
        assert abs(out["weights"][-1][0] - total[0]) <= 16


def test_fp16_record_values_keep_their_rounding_in_the_memory(gloo):
    for out in _checked(gloo, "fp16_records"):
        assert 0.8 * 41 <= out["sent"] <= 41  # k = 41 of 4,096 at density 0.01
        assert out["rounding_nonzero"] > 10  # fp16 did round these values
        assert out["rounding_kept"] == 0.0 and out["unsent_untouched"]
        assert out["average_diff"] == 0.0


def test_8bit_record_values_keep_their_rounding_in_the_memory(gloo):
    """The default: values in 8 bits, float8 e4m3 and a scale per tensor (the NumPy
    reference's), the rounding kept in the memory, the average of what arrived."""
    for out in _checked(gloo, "fp8_records"):
        assert 0.8 * 41 <= out["sent"] <= 41  # k = 41 of 4,096 at density 0.01
        assert out["rounding_nonzero"] > 10  # 8 bits did round these values
        assert out["rounding_kept"] == 0.0 and out["unsent_untouched"]
        assert out["average_diff"] == 0.0
        # 41 slots: a byte each, a float32 scale, the positions coded (a bitmap)
        assert out["bytes"] == 41 + 4 + index_bytes(4096, 41)


def test_np1_still_compresses():
    (out,) = run("tests.torch.torch_dgc:suite", np=1, kwargs={"names": ["np1_compresses"]})
    res = out["np1_compresses"]
    assert "error" not in res, res.get("error")
    assert res["size"] == 1
    assert res["stats"]["paths"] == {"sparse": 9, "dense": 9}
    for c in res["counts"]:
        if c["path"] == "sparse":
            k = -(-c["numel"] // 1000)
            assert 0.8 * k <= c["sent"] <= 1.3 * k


def test_backward_passes_per_step(gloo):
    for out in _checked(gloo, "backward_passes"):
        assert out["max_diff"] < 1e-6
        assert "backward_passes_per_step" in out["too_many"]


def test_sparse_embeddings_as_horovod(gloo):
    for rank, out in enumerate(_checked(gloo, "sparse_embeddings")):
        # rows allgathered and averaged, the base SGD's momentum: Horovod's weights
        assert out["max_diff"] < 1e-5
        assert out["max_diff_sparse_as_dense"] < 1e-6
        assert out["grad_is_sparse"] == [True, True]  # as Horovod leaves p.grad
        assert out["momentum_buffer_sparse"]  # SGD's own momentum, not DGC's memory
        plain, as_dense, dgc = out["paths"]
        assert plain == {"dense": 24, "sparse_grad": 6}  # 6 steps: 4 dense tensors + 1
        assert as_dense == {"dense": 30}
        assert dgc == {"dense": 60, "sparse": 20, "sparse_grad": 20}
        emb = out["emb_last_step"]  # coalesced rows: 32 fp32 values + one int64 row index
        assert emb["path"] == "sparse_grad" and emb["sent"] % 32 == 0
        assert emb["bytes"] == emb["sent"] * 4 + (emb["sent"] // 32) * 8
        assert out["dgc_ratio"] > 2
        # every rank hands its SGD the same averaged rows at every step, bit for bit; the
        # weights are then bit-identical wherever torch's sparse momentum is deterministic
        # (CPU), within rounding where it adds rows with atomics (CUDA)
        assert out["dgc_grads_identical"], out["dgc_grads_rank_diff"]
        if out["sparse_momentum_deterministic"]:
            assert out["dgc_identical"]
        else:
            assert out["dgc_rank_weight_diff"] < 1e-5, out["dgc_rank_weight_diff"]
        assert out["dgc_moved_from_dense"] > 1e-3  # the head really was compressed
        assert "delay=2" in out["delay"] and "sparse_as_dense=True" in out["delay"]
        # NaN in rank 1's sparse gradient: skipped on every rank, named in the warning
        # (rank 0's: every rank sees it)
        assert out["nan_step_changed"] == 0.0 and out["nan_steps"] == 1
        assert out["nan_warned"] == (rank == 0) and out["nan_identical"]


def test_groups(gloo):
    for out in _checked(gloo, "grouping"):
        assert out["identical"] == [True, True, True]
        assert out["topk_diffs"] == [0.0, 0.0]
        assert out["bad_groups"] == "A parameter can only appear once in groups."
        # Horovod's private map, which its own tests read: parameter -> name, unique,
        # Horovod's noname.{group}.{index} where the script names none, the same on
        # every rank
        assert out["unnamed"] == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                                  "allreduce.noname.1.0", "allreduce.noname.1.1"]
        assert out["unnamed_keys_are_params"]
        assert out["unnamed_everywhere"] == [out["unnamed"]] * 2


def test_adam(gloo):
    for out in _checked(gloo, "adam"):
        assert out["max_diff"] < 1e-6
        assert out["sparse_identical"]
        assert out["sparse_paths"]["sparse"] == 3 * 15


def test_amp_synchronize_skip_synchronize_pattern(gloo):
    for out in _checked(gloo, "amp_pattern"):
        assert out["warnings"] == []
        # power-of-two loss scale: exactly the unscaled run, including after the overflow
        assert out["diffs"] == [0.0] * 8
        assert out["skipped_step_change"] == 0.0
        assert out["overflow_steps"] == 1
        assert out["residual_finite"] and out["identical"]
        assert out["scale"] == 2.0 ** 11  # GradScaler backed off once


def test_state_dict_roundtrip_resumes_bit_identically(gloo):
    for out in _checked(gloo, "state_roundtrip"):
        assert out["has_residual"], "nothing to lose: the test would prove nothing"
        assert out["step"] == 5
        assert out["equal"]
        assert out["broadcast_ok"]


def test_bad_inputs_give_clear_errors(gloo):
    for out in _checked(gloo, "bad_inputs"):
        for bad in ("0", "1.5", "-0.1", "nan"):
            assert out[f"density={bad}"].startswith("density must be in (0, 1]"), out
        assert "density must be a float" in out["density=str"]
        assert "not named" in out["missing_name"]
        assert "Found duplicates: same" in out["duplicate_name"]
        assert "sequence of tuples" in out["not_tuples"]
        assert "backward_passes_per_step must be an int > 0" in out["bpps=0"]
        assert "Adasum is not supported" in out["adasum"]
        assert "dampening=0.1 is not supported" in out["dampening"]
        assert "apply to sparse compressors" in out["density_with_dense_compressor"]
        assert "'c' has dtype torch.complex64" in out["complex"]
        # the rows both ranks looked up (1, 2 on rank 0; 1, 3 on rank 1) moved, and only they
        assert out["sparse_as_dense_rows_changed"] == [1, 2, 3]
        assert out["sparse_as_dense_identical"]
        assert "Horovod's allreduce cannot sum" in out["stock_optimizer"]
        assert "hvd_dgc.torch.DistributedOptimizer" in out["stock_optimizer"]


def test_inconsistent_config_fails_on_every_rank_naming_it(gloo):
    for out in _checked(gloo, "inconsistent_config"):
        assert "configured differently on different ranks" in out
        assert "density: rank 0=('DensitySchedule', 0.001" in out
        assert "rank 1=('DensitySchedule', 0.01" in out


def test_process_sets():
    res = run("tests.torch.torch_dgc:with_process_sets", np=2,
              kwargs={"names": ["process_sets"]})
    for out in _checked(res, "process_sets"):
        assert out["global_identical"]
        assert not out["set_identical"]  # each rank averaged over its own set only
        assert out["set_world_size"] == 1 and out["set_steps"] == 4
        assert out["set_paths"] == {"dense": 12, "sparse": 12}


def test_log_every_prints_statistics_on_rank_zero_only(gloo):
    rank0, rank1 = _checked(gloo, "log_every")
    assert [line.split()[:3] for line in rank0] == [["[hvd_dgc]", "step", "2:"],
                                                    ["[hvd_dgc]", "step", "4:"]]
    # the density in effect; this step's bytes and the total, each labelled
    assert all("density 0.01 now; sent " in line and " MB this step, " in line and
               "x less than dense fp32" in line for line in rank0), rank0
    assert " MB in 2 steps " in rank0[0] and " MB in 4 steps " in rank0[1], rank0
    assert rank1 == []


def test_horovod_script_patterns_compress_with_the_import_line_switched(gloo):
    """Horovod's examples pass compression=Compression.none / fp16 explicitly: under hvd_dgc
    that is DGC with fp32 / fp16 values (and a name or a class resolves too), with the
    default warm-up by steps (no set_epoch); density=1.0 is dense and equals Horovod; each
    trains as Horovod's dense run does (4 epochs of digits, 88 steps: all in the warm-up's
    first stage, 25%)."""
    for rank, out in enumerate(_checked(gloo, "horovod_patterns")):
        for tag in ("none", "fp16", "name", "name_case", "class", "average", "predivide", "amp",
                    "broadcast_state"):
            res = out[tag]
            assert res["identical"], tag
            assert res["density_now"] == 0.25 and res["density_at_10000"] == 0.001, res
            # 3 large weights at 25%: 8-bit records cost under 3/8 of their dense bytes
            assert res["ratio"] > 2.5, (tag, res["ratio"])
            assert res["paths"]["sparse"] == 3 * 4 * 22, (tag, res["paths"])
            assert res["accuracy"] > out["dense_accuracy"] - 0.02, (tag, res["accuracy"])
        # a record: an 8-bit value (and a share of its tensor's scale) and its position
        # coded, half a byte at density 0.25 (paths.py AllgatherPath.coded), with fp16 on
        # the dense path too; the small dense tensors (biases) ride in their bucket's
        # allgather as their values alone, in 8 bits and a scale each (paths.py _fold)
        for tag in ("none", "fp16"):
            assert out[tag]["record_bytes"] == [1.5], tag
            assert out[tag]["dense_bytes"] == out["none"]["dense_bytes"], tag
            assert all(1 < b <= 1 + 4 / 10 for b in out[tag]["dense_bytes"]), tag
        # op=hvd.Average is the default; predividing by 2 and multiplying back, a
        # power-of-two loss scale and a clipping bound the gradients stay under are exact;
        # broadcast_optimizer_state leaves nothing behind: each equals the plain run
        for tag in ("average", "predivide", "amp", "broadcast_state"):
            assert out[tag]["max_diff_vs_none"] == 0.0, tag
        assert out["name"]["compressor"] == out["class"]["compressor"] == "DGCCompressor"
        assert out["name_case"]["compressor"] == "TopKCompressor"
        dense = out["dense"]
        assert dense["ratio"] == 1.0 and "sparse" not in dense["paths"]
        # float32 rounding over 88 steps (momentum in the memory vs in SGD); the exact
        # equivalence over 20 steps is test_dense_equivalence's, at 1e-6
        assert dense["max_diff_vs_horovod"] < 1e-4
        if rank == 0:
            assert out["none"]["printed"].count(
                "[hvd_dgc] torch: DGC at density 0.001, warm-up 0.25 to step 160, 0.0625 "
                "to step 640, 0.01562 to step 2500, 0.004 to step 10000: 3 of 6") == 1
            assert "3 of 6 tensors sparse (fp8 records" in out["none"]["printed"]
            assert "fp8 records" in out["fp16"]["printed"]
            assert "fp16 allreduce" in out["fp16"]["printed"]
            assert "dense averaging (density=1.0)" in dense["printed"]
        else:
            assert all(out[t]["printed"] == "" for t in ("none", "fp16", "dense"))
        # AdamW with no option: 0/1 Adam, exact Adam to step 20, then the sign at every
        # 4th step, the variance refreshed ("auto"); with DGC's top-k asked for, SGD's
        # stages (DEFAULT_SENDS) from the freeze; with freeze_variance=False error
        # feedback's longer ones (ADAPTIVE_SENDS)
        assert out["adamw_default"] == ["SignCompressor", 4]
        assert out["adamw_schedule"] == ("FrozenAdamSchedule", 20, (
            "DensitySchedule", 1.0, 0.0, "epoch", (1.0, 1.0, 1.0, 1.0), ()), "auto")
        assert out["adamw_topk_schedule"] == ("FrozenAdamSchedule", 20, (
            "DensitySchedule", 0.001, 10000.0, "step", (0.25, 0.0625, 0.015625, 0.004),
            (160.0, 640.0, 2500.0, 10000.0)), "auto")
        assert out["adamw_feedback_boundaries"] == (640, 2560, 10000, 40000)
        if rank == 0:  # warnings on rank 0 only (hvd_dgc/say.py)
            assert len(out["warnings"]) == 2
            assert "min_compress_size=1000000" in out["warnings"][0]
            assert "density 0.99 and 2 ranks" in out["warnings"][1]
        else:
            assert out["warnings"] == []
        assert "not a compressor name" in out["bad_name"] and "'dgc'" in out["bad_name"]
        assert "Custom is a class hvd_dgc cannot use" in out["foreign_class"]
        assert "not one of hvd_dgc's compressors" in out["foreign_instance"]
        assert "density=1.0 trains dense" in out["foreign_instance"]
        assert "Linear is a class" in out["module"]


def test_step_applies_sparse_averages_where_they_landed(gloo):
    """step() synchronizing itself writes the average into views of the exchange's buffer
    and steps at the records' positions only (SGD's step, frozen AdamW's): bit-identical
    weights and gradients to the explicit synchronize() + dense step, every step,
    whatever zero_grad does."""
    # 6 tensors a step (the biases ride in the weights' allgather: the bucket fold);
    # the explicit pattern (the user may change p.grad before step) never steps at the
    # records; mixed does at 5 of its 8 steps; AdamW from its freeze (2 steps) on
    stepped = {"sgd": {"explicit": 0, "step": 48, "kept": 48, "mixed": 30},
               "adamw": {"explicit": 0, "step": 36, "kept": 36, "mixed": 24}}
    stepped["sgd maximize"] = stepped["sgd"]
    if device_kind() != "cpu" or not fused_kernel_available():  # the kernel's: CPU only
        stepped = {variant: dict.fromkeys(counts, 0) for variant, counts in stepped.items()}
    for out in _checked(gloo, "sparse_step"):
        assert set(out) == set(stepped)
        for variant, res in out.items():
            assert res["moved"] > 1e-3 and res["grad_sum"] > 0, variant
            assert res["max_diff"] == 0.0, (variant, res["max_diff"])
            assert res["grad_diff"] == 0.0, (variant, res["grad_diff"])
            assert res["stepped"] == stepped[variant], (variant, res["stepped"])
            assert res["identical"]
