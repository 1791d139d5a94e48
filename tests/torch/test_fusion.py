"""hvd_dgc's buckets (``fusion_threshold``): a step's tensors leave in one launch per
bucket instead of one per tensor, with the same training bit for bit; 2 ranks under
horovodrun (Gloo)."""

import pytest

from harness.hvdrun import run
from tests.device import kind as device_kind
from tests.torch.test_optimizer import _checked

SCENARIOS = ["bundled_equals_per_tensor", "unused_parameter_on_one_rank",
             "sparse_gradient_in_a_bucket", "bad_threshold"]


@pytest.fixture(scope="module")
def gloo():
    return run("tests.torch.torch_fusion:suite", np=2, controller="gloo",
               kwargs={"names": SCENARIOS})


@pytest.mark.parametrize("variant", ["sync", "delay", "period", "passes", "region",
                                     "unfolded", "unfolded_8bit"])
def test_buckets_train_exactly_as_one_launch_per_tensor(gloo, variant):
    for out in _checked(gloo, "bundled_equals_per_tensor"):
        res = out[variant]
        assert res["moved"] > 1e-2
        assert all(res["equal_each_step"]), res["equal_each_step"]
        assert all(res["identical"])
        assert res["paths"][0]["sparse" if variant != "region" else "region"] > 0


def test_one_launch_per_bucket(gloo):
    if device_kind() != "cpu":  # an accelerator launches all of a step's tensors at once
        _one_launch_on_an_accelerator(gloo)
        return
    for out in _checked(gloo, "bundled_equals_per_tensor"):
        # default threshold: one bucket, its biases riding in its allgather: 1 Horovod
        # op; a threshold cutting it in three: 3; per tensor (0): one op per tensor, 6
        assert out["sync"]["launches"] == [1, 3, 6]
        assert out["delay"]["launches"] == [1, 6]
        # region: the compressed tensors go together in synchronize (alltoall), the
        # dense ones in a bucket of their own or one launch each
        assert out["region"]["launches"] == [2, 5]
        # the cost model without latency keeps the biases' allreduce: 2 ops
        assert out["unfolded"]["launches"] == [2, 6]


def _one_launch_on_an_accelerator(gloo):
    """On a GPU the tensors of a step leave together in synchronize whatever the bucket
    size (the selection is bound by kernel launches there: scheduler.py), so every
    threshold gives the same launches: one, the dense tensors folded into it."""
    for out in _checked(gloo, "bundled_equals_per_tensor"):
        assert out["sync"]["launches"] == [1, 1, 1]
        for variant in ("delay", "region", "unfolded"):
            assert len(set(out[variant]["launches"])) == 1, (variant, out[variant])


def test_folded_dense_tensors_are_counted_as_their_values(gloo):
    """A dense tensor riding in its launch's allgather sends its values alone (fp32 here,
    8 bits and a scale by default): its positions are every index, which every rank
    knows (paths.py AllgatherPath._fold)."""
    dense = [64, 64, 320, 5]  # mlp()'s tensors below min_compress_size, elements
    for out in _checked(gloo, "bundled_equals_per_tensor"):
        folded, alone = out["sync"]["dense_bytes"][0], out["sync"]["dense_bytes"][2]
        assert sorted(folded.values()) == sorted(4 * n for n in dense)
        # one launch per tensor: its own allreduce (on a GPU one launch whatever the
        # buckets: folded), fp32 either way
        assert sorted(alone.values()) == sorted(4 * n for n in dense)
        assert sorted(out["unfolded"]["dense_bytes"][0].values()) == \
            sorted(4 * n for n in dense)  # the cost model kept their fp32 allreduce
        # 8-bit values (the default): folded, a byte each and the tensor's scale
        eight = out["folded_8bit"]
        assert sorted(eight["dense_bytes"][0].values()) == sorted(n + 4 for n in dense)
        assert eight["launches"] == [1] and all(eight["identical"])
        assert sorted(out["unfolded_8bit"]["dense_bytes"][0].values()) == \
            sorted(4 * n for n in dense)


def test_a_tensor_unused_on_one_rank_leaves_with_its_bucket_in_synchronize(gloo):
    for out in _checked(gloo, "unused_parameter_on_one_rank"):
        assert out["identical_each_step"] == [True] * 6
        assert out["launches"] == 1


def test_a_sparse_gradient_leaves_alone_and_its_bucket_without_it(gloo):
    for out in _checked(gloo, "sparse_gradient_in_a_bucket"):
        # the same averaged gradients every step, bit for bit; the same weights wherever
        # torch's sparse momentum is deterministic (CPU), within rounding on CUDA, where
        # it adds the embedding's rows with atomics (tests/device.py)
        assert all(out["grads_equal_each_step"]), out
        if out["sparse_momentum_deterministic"]:
            assert all(out["equal_each_step"]) and out["identical"], out
        else:
            assert out["spread"] < 1e-5 and out["rank_spread"] < 1e-5, out
        assert out["launches"] == 2  # the embedding's rows (two allgathers), the bucket


def test_bad_threshold_names_the_argument(gloo):
    for out in _checked(gloo, "bad_threshold"):
        for case in ("negative", "float", "bool"):
            assert "fusion_threshold must be an int >= 0" in out[case], out[case]
        assert "HOROVOD_FUSION_THRESHOLD must be a number of bytes" in out["environment"]
        assert "'64MB'" in out["environment"]
