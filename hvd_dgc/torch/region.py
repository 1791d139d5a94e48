"""Region reduce over Horovod's collectives: sparse aggregation whose bytes per worker
stay flat as workers are added (issue 15; the maths and its NumPy reference are in
hvd_dgc/aggregation.py, after Ok-Topk, Shi et al., PPoPP 2022).

Allgather, the other sparse path, hands every worker every other worker's k records:
k(N-1) per worker per tensor, growing with N. Here each tensor's index space is cut
into R = N regions, or 2k where that is fewer (aggregation.regions), rank j owning the
indices i with i mod R = j: one alltoall sends each record to its region's owner, the
owner sums what it got and keeps its ``quota = ceil(2k/R)`` largest sums per tensor,
one allgather shares the kept ones. About 3k(N-1)/N records per worker, whatever N.

What an owner does not keep goes back into the owner's residual (error feedback), so
nothing is lost: the sum over ranks of the memories plus the update is what it was
before the step. With fp16 values the kept sum's rounding error goes back too. Every
rank receives the same allgather, so every rank applies the same update, bit for bit.

Many tensors travel together (one alltoall and one allgather per launch, whatever
the number of tensors): their indices are offset into one index space, each tensor
keeping its own regions and quota. Records are the compressor's ``[int32 index |
value]`` rows, so a launch's tensors may hold at most 2**31 elements together (the
optimizer splits larger launches).

Non-blocking, in the optimizer's two-round protocol (as PowerSGD's exchange)::

    job = RegionReduce(indices, values, counts, numels, ks, codec, name)  # alltoall
    job.advance()        # wait for it, reduce this rank's regions, start the allgather
    res = job.collect()  # wait; RegionResult
"""

from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import global_process_set

from hvd_dgc.aggregation import quota, regions
from hvd_dgc.torch.compression import TopKCompressor
from hvd_dgc.torch.gpu_select import on_device

__all__ = ["RegionReduce", "RegionResult", "owners", "pack_records", "region_reduce",
           "unpack_records", "MAX_ELEMENTS"]

#: int32 record indices: the elements one region reduce may address
MAX_ELEMENTS = 2 ** 31 - 1
#: the codec ``region_reduce`` uses alone: a sparse compressor's records, float32 values
_FLOAT32_RECORDS = TopKCompressor()


class RegionResult(NamedTuple):
    indices: torch.Tensor    # int64, sorted, in the launch's joint index space
    values: torch.Tensor     # their sum over ranks (float32; divide by N to average)
    returned: tuple          # (indices, values) this rank, as owner, adds to its residual
    received: int            # records received from other ranks, both rounds


def owners(indices, regions):
    """The rank owning each index of its tensor: ``index mod R``, interleaved regions
    (hvd_dgc.aggregation.region_of says why); ``regions``: R, per index or one for all."""
    return torch.remainder(indices, regions)


def pack_records(indices, values):
    """``[int32 index bits | float32 value]`` rows (the benchmark's fixed 8-byte form)."""
    return torch.stack([indices.to(torch.int32).view(torch.float32),
                        values.to(torch.float32)], dim=1)


def unpack_records(records):
    records = records.contiguous()
    return records[:, 0].contiguous().view(torch.int32).to(torch.int64), records[:, 1]


