"""Region reduce over Horovod's alltoall and allgather (hvd_dgc/torch/region.py) on 2 and
4 real ranks, against the NumPy references on the same records: hvd_dgc/aggregation.py's
(the sums, float32 values) and tests/reference.py's of the coded wire (every value
width, a launch of several tensors: the bytes received, what each rounding kept)."""

import numpy as np
import pytest

from hvd_dgc.aggregation import region_reduce_reference
from harness.hvdrun import run
from tests import reference as ref
from tests.torch.torch_region import CASES, LAUNCH, VALUE_BITS, launch_selections, selections


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    world = request.param
    return world, run("tests.torch.torch_region:suite", np=world, controller="gloo")


def _received(want, rank):
    """Bytes rank receives on the coded wire: the others' blocks for it, their kept."""
    return sum(blocks[rank].size for i, blocks in enumerate(want.to_owners) if i != rank) + \
        sum(block.size for j, block in enumerate(want.kept) if j != rank)


def _check_coded(results, want):
    for rank, out in enumerate(results):
        assert out["identical"], "ranks must apply the same update"
        np.testing.assert_array_equal(out["indices"], want.indices)
        np.testing.assert_array_equal(out["values"], want.values)
        lost = np.argsort(out["lost"][0], kind="stable")  # (in the blocks' order: sort)
        for got, expected in ((out["returned"], want.returned[rank]),
                              ((out["lost"][0][lost], out["lost"][1][lost]), want.lost[rank])):
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_allclose(got[1], expected[1], rtol=1e-6, atol=1e-7)
        assert out["received"] == _received(want, rank)


def _nothing_lost(results, total):
    """The update plus what the owners keep plus what the senders kept equals
    everything sent."""
    kept = np.zeros(total.size)
    np.add.at(kept, results[0]["indices"], results[0]["values"])
    for out in results:
        np.add.at(kept, *out["returned"])
        np.add.at(kept, *out["lost"])
    np.testing.assert_allclose(kept, total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", VALUE_BITS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_region_reduce_equals_the_reference_on_every_rank(ranks, case, bits):
    world, results = ranks
    results = [out[case, bits] for out in results]
    numel, k, overlap = CASES[case]
    sent = [(i.numpy(), v.numpy()) for i, v in selections(world, numel, k, overlap)]
    _check_coded(results, ref.region_reduce_coded(sent, (numel,), (k,), bits))
    if bits == 32:  # the sums of hvd_dgc.aggregation's reference, no rounding kept
        plain = region_reduce_reference(sent, numel, k)
        for rank, out in enumerate(results):
            np.testing.assert_array_equal(out["indices"], plain.indices)
            np.testing.assert_allclose(out["values"], plain.values, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(out["returned"][0], plain.returned[rank][0])
            assert out["lost"][0].size == 0
    total = np.zeros(numel)
    for i, v in sent:
        np.add.at(total, i, v)
    _nothing_lost(results, total)
    if case == "density_one" and bits == 32:  # every coordinate fits its quota: the sum
        assert all(out["returned"][0].size == 0 for out in results)
        np.testing.assert_array_equal(results[0]["indices"], np.arange(numel))
        np.testing.assert_allclose(results[0]["values"], total, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", VALUE_BITS)
def test_a_launch_of_several_tensors_equals_the_reference(ranks, bits):
    world, results = ranks
    results = [out["launch", bits] for out in results]
    drawn = launch_selections(world)
    want = ref.region_reduce_coded([(j, v) for j, v, _ in drawn], *LAUNCH, bits)
    _check_coded(results, want)
    total = np.zeros(sum(LAUNCH[0]))
    for joint, values, _ in drawn:
        np.add.at(total, joint, values)
    _nothing_lost(results, total)
    if bits == 8:  # one byte a value, about 2 to 10 bits a position, and the blocks'
        # counts and scales: a fifth of int32 records' 8 bytes or less at 4 ranks
        records = sum(out["received"] for out in results)
        assert records < sum(len(j) for j, _, _ in drawn) * (world - 1) * 8 * 0.6, records
