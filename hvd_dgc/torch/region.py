"""Region reduce over Horovod's collectives: sparse aggregation whose bytes per worker
stay flat as workers are added (issue 15; the maths and its NumPy reference are in
hvd_dgc/aggregation.py, after Ok-Topk, Shi et al., PPoPP 2022).

Allgather, the other sparse path, hands every worker every other worker's k records:
k(N-1) per worker per tensor, growing with N. Here each tensor's index space is cut
into R = N regions, or 2k where that is fewer (aggregation.regions), rank j owning the
indices i with i mod R = j: one alltoall sends each record to its region's owner, the
owner sums what it got and keeps its ``quota = ceil(2k/R)`` largest sums per tensor,
one allgather shares the kept ones. About 3k(N-1)/N records per worker, whatever N.

Both rounds send an owner's records as one block, coded as the allgather's are
(hvd_dgc/packing.py ``region_layout``: positions in the owner's region space, Elias-Fano
or a bitmap, about 12 bits at density 0.001; values in ``value_bits``: 32 or 16, as the
optimizer sends them, packing.region_value_bits, or 8 with one scale a block). What a
rounding loses stays with whoever rounded: the sender's in its memory
(``RegionResult.lost``), the owner's in its residual with the sums it did not keep
(``RegionResult.returned``), so nothing is lost: the sum over ranks of the memories plus
the update is what it was before the step. Every rank reads the same allgather, so
every rank applies the same update, bit for bit.

Many tensors travel together (one alltoall and one allgather per launch, whatever the
number of tensors), each keeping its own regions and quota; a launch's tensors may hold
at most 2**31 elements together (the optimizer splits larger launches).

Non-blocking, in the optimizer's two-round protocol (as PowerSGD's exchange)::

    job = RegionReduce(indices, values, counts, numels, ks, value_bits, name)  # alltoall
    job.advance()        # wait for it, reduce this rank's regions, start the allgather
    res = job.collect()  # wait; RegionResult
"""

from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import global_process_set

from hvd_dgc.aggregation import quota
from hvd_dgc.packing import REGION_COUNT_BYTES, SCALE_BYTES, index_bytes, region_layout
from hvd_dgc.torch.gpu_select import on_device
from hvd_dgc.torch.positions import decode_positions, encode_positions, encode_values

__all__ = ["RegionReduce", "RegionResult", "owners", "region_reduce", "code_blocks",
           "read_block", "MAX_ELEMENTS"]

#: the elements one region reduce may address (positions and indices travel as int64
#: here, but a launch's joint index space is kept to what Horovod's int32 splits name)
MAX_ELEMENTS = 2 ** 31 - 1
FP16_MAX = 65504.0


class RegionResult(NamedTuple):
    indices: torch.Tensor    # int64, sorted, in the launch's joint index space
    values: torch.Tensor     # their sum over ranks, as they arrived (divide by N to average)
    returned: tuple          # (indices, values) this rank, as owner, adds to its residual
    lost: tuple              # (indices, values) its sends' rounding, back into its memory
    received: int            # bytes received from other ranks, both rounds


def owners(indices, regions):
    """The rank owning each index of its tensor: ``index mod R``, interleaved regions
    (hvd_dgc.aggregation.region_of says why); ``regions``: R, per index or one for all."""
    return torch.remainder(indices, regions)


def round_values(values, group, groups, value_bits):
    """``values`` as their blocks send them (``group``: each one's block, of ``groups``):
    ``(bytes, each as it arrives, each block's scale or None)``; the NumPy reference is
    tests/reference.py ``round_values``."""
    if value_bits == 8:
        codes, scales, arrived = encode_values(values, group, groups)
        return codes.view(torch.uint8), arrived, scales
    values = values.float()
    if value_bits == 16:
        half = torch.where(torch.isfinite(values), values.clamp(-FP16_MAX, FP16_MAX),
                           values).to(torch.float16)
        return half.view(torch.uint8), half.float(), None
    return values.view(torch.uint8), values, None