class RegionReduce:
    """One launch's region reduce, started at construction (the alltoall).

    Args:
        indices, values: this rank's records of every tensor, concatenated in tensor
            order (``counts[t]`` of tensor ``t``, indices local to it, distinct).
        counts: records this rank sends of each tensor (a CPU selection may send
            fewer than k).
        numels, ks: per tensor, its size and the k of the selection (its regions and
            quota: aggregation.regions, aggregation.quota); identical on every rank.
        codec: ``pack(values, indices) -> records`` / ``unpack(records) -> (values,
            indices)``; the sparse compressor's (its value width travels).
    """

    def __init__(self, indices, values, counts, numels, ks, codec, name,
                 process_set=global_process_set):
        self.numels, self.ks = tuple(int(n) for n in numels), tuple(int(k) for k in ks)
        if sum(self.numels) > MAX_ELEMENTS:
            raise ValueError(f"region reduce: {sum(self.numels)} elements in one launch do "
                             f"not fit int32 indices; split the launch")
        self.codec, self.name, self.process_set = codec, name, process_set
        self.world, self.rank = process_set.size(), process_set.rank()
        device = values.device
        sizes = on_device(self.numels, str(device))
        self.starts = sizes.cumsum(0) - sizes
        counts = tuple(int(c) for c in counts)
        # on a GPU the counts are the fixed ks (made once there); a CPU's vary
        counts_t = torch.tensor(counts) if device.type == "cpu" else \
            on_device(counts, str(device))
        tensor_of = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                            counts_t, output_size=indices.numel())
        local = indices.to(torch.int64)
        cut = on_device(tuple(regions(k, self.world) for k in self.ks), str(device))
        owner = owners(local, cut[tensor_of])
        order = torch.argsort(owner, stable=True)
        splits = torch.bincount(owner, minlength=self.world).to(torch.int32).cpu()
        joint = local + self.starts[tensor_of]
        self._round1 = _hvd.alltoall_async(codec.pack(values[order], joint[order]),
                                           splits=splits, name=name + ".split",
                                           process_set=process_set)
        self._round2 = None
        self.advanced = False
        self.kept_counts = None  # per tensor, records this rank kept as owner (advance)

    def advance(self):
        """Wait for the alltoall, reduce this rank's regions, start the allgather."""
        if self.advanced:
            return
        self.advanced = True
        got, got_splits = _hvd.synchronize(self._round1)
        self._round1 = None
        values, joint = self.codec.unpack(got)
        joint = joint.to(torch.int64)
        # sum by index, in source-rank order (the alltoall's output order): deterministic
        unique, inverse = torch.unique(joint, sorted=True, return_inverse=True)
        sums = torch.zeros(unique.numel(), dtype=torch.float32, device=got.device)
        sums.index_add_(0, inverse, values.to(torch.float32))
        tensor, _ = self.split(unique)
        # per tensor, largest |sum| first, ties by lower index (both sorts stable)
        ranked = torch.sort(sums.abs(), descending=True, stable=True).indices
        ranked = ranked[torch.sort(tensor[ranked], stable=True).indices]
        first = torch.searchsorted(tensor[ranked], tensor[ranked], right=False)
        position = torch.arange(ranked.numel(), device=got.device) - first
        quotas = torch.tensor([quota(k, self.world) for k in self.ks], dtype=torch.int64,
                              device=got.device)
        keep = torch.zeros(unique.numel(), dtype=torch.bool, device=got.device)
        keep[ranked[position < quotas[tensor[ranked]]]] = True
        kept = self.codec.pack(sums[keep], unique[keep])
        sent_values, _ = self.codec.unpack(kept)
        residual = sums.clone()
        residual[keep] -= sent_values.to(torch.float32)  # fp16 values: the rounding error
        back = ~keep | (residual != 0)
        self._returned = (unique[back], residual[back])
        self._received = got.shape[0] - int(got_splits[self.rank])
        self._kept_rows = kept.shape[0]
        self.kept_counts = torch.bincount(tensor[keep], minlength=len(self.numels)).tolist()
        self._round2 = _hvd.allgather_async(kept, name=self.name + ".gather",
                                            process_set=self.process_set)

    def collect(self):
        """Wait for the allgather: the ``RegionResult`` (every rank the same update)."""
        self.advance()
        everyone = _hvd.synchronize(self._round2)
        values, joint = self.codec.unpack(everyone)
        # by owner, each owner's by index: sorted only for one tensor, so sort
        joint, order = torch.sort(joint.to(torch.int64))
        received = self._received + everyone.shape[0] - self._kept_rows
        return RegionResult(joint, values.to(torch.float32)[order], self._returned, received)

    def split(self, joint):
        """``(tensor number, local index)`` of joint indices."""
        tensor = torch.searchsorted(self.starts, joint, right=True) - 1
        return tensor, joint - self.starts[tensor]


def region_reduce(indices, values, numel, k, name, process_set=global_process_set):
    """Sum every rank's records ``(indices, values)`` of one flat tensor of ``numel``
    elements, keeping ``quota(k, N)`` per region (module doc). Blocking; every rank of
    ``process_set`` must call it with the same ``numel``, ``k`` and ``name``."""
    return RegionReduce(indices, values, [indices.numel()], [numel], [k], _FLOAT32_RECORDS,
                        name, process_set).collect()
