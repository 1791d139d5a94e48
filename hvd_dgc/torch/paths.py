"""How one launch's tensors travel: one class per way, one protocol (the exchange's paths).

A launch (one tensor, a Horovod group, a bucket, or every tensor of a step) holds
tensors that may travel different ways (``hvd_dgc.paths.PathKind``). The exchange
(exchange.py) lays the launch out in flat buffers, one contiguous range per path (a
``Part``), prepares the gradients and updates the memory; then every path answers the
same three calls, so a new way to travel is one more class here, not more branches
there::

    handle = path.launch(part)          take what leaves the memory (it keeps the rest),
                                        start the collectives (non-blocking); with
                                        ``part.own`` (delay, period), write what this
                                        rank sent there
    path.advance(handle)                second rounds: called for every launch of a step
                                        before any is waited on, so no rank waits on a
                                        round another rank has not started
    path.collect(handle, out)           wait; write the average over the part's range
                                        through ``out`` (update.py: the launch's flat
                                        buffer, or the gradients themselves)

The memory belongs to the exchange: a part carries the launch's memory block and the
exchange's ``FlatMemory``, and a path takes from them only what leaves (``sent``) or
gives back what an aggregation did not deliver (``give_back``).
"""

from itertools import accumulate
from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Average, Sum

from hvd_dgc.aggregation import slice_k, slices
from hvd_dgc.fp16wire import fp16_bound
from hvd_dgc.masking import masking_density_limit
from hvd_dgc.packing import SCALE_BYTES, folds_values, gather_value_bits, index_bytes, \
    region_value_bits, shares_of, values_bytes
from hvd_dgc.paths import PathKind
from hvd_dgc.torch.collective import HorovodComm
from hvd_dgc.torch.compression import INDEX_BYTES, coalesce_sorted, on_accelerator
from hvd_dgc.torch.gpu_select import counts_on, on_device
from hvd_dgc.torch.memory import Run
from hvd_dgc.torch.positions import decode_records, decode_values, encode_records, \
    encode_values, gather_dtype, sorted_on_host, tensor_of
from hvd_dgc.torch.region import MAX_ELEMENTS, RegionReduce

__all__ = ["Part", "Wire", "PathContext", "make_paths", "CLASSES", "InPlacePath"]


class Gathered(NamedTuple):
    """An allgather of one rank, done at once."""

    tensor: torch.Tensor


class Wire(NamedTuple):
    """How the optimizer's collectives run: Horovod's arguments, fixed at wrap time."""

    process_set: object
    op: object
    predivide: float
    peers: tuple = ()  # global ranks on this rank's host, sorted (hierarchical DGC only)

    def world(self):
        return self.process_set.size()

    def allgather_async(self, tensor, name):
        """Horovod's allgather on the process set. In a world of one, the tensor itself:
        no background round, and no wait in ``synchronize`` for the backward pass to
        finish on a GPU (Horovod's own DistributedOptimizer registers no hooks there)."""
        if self.world() == 1:
            return Gathered(tensor)
        return _hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    @staticmethod
    def wait(handle):
        return handle.tensor if isinstance(handle, Gathered) else _hvd.synchronize(handle)

    def pre(self):
        """Factor on the wire before the sum (Horovod's gradient_predivide_factor)."""
        return 1.0 / self.predivide if self.op == Average else 1.0

    def post(self):
        """Factor after the sum: the average (op=Average) of what was sent."""
        return self.predivide / self.world() if self.op == Average else 1.0

    def allreduce_factors(self):
        """``(prescale_factor, postscale_factor)`` of a dense allreduce under ``op``: the
        gradient predivide and its inverse (op=Average divides by the world itself)."""
        return (self.pre(), self.predivide) if self.op == Average else (1.0, 1.0)

    def fp16_bound(self):
        """What one rank may put on a dense fp16 allreduce (hvd_dgc/fp16wire.py)."""
        return fp16_bound(self.world(), self.pre())


class PathContext(NamedTuple):
    """What every path of one optimizer shares: fixed at wrap time, but ``counters``,
    whose ``fp16_clipped`` list collects a step's device counts."""

    wire: object
    compressor: object
    memory: object        # the exchange's FlatMemory
    stats: object         # CompressionStats
    masking: object       # the momentum_masking option
    dense_fp16: bool
    counters: object      # exchange.StepCounters


class Part(NamedTuple):
    """One path's share of a launch: its members, a contiguous range of the flat buffers."""

    kind: PathKind
    launch: object        # exchange.Launch: block, buffers, step, density, name
    members: tuple        # exchange.Member records, in flat order
    index: tuple          # their positions in the launch's layout
    lo: int               # [lo, hi): their range in the block's buffers
    hi: int
    ks: tuple             # records each may send (sparse paths)
    own: object = None    # keeps_own: a flat buffer (the launch's layout) for what was sent
    folded: object = None  # allgather: the launch's dense part, carried as records

    @property
    def offsets(self):
        """Where each member starts in the launch's flat buffers."""
        return tuple(self.launch.layout.offsets[i] for i in self.index)

    @property
    def numels(self):
        return tuple(m.numel for m in self.members)

    @property
    def keys(self):
        return tuple(m.key for m in self.members)


