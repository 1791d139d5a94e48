"""How one launch's tensors travel: one protocol, one class per way (the optimizer's paths).

A launch (one tensor, one Horovod group, or every tensor of a step) holds tensors
that may travel different ways: dense allreduce, sparse allgather, region reduce,
hierarchical DGC, a compressor's own collectives, or a sparse gradient as Horovod
sends it. The
optimizer (optimizer.py) prepares each tensor — clip, accumulate, choose — and
hands it to its path; every path answers the same calls, so a new aggregation is
one more class here, not more branches there::

    payload = path.take(job)            what leaves the memory (the memory keeps the rest)
    payload = path.placeholder(job, x)  a non-finite gradient's stand-in: x = inf or 0
    launched = path.launch(items, name) start the collectives (non-blocking); with
                                        delay > 0 or period > 1 (DGCState.keeps_own),
                                        ``launched.sent``: what this rank sent
    sent = path.advance(handle)         second rounds: called for every launch of a step
                                        before any is waited on, so no rank waits on a
                                        round another rank has not started; a path that
                                        learns only here what it sent returns it (delay)
    updates = path.collect(handle)      wait; each tensor's averaged update, flat, in order

What a tensor sent (``sent``: a flat tensor, or ``Selected`` records) is what delayed
averaging replaces by the average D steps later (``own_of`` / ``subtract_own``); with
``period > 1`` the steps between exchanges take no path at all (optimizer.py, LOCAL).

A path whose ``reduces_first`` is set (hierarchical DGC) takes the clipped gradient
itself: its memory accumulates what the first round returns, not this rank's own.
"""

from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Average, Sum

from hvd_dgc.aggregation import slice_k, slices
from hvd_dgc.costmodel import DENSE, HIERARCHICAL, REGION, SPARSE
from hvd_dgc.fp16wire import fp16_bound
from hvd_dgc.masking import masking_density_limit
from hvd_dgc.torch.collective import EXCHANGE, HorovodComm
from hvd_dgc.torch.compression import INDEX_BYTES, Selected, Selection, on_accelerator
from hvd_dgc.torch.gpu_select import counts_on
from hvd_dgc.torch.region import MAX_ELEMENTS, RegionReduce

__all__ = ["Job", "Item", "Launched", "Wire", "make_paths", "own_of", "subtract_own",
           "SPARSE_GRAD"]

#: Horovod's path for a sparse gradient (its sparse_allreduce_async): allgather of the
#: indices and values, no DGC (the gradient is sparse already).
SPARSE_GRAD = "sparse_grad"


class Job(NamedTuple):
    """One tensor's part of a launch, as ``_prepare`` hands it to its path."""

    key: object            # its memory's key
    name: str
    shape: torch.Size
    v: torch.Tensor        # what may be sent (the memory's velocity, flat); or the gradient
    k: int                 # records a sparse path selects
    density: float
    momentum: float = 0.0  # the memory's momentum for it (masking: hvd_dgc/masking.py)
    block_max: object = None  # |v| block maxima from the fused CPU update
    poison: object = None  # device flag: the gradient was not finite (GPU, skip_nonfinite)
    fixed: object = None   # Selected: send this instead (a non-finite gradient's record)
    nesterov: bool = False  # for a memory that accumulates after the launch (hierarchical)


class Item(NamedTuple):
    """One tensor of a launch, from ``_prepare`` to its update."""

    path: str
    job: Job
    payload: object        # what its path sends
    scale: object = None   # GradScaler's scale the update is multiplied back by
    own: object = None     # keeps_own: what this rank sent (flat tensor or Selected)


class Launched(NamedTuple):
    handle: object
    sent: list = None      # per item, what this rank sent (DGCState.keeps_own only)