def code_blocks(owner, positions, values, spaces, value_bits):
    """One block per owner (hvd_dgc/packing.py): records sorted by owner, then position
    in that owner's region space (``spaces[j]``). Returns ``(bytes, each block's length,
    each value as it arrives, each block's bytes of positions)``."""
    world = len(spaces)
    device = values.device
    counts = torch.bincount(owner, minlength=world).tolist()
    coded, arrived, scales = round_values(values, owner, world, value_bits)
    width = value_bits // 8
    parts, lengths, coded_positions, at = [], [], [], 0
    for j, count in enumerate(counts):
        space = int(spaces[j])
        coded_positions.append(index_bytes(space, count) if count else 0)
        if space == 0:
            lengths.append(0)
            continue
        block = [torch.tensor([count], dtype=torch.int32, device=device).view(torch.uint8)]
        if count:
            if scales is not None:
                block.append(scales[j:j + 1].view(torch.uint8))
            block.append(encode_positions(positions[at:at + count], space))
            block.append(coded[at * width:(at + count) * width])
        at += count
        parts.extend(block)
        lengths.append(sum(b.numel() for b in block))
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    return payload, lengths, arrived, coded_positions


def read_block(payload, at, space, value_bits):
    """The block at byte ``at`` of ``payload`` in a region space of ``space``:
    ``(positions, values as they arrived, its length)``."""
    count = int(payload[at:at + REGION_COUNT_BYTES].clone().view(torch.int32))
    at, start = at + REGION_COUNT_BYTES, at
    device = payload.device
    if count == 0:
        return (torch.zeros(0, dtype=torch.int64, device=device),
                torch.zeros(0, device=device), REGION_COUNT_BYTES)
    scale = None
    if value_bits == 8:
        scale = payload[at:at + SCALE_BYTES].clone().view(torch.float32)
        at += SCALE_BYTES
    code = index_bytes(space, count)
    positions = decode_positions(payload[at:at + code], space, count)
    at += code
    raw = payload[at:at + count * value_bits // 8].clone()
    at += count * value_bits // 8
    if value_bits == 8:
        values = raw.view(torch.float8_e4m3fn).float() * scale
    else:
        values = raw.view(torch.float16 if value_bits == 16 else torch.float32).float()
    return positions, values, at - start


class RegionReduce:
    """One launch's region reduce, started at construction (the alltoall).

    Args:
        indices, values: this rank's records of every tensor, concatenated in tensor
            order (``counts[t]`` of tensor ``t``, indices local to it, distinct).
        counts: records this rank sends of each tensor (a CPU selection may send
            fewer than k).
        numels, ks: per tensor, its size and the k of the selection (its regions and
            quota: aggregation.regions, aggregation.quota); identical on every rank.
        value_bits: 8, 16 or 32 (the optimizer's: packing.region_value_bits).
    """

    def __init__(self, indices, values, counts, numels, ks, value_bits, name,
                 process_set=global_process_set):
        self.numels, self.ks = tuple(int(n) for n in numels), tuple(int(k) for k in ks)
        if sum(self.numels) > MAX_ELEMENTS:
            raise ValueError(f"region reduce: {sum(self.numels)} elements in one launch do "
                             f"not fit int32 indices; split the launch")
        self.value_bits, self.name, self.process_set = value_bits, name, process_set
        self.world, self.rank = process_set.size(), process_set.rank()
        self.layout = region_layout(self.numels, self.ks, self.world)
        device = values.device
        on = str(device)
        sizes = on_device(self.numels, on)
        self.starts = sizes.cumsum(0) - sizes
        self._regions = on_device(self.layout.regions, on)
        self._offsets = torch.as_tensor(self.layout.offsets, device=device)
        counts = tuple(int(c) for c in counts)
        # on a GPU the counts are the fixed ks (made once there); a CPU's vary
        counts_t = torch.tensor(counts) if device.type == "cpu" else on_device(counts, on)
        tensor = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                         counts_t, output_size=indices.numel())
        local = indices.to(torch.int64)
        owner = owners(local, self._regions[tensor])
        position = self.position(owner, tensor, local)
        space = max(1, int(self.layout.spaces.max()))
        order = torch.argsort(owner * space + position)
        values = values[order]
        payload, lengths, arrived, coded = code_blocks(owner[order], position[order], values,
                                                       self.layout.spaces, value_bits)
        lost = torch.where(torch.isfinite(values), values.float() - arrived, 0.0)
        joint = (local + self.starts[tensor])[order]
        back = lost != 0
        self.lost = (joint[back], lost[back])
        #: bytes this rank sends other ranks, and of them its positions': its blocks
        #: (round 1), then its kept block (round 2)
        self.sent = sum(lengths) - lengths[self.rank]
        self.sent_positions = sum(coded) - coded[self.rank]
        self._round1 = _hvd.alltoall_async(payload, splits=torch.tensor(lengths,
                                                                        dtype=torch.int32),
                                           name=name + ".split", process_set=process_set)
        self._round2 = None
        self.advanced = False
        self.kept_counts = None  # per tensor, records this rank kept as owner (advance)

    def position(self, owner, tensor, local):
        """Where index ``local`` of ``tensor`` lies in its ``owner``'s region space
        (packing.region_layout)."""
        return self._offsets[owner, tensor] + local // self._regions[tensor]

    def joint(self, owner, positions):
        """Joint indices of ``positions`` in ``owner``'s region space (``position``'s
        inverse, the tensors one after the other)."""
        row = self._offsets[owner]
        tensor = torch.searchsorted(row, positions, right=True) - 1
        return self.starts[tensor] + (positions - row[tensor]) * self._regions[tensor] + owner

    def advance(self):
        """Wait for the alltoall, reduce this rank's regions, start the allgather."""
        if self.advanced:
            return
        self.advanced = True
        got, got_splits = _hvd.synchronize(self._round1)
        self._round1 = None
        space, bits = int(self.layout.spaces[self.rank]), self.value_bits
        positions, values, at = [], [], 0
        for length in got_splits.tolist():
            if length:
                p, v, used = read_block(got, at, space, bits)
                assert used == length, (used, length)
                positions.append(p)
                values.append(v)
            at += length
        device = got.device
        if positions:
            joint = self.joint(self.rank, torch.cat(positions))
            values = torch.cat(values)
        else:
            joint = torch.zeros(0, dtype=torch.int64, device=device)
            values = torch.zeros(0, device=device)
        # sum by index, in source-rank order (the alltoall's output order): deterministic
        unique, inverse = torch.unique(joint, sorted=True, return_inverse=True)
        sums = torch.zeros(unique.numel(), dtype=torch.float32, device=device)
        sums.index_add_(0, inverse, values)
        tensor, local = self.split(unique)
        # per tensor, largest |sum| first, ties by lower index (both sorts stable)
        ranked = torch.sort(sums.abs(), descending=True, stable=True).indices
        ranked = ranked[torch.sort(tensor[ranked], stable=True).indices]
        first = torch.searchsorted(tensor[ranked], tensor[ranked], right=False)
        place = torch.arange(ranked.numel(), device=device) - first
        quotas = torch.tensor([quota(k, self.world) for k in self.ks], dtype=torch.int64,
                              device=device)
        keep = torch.zeros(unique.numel(), dtype=torch.bool, device=device)
        keep[ranked[place < quotas[tensor[ranked]]]] = True
        mine = self.position(self.rank, tensor[keep], local[keep])
        kept, _, arrived, coded = code_blocks(torch.zeros_like(mine), mine, sums[keep],
                                              [space], bits)
        residual = sums.clone()
        residual[keep] -= arrived  # what the kept sums lose on the way
        back = ~keep | (residual != 0)
        self._returned = (unique[back], residual[back])
        self._received = got.numel() - int(got_splits[self.rank])
        self._kept_bytes = kept.numel()
        self.sent += kept.numel()
        self.sent_positions += coded[0]
        self.kept_counts = torch.bincount(tensor[keep], minlength=len(self.numels)).tolist()
        self._round2 = _hvd.allgather_async(kept, name=self.name + ".gather",
                                            process_set=self.process_set)

    def collect(self):
        """Wait for the allgather: the ``RegionResult`` (every rank the same update)."""
        self.advance()
        everyone = _hvd.synchronize(self._round2)
        joints, values, at = [], [], 0
        for owner, space in enumerate(self.layout.spaces.tolist()):
            if space:
                p, v, used = read_block(everyone, at, space, self.value_bits)
                joints.append(self.joint(owner, p))
                values.append(v)
                at += used
        assert at == everyone.numel(), (at, everyone.numel())
        joint, values = torch.cat(joints), torch.cat(values)
        # by owner, each owner's by index: sorted only for one tensor, so sort
        joint, order = torch.sort(joint)
        received = self._received + everyone.numel() - self._kept_bytes
        return RegionResult(joint, values[order], self._returned, self.lost, received)

    def split(self, joint):
        """``(tensor number, local index)`` of joint indices."""
        tensor = torch.searchsorted(self.starts, joint, right=True) - 1
        return tensor, joint - self.starts[tensor]


def region_reduce(indices, values, numel, k, name, process_set=global_process_set,
                  value_bits=32):
    """Sum every rank's records ``(indices, values)`` of one flat tensor of ``numel``
    elements, keeping ``quota(k, N)`` per region (module doc), values in ``value_bits``.
    Blocking; every rank of ``process_set`` must call it with the same ``numel``, ``k``,
    ``value_bits`` and ``name``."""
    return RegionReduce(indices, values, [indices.numel()], [numel], [k], value_bits,
                        name, process_set).collect()