class _Path:
    """What every path answers, and what the exchange lays out by (class attributes)."""

    kind = None
    #: where its tensors lie in a launch's flat buffers (those whose selection scans
    #: the memory's block maxima first, aligned to the blocks)
    flat_rank = 3
    stored = True          # its tensors' u and v live in the launch's memory block
    aligned = False        # its selection scans block maxima: slices at block bounds
    reads_gradient = False  # reads the launch's flat gradient after the memory update
    checked = False        # its payload could hide a non-finite value: the guard looks
    batched = False        # its launches wait for synchronize, to leave together

    def __init__(self, ctx):
        self.ctx = ctx

    def absorb(self, parts, planner):
        """The launch's parts, this path carrying others' tensors where that is cheaper
        (``{PathKind: Part}``; default: as they are)."""
        return parts

    def advance(self, handle):
        pass


class DensePath(_Path):
    """Ring allreduce of the part's velocity, one flat tensor. fp16 on the wire
    (hvd_dgc/fp16wire.py) keeps its rounding error, and what lies beyond fp16's range,
    in the residual."""

    kind = PathKind.DENSE
    flat_rank = 3

    def take(self, part, in_place=False, value_bits=None):
        """What leaves the memory: all of ``v`` over the part (stats counted). A rank's
        non-finite gradient is in its ``v`` (the guard's flags are read off it), so the
        payload carries it to every rank's average without being poisoned. ``in_place``:
        ``v`` itself where it can go (fp32, nothing kept for delayed averaging), zero
        once its average is read (``collect``; MemoryBlock.clear_later: the next update
        reads zeros instead): two passes over it fewer than a copy and a clear.
        ``value_bits``: the values' width on the wire (a folded tensor's 8 bits, with
        its scale), if not the payload's."""
        ctx, launch = self.ctx, part.launch
        v = launch.block.v[part.lo:part.hi]
        if ctx.dense_fp16:
            payload = self._half(v)
        elif in_place and self.sends_v(part):
            payload = v
        else:
            payload = v.clone()
            v.zero_()  # every coordinate left: v cleared, u kept (memory.sent_range)
        for m in part.members:
            sent = m.numel * payload.element_size() if value_bits is None else \
                values_bytes(m.numel, value_bits)
            ctx.stats.record(m.name, self.kind, m.numel, m.numel, sent, launch.density)
        if part.own is not None:
            part.own[part.lo:part.hi] = payload
        return payload

    def sends_v(self, part):
        return not self.ctx.dense_fp16 and part.own is None

    def _half(self, v):
        """fp16wire.fp16_payload, in place on the memory's ``v``: at most the bound on the
        wire, the rest stays; the count of clipped values is read once per step."""
        bound = self.ctx.wire.fp16_bound()
        finite = torch.isfinite(v)
        self.ctx.counters.fp16_clipped.append(torch.count_nonzero(finite & (v.abs() > bound)))
        payload = torch.where(finite, v.clamp(-bound, bound), v).to(torch.float16)
        v.copy_(torch.where(finite, v - payload.to(v.dtype), 0.0))
        return payload

    def launch(self, part):
        payload = self.take(part, in_place=True)
        w = self.ctx.wire
        pre, post = w.allreduce_factors()
        sent_in_place = payload if self.sends_v(part) else None
        return _hvd.allreduce_async_(payload, name=part.launch.name + ".dense", op=w.op,
                                     prescale_factor=pre, postscale_factor=post,
                                     process_set=w.process_set), part, sent_in_place

    def collect(self, handle, out):
        handle, part, sent_in_place = handle
        out.assign(part.lo, part.hi, _hvd.synchronize(handle))
        if sent_in_place is not None:  # the memory's v went: zero once read (lazily)
            part.launch.block.clear_later(sent_in_place, part.lo, part.hi)