class Wire(NamedTuple):
    """How the optimizer's collectives run: Horovod's arguments, fixed at wrap time."""

    process_set: object
    op: object
    predivide: float
    peers: tuple = ()  # global ranks on this rank's host, sorted (hierarchical DGC only)

    def world(self):
        return self.process_set.size()

    def pre(self):
        """Factor on the wire before the sum (Horovod's gradient_predivide_factor)."""
        return 1.0 / self.predivide if self.op == Average else 1.0

    def post(self):
        """Factor after the sum: the average (op=Average) of what was sent."""
        return self.predivide / self.world() if self.op == Average else 1.0


class _Path:
    name = None
    selects = False        # a sparse selection (k records from the memory)
    reduces_first = False  # takes the gradient; the memory accumulates after a first round

    def __init__(self, dgc, wire):
        self.dgc, self.wire = dgc, wire

    def advance(self, handle):
        return None


class DensePath(_Path):
    """Ring allreduce of the whole velocity (grouped: one Horovod fusion per launch).
    fp16 on the wire (hvd_dgc/fp16wire.py) keeps its rounding error, and what lies
    beyond fp16's range, in the residual."""

    name = DENSE

    def take(self, job):
        d, v = self.dgc, job.v
        if d.dense_fp16:
            payload = self._half(v)
        else:
            payload = v.clone()
            d.memory.sent_all(job.key)
        d.stats.record(job.name, DENSE, v.numel(), v.numel(),
                       payload.numel() * payload.element_size(), job.density)
        return payload

    def half_bound(self):
        """What one rank may put on this wire's fp16 allreduce (hvd_dgc/fp16wire.py)."""
        return fp16_bound(self.wire.world(), self.wire.pre())

    def _half(self, v):
        """fp16wire.fp16_payload, in place on the memory's ``v``: at most the bound on the
        wire, the rest stays; the count of clipped values is read once per step
        (optimizer.py ``_report_fp16``), not here (a GPU would wait)."""
        bound = self.half_bound()
        finite = torch.isfinite(v)
        self.dgc.fp16_clipped.append(torch.count_nonzero(finite & (v.abs() > bound)))
        payload = torch.where(finite, v.clamp(-bound, bound), v).to(torch.float16)
        v.copy_(torch.where(finite, v - payload.to(v.dtype), 0.0))
        return payload

    def placeholder(self, job, value):
        payload = torch.full_like(job.v, value)
        return payload.half() if self.dgc.dense_fp16 else payload

    def launch(self, items, name):
        # the allreduce overwrites the payloads in place: keep what was sent first
        sent = [it.payload.to(it.job.v.dtype, copy=True) for it in items] \
            if self.dgc.keeps_own else None
        w = self.wire
        pre, post = (w.pre(), w.predivide) if w.op == Average else (1.0, 1.0)
        handle = _hvd.grouped_allreduce_async_(
            [it.payload for it in items], name=name + ".dense", op=w.op, prescale_factor=pre,
            postscale_factor=post, process_set=w.process_set)
        return Launched(handle, sent)

    def collect(self, handle):
        return [out.reshape(-1) for out in _hvd.synchronize(handle)]


