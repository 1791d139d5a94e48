"""Region reduce (hvd_dgc/torch/region.py) on every rank under horovodrun: each case's
records are drawn from generators any process can rebuild, so the test compares the
ranks' results with the NumPy references on the same inputs (hvd_dgc.aggregation's,
tests/reference.py's of the coded wire). The records go through Horovod on the test
device (``HVD_DGC_TEST_DEVICE``: CUDA over NCCL)."""

import numpy as np
import torch

import horovod.torch as hvd
from hvd_dgc.torch.region import RegionReduce, region_reduce
from tests.device import device

#: name -> (numel, k per rank, overlap): "overlap" draws every rank's indices from the
#: first half, so ranks send the same coordinates and owners sum them
CASES = {"spread": (1000, 40, False), "overlap": (1001, 60, True), "k_above_region": (10, 5, False),
         "fewer_elements_than_ranks": (3, 2, False), "density_one": (64, 64, False),
         "fewer_records_than_ranks": (50, 1, False)}  # 4 ranks: 2 regions, 2 owners
#: one launch of several tensors (one joint index space, each its own regions and quota):
#: values of magnitudes 1e-3 to 1e2, so one block's 8-bit scale spans tensors
LAUNCH = ((1000, 37, 3, 64), (10, 4, 1, 12))
VALUE_BITS = (32, 8)


def selections(world, numel, k, overlap, seed=0):
    """Every rank's (indices, values), sorted by index as DGC's selection sends them."""
    out = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        pool = numel // 2 if overlap else numel
        indices = torch.randperm(pool, generator=gen)[:k].sort().values
        out.append((indices, torch.randn(indices.numel(), generator=gen)))
    return out


def launch_selections(world, seed=1):
    """Every rank's records of ``LAUNCH``: ``(joint indices, values, counts)`` (a tensor
    of 3 elements sends 1 or none)."""
    numels, ks = LAUNCH
    out = []
    for rank in range(world):
        gen = np.random.default_rng(seed * 1000 + rank)
        parts, counts, start = [], [], 0
        for n, k in zip(numels, ks):
            count = min(k, n) if n > 3 else rank % 2
            parts.append(np.sort(gen.choice(n, count, replace=False)) + start)
            counts.append(count)
            start += n
        joint = np.concatenate(parts)
        values = gen.standard_normal(joint.size) * 10.0 ** gen.integers(-3, 3, joint.size)
        out.append((joint, values.astype(np.float32), counts))
    return out


def _result(res, name):
    everyone = hvd.allgather_object((res.indices.tolist(), res.values.tolist()),
                                    name=f"{name}.check")
    return {"indices": res.indices.cpu().numpy(), "values": res.values.cpu().numpy(),
            "returned": (res.returned[0].cpu().numpy(), res.returned[1].cpu().numpy()),
            "lost": (res.lost[0].cpu().numpy(), res.lost[1].cpu().numpy()),
            "received": res.received,
            "identical": all(e == everyone[0] for e in everyone)}


def suite(names=None):
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    results = {}
    for bits in VALUE_BITS:
        for case, (numel, k, overlap) in CASES.items():
            indices, values = selections(world, numel, k, overlap)[rank]
            res = region_reduce(indices.to(device()), values.to(device()), numel, k,
                                name=f"region.{case}.{bits}", value_bits=bits)
            results[case, bits] = _result(res, f"region.{case}.{bits}")
        joint, values, counts = launch_selections(world)[rank]
        numels, ks = LAUNCH
        starts = np.repeat(np.cumsum(numels) - np.asarray(numels), counts)
        job = RegionReduce(torch.from_numpy(joint - starts).to(device()),
                           torch.from_numpy(values).to(device()), counts, numels, ks, bits,
                           f"region.launch.{bits}")
        results["launch", bits] = _result(job.collect(), f"region.launch.{bits}")
    return results