class InPlacePath(_Path):
    """The dense path where nothing of DGC's is pending for its tensors (``takes``):
    Horovod's own grouped allreduce of the gradients, in place, as stock Horovod sends
    them: no pass over the memory, no copy."""

    kind = PathKind.DENSE

    def takes(self, layout, at, clip_norm, guard_mode, scale):
        """Can the launch go this way? Every tensor dense this step with its residual
        zero (``MemoryBlock.zero``), nothing for the memory to apply (no momentum,
        weight decay or ``scale`` of its own, no clipping, no loss scale, fp32 on the
        wire), a synchronous exchange (``at``: exchange.StepPlace), and each gradient a
        dense contiguous tensor in the buffer's dtype."""
        block = layout.block
        if block is None or not at.exchanging or at.keeps_own or at.scale is not None or \
                clip_norm is not None or self.ctx.dense_fp16 or guard_mode == "drop" or \
                layout.sparse_grads or len(block.zero) < len(layout.members) or \
                any(k != PathKind.DENSE for k in layout.kinds):
            return False
        for m in layout.members:
            g = m.param.grad
            if m.momentum or m.weight_decay or scale(m.param) is not None or g is None or \
                    g.is_sparse or g.dtype != block.dtype or not g.is_contiguous():
                return False
        return True

    def start(self, launch):
        """The launch's tensors leave (``takes`` said they can), as one part."""
        layout = launch.layout
        launch.in_place = True
        part = Part(self.kind, launch, layout.members, tuple(range(len(layout.members))),
                    0, layout.total, launch.ks)
        launch.started.append((self, part, self.launch(part)))

    def launch(self, part):
        ctx, launch = self.ctx, part.launch
        grads = [m.param.grad for m in part.members]
        for m, g in zip(part.members, grads):
            ctx.stats.record(m.name, self.kind, m.numel, m.numel,
                             m.numel * g.element_size(), launch.density)
        w = ctx.wire
        pre, post = w.allreduce_factors()
        return _hvd.grouped_allreduce_async_(
            grads, name=launch.name + ".grads", op=w.op, prescale_factor=pre,
            postscale_factor=post, process_set=w.process_set), grads

    def collect(self, handle, out):
        handle, grads = handle
        _hvd.synchronize(handle)
        out.arrived(grads)


class _Picked(NamedTuple):
    """A sparse part's selection: positions in the block, this rank's values there, and
    per member the records chosen and the slots it sends (k)."""

    positions: torch.Tensor
    values: torch.Tensor
    counts: tuple
    ks: tuple