class AllgatherPath(_Path):
    """Every rank's k records of each tensor to every rank; each sums them. Bytes per
    worker k(N-1): linear in N (hvd_dgc/aggregation.py)."""

    name = SPARSE
    selects = True

    def take(self, job):
        return job  # selected with the launch's other sparse tensors (select)

    def placeholder(self, job, value):
        # at index 0: one record, or k on a GPU (there every rank sends exactly k)
        count = job.k if on_accelerator(job.v) else 1
        device, dtype = job.v.device, job.v.dtype
        return job._replace(fixed=Selected(torch.zeros(count, dtype=torch.long, device=device),
                                           torch.full((count,), value, dtype=dtype,
                                                      device=device)))

    def select(self, jobs, pre):
        """Select and take out of the memory what ``jobs`` send: ``(values on the wire,
        Selection)``. On a GPU one selection serves them all (gpu_select.py), as kernel
        launches, not bytes, bound the work there."""
        d, comp, rank = self.dgc, self.dgc.compression, _hvd.rank()
        free = [job for job in jobs if job.fixed is None]
        if free:
            sel = comp.sparsify_many([job.v for job in free], [job.k for job in free], rank,
                                     [job.block_max for job in free])
        if len(free) < len(jobs):  # fixed records among them: a non-finite gradient's
            picked = iter(sel.split() if free else ())  # placeholder, a folded dense tensor
            parts = [job.fixed or Selected(*next(picked)) for job in jobs]
            sel = Selection(torch.cat([part.indices for part in parts]),
                            torch.cat([part.values for part in parts]),
                            tuple(part.indices.numel() for part in parts))
        wire = sel.values if pre == 1.0 else sel.values * pre
        if any(job.poison is not None for job in jobs):  # a GPU, skip_nonfinite
            # inf in a bad tensor's records; a folded dense tensor (fold) has no flag: its
            # own non-finite values reach the sum as they are
            no = torch.zeros((), dtype=torch.bool, device=wire.device)
            poison = [no if job.poison is None else job.poison for job in jobs]
            bad = torch.stack(poison).repeat_interleave(
                counts_on(sel.ks, str(wire.device)), output_size=wire.numel())
            wire = torch.where(bad, float("inf"), wire)
        for job, (indices, _) in zip(jobs, sel.split()):
            if job.fixed is None:
                mask = job.density <= masking_density_limit(d.memory.momentum_masking,
                                                             job.momentum)
                d.memory.sent(job.key, indices, mask_momentum=mask)
                d.stats.record(job.name, self.name, job.v.numel(), indices.numel(),
                               indices.numel() * comp.record_bytes, job.density)
        return wire, sel

    def fold(self, items):
        """``items`` with the launch's dense tensors moved into its allgather, where the
        cost model says so (costmodel.py ``folds``): each as records of all its indices,
        values exactly those the dense allreduce would have summed (so the memory, the
        stats' dense count and delayed averaging's ``own`` are unchanged). One Horovod
        operation per launch instead of two: two round trips fewer a step over a WAN
        (bench/results/round_trips.md). The same decision on every rank: it depends on
        the launch's members and sizes only."""
        dense = [i for i, it in enumerate(items) if it.path == DENSE]
        if not dense or not any(it.path == SPARSE for it in items):
            return items
        comp, d = self.dgc.compression, self.dgc
        if any(items[i].payload.dtype != comp.value_dtype for i in dense):
            return items  # fp16 on the dense wire, fp32 records (or the reverse): leave it
        numel = sum(items[i].payload.numel() for i in dense)
        if not d.cost_model.folds(numel, self.wire.world(), comp.value_bytes, INDEX_BYTES):
            return items
        items = list(items)
        for i in dense:
            it = items[i]
            n = it.payload.numel()
            whole = Selected(torch.arange(n, device=it.payload.device), it.payload)
            d.stats.add_bytes(it.job.name, n * INDEX_BYTES)
            items[i] = it._replace(path=SPARSE, payload=it.job._replace(k=n, fixed=whole))
        return items

    @staticmethod
    def _sent(sel):
        return [Selected(indices, values) for indices, values in sel.split()]

    def launch(self, items, name):
        jobs = [it.payload for it in items]
        wire, sel = self.select(jobs, self.wire.pre())
        ks = tuple(job.k for job in jobs)
        indices = sel.indices
        if sel.ks != ks:
            wire, indices = self._pad(jobs, wire, sel, ks)
        records = self.dgc.compression.pack(wire, indices)
        handle = _hvd.allgather_async(records, name=name + ".sparse",
                                      process_set=self.wire.process_set)
        layout = (tuple(job.v.numel() for job in jobs), ks)
        return Launched((handle, layout), self._sent(sel) if self.dgc.keeps_own else None)

    def _pad(self, jobs, wire, sel, ks):
        """Each tensor's records up to its k with (index 0, value 0) records, which add
        nothing. A CPU selection sends 0.8k to k records; padded, every rank sends the
        same buffer shape every step, and Horovod's response cache answers the
        negotiation: measured over a 100 ms link (bench/results/round_trips.md), an
        allgather whose size changes from step to step waits 7 round trips, one of a
        fixed size 3, what a single allreduce waits. Up to a quarter more record bytes
        for four round trips fewer."""
        values, indices, record = [], [], self.dgc.compression.record_bytes
        for job, (idx, val), k in zip(jobs, zip(sel.indices.split(sel.ks),
                                                wire.split(sel.ks)), ks):
            missing = k - idx.numel()
            values += [val, val.new_zeros(missing)]
            indices += [idx, idx.new_zeros(missing)]
            self.dgc.stats.add_bytes(job.name, missing * record)
        return torch.cat(values), torch.cat(indices)

    def collect(self, handle):
        handle, (sizes, ks) = handle
        out, comp, post = _hvd.synchronize(handle), self.dgc.compression, self.wire.post()
        return comp.scatter_sum_many(out, sizes, ks, scale=post)


