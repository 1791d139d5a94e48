"""Region reduce over Horovod's alltoall and allgather (hvd_dgc/torch/region.py) on 2 and
4 real ranks, against the NumPy reference (hvd_dgc/aggregation.py) on the same records."""

import numpy as np
import pytest

from hvd_dgc.aggregation import region_reduce_reference
from harness.hvdrun import run
from tests.torch.torch_region import CASES, selections


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    world = request.param
    return world, run("tests.torch.torch_region:suite", np=world, controller="gloo")


@pytest.mark.parametrize("case", sorted(CASES))
def test_region_reduce_equals_the_reference_on_every_rank(ranks, case):
    world, results = ranks
    numel, k, overlap = CASES[case]
    sent = [(i.numpy(), v.numpy()) for i, v in selections(world, numel, k, overlap)]
    ref = region_reduce_reference(sent, numel, k)
    for rank, out in enumerate(results):
        res = out[case]
        assert res["identical"], "ranks must apply the same update"
        np.testing.assert_array_equal(res["indices"], ref.indices)
        np.testing.assert_allclose(res["values"], ref.values, rtol=1e-6, atol=1e-6)
        back_i, back_v = ref.returned[rank]
        np.testing.assert_array_equal(res["returned"][0], back_i)
        np.testing.assert_allclose(res["returned"][1], back_v, rtol=1e-6, atol=1e-6)
        assert res["received"] == ref.received_records[rank]
    # nothing lost: the update plus what the owners keep equals everything sent
    total = np.zeros(numel)
    for i, v in sent:
        np.add.at(total, i, v)
    kept = np.zeros(numel)
    np.add.at(kept, results[0][case]["indices"], results[0][case]["values"])
    for out in results:
        np.add.at(kept, *out[case]["returned"])
    np.testing.assert_allclose(kept, total, rtol=1e-5, atol=1e-5)
    if case == "density_one":  # every coordinate fits its region's quota: the dense sum
        assert all(out[case]["returned"][0].size == 0 for out in results)
        np.testing.assert_array_equal(results[0][case]["indices"], np.arange(numel))
        np.testing.assert_allclose(results[0][case]["values"], total, rtol=1e-6, atol=1e-6)