class AllgatherPath(_Path):
    """Every rank's k records of each tensor to every rank; each sums them. Bytes per
    worker k(N-1): linear in N (hvd_dgc/aggregation.py)."""

    kind = PathKind.ALLGATHER
    flat_rank = 0
    aligned = True
    checked = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.dense = DensePath(ctx)  # what a folded dense tensor leaves the memory as

    def select(self, part):
        """Choose and take out of the memory what the part's tensors send: one
        selection for them all (the compressor's ``pick``), the memory told once."""
        ctx, launch, block = self.ctx, part.launch, part.launch.block
        picked = ctx.compressor.pick(block.v, block.block_max, part.offsets, part.numels,
                                     part.ks, part.keys, launch.rank, launch.step)
        masked = self._masked(part, picked)
        if picked.values is None:
            values = ctx.memory.take(block, picked.positions, masked)
        else:
            values = picked.values
            ctx.memory.sent(block, picked.positions,
                            picked.positions if masked is True else masked)
        if part.own is not None:
            part.own.index_put_((picked.positions,), values.to(part.own.dtype))
        for m, count, (sent, positions) in zip(part.members, picked.counts,
                                               self.record_bytes(part, picked.counts)):
            ctx.stats.record(m.name, self.kind, m.numel, count, sent, launch.density,
                             positions)
        return _Picked(picked.positions, values, picked.counts, part.ks)

    def record_bytes(self, part, counts):
        """``(bytes, of which positions)`` each member's records weigh on the wire: ``k``
        slots of a coded position and a value, the part's code shared by the members'
        ``k``."""
        bits = self._bits(part)
        total = sum(part.ks)
        code = index_bytes(part.hi - part.lo, total)
        shares = shares_of(code, part.ks)
        return [(values_bytes(k, bits) + share, share) for k, share in zip(part.ks, shares)]

    def _bits(self, part):
        """The bits of the part's values on the wire (packing.gather_value_bits: 8 by
        default, whole at density 1)."""
        return gather_value_bits(self.ctx.compressor, part.launch.density)

    def _dtype(self, part):
        return gather_dtype(self.ctx.compressor, part.launch.density)

    def _masked(self, part, picked):
        """Whose momentum the sent coordinates lose (hvd_dgc/masking.py): True (all),
        None (none), or the positions of those that do."""
        density, setting = part.launch.density, self.ctx.masking
        masks = [density <= masking_density_limit(setting, m.momentum) for m in part.members]
        if all(masks):
            return True
        if not any(masks):
            return None
        device = str(picked.positions.device)
        keep = on_device(tuple(masks), device, torch.bool).repeat_interleave(
            counts_on(picked.counts, device), output_size=picked.positions.numel())
        return picked.positions[keep]

    def absorb(self, parts, planner):
        """The launch's dense tensors ride in its allgather, their values after the
        records, where the cost model says so (costmodel.folds: small tensors, or a link of high
        latency): one Horovod operation fewer, two round trips a step over a WAN. The
        same on every rank: it depends on the launch's members and sizes only."""
        dense, mine = parts.get(PathKind.DENSE), parts.get(self.kind)
        if dense is None or mine is None or \
                not folds_values(self._bits(mine), self.ctx.dense_fp16) or \
                not planner.prices.folds(sum(dense.numels)):
            return parts
        parts = dict(parts)
        parts[self.kind] = mine._replace(folded=parts.pop(PathKind.DENSE))
        return parts

    def _fold(self, part, pre):
        """The launch's dense tensors' values (``part.folded``), prescaled by ``pre``, as
        bytes after the records: what the dense allreduce would have summed (the memory,
        the statistics and delayed averaging's own as it keeps them), or in 8 bits with
        what the rounding loses back in the memory. Their positions are every index,
        known to every rank, so none travel. One Horovod operation per launch instead of
        two (bench/results/round_trips.md)."""
        folded = part.folded
        if self._bits(part) != 8:
            dense = self.dense.take(folded)  # the dense path's own bookkeeping
            return (dense if pre == 1.0 else dense * pre).to(self._dtype(part)).view(
                torch.uint8)
        dense = self.dense.take(folded, value_bits=8).float()
        device = dense.device
        tensor = _member_of_each(folded.numels, device, dense.numel())
        codes, scales = self._eighth(folded, _every_index(folded, device),
                                     dense if pre == 1.0 else dense * pre, pre, tensor)
        return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)])

    def coded(self, part, sel, pre):
        """This rank's bytes: the part's positions coded (positions.py: Elias-Fano or a
        bitmap over the part's range, sorted), then their values in the same order (in
        8 bits, then each member's scale). Every tensor fills its k slots, those a CPU
        selection left empty with positions it did not pick and the value 0, which add
        nothing: every rank sends the same size every step, and Horovod's response cache
        answers the negotiation (measured over a 100 ms link,
        bench/results/round_trips.md: an allgather whose size changes from step to step
        waits 7 round trips, one of a fixed size 3)."""
        device = sel.positions.device
        values = sel.values if pre == 1.0 else sel.values * pre
        bits, scales, member = self._bits(part), None, None
        if part.launch.poison is not None or bits == 8:  # each value's member
            member = _member_of_each(sel.counts, device, sel.positions.numel())
        if part.launch.poison is not None:  # skip_nonfinite: inf in a bad tensor's records
            bad = part.launch.poison[on_device(tuple(part.index), str(device))]
            values = torch.where(bad[member], float("inf"), values)
        if bits == 16:
            values = self._half(part, sel.positions, values, pre)
        elif bits == 8:
            values, scales = self._eighth(part, sel.positions, values, pre, member)
        n, total = part.hi - part.lo, sum(part.ks)
        positions = sel.positions - part.lo
        if sum(sel.counts) < total:
            positions, values = _merged(positions, values,
                                        _unpicked(part, sel.counts, positions))
        coded = encode_records(positions, values, n, self._dtype(part))
        return coded if scales is None else torch.cat([coded, scales.view(torch.uint8)])

    def _half(self, part, positions, values, pre):
        """fp16 values (``values`` prescaled by ``pre``) with what fp16 loses kept in the
        memory (error feedback, as the dense path's fp16, hvd_dgc/fp16wire.py): the
        rounding, and beyond the dense wire's bound the excess (one bound for both, so
        fp16wire's warning says it); delayed averaging's own is what the others read.
        Not finite: sent as it is (the guard sees it)."""
        ctx = self.ctx
        bound = ctx.wire.fp16_bound() * pre
        finite = torch.isfinite(values)
        ctx.counters.fp16_clipped.append(torch.count_nonzero(finite & (values.abs() > bound)))
        half = torch.where(finite, values.clamp(-bound, bound), values).to(torch.float16)
        self._keep_rest(part, positions, values, half.float(), pre, finite)
        return half

    def _eighth(self, part, positions, values, pre, tensor):
        """8-bit values (positions.encode_values: float8 and a scale per member, whose
        members ``tensor`` names) with the rounding kept in the memory, as ``_half``:
        ``(codes, scales)``."""
        codes, scales, arrived = encode_values(values, tensor, len(part.members))
        self._keep_rest(part, positions, values, arrived, pre, torch.isfinite(values))
        return codes, scales

    def _keep_rest(self, part, positions, values, arrived, pre, finite):
        """Error feedback of a rounding: what ``values`` (prescaled by ``pre``) lost on
        the way to ``arrived`` back into the memory at ``positions``; delayed averaging's
        own holds what arrives."""
        sent = arrived if pre == 1.0 else arrived / pre
        self.ctx.memory.give_back(part.launch.block, positions, torch.where(
            finite, (values if pre == 1.0 else values / pre) - sent, 0.0))
        if part.own is not None:
            part.own.index_put_((positions,), sent.to(part.own.dtype))

    def launch(self, part):
        sel = self.select(part)
        pre = self.ctx.wire.pre()
        payload = self.coded(part, sel, pre)
        if part.folded is not None:
            payload = torch.cat([payload, self._fold(part, pre)])
        handle = self.ctx.wire.allgather_async(payload, part.launch.name + ".sparse")
        starts = tuple(o - part.lo for o in part.offsets)
        return _GatherLaunch(handle, part.lo, part.hi, sum(part.ks), starts, part.folded,
                             self._dtype(part))

    def collect(self, handle, out):
        blocks = self.ctx.wire.wait(handle.handle)
        rows = self.ctx.wire.world()
        blocks = blocks.view(rows, -1)
        dtype = handle.dtype
        positions, values, rest = decode_records(blocks, handle.hi - handle.lo, handle.k,
                                                 dtype)
        device = positions.device
        if dtype == torch.float8_e4m3fn:  # then each member's scale
            scales, rest = _floats(rest[:, :SCALE_BYTES * len(handle.starts)]), \
                rest[:, SCALE_BYTES * len(handle.starts):]
            values = decode_values(values, scales.gather(1, tensor_of(
                positions, on_device(handle.starts, str(device)))))
        positions = positions + handle.lo
        out.zero(handle.lo, handle.hi)
        if handle.folded is not None:
            folded = handle.folded
            out.zero(folded.lo, folded.hi)
            every = _every_index(folded, device)
            if dtype == torch.float8_e4m3fn:
                dense = rest[:, :every.numel()].clone(
                    memory_format=torch.contiguous_format).view(dtype)
                tensor = _member_of_each(folded.numels, device, every.numel())
                dense = decode_values(dense, _floats(rest[:, every.numel():])[:, tensor])
            else:
                dense = rest.clone(memory_format=torch.contiguous_format).view(dtype)
            positions = torch.cat([positions, every.expand(rows, -1)], 1)
            values = torch.cat([values.to(dense.dtype), dense], 1)
        values = values.reshape(-1).float()
        scale = self.ctx.wire.post()
        out.add(positions.reshape(-1), values if scale == 1.0 else values * scale)