class _RegionLaunch(NamedTuple):
    jobs: list
    chunks: list   # [(RegionReduce, positions of its jobs)]


class RegionPath(AllgatherPath):
    """Region reduce (hvd_dgc/torch/region.py, after Ok-Topk): alltoall to the owners of
    N index regions, each keeps ceil(2k/N) of its sums, allgather of the kept. Bytes per
    worker ~3k(N-1)/N: flat in N. What an owner does not keep goes back into its own
    memory (error feedback). Values travel unscaled (predivide plays no part: sums are
    formed once, on the owner).

    Momentum factor masking stays at send, as for allgather: masking only the sent
    coordinates the owners then applied measured no better (digits, N = 4, 4 seeds, one
    run: 96.53% both)."""

    name = REGION

    def launch(self, items, name):
        jobs = [it.payload for it in items]
        wire, sel = self.select(jobs, 1.0)
        chunks, start, bounds = [], 0, [0]
        for c in sel.ks:
            bounds.append(bounds[-1] + c)
        while start < len(jobs):  # launches of more than 2**31 elements: several reduces
            stop, total = start, 0
            while stop < len(jobs) and (stop == start
                                        or total + jobs[stop].v.numel() <= MAX_ELEMENTS):
                total += jobs[stop].v.numel()
                stop += 1
            lo, hi = bounds[start], bounds[stop]
            part = jobs[start:stop]
            reduce = RegionReduce(sel.indices[lo:hi], wire[lo:hi], sel.ks[start:stop],
                                  [job.v.numel() for job in part], [job.k for job in part],
                                  self.dgc.compression, f"{name}.region{len(chunks)}",
                                  self.wire.process_set)
            chunks.append((reduce, list(range(start, stop))))
            start = stop
        sent = self._sent(sel) if self.dgc.keeps_own else None
        return Launched(_RegionLaunch(jobs, chunks), sent)

    def advance(self, handle):
        comp = self.dgc.compression
        for reduce, positions in handle.chunks:
            if reduce.advanced:
                continue
            reduce.advance()
            for position, kept in zip(positions, reduce.kept_counts):
                job = handle.jobs[position]
                self.dgc.stats.add_bytes(job.name, kept * comp.record_bytes)

    def collect(self, handle):
        self.advance(handle)
        post = 1.0 / self.wire.world() if self.wire.op == Average else 1.0  # no predivide
        updates, memory = [None] * len(handle.jobs), self.dgc.memory
        for reduce, positions in handle.chunks:
            res = reduce.collect()
            values = res.values if post == 1.0 else res.values * post
            total = torch.zeros(sum(reduce.numels), dtype=torch.float32, device=values.device)
            total.index_put_((res.indices,), values)  # each index once: no order to fix
            for position, update in zip(positions, total.split(list(reduce.numels))):
                updates[position] = update
            # error feedback: this rank's regions' unsent sums go back into its memory
            back_indices, back_values = res.returned
            self.dgc.stats.add_returned(back_indices.numel())
            tensor, local = reduce.split(back_indices)
            counts = torch.bincount(tensor, minlength=len(positions)).tolist()
            for position, idx, val in zip(positions, local.split(counts),
                                          back_values.split(counts)):
                if idx.numel():
                    job = handle.jobs[position]
                    memory.give_back(job.key, idx, val, like=job.v)
        return updates


