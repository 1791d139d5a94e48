"""Region reduce over Horovod's collectives: sparse aggregation whose bytes per worker
stay flat as workers are added (issue 15; the maths and its NumPy reference are in
hvd_dgc/aggregation.py, after Ok-Topk, Shi et al., PPoPP 2022).

Allgather, today's sparse path, hands every worker every other worker's k records:
k(N-1) per worker per tensor, growing with N. Here each rank owns one contiguous
region of the index space: one alltoall sends each record to its region's owner, the
owner sums what it got and keeps its ``quota = ceil(k/N)`` largest sums, one
allgather shares the kept ones. About 2k(N-1)/N records per worker, whatever N.

What an owner does not keep goes back into the owner's residual (error feedback), so
nothing is lost: the sum over ranks of the memories plus the update is what it was
before the step. Every rank receives the same allgather, so every rank applies the
same update, bit for bit.

Records travel as ``[int32 index bits | float32 value]`` rows, one alltoall and one
allgather per tensor (two collective rounds: this path is for bandwidth, not latency).
"""

from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import global_process_set

from hvd_dgc.aggregation import quota

__all__ = ["RegionResult", "owners", "pack_records", "region_reduce", "unpack_records"]


class RegionResult(NamedTuple):
    indices: torch.Tensor    # int64, sorted: the coordinates this step updates
    values: torch.Tensor     # their sum over ranks (float32; divide by N to average)
    returned: tuple          # (indices, values) this rank, as owner, adds back to its residual
    received: int            # records received from other ranks, both rounds


def owners(indices, numel, world):
    """The rank owning each index: ``world`` contiguous regions whose sizes differ by at
    most one, the first ``numel % world`` one longer (hvd_dgc.aggregation.regions)."""
    base, extra = divmod(numel, world)
    cut = extra * (base + 1)
    if base == 0:  # fewer elements than ranks: rank i owns index i
        return indices.clone()
    return torch.where(indices < cut, indices // (base + 1), extra + (indices - cut) // base)


def pack_records(indices, values):
    return torch.stack([indices.to(torch.int32).view(torch.float32),
                        values.to(torch.float32)], dim=1)


def unpack_records(records):
    records = records.contiguous()
    return records[:, 0].contiguous().view(torch.int32).to(torch.int64), records[:, 1]


def region_reduce(indices, values, numel, k, name, process_set=global_process_set):
    """Sum every rank's records ``(indices, values)`` of one flat tensor of ``numel``
    elements, keeping ``ceil(k/N)`` per region (module doc). Blocking; every rank of
    ``process_set`` must call it with the same ``numel``, ``k`` and ``name``."""
    if numel >= 2 ** 31:
        raise ValueError(f"region_reduce: {numel} elements do not fit int32 indices")
    world, rank = process_set.size(), process_set.rank()
    own = owners(indices, numel, world)
    order = torch.argsort(own, stable=True)
    splits = torch.bincount(own, minlength=world).to(torch.int32)
    got, got_splits = _hvd.alltoall(pack_records(indices[order], values[order]), splits=splits,
                                    name=name + ".split", process_set=process_set)
    region_indices, region_values = unpack_records(got)  # by source rank: a fixed summation order
    unique, inverse = torch.unique(region_indices, sorted=True, return_inverse=True)
    sums = torch.zeros(unique.numel(), dtype=torch.float32).index_add_(0, inverse, region_values)
    # largest |sum| first, ties by lower index (unique is sorted and the sort is stable)
    ranked = torch.sort(sums.abs(), descending=True, stable=True).indices
    q = quota(k, world)
    keep, back = ranked[:q].sort().values, ranked[q:].sort().values
    kept = pack_records(unique[keep], sums[keep])
    everyone = _hvd.allgather(kept, name=name + ".gather", process_set=process_set)
    update_indices, update_values = unpack_records(everyone)  # owners in rank order: sorted
    received = (got.shape[0] - int(got_splits[rank])) + (everyone.shape[0] - kept.shape[0])
    return RegionResult(update_indices, update_values, (unique[back], sums[back]), received)