def _member_of_each(counts, device, total):
    """Each of ``total`` values' member (0 .. len(counts) - 1), member i's ``counts[i]``
    of them in member order (a selection's records, a folded part's elements)."""
    return torch.arange(len(counts), device=device).repeat_interleave(
        counts_on(counts, str(device)), output_size=total)


def _floats(raw):
    """Rows of bytes as float32 (the scales of 8-bit values)."""
    return raw.clone(memory_format=torch.contiguous_format).view(torch.float32)


class _GatherLaunch(NamedTuple):
    handle: object
    lo: int          # the part's range in the launch's buffers: positions are coded in it
    hi: int
    k: int           # records a rank sends (the part's k, summed)
    starts: tuple    # where each member starts in that range
    folded: object   # the dense part carried after the records, or None
    dtype: object    # the values' (AllgatherPath._dtype)


def _unpicked(part, counts, picked):
    """``sum(part.ks) - sum(counts)`` positions (in the part's range) of its members'
    elements that ``picked`` (``counts[i]`` of member i's, in member order) does not
    hold, never the alignment between them: each member's first ``k + count`` elements
    hold at least ``k`` it did not pick."""
    lengths = [min(m.numel, k + c) for m, k, c in zip(part.members, part.ks, counts)]
    bases, seen = [], 0  # a member's candidates: part position - base, for its lengths
    for offset, length in zip(part.offsets, lengths):
        bases.append(offset - part.lo - seen)
        seen += length
    device = picked.device
    on = str(device)
    member = _member_of_each(counts, device, picked.numel())
    slot = picked - on_device(tuple(bases), on)[member]  # its candidate slot, if it has one
    free = torch.ones(seen, dtype=torch.bool, device=device)
    free[slot[slot < on_device(tuple(accumulate(lengths)), on)[member]]] = False
    candidates = torch.arange(seen, device=device) + on_device(tuple(bases), on)\
        .repeat_interleave(on_device(tuple(lengths), on), output_size=seen)
    return candidates[free][:sum(part.ks) - sum(counts)]


def _merged(positions, values, more):
    """``positions`` (sorted) with ``more`` (sorted, none among them) in one sorted
    list, ``values`` with a 0 at each of ``more``'s: each lands where the other list's
    smaller ones put it, which costs less than sorting them again. (Where ``positions``
    are not sorted, an accelerator's selection, ``encode_records`` sorts the two.)"""
    if not sorted_on_host(positions):
        return torch.cat([positions, more]), torch.cat([values, values.new_zeros(more.numel())])
    total = positions.numel() + more.numel()
    out = positions.new_empty(total)
    at = torch.arange(positions.numel()) + torch.searchsorted(more, positions)
    out[at] = positions
    gaps = torch.arange(more.numel()) + torch.searchsorted(positions, more)
    out[gaps] = more
    merged = values.new_zeros(total)
    merged[at] = values
    return out, merged


def _every_index(part, device):
    """The launch's positions of every element of ``part`` (a folded dense part)."""
    return torch.cat([torch.arange(o, o + n, device=device)
                      for o, n in zip(part.offsets, part.numels)])