class _HierarchicalLaunch(NamedTuple):
    jobs: list
    name: str
    bounds: list     # per job, its slices' (start, stop), one per rank of the host
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
    j-th rank, and only there (1/L of a tensor per rank); what a host did not send
    stays in the memory of the rank owning that slice. A host sends about k records
    per tensor across hosts where flat DGC's L ranks send L k (hvd_dgc/aggregation.py
    hierarchical_bytes). At density 1 every coordinate is sent: the update is dense
    momentum SGD's."""

    name = HIERARCHICAL
    selects = True
    reduces_first = True

    def take(self, job):
        return job  # the clipped gradient: the host's sum reaches the memory in advance

    def placeholder(self, job, value):
        return job._replace(v=torch.full_like(job.v, value))

    def launch(self, items, name):
        jobs = [it.payload for it in items]
        peers, ps = self.wire.peers, self.wire.process_set
        bounds = [slices(job.v.numel(), len(peers)) for job in jobs]
        # a GPU's non-finite flag (skip_nonfinite): inf reaches the host's sums, then the wire
        sends = [job.v if job.poison is None else torch.where(job.poison, float("inf"), job.v)
                 for job in jobs]
        parts = [torch.cat([v[b[j][0]:b[j][1]] for v, b in zip(sends, bounds)])
                 for j in range(len(peers))]
        splits = torch.zeros(ps.size(), dtype=torch.int32)
        for j, rank in enumerate(peers):
            splits[rank] = parts[j].numel()
        local = _hvd.alltoall_async(torch.cat(parts), splits=splits, name=name + ".local",
                                    process_set=ps)
        return Launched(_HierarchicalLaunch(jobs, name, bounds, local, []), None)

    def advance(self, handle):
        """Returns what this rank sent, per tensor (its slice's records, unscaled): its
        host's sum, so over all ranks they add up to N x the average, as delayed
        averaging's ``own`` must (paths.py own_of)."""
        if handle.gather:
            return None
        d, comp, rank = self.dgc, self.dgc.compression, _hvd.rank()
        got, _ = _hvd.synchronize(handle.local)
        me = self.wire.peers.index(rank)
        host = got.view(len(self.wire.peers), -1).sum(0)  # the host's ranks, in rank order
        records, sent, start, pre = [], [], 0, self.wire.pre()
        for job, bounds in zip(handle.jobs, handle.bounds):
            lo, hi = bounds[me]
            v = d.memory.accumulate(job.key, host[start:start + hi - lo], job.momentum,
                                    job.nesterov)
            start += hi - lo
            k = slice_k(job.k, job.v.numel(), hi - lo)
            if not k:  # fewer elements than the host has ranks: nothing here
                empty = v.new_zeros(0)
                records.append(comp.pack(empty, empty.long()))
                sent.append(Selected(empty.long(), empty))
                continue
            sel = comp.sparsify(v, k, rank, None)
            mask = job.density <= masking_density_limit(d.memory.momentum_masking, job.momentum)
            d.memory.sent(job.key, sel.indices, mask_momentum=mask)
            count = sel.indices.numel()
            d.stats.record(job.name, HIERARCHICAL, hi - lo, count, count * comp.record_bytes,
                           job.density)
            values = sel.values if pre == 1.0 else sel.values * pre
            records.append(comp.pack(values, sel.indices + lo))
            sent.append(Selected(sel.indices + lo, sel.values))
        handle.gather.append(_hvd.grouped_allgather_async(
            records, name=handle.name + ".cross", process_set=self.wire.process_set))
        return sent

    def collect(self, handle):
        self.advance(handle)
        out, comp, post = _hvd.synchronize(handle.gather[0]), self.dgc.compression, \
            self.wire.post()
        return [comp.scatter_sum(records, job.v.numel(), scale=post)
                for records, job in zip(out, handle.jobs)]


