"""Region reduce (hvd_dgc/torch/region.py) on every rank under horovodrun: each case's
records are drawn from generators any process can rebuild, so the test compares the
ranks' results with hvd_dgc.aggregation's NumPy reference on the same inputs. The records
go through Horovod on the test device (``HVD_DGC_TEST_DEVICE``: CUDA over NCCL)."""

import torch

import horovod.torch as hvd
from hvd_dgc.torch.region import region_reduce
from tests.device import device

#: name -> (numel, k per rank, overlap): "overlap" draws every rank's indices from the
#: first half, so ranks send the same coordinates and owners sum them
CASES = {"spread": (1000, 40, False), "overlap": (1001, 60, True), "k_above_region": (10, 5, False),
         "fewer_elements_than_ranks": (3, 2, False), "density_one": (64, 64, False),
         "fewer_records_than_ranks": (50, 1, False)}  # 4 ranks: 2 regions, 2 owners


def selections(world, numel, k, overlap, seed=0):
    """Every rank's (indices, values), sorted by index as DGC's selection sends them."""
    out = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        pool = numel // 2 if overlap else numel
        indices = torch.randperm(pool, generator=gen)[:k].sort().values
        out.append((indices, torch.randn(indices.numel(), generator=gen)))
    return out


def suite(names=None):
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    results = {}
    for case, (numel, k, overlap) in CASES.items():
        indices, values = selections(world, numel, k, overlap)[rank]
        res = region_reduce(indices.to(device()), values.to(device()), numel, k,
                            name=f"region.{case}")
        everyone = hvd.allgather_object((res.indices.tolist(), res.values.tolist()),
                                        name=f"region.{case}.check")
        results[case] = {"indices": res.indices.cpu().numpy(), "values": res.values.cpu().numpy(),
                         "returned": (res.returned[0].cpu().numpy(),
                                      res.returned[1].cpu().numpy()),
                         "received": res.received,
                         "identical": all(e == everyone[0] for e in everyone)}
    return results