class _RegionLaunch(NamedTuple):
    part: Part
    chunks: list   # [(RegionReduce, member positions in the part)]


class RegionPath(AllgatherPath):
    """Region reduce (hvd_dgc/torch/region.py, after Ok-Topk): alltoall to the owners of
    N index regions, each keeps ceil(2k/N) of its sums, allgather of the kept. Bytes per
    worker ~3k(N-1)/N: flat in N. Each owner's records travel as one coded block
    (packing.region_layout: positions in its region space; values whole, fp32 or fp16,
    packing.region_value_bits); what an owner does not keep, and what fp16 loses, go
    back into the memory of whoever held it (error feedback). Values travel unscaled
    (predivide plays no part: sums are formed once, on the owner).

    Momentum factor masking stays at send, as for allgather: masking only the sent
    coordinates the owners then applied measured no better (digits, N = 4, 4 seeds, one
    run: 96.53% both)."""

    kind = PathKind.REGION
    flat_rank = 1
    batched = True  # one alltoall and one allgather carry all of a step's: synchronize

    def record_bytes(self, part, counts):
        """None yet: a block's bytes are known once coded (``launch``, ``advance`` count
        them)."""
        return [(0, 0) for _ in counts]

    def absorb(self, parts, planner):
        return parts

    def _count(self, part, positions, weights, sent, coded):
        """``sent`` bytes (``coded`` of them positions) of the members at ``positions``,
        shared by ``weights`` (their records)."""
        names = [part.members[p].name for p in positions]
        for name, share, of_positions in zip(names, shares_of(sent, weights),
                                             shares_of(coded, weights)):
            self.ctx.stats.add_bytes(name, share, of_positions)

    def launch(self, part):
        sel = self.select(part)
        device = sel.positions.device
        starts = on_device(tuple(part.offsets), str(device))
        member = _member_of_each(sel.counts, device, sel.positions.numel())
        local = sel.positions - starts[member]
        values = sel.values
        if part.launch.poison is not None:  # not finite is the largest sum: some owner sends it
            values = torch.where(part.launch.poison[list(part.index)][member],
                                 float("inf"), values)
        chunks, start, bounds = [], 0, [0]
        for c in sel.counts:
            bounds.append(bounds[-1] + c)
        numels, n = part.numels, len(part.members)
        while start < n:  # launches of more than 2**31 elements: several reduces
            stop, total = start, 0
            while stop < n and (stop == start or total + numels[stop] <= MAX_ELEMENTS):
                total += numels[stop]
                stop += 1
            lo, hi = bounds[start], bounds[stop]
            reduce = RegionReduce(local[lo:hi], values[lo:hi], sel.counts[start:stop],
                                  numels[start:stop], part.ks[start:stop],
                                  region_value_bits(self.ctx.compressor),
                                  f"{part.launch.name}.region{len(chunks)}",
                                  self.ctx.wire.process_set)
            members = list(range(start, stop))
            self._count(part, members, sel.counts[start:stop], reduce.sent,
                        reduce.sent_positions)
            self._keep_lost(part, reduce, starts[start:stop])
            chunks.append((reduce, members))
            start = stop
        return _RegionLaunch(part, chunks)

    def _keep_lost(self, part, reduce, starts):
        """What this rank's records lost to rounding (``reduce.lost``; members starting
        at ``starts`` in the launch) back into its memory, as the allgather's
        ``_keep_rest``; delayed averaging's own holds what arrives."""
        indices, lost = reduce.lost
        if not indices.numel():
            return
        tensor, local = reduce.split(indices)
        at = starts[tensor] + local
        self.ctx.memory.give_back(part.launch.block, at, lost)
        if part.own is not None:
            part.own.index_put_((at,), (part.own[at].float() - lost).to(part.own.dtype))

    def advance(self, handle):
        for reduce, positions in handle.chunks:
            if reduce.advanced:
                continue
            sent, coded = reduce.sent, reduce.sent_positions
            reduce.advance()
            self._count(handle.part, positions, reduce.kept_counts, reduce.sent - sent,
                        reduce.sent_positions - coded)

    def collect(self, handle, out):
        self.advance(handle)
        ctx, part = self.ctx, handle.part
        post = 1.0 / ctx.wire.world() if ctx.wire.op == Average else 1.0  # no predivide
        offsets = part.offsets
        out.zero(part.lo, part.hi)
        for reduce, positions in handle.chunks:
            res = reduce.collect()
            for position, share in zip(positions, shares_of(res.received, [
                    part.ks[p] for p in positions])):
                ctx.stats.add_received(part.members[position].name, share)
            device = res.values.device
            starts = on_device(tuple(offsets[p] for p in positions), str(device))
            tensor, local = reduce.split(res.indices)
            values = res.values if post == 1.0 else res.values * post
            out.add(starts[tensor] + local, values)  # each index once
            # error feedback: this rank's regions' unsent sums, and what its kept sums
            # lost to rounding, go back into its memory
            back_indices, back_values = res.returned
            ctx.stats.add_returned(back_indices.numel())
            tensor, local = reduce.split(back_indices)
            ctx.memory.give_back(part.launch.block, starts[tensor] + local, back_values)