class ExchangePath(_Path):
    """Compressors that run their own collectives (collective.py: PowerSGD, sign,
    TernGrad, QSGD, bf16); they take what they sent out of ``v`` (error feedback)."""

    name = EXCHANGE

    def take(self, job):
        comp = self.dgc.compression
        self.dgc.stats.record(job.name, comp.name, job.v.numel(), job.v.numel(),
                              comp.wire_bytes(job.shape), job.density)
        return job.v.view(job.shape)

    def placeholder(self, job, value):  # through the compressor, from a throwaway residual
        return torch.full(job.shape, value, dtype=job.v.dtype, device=job.v.device)

    def launch(self, items, name):
        comp = self.dgc.compression
        ex = comp.launch([it.payload for it in items], [it.job.name for it in items],
                         name + ".x", HorovodComm(self.wire.process_set))
        sent = None
        if self.dgc.keeps_own:  # one-round compressors know what they sent at launch
            sent = [s.to(it.payload.dtype, copy=True) for s, it in zip(ex.sent, items)]
        return Launched(ex, sent)

    def advance(self, handle):
        self.dgc.compression.advance(handle)

    def collect(self, handle):
        outs = self.dgc.compression.collect(handle)  # averages
        if self.wire.op == Sum:
            return [out.mul_(self.wire.world()) for out in outs]
        return outs


class SparseGradPath(_Path):
    """A sparse gradient (nn.Embedding(sparse=True)) as Horovod's sparse allreduce sends
    it: every rank's coalesced indices and values allgathered; no DGC, no memory."""

    name = SPARSE_GRAD

    def launch(self, items, name):
        ps = self.wire.process_set
        return Launched([
            (_hvd.allgather_async(indices, name=f"{name}.g{i}.indices", process_set=ps),
             _hvd.allgather_async(values, name=f"{name}.g{i}.values", process_set=ps),
             it.job.shape)
            for i, it in enumerate(items) for indices, values in (it.payload,)])

    def collect(self, handle):
        """Every rank's rows, as one (uncoalesced) sparse tensor: the sum, or the average
        (op=Average), as Horovod's sparse allreduce returns it."""
        out = []
        for indices_handle, values_handle, shape in handle:
            values = _hvd.synchronize(values_handle)  # values first, as Horovod waits
            indices = _hvd.synchronize(indices_handle)
            if self.wire.op == Average:
                values = values / self.wire.world()
            out.append(torch.sparse_coo_tensor(indices.t(), values, shape))
        return out


#: the order a launch starts its paths in (the same on every rank)
ORDER = (SPARSE_GRAD, EXCHANGE, SPARSE, REGION, HIERARCHICAL, DENSE)


def make_paths(dgc, wire):
    return {cls.name: cls(dgc, wire) for cls in (SparseGradPath, ExchangePath, AllgatherPath,
                                                  RegionPath, HierarchicalPath, DensePath)}


def own_of(item, dtype):
    """This rank's contribution to a launch, as a dense flat tensor."""
    own = item.own
    if not isinstance(own, Selected):
        return own.clone()  # p.grad may be changed by the user (clipping); own may not
    dense = torch.zeros(item.job.v.numel(), dtype=dtype, device=own.values.device)
    return dense.index_put_((own.indices,), own.values.to(dtype), accumulate=True)


def subtract_own(update, item):
    """``update - own`` in place: the local term a delayed average replaces."""
    own = item.own
    if not isinstance(own, Selected):
        return update.sub_(own.to(update.dtype))
    return update.index_put_((own.indices,), -own.values.to(update.dtype), accumulate=True)