class _HierarchicalLaunch(NamedTuple):
    part: Part
    bounds: list     # per member, its slices' (start, stop), one per rank of the host
    local: object    # the alltoall inside the host
    gather: list     # [the allgather across hosts], once advanced


class HierarchicalPath(_Path):
    """Hierarchical DGC for several hosts of several ranks each (Horovod's local_size > 1
    and cross_size > 1): the dense gradient is summed inside the host first, over its
    fast links, and only sparse records cross between hosts.

    Round 1 (launch): an alltoall among the host's L ranks (Horovod's global alltoall,
    nothing to other hosts) sends slice j of every tensor's clipped gradient to the
    host's j-th rank: a reduce-scatter, so each rank holds its host's sum of one slice.
    Round 2 (advance): that rank's memory accumulates the host sum (momentum correction
    on it), selects about k/L of the slice and sends the records in one allgather of
    every rank's; every rank sums the same records in the same order (collect).

    Memory: the residual of slice j of a host's summed gradient lives on the host's
    j-th rank, and only there (1/L of a tensor per rank): a block of its own per tensor,
    outside the launch's. What a host did not send stays in the memory of the rank
    owning that slice. A host sends about k records per tensor across hosts where flat
    DGC's L ranks send L k (hvd_dgc/aggregation.py hierarchical_bytes). At density 1
    every coordinate is sent: the update is dense momentum SGD's. Per tensor, not flat:
    it runs on several hosts only, where the link, not the launches, bounds a step."""

    kind = PathKind.HIERARCHICAL
    flat_rank = 4
    stored = False  # its memory holds the host's sum of a slice: blocks of its own
    reads_gradient = True
    checked = True

    def launch(self, part):
        launch, peers, ps = part.launch, self.ctx.wire.peers, self.ctx.wire.process_set
        grads = [launch.g[lo:lo + m.numel] for lo, m in zip(part.offsets, part.members)]
        bounds = [slices(m.numel, len(peers)) for m in part.members]
        if launch.poison is not None:  # a non-finite flag: inf reaches the host's sums
            bad = launch.poison[list(part.index)]
            grads = [torch.where(bad[j], float("inf"), g) for j, g in enumerate(grads)]
        pieces = [torch.cat([g[b[j][0]:b[j][1]] for g, b in zip(grads, bounds)])
                  for j in range(len(peers))]
        splits = torch.zeros(ps.size(), dtype=torch.int32)
        for j, rank in enumerate(peers):
            splits[rank] = pieces[j].numel()
        local = _hvd.alltoall_async(torch.cat(pieces), splits=splits,
                                    name=launch.name + ".local", process_set=ps)
        return _HierarchicalLaunch(part, bounds, local, [])

    def advance(self, handle):
        """Accumulate the host's sum of this rank's slices, select, start the allgather;
        what this rank sent (its host's sum: over all ranks they add up to N x the
        average) is its own for delayed averaging."""
        if handle.gather:
            return
        ctx, part = self.ctx, handle.part
        launch, comp, rank = part.launch, ctx.compressor, _hvd.rank()
        got, _ = _hvd.synchronize(handle.local)
        me = ctx.wire.peers.index(rank)
        host = got.view(len(ctx.wire.peers), -1).sum(0)  # the host's ranks, in rank order
        records, start, pre = [], 0, ctx.wire.pre()
        wants = comp.wants_block_max(host.device)
        for m, bounds, k_full, offset in zip(part.members, handle.bounds, part.ks,
                                             part.offsets):
            lo, hi = bounds[me]
            n = hi - lo
            block = ctx.memory.block((m.key,), (n,), 1, host.device, host.dtype)
            if launch.guarded:  # a step that may be undone (guard.py)
                ctx.memory.undo.snapshot(block)
            g = host.new_zeros(block.total)
            g[:n] = host[start:start + n]
            start += n
            ctx.memory.accumulate(block, g, [Run(0, block.total, m.momentum, m.nesterov)],
                                  with_block_max=wants)
            k = slice_k(k_full, m.numel, n)
            if not k:  # fewer elements than the host has ranks: nothing here
                empty = block.v.new_zeros(0)
                records.append(comp.pack(empty, empty.long()))
                continue
            picked = comp.pick(block.v, block.block_max, (0,), (n,), (k,), (m.key,), rank,
                               launch.step)
            masked = launch.density <= masking_density_limit(ctx.masking, m.momentum)
            if picked.values is None:
                values = ctx.memory.take(block, picked.positions, True if masked else None)
            else:
                values = picked.values
                ctx.memory.sent(block, picked.positions, picked.positions if masked else None)
            count = picked.positions.numel()
            ctx.stats.record(m.name, self.kind, n, count, count * comp.record_bytes,
                             launch.density, count * INDEX_BYTES)
            records.append(comp.pack(values if pre == 1.0 else values * pre,
                                     picked.positions + lo))
            if part.own is not None:
                part.own.index_put_((picked.positions + lo + offset,),
                                    values.to(part.own.dtype), accumulate=True)
        handle.gather.append(_hvd.grouped_allgather_async(
            records, name=launch.name + ".cross", process_set=ctx.wire.process_set))

    def collect(self, handle, out):
        self.advance(handle)
        part, comp = handle.part, self.ctx.compressor
        gathered = _hvd.synchronize(handle.gather[0])
        post = self.ctx.wire.post()
        for records, lo, m in zip(gathered, part.offsets, part.members):
            out.assign(lo, lo + m.numel, comp.scatter_sum(records, m.numel, scale=post))


class ExchangePath(_Path):
    """Compressors that run their own collectives (collective.py: PowerSGD, sign,
    TernGrad, QSGD, bf16); they take what they sent out of ``v`` (error feedback)."""

    kind = PathKind.EXCHANGE
    flat_rank = 2
    checked = True

    def launch(self, part):
        ctx, launch, block = self.ctx, part.launch, part.launch.block
        comp = ctx.compressor
        residuals = [block.v[o:o + m.numel].view(m.shape)
                     for o, m in zip(part.offsets, part.members)]
        if launch.poison is not None:  # inf through the compressor from a non-finite rank
            for j, r in enumerate(residuals):
                r.copy_(torch.where(launch.poison[part.index[j]], float("inf"), r))
        shares = comp.wire_shares([m.shape for m in part.members], ctx.wire.world())
        for m, sent in zip(part.members, shares):
            ctx.stats.record(m.name, comp.name, m.numel, m.numel, sent, launch.density)
        ex = comp.launch(residuals, [m.name for m in part.members], launch.name + ".x",
                         HorovodComm(ctx.wire.process_set))
        if part.own is not None:  # one-round compressors know what they sent at launch
            torch._foreach_copy_([part.own[o:o + m.numel] for o, m in
                                  zip(part.offsets, part.members)],
                                 [s.reshape(-1) for s in ex.sent])
        return ex, part

    def advance(self, handle):
        self.ctx.compressor.advance(handle[0])

    def collect(self, handle, out):
        ex, part = handle
        averages = self.ctx.compressor.collect(ex)
        if self.ctx.wire.op == Sum:
            averages = [a.mul_(self.ctx.wire.world()) for a in averages]
        for o, m, avg in zip(part.offsets, part.members, averages):
            out.assign(o, o + m.numel, avg)


class SparseGradPath(_Path):
    """A sparse gradient (nn.Embedding(sparse=True)) as Horovod's sparse allreduce sends
    it: every rank's coalesced indices and values allgathered; no DGC, no memory. Its
    average is a sparse tensor, set as the parameter's gradient (exchange.py)."""

    kind = PathKind.SPARSE_GRAD
    flat_rank = 5
    stored = False  # no memory: it is sparse already

    def launch(self, part):
        ps, launch = self.ctx.wire.process_set, part.launch
        handles = []
        for i, (m, (indices, values)) in enumerate(zip(part.members, launch.sparse)):
            sent = indices.numel() * indices.element_size() \
                + values.numel() * values.element_size()
            self.ctx.stats.record(m.name, self.kind, m.numel, values.numel(), sent,
                                  values.numel() / max(1, m.numel))
            handles.append((_hvd.allgather_async(indices, name=f"{launch.name}.g{i}.indices",
                                                 process_set=ps),
                            _hvd.allgather_async(values, name=f"{launch.name}.g{i}.values",
                                                 process_set=ps), m))
        return handles

    def collect(self, handle, out):
        """Every rank's rows, as one (uncoalesced) sparse tensor per member: the sum, or
        the average (op=Average), as Horovod's sparse allreduce returns it (returned:
        they replace the flat average, exchange.py)."""
        out = []
        for indices_handle, values_handle, m in handle:
            values = _hvd.synchronize(values_handle)  # values first, as Horovod waits
            indices = _hvd.synchronize(indices_handle)
            if self.ctx.wire.op == Average:
                values = values / self.ctx.wire.world()
            avg = torch.sparse_coo_tensor(indices.t(), values, m.shape)
            if on_accelerator(avg):  # its adds of repeated rows: atomics, in any order
                avg = coalesce_sorted(avg)
            out.append((m, avg))
        return out


CLASSES = {cls.kind: cls for cls in (SparseGradPath, ExchangePath, AllgatherPath,
                                      RegionPath, HierarchicalPath, DensePath)}


def make_paths(ctx):
    """One instance of every path class, by kind."""
    return {kind: cls(ctx) for kind, cls in CLASSES.items()}
