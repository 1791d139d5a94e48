"""How one tensor travels in TensorFlow: one class per way (``hvd_dgc.paths.PathKind``),
one protocol, used by the synchronous step and by delayed averaging alike.

For each tensor of a step (exchange.py), ``ExchangePaths`` accumulates the gradient
into the memory (``v``) and hands ``v`` to the tensor's path at this step's density
stage (the planner's choice, hvd_dgc/plan.py; a ``tf.switch_case`` on the stage where
it changes, so every rank takes the same branch and joins the same collectives)::

    path.take(i, v, k, at)         what leaves the memory (it keeps the rest; the
                                   statistics count it), as the collectives take it
    path.take_own(i, v, k, at)     the same, with what this rank sent as the others
                                   will read it: Sent(payload, own) (delayed averaging)
    handle = path.launch(part)     start the collectives of a Part: one tensor
                                   (synchronous) or one delayed step's tensors on it
    path.advance(handle)           second rounds (region reduce's allgather)
    got = path.collect(handle)     what arrived, per member
    path.average(part, got)        synchronous, in the step's graph: the averages
    path.correction(part, got)     delayed, on delayed.py's threads: avg - own, NumPy

``path.synchronous(i, v, k, at)`` runs take..average in the step's graph;
``ExchangePaths.step`` runs every tensor's, alone or in buckets (``fusion_threshold``:
one grouped collective per bucket, as PyTorch's). Delayed averaging (delayed.py) runs
``take_own`` in the graph, carries the payloads to its threads as int32 words
(``to_words`` / ``from_words``), and runs launch..correction there. A path that reads
the gradient itself (``reads_gradient``: hierarchical DGC, whose memory holds its
host's sum of a slice) makes ``v`` in its own ``accumulate``. A new way to travel is
one more class here.
"""

from typing import NamedTuple

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Average

from hvd_dgc.aggregation import chunk_spans, slice_k, slices
from hvd_dgc.fp16wire import fp16_bound
from hvd_dgc.packing import fold_block_bytes, folds_values, gather_block_bytes, \
    gather_value_bits, index_bytes, reduces_signs, sign_shares
from hvd_dgc.paths import ORDER, PathKind
from hvd_dgc.stats import RECORDS
from hvd_dgc.tensorflow.collective import Comm
from hvd_dgc.tensorflow.compression import SparseCompressor
from hvd_dgc.tensorflow.memory import local_gradient
from hvd_dgc.tensorflow.positions import decode_records, decode_values, encode_records, \
    encode_values, traced_once
from hvd_dgc.tensorflow.region import share_kept, to_owners

__all__ = ["At", "Wire", "PathContext", "Sent", "Part", "Folded", "Correction",
           "ExchangePaths", "DensePath", "RecordsPath", "AllgatherPath", "RegionPath",
           "HierarchicalPath", "ExchangePath",
           "SignGroupPath", "SparseGradPath", "host_slice", "later_positions"]


def later_positions(compressor, later_bytes):
    """Of a region owner's ``later_bytes`` (its kept records, sent in the second round),
    those of their int32 positions."""
    return later_bytes * SparseCompressor.INDEX_BYTES // compressor.record_bytes


class At(NamedTuple):
    """Where a step is: its density stage (k and the path are looked up by it), the
    density (momentum masking depends on it), the random seed (selection, QSGD) and the
    step (PowerSGD's start_iter)."""

    stage: tf.Tensor
    density: tf.Tensor
    seed: tf.Tensor
    step: tf.Tensor


class Wire(NamedTuple):
    """Horovod's arguments to the exchange's collectives, fixed at wrap time.
    ``agnostic``: the step is traced once for every world size (a tape under elastic
    Horovod: the user's ``tf.function`` is not traced again after a reset), so the
    number of ranks is read when the step runs, not when it is traced."""

    process_set: object
    op: object
    predivide: float
    agnostic: bool = False
    peers: tuple = ()  # global ranks on this rank's host, sorted (hierarchical DGC only)

    def world(self):
        if self.agnostic:
            return tf.cast(_hvd.size_op(process_set_id=self.process_set.process_set_id),
                           tf.float32)
        return self.process_set.size()

    def scales(self):
        """(prescale, postscale) of Horovod's Average with gradient_predivide_factor."""
        if self.op == Average:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0

    def gathered(self):
        """Factor turning the sum of every rank's (prescaled) records into the result."""
        return self.predivide / self.world() if self.op == Average else 1.0

    def summed(self):
        """Factor turning a sum of unscaled values into the result (region reduce: its
        sums are formed once, on the owners, so the predivide factor plays no part)."""
        return 1.0 / self.world() if self.op == Average else 1.0

    def result(self, mean):
        """A mean over the ranks as the op asks for it: itself, or the sum."""
        return mean if self.op == Average else mean * self.world()

    def fp16_bound(self):
        """What one rank may put on a dense fp16 allreduce (hvd_dgc/fp16wire.py)."""
        return fp16_bound(self.world(), self.scales()[0])


class PathContext(NamedTuple):
    """What every path of one exchange shares (fixed when its memory is built)."""

    wire: Wire
    compressor: object
    memory: object        # DGCMemory
    statistics: object    # statistics.Statistics
    tensors: tuple        # hvd_dgc.plan.TensorInfo, by index
    slots: object         # a compressor's per-tensor state (PowerSGD's Q), or None
    mask_limit: float     # momentum masking at densities up to this (hvd_dgc/masking.py)
    dense_fp16: bool
    clip_norm: object

    def numel(self, i):
        return self.tensors[i].numel

    def accumulate(self, i, grad):
        """Clip and accumulate: ``v``, what the memory holds to send."""
        return self.memory.accumulate(i, local_gradient(grad, self.clip_norm,
                                                        self.wire.world()))

    def intake(self, i, grad):
        """Clip and accumulate, on a step between exchanges: what ``v`` took in."""
        return self.memory.intake(i, local_gradient(grad, self.clip_norm, self.wire.world()))

    def give_back(self, i, indices, values):
        """What an aggregation took but did not deliver (region reduce's owner keeps
        what it did not send on) back into the residual: error feedback sends it later."""
        self.memory.give_back(i, indices, values)
        self.statistics.add(returned_elements=tf.size(indices, out_type=tf.int64))


class Sent(NamedTuple):
    """What one tensor puts on the wire this step (delayed averaging)."""

    payload: object   # as the path's collectives take it
    own: tf.Tensor    # flat float32: this rank's contribution, as the others read it


class Part(NamedTuple):
    """Tensors that leave together on one path: one tensor of the synchronous step, or
    a delayed step's tensors on that path (one grouped collective)."""

    name: str
    members: tuple    # tensor indices
    payloads: tuple   # each member's, as ``take`` made it (NumPy on delayed's threads)
    ks: object        # records each may send (a tuple, or an int32 tensor); on the
    #                   allgather, Folded(bits) for a dense tensor riding along

    def tag(self, what):
        """The name of the part's collective ``what`` (every rank names it alike)."""
        return f"{self.name}.{what}"

    def each(self, what):
        """Names of per-member collectives ``what``."""
        if len(self.members) == 1:
            return [self.tag(what)]
        return [f"{self.name}.{what}.{i}" for i in self.members]


class Folded(NamedTuple):
    """The k of a dense tensor folded into the allgather (``DensePath.fold``): its
    values alone, every index, in ``bits``."""

    bits: int


class Correction(NamedTuple):
    """``avg - own`` of one tensor of one delayed launch, and what it gives back."""

    records: np.ndarray   # [m, 2] int32 (index, value bits) to scatter-add
    dense: np.ndarray     # or a dense float32 part (the other one empty)
    returned: np.ndarray  # [r, 2] records this rank adds back to its residual
    later_bytes: int = 0  # bytes this rank sent in a later round (region reduce's owners)


NO_RECORDS = np.zeros([0, 2], np.int32)
NO_DENSE = np.zeros([0], np.float32)


class _Path:
    """One way a tensor travels (the protocol: this module's docstring)."""

    kind = None
    #: its corrections give records back to this rank's residual
    gives_back = False
    #: it takes the tensor's gradient, not the memory's ``v`` (it accumulates itself)
    reads_gradient = False
    #: delayed averaging runs its launches one after another, in launch order
    serial = False
    #: its payload's size depends on k, which it is given as a Python int
    #: (``ExchangePaths.choose``); else this step's k, a tensor
    static_k = False

    def __init__(self, ctx):
        self.ctx = ctx

    def synchronous(self, i, v, k, at, poison=None):
        """Tensor i's average this step (flat), all in the step's graph. ``poison``: this
        rank's gradient was not finite; it sends inf, so every rank sees it."""
        return self.alone(i, self.take(i, v, k, at, poison), k)

    def alone(self, i, payload, k):
        """Tensor i's ``payload`` through its own collectives: its average (flat)."""
        part = Part(f"hvd_dgc.{i}", (i,), (payload,), (k,))
        handle = self.launch(part)
        self.advance(handle)
        return self.average(part, self.collect(handle))[0]

    def take(self, i, v, k, at, poison=None):
        raise NotImplementedError

    def take_own(self, i, v, k, at):
        raise NotImplementedError(f"the {self.kind} path runs in the synchronous step only")

    def advance(self, handle):
        pass

    def collect(self, handle):
        return handle


class DensePath(_Path):
    """Ring allreduce of the whole velocity. With fp16 on the wire (Horovod's
    Compression.fp16) at most fp16wire.fp16_bound of it leaves, the rest and fp16's
    rounding staying in the residual, as on the PyTorch side (hvd_dgc/fp16wire.py)."""

    kind = PathKind.DENSE

    def __init__(self, ctx):
        super().__init__(ctx)
        #: tensor -> per density stage, the bits its values take folded into the step's
        #: allgathers, 0 where it is not (``ExchangePaths.replan``: costmodel.folds, as
        #: PyTorch's AllgatherPath.absorb)
        self.folds = {}

    def synchronous(self, i, v, k, at, poison=None):
        """Tensor i's average: an allreduce of its velocity, or where the plan folds it,
        its values alone in an allgather that Horovod fuses with the sparse tensors'
        allgathers: one Horovod operation a step instead of two, two round trips fewer
        over a WAN (bench/results/round_trips.md)."""
        stages = self.folds.get(i)
        if not stages or not any(stages):
            return super().synchronous(i, v, k, at, poison)

        def run(bits):
            if bits == 0:
                return _Path.synchronous(self, i, v, k, at, poison)
            return self._folded(i, v, bits, at, poison)
        return by_stage(stages, at, run, sorted(set(stages)))

    def fold(self, i, v, bits, at, poison=None):
        """Tensor i's velocity, all of it leaving the memory, as the allgather carries a
        folded tensor: its values alone (every index, known to every rank), prescaled,
        in ``bits`` (positions.py ``encode_values``), what the rounding loses kept in the
        memory as the records' is."""
        ctx, n = self.ctx, self.ctx.numel(i)
        ctx.memory.sent_all(i)
        ctx.statistics.count(self.kind, n, n, fold_block_bytes(n, bits))
        pre = ctx.wire.scales()[0]
        values = v * pre if poison is None else poisoned(v * pre, poison)
        coded, arrived = encode_values(values, bits)
        if bits < 32:
            ctx.memory.keep(i, tf.where(tf.math.is_finite(values), v - arrived / pre, 0.0))
        return coded

    def _folded(self, i, v, bits, at, poison):
        """``fold``'s values in an allgather of their own; each rank sums them."""
        ctx = self.ctx
        got = _hvd.allgather(self.fold(i, v, bits, at, poison), name=f"hvd_dgc.{i}.folded",
                             process_set=ctx.wire.process_set)
        return folded_sum(got, ctx.numel(i), bits) * ctx.wire.gathered()

    def shortcut(self, i, grad, poison=None):
        """Tensor i's payload where every rank's memory of it may be settled (dense at
        every stage, fp32, Average, momentum that is not Nesterov's, no Adam: a
        synchronous step): settled (DGCMemory.apart), the gradient itself, and the
        momentum is applied to the average when the step is kept (DGCMemory.settle,
        ``ExchangePaths.finish``). By linearity the average is the one the velocity
        would have made (DGC at density 1 is momentum SGD), and nothing of the memory
        is read, written or saved before the exchange: the velocity's pass, its
        guard's copies and emptying ``v`` cost nothing. Unsettled, the whole velocity
        as ``take`` sends it, which takes v's residual along."""
        ctx, numel = self.ctx, self.ctx.numel(i)
        g = local_gradient(grad, ctx.clip_norm, ctx.wire.world())
        payload = tf.cond(ctx.memory.settled(i), lambda: tf.identity(g),
                          lambda: self._sent_all(i, ctx.memory.accumulate(i, g)))
        ctx.statistics.count(self.kind, numel, numel, 4 * numel)
        return payload if poison is None else poisoned(payload, poison)

    def _sent_all(self, i, v):
        self.ctx.memory.sent_all(i)
        return v

    def _payload(self, i, v):
        ctx, numel = self.ctx, self.ctx.numel(i)
        ctx.statistics.count(self.kind, numel, numel, (2 if ctx.dense_fp16 else 4) * numel)
        if not ctx.dense_fp16:
            return self._sent_all(i, v)
        bound = ctx.wire.fp16_bound()
        finite = tf.math.is_finite(v)
        ctx.statistics.add_fp16_clipped(tf.math.count_nonzero(
            finite & (tf.abs(v) > bound), dtype=tf.int64))
        payload = tf.cast(tf.where(finite, tf.clip_by_value(v, -bound, bound), v), tf.float16)
        ctx.memory.keep(i, tf.where(finite, v - tf.cast(payload, tf.float32), 0.0))
        return payload

    def take(self, i, v, k, at, poison=None):
        payload = self._payload(i, v)
        if poison is not None:
            payload = poisoned(payload, poison)
        return payload

    def take_own(self, i, v, k, at):
        own = tf.cast(self._payload(i, v), tf.float32)
        return Sent(own, own)

    def nothing(self, i, k, at):
        zero = tf.zeros([self.ctx.numel(i)])
        return Sent(zero, zero)

    def to_words(self, payload):
        return tf.bitcast(payload, tf.int32)

    def from_words(self, words, i):
        own = words.view(np.float32)
        return own.astype(np.float16) if self.ctx.dense_fp16 else own

    def spec(self, i):
        return tf.TensorSpec([None], tf.float16 if self.ctx.dense_fp16 else tf.float32)

    def launch(self, part):
        pre, post = self.ctx.wire.scales()
        return _collective(_hvd.allreduce, _hvd.grouped_allreduce, part.payloads,
                           name=part.tag("dense"), op=self.ctx.wire.op, prescale_factor=pre,
                           postscale_factor=post, process_set=self.ctx.wire.process_set)

    def average(self, part, got):
        return [tf.cast(avg, tf.float32) for avg in got]

    def correction(self, part, got):
        return {i: Correction(NO_RECORDS, avg.numpy().astype(np.float32, copy=False)
                              - mine.astype(np.float32, copy=False), NO_RECORDS)
                for i, mine, avg in zip(part.members, part.payloads, got)}


class RecordsPath(_Path):
    """Records ``[index | value]`` as the compressor makes them (int32 pairs; fp16
    values: 6 bytes), every rank's k to every rank by one allgather, each summing them:
    the base of the paths that add records up in flight (region reduce) or select from
    a slice (hierarchical DGC). The allgather path itself codes its records
    (``AllgatherPath``)."""

    def record_bytes(self):
        return self.ctx.compressor.record_bytes

    def held(self, i):
        """The elements of tensor i this rank's memory holds and selects from."""
        return self.ctx.numel(i)

    def offset(self, i):
        """Where in tensor i the memory's first element lies."""
        return 0

    def select(self, i, v, k, at):
        """The indices and values to send; the memory forgets them; counted."""
        ctx = self.ctx
        indices = ctx.compressor.select(v, k, at.seed)
        values = tf.gather(v, indices)
        ctx.memory.sent(i, indices, mask_momentum=at.density <= ctx.mask_limit)
        self.count(i, k, tf.size(indices, out_type=tf.int64))
        return indices, values

    def count(self, i, k, sent):
        """``sent`` records selected, counted as ``k`` records' bytes: ``_padded`` sends
        that many."""
        slots = tf.maximum(tf.cast(k, tf.int64), sent)
        self.ctx.statistics.count(self.kind, self.held(i), sent, self.record_bytes() * slots,
                                  SparseCompressor.INDEX_BYTES * slots)

    def take(self, i, v, k, at, poison=None):
        indices, values = self.select(i, v, k, at)
        if poison is not None:
            values = poisoned(values, poison)
        return _padded(SparseCompressor.pack(values * self.ctx.wire.scales()[0],
                                             indices + self.offset(i)), k)

    def take_own(self, i, v, k, at):
        indices, values = self.select(i, v, k, at)
        indices += self.offset(i)
        pre = self.ctx.wire.scales()[0]
        values = self.ctx.compressor.wire_values(values * pre) / pre  # as the others read it
        return Sent(_padded(SparseCompressor.pack(values * pre, indices), k),
                    _scattered(indices, values, self.ctx.numel(i)))

    def nothing(self, i, k, at):
        return Sent(SparseCompressor.pack(tf.zeros([1]), tf.zeros([1], tf.int32)),
                    tf.zeros([self.ctx.numel(i)]))

    def to_words(self, payload):
        return tf.reshape(payload, [-1])

    def from_words(self, words, i):
        return words.reshape(-1, 2)

    def spec(self, i):
        return tf.TensorSpec([None, 2], tf.int32)

    def launch(self, part):
        comp = self.ctx.compressor
        return _collective(_hvd.allgather, _hvd.grouped_allgather,
                           [comp.to_wire(p) for p in part.payloads], name=part.tag("sparse"),
                           process_set=self.ctx.wire.process_set)

    def collect(self, handle):
        return [self.ctx.compressor.from_wire(g) for g in handle]

    def average(self, part, got):
        scale = self.ctx.wire.gathered()
        return [self.ctx.compressor.scatter_sum(g, self.ctx.numel(i)) * scale
                for i, g in zip(part.members, got)]

    def correction(self, part, got):
        """As records: everyone's scaled, then this rank's negated."""
        pre, scale = self.ctx.wire.scales()[0], self.ctx.wire.gathered()
        return {i: Correction(np.concatenate([_scaled(everyone.numpy(), scale),
                                              _scaled(own, -1 / pre)]), NO_DENSE, NO_RECORDS)
                for i, own, everyone in zip(part.members, part.payloads, got)}


class AllgatherPath(RecordsPath):
    """Every rank's k records of a tensor to every rank (DGC's sparse allgather), coded
    as PyTorch's (positions.py): the positions in Elias-Fano or a bitmap, the values in
    ``value_bits`` (8 by default: float8 and the tensor's scale), what the rounding
    loses kept in the memory (error feedback); each rank decodes every rank's and sums
    them. A selection short of k (DGC's sends between ``window[0] k`` and k) is filled
    with positions it did not pick and the value 0, which add nothing: every rank sends
    the same size every step, and Horovod's response cache answers the negotiation
    (over a 100 ms link an allgather whose size changes from step to step waits 7 round
    trips, one of a fixed size 3: bench/results/round_trips.md). The dense tensors the
    plan folds in ride as their values alone (``Folded``, ``DensePath.fold``)."""

    kind = PathKind.ALLGATHER
    static_k = True

    def bits(self, i, k):
        """The bits of tensor i's values with k records (packing.gather_value_bits):
        whole where every element goes (density 1: dense averaging, exact)."""
        return gather_value_bits(self.ctx.compressor, 1.0 if k >= self.ctx.numel(i) else None)

    def block_bytes(self, i, k):
        """Tensor i's bytes on the wire with k records, or folded (``Folded``)."""
        if isinstance(k, Folded):
            return fold_block_bytes(self.ctx.numel(i), k.bits)
        return gather_block_bytes(self.ctx.numel(i), k, self.bits(i, k))

    def coded(self, i, v, k, at, poison=None):
        """What leaves the memory as bytes: ``(payload, positions, each value as the
        others read it)``, k records, the memory told, the statistics counted."""
        ctx, n, bits = self.ctx, self.ctx.numel(i), self.bits(i, k)
        indices, values = self.select(i, v, k, at)
        pre = ctx.wire.scales()[0]
        values = values * pre if poison is None else poisoned(values * pre, poison)
        positions, values = _filled(indices, values, n, k)
        if bits == 16:
            values = self._clamped(values, pre)
        payload, arrived = encode_records(positions, values, n, k, bits)
        if bits < 32:  # the rounding back into the memory (error feedback)
            ctx.memory.give_back(i, positions, tf.where(tf.math.is_finite(values),
                                                        (values - arrived) / pre, 0.0))
        return payload, positions, arrived / pre

    def _clamped(self, values, pre):
        """fp16 values within the dense wire's bound (hvd_dgc/fp16wire.py, as PyTorch's
        ``_half``): what lies beyond stays in the memory with the rounding."""
        bound = self.ctx.wire.fp16_bound() * pre
        finite = tf.math.is_finite(values)
        self.ctx.statistics.add_fp16_clipped(tf.math.count_nonzero(
            finite & (tf.abs(values) > bound), dtype=tf.int64))
        return tf.where(finite, tf.clip_by_value(values, -bound, bound), values)

    def count(self, i, k, sent):
        n = self.ctx.numel(i)
        self.ctx.statistics.count(self.kind, n, sent, self.block_bytes(i, k),
                                  index_bytes(n, k))

    def take(self, i, v, k, at, poison=None):
        return self.coded(i, v, k, at, poison)[0]

    def take_own(self, i, v, k, at):
        payload, positions, own = self.coded(i, v, k, at)
        return Sent(payload, _scattered(positions, own, self.ctx.numel(i)))

    def nothing(self, i, k, at):
        """k records of the value 0 (a dropped tensor: every rank joins alike)."""
        n, bits = self.ctx.numel(i), self.bits(i, k)
        payload, _ = encode_records(tf.range(k), tf.zeros([k]), n, k, bits)
        return Sent(payload, tf.zeros([n]))

    def to_words(self, payload):
        """The bytes as int32 words (zero-padded to a whole word)."""
        return tf.bitcast(tf.reshape(tf.pad(payload, [[0, -int(payload.shape[0]) % 4]]),
                                     [-1, 4]), tf.int32)

    def from_words(self, words, i):
        return words.view(np.uint8)

    def spec(self, i):
        return tf.TensorSpec([None], tf.uint8)

    def launch(self, part):
        return _collective(_hvd.allgather, _hvd.grouped_allgather, part.payloads,
                           name=part.tag("sparse"), process_set=self.ctx.wire.process_set)

    def collect(self, handle):
        return handle

    def average(self, part, got):
        scale = self.ctx.wire.gathered()
        return [self._sum(i, k, tf.reshape(g, [-1, self.block_bytes(i, k)])) * scale
                for i, k, g in zip(part.members, part.ks, got)]

    def _sum(self, i, k, rows):
        """The sum of every rank's records (``rows``: their bytes), dense, flat."""
        n = self.ctx.numel(i)
        if isinstance(k, Folded):
            return folded_sum(rows, n, k.bits)
        positions, values = decode_records(rows, n, k, self.bits(i, k))
        return tf.scatter_nd(tf.reshape(positions, [-1, 1]), tf.reshape(values, [-1]), [n])

    def correction(self, part, got):
        """As records: everyone's scaled, then this rank's negated (its payload is
        padded to whole words, as every rank's: ``to_words``)."""
        pre, scale = self.ctx.wire.scales()[0], np.float32(self.ctx.wire.gathered())
        out = {}
        for i, k, own, everyone in zip(part.members, part.ks, part.payloads, got):
            k, size = int(k), self.block_bytes(i, int(k))
            rows = tf.reshape(everyone, [-1, size + -size % 4])[:, :size]
            records = [self._records(i, k, rows, scale),
                       self._records(i, k, tf.constant(own[None, :size]), -1 / pre)]
            out[i] = Correction(np.concatenate(records), NO_DENSE, NO_RECORDS)
        return out

    def _records(self, i, k, rows, factor):
        positions, values = decode_records(rows, self.ctx.numel(i), k, self.bits(i, k))
        values = (values.numpy().reshape(-1) * np.float32(factor)).astype(np.float32)
        return np.stack([positions.numpy().reshape(-1).astype(np.int32),
                         values.view(np.int32)], axis=1)


@traced_once
def folded_sum(rows, n, bits):
    """The sum of every rank's folded values (``rows``: each rank's bytes, or all of
    them one after the other), dense, flat."""
    rows = tf.reshape(rows, [-1, fold_block_bytes(n, bits)])
    values = decode_values(rows, n, bits)
    return tf.scatter_nd(tf.reshape(tf.tile(tf.range(n), [tf.shape(rows)[0]]), [-1, 1]),
                         tf.reshape(values, [-1]), [n])


@traced_once
def _filled(indices, values, n, k):
    """A selection of at most k (``indices``, distinct, and their ``values``) as
    exactly k records in position order: the missing ones the first positions it did
    not pick, with the value 0."""
    picked = tf.scatter_nd(tf.reshape(indices, [-1, 1]), tf.ones_like(indices), [n])
    missing = k - tf.size(indices)
    free = tf.cast(tf.where(picked == 0)[:missing, 0], indices.dtype)
    taken = tf.tensor_scatter_nd_update(picked, tf.reshape(free, [-1, 1]),
                                        tf.ones_like(free))
    positions = tf.reshape(tf.cast(tf.where(taken > 0)[:, 0], tf.int32), [k])
    dense = tf.scatter_nd(tf.reshape(indices, [-1, 1]), values, [n])
    return positions, tf.gather(dense, positions)


class _RegionLaunch(NamedTuple):
    part: Part
    first: list     # region.OwnersRound per member
    results: list   # region.RegionResult per member, once advanced


class RegionPath(RecordsPath):
    """Region reduce (hvd_dgc/tensorflow/region.py, after Ok-Topk): records to the owners
    of N index regions (alltoall), their largest sums to everyone (allgather), both as
    the compressor puts them on the wire (fp16 values: 6 bytes). Values travel
    unscaled: the sums are formed once, on the owners. What an owner does not keep (and
    its kept sums' fp16 rounding) goes back into its own residual (error feedback)."""

    kind = PathKind.REGION
    gives_back = True

    def take(self, i, v, k, at, poison=None):
        indices, values = self.select(i, v, k, at)
        if poison is not None:  # inf is the largest sum: some owner keeps and sends it
            values = poisoned(values, poison)
        return SparseCompressor.pack(values, indices)

    def take_own(self, i, v, k, at):
        indices, values = self.select(i, v, k, at)
        values = self.ctx.compressor.wire_values(values)  # as the owner reads it
        return Sent(SparseCompressor.pack(values, indices),
                    _scattered(indices, values, self.ctx.numel(i)))

    def launch(self, part):
        ps, codec = self.ctx.wire.process_set, self.ctx.compressor
        first = [to_owners(r[:, 0], tf.bitcast(r[:, 1], tf.float32), part.ks[j], name, ps,
                           codec)
                 for j, (r, name) in enumerate(zip(part.payloads, part.each("region")))]
        return _RegionLaunch(part, first, [])

    def advance(self, handle):
        if handle.results:
            return
        ps, names = self.ctx.wire.process_set, handle.part.each("region")
        handle.results.extend(share_kept(first, self.ctx.numel(i), name, ps,
                                         self.ctx.compressor)
                              for i, first, name in zip(handle.part.members, handle.first,
                                                        names))

    def collect(self, handle):
        self.advance(handle)
        return handle.results

    def average(self, part, got):
        for i, res in zip(part.members, got):
            self.ctx.give_back(i, res.returned_indices, res.returned_values)
            self.ctx.statistics.add(bytes_sent=self.record_bytes() * res.kept,
                                    cause=RECORDS,
                                    positions=SparseCompressor.INDEX_BYTES * res.kept)
        return [res.total * self.ctx.wire.summed() for res in got]

    def correction(self, part, got):
        """A dense part (the sums less this rank's records), and the owner's give-back."""
        scale = np.float32(self.ctx.wire.summed())
        out = {}
        for i, own, res in zip(part.members, part.payloads, got):
            correction = res.total.numpy() * scale
            correction[own[:, 0]] -= own[:, 1].view(np.float32)  # this rank's: distinct
            returned = np.stack([res.returned_indices.numpy(),
                                 res.returned_values.numpy().view(np.int32)], axis=1)
            out[i] = Correction(NO_RECORDS, correction, returned,
                                self.record_bytes() * int(res.kept))
        return out


class HierarchicalPath(RecordsPath):
    """Hierarchical DGC for several hosts of several ranks each (Horovod's local_size > 1
    and cross_size > 1), as PyTorch's (hvd_dgc/torch/paths.py ``HierarchicalPath``): the
    dense gradient is summed inside the host first, over its fast links, and only
    sparse records cross between hosts.

    Round 1 (``accumulate``, in the step's graph): an alltoall among the host's L ranks
    (Horovod's global alltoall, nothing to other hosts) sends slice j of the clipped
    gradient to the host's j-th rank (the slices of hvd_dgc.aggregation.slices): a
    reduce-scatter, so each rank holds its host's sum of one slice, which its memory,
    built slice-sized (``held``), accumulates (momentum correction on it). Round 2: the
    allgather's path on that slice: its share of k (``ExchangePaths.replan``), records
    at the slice's ``offset``, one allgather of every rank's, summed alike by all.

    What a host did not send stays in the memory of the rank owning that slice. A host
    sends about k records across hosts where flat DGC's L ranks send L k
    (hvd_dgc/aggregation.py hierarchical_bytes). At density 1 every coordinate is sent:
    dense momentum SGD. Under delayed averaging round 1 stays in the step (a fast local
    link) and the allgather is delayed; this rank's own part is what it sent (its slice
    of its host's sum: over all ranks they add up to N x the average), as in PyTorch."""

    kind = PathKind.HIERARCHICAL
    reads_gradient = True

    def bounds(self, i):
        return host_slice(self.ctx.numel(i), self.ctx.wire.peers)

    def held(self, i):
        lo, hi = self.bounds(i)
        return hi - lo

    def offset(self, i):
        return self.bounds(i)[0]

    def accumulate(self, i, grad, poison=None):
        """Round 1: the host's sum of this rank's slice of tensor i's clipped gradient,
        into its memory; returns the memory's ``v``. ``poison``: this rank's gradient is
        not finite; it sends inf, so its host's sums and then every rank see it."""
        ctx, peers, ps = self.ctx, self.ctx.wire.peers, self.ctx.wire.process_set
        g = local_gradient(grad, ctx.clip_norm, ctx.wire.world())
        if poison is not None:
            g = poisoned(g, poison)
        splits = np.zeros([ps.size()], np.int32)
        for rank, (lo, hi) in zip(peers, slices(ctx.numel(i), len(peers))):
            splits[rank] = hi - lo  # the slices lie in order: g is sent as it is
        got, _ = _hvd.alltoall(g, splits=tf.constant(splits), name=f"hvd_dgc.{i}.local",
                               process_set=ps)
        host = tf.reduce_sum(tf.reshape(got, [len(peers), self.held(i)]), 0)  # rank order
        return ctx.memory.accumulate(i, host)

    def nothing(self, i, k, at):
        raise AssertionError("a rank on hierarchical DGC always joins its host's alltoall "
                             "(ExchangePaths.take_own sends zeros for a dropped tensor)")


class ExchangePath(_Path):
    """A compressor that runs its own collectives (collective.py: PowerSGD, sign, QSGD,
    bf16); the memory keeps what it did not send (error feedback)."""

    kind = PathKind.EXCHANGE

    @staticmethod
    def slots(compressor, planner):
        """The compressor's per-tensor state (PowerSGD's Q, made at build, outside any
        trace) for the tensors that take this path, or None where none does."""
        taking = [PathKind.EXCHANGE in planner.stage_paths(t) for t in planner.tensors]
        if not any(taking):
            return None
        return [compressor.slot(t.shape, t.name, planner.world_size) if takes else None
                for t, takes in zip(planner.tensors, taking)]

    def synchronous(self, i, v, k, at, poison=None):
        """Every round in the compressor's own call (PowerSGD's second round needs its
        first's result, so what it sent is known only at the end)."""
        ctx, numel = self.ctx, self.ctx.numel(i)
        send = v if poison is None else poisoned(v, poison)
        res = ctx.compressor.exchange(send, ctx.tensors[i].shape, ctx.slots[i],
                                      Comm(ctx.wire.process_set, f"hvd_dgc.{i}"), at)
        ctx.memory.keep(i, v - res.sent)  # error feedback
        ctx.statistics.count(self.kind, numel, numel, res.bytes)
        return ctx.wire.result(res.mean)

    def take_own(self, i, v, k, at):
        """A one-round compressor (``sent_at_launch``): its payload and what it stands for."""
        ctx, numel = self.ctx, self.ctx.numel(i)
        payload, own = ctx.compressor.launch(v, at)
        ctx.memory.keep(i, v - own)  # error feedback
        ctx.statistics.count(self.kind, numel, numel, ctx.compressor.payload_bytes(numel))
        return Sent(payload, own)

    def nothing(self, i, k, at):
        zero = tf.zeros([self.ctx.numel(i)])
        return Sent(self.ctx.compressor.launch(zero, at)[0], zero)

    def to_words(self, payload):
        """A uint8 payload as int32 words (zero-padded)."""
        pad = -int(payload.shape[0]) % 4
        return tf.bitcast(tf.reshape(tf.pad(payload, [[0, pad]]), [-1, 4]), tf.int32)

    def from_words(self, words, i):
        return words.view(np.uint8)[:self.ctx.compressor.payload_bytes(self.ctx.numel(i))]

    def spec(self, i):
        return tf.TensorSpec([None], tf.uint8)

    def launch(self, part):
        return _collective(_hvd.allgather, _hvd.grouped_allgather, part.payloads,
                           name=part.tag("exchange"), process_set=self.ctx.wire.process_set)

    def correction(self, part, got):
        """Every rank decodes the payloads in rank order; own: this rank's, decoded."""
        comp, world = self.ctx.compressor, self.ctx.wire.world()
        out = {}
        for i, own, everyone in zip(part.members, part.payloads, got):
            n = self.ctx.numel(i)
            mean = self.ctx.wire.result(comp.finish(everyone, n, world))
            out[i] = Correction(NO_RECORDS, (mean - comp.decode(tf.constant(own), n)).numpy(),
                                NO_RECORDS)
        return out


class SignGroupPath(ExchangePath):
    """The sign's compressed allreduce (packing.sign_reduces), a stage's tensors on it in
    one exchange (quantize.py ``exchange_group``: one alltoall and one allgather for all
    of them, as PyTorch's launch): in the synchronous step's graph
    (``synchronous_group``), or on delayed averaging's threads, one exchange after
    another (``serial``: the owners read and write their server errors at each). There
    the graph signs each tensor's part of the group's rows (``take_own``: what the
    threads send; signed already, it signs to itself)."""

    serial = True

    def __init__(self, ctx, signs_at):
        super().__init__(ctx)
        self.signs_at = signs_at  # per stage, the tensors whose signs leave together

    def synchronous_group(self, members, vs, at, name, poison=None):
        """The sign's compressed allreduce of tensors ``members`` (their memories ``vs``)
        at once: one alltoall and one allgather for all of them, as PyTorch's launch
        (quantize.py ``exchange_group``)."""
        ctx = self.ctx
        sends = [v if poison is None else poisoned(v, poison) for v in vs]
        steps = ctx.compressor.exchange_group(
            sends, [ctx.tensors[i].shape for i in members], [ctx.slots[i] for i in members],
            Comm(ctx.wire.process_set, name), at)
        out = []
        for i, v, res in zip(members, vs, steps):
            ctx.memory.keep(i, v - res.sent)  # error feedback
            numel = ctx.numel(i)
            ctx.statistics.count(self.kind, numel, numel, res.bytes)
            out.append(ctx.wire.result(res.mean))
        return out

    def take_own(self, i, v, k, at):
        """Tensor i's part of its group's rows, signed, each segment with its own scale,
        and its share of the group's bytes."""
        ctx, numel = self.ctx, self.ctx.numel(i)
        own = self._by_stage(i, at, lambda members: self._signed(i, v, members))
        ctx.memory.keep(i, v - own)  # error feedback
        sent = self._by_stage(i, at, lambda members: tf.constant(
            sign_shares([ctx.numel(j) for j in members], ctx.wire.world())[
                members.index(i)], tf.int64))
        ctx.statistics.count(self.kind, numel, numel, sent)
        return Sent(own, own)

    def _by_stage(self, i, at, make):
        """``make(members)`` for tensor i's group at this step's stage (a
        ``tf.switch_case`` where its group differs by stage)."""
        groups = list(dict.fromkeys(m for m in self.signs_at if i in m))
        return by_stage([m if i in m else groups[0] for m in self.signs_at], at, make,
                        groups)

    def _signed(self, i, v, members):
        """Tensor i's signs, each of its segments in the group ``members``' chunks
        (aggregation.chunk_spans) times its mean |v|: as the rows arrive."""
        world, t = self.ctx.wire.world(), members.index(i)
        lengths = [hi - lo for chunk in chunk_spans([self.ctx.numel(j) for j in members],
                                                    world)
                   for owner, lo, hi in chunk if owner == t]
        if not lengths:
            return tf.zeros([0])
        ids = np.repeat(np.arange(len(lengths)), lengths)
        sums = tf.math.unsorted_segment_sum(tf.cast(tf.abs(v), tf.float64), ids, len(lengths))
        each = tf.gather(tf.cast(sums / np.asarray(lengths, np.float64), tf.float32), ids)
        return tf.where(v >= 0, each, -each)

    def nothing(self, i, k, at):
        zero = tf.zeros([self.ctx.numel(i)])
        return Sent(zero, zero)

    def to_words(self, payload):
        """The signed part as its float32 bits."""
        return tf.bitcast(payload, tf.int32)

    def from_words(self, words, i):
        return words.view(np.float32)

    def spec(self, i):
        return tf.TensorSpec([self.ctx.numel(i)], tf.float32)

    def launch(self, part):
        """The threads: the group as one compressed allreduce."""
        ctx = self.ctx
        return ctx.compressor.exchange_group(
            list(part.payloads), [ctx.tensors[i].shape for i in part.members],
            [ctx.slots[i] for i in part.members], Comm(ctx.wire.process_set, part.name),
            None)

    def correction(self, part, got):
        """Each tensor's mean, less what this rank sent."""
        return {i: Correction(NO_RECORDS, np.asarray(self.ctx.wire.result(step.mean)) - own,
                              NO_RECORDS)
                for i, own, step in zip(part.members, part.payloads, got)}


class SparseGradPath(_Path):
    """A ``tf.IndexedSlices`` gradient (an embedding lookup) as Horovod sends it: every
    rank's rows and indices allgathered, as they are (duplicates kept, so the optimizer
    sees what Horovod's would); rows / N for Average. No DGC and no residual: it is
    sparse already. With an SGD's momentum taken over, the memory's velocity applies
    the momentum the SGD would have applied to these slices (a dense gradient)."""

    kind = PathKind.SPARSE_GRAD

    def synchronous(self, i, grad, k, at, poison=None):
        ctx, wire = self.ctx, self.ctx.wire
        values = grad.values
        if poison is not None:
            values = poisoned(values, poison)
        name = f"hvd_dgc.{i}.slices"
        rows = _hvd.allgather(values, name=name + ".values", process_set=wire.process_set)
        indices = _hvd.allgather(grad.indices, name=name + ".indices",
                                 process_set=wire.process_set)
        if wire.op == Average:
            rows = rows / tf.cast(wire.world(), rows.dtype)
        sent = tf.size(values, out_type=tf.int64)
        index_bytes = tf.size(grad.indices, out_type=tf.int64) * grad.indices.dtype.size
        numel, shape = ctx.numel(i), ctx.tensors[i].shape  # counted against dense fp32
        ctx.statistics.count(self.kind, numel, sent, sent * values.dtype.size + index_bytes)
        dense_shape = grad.dense_shape if grad.dense_shape is not None else \
            tf.constant(shape, tf.int64)
        avg = tf.IndexedSlices(rows, indices, dense_shape)
        if not ctx.memory.sgd_momentum:
            return avg
        g = tf.reshape(tf.cast(tf.convert_to_tensor(avg), tf.float32), [-1])
        return tf.reshape(ctx.memory.velocity(i, g), shape)


#: every way a tensor travels in TensorFlow
PATH_CLASSES = (SparseGradPath, ExchangePath, AllgatherPath, RegionPath, HierarchicalPath,
                DensePath)


class ExchangePaths:
    """One exchange's paths: an instance of each class, which one each tensor takes at
    each density stage, and which tensors leave together (``replan`` after an elastic
    reset). ``fusion_threshold``: bytes on the wire of one bucket (0: no buckets)."""

    def __init__(self, ctx, planner, fusion_threshold=0):
        self.ctx = ctx
        self.fusion_threshold = fusion_threshold
        self.by_kind = {cls.kind: cls(ctx) for cls in PATH_CLASSES}
        self.replan(planner)

    def compressed(self):
        """``(tensors, paths, stages)``: the tensors compressed at some stage, their
        compressed paths over all stages (each a graph of its own in the step), and the
        stages."""
        marks = [[kind != PathKind.DENSE for kind in paths] for paths in self.stages]
        return (sum(any(m) for m in marks), sum(map(sum, marks)),
                max((len(m) for m in marks), default=0))

    def replan(self, planner):
        densities = planner.densities()
        self.stages = [planner.stage_paths(t) for t in planner.tensors]
        self.ks = [tuple(self._k(t, planner, d, paths) for d in densities)
                   for t, paths in zip(planner.tensors, self.stages)]
        self.by_kind[PathKind.DENSE].folds = self._folds(planner, densities)
        self.shortcuts = self._shortcuts()
        # the sign's compressed allreduce: a stage's tensors on it leave together
        self.signs_together = self.ctx.slots is not None and \
            reduces_signs(self.ctx.compressor, planner.world_size)
        self.by_kind[PathKind.EXCHANGE] = SignGroupPath(self.ctx, [
            tuple(i for i, paths in enumerate(self.stages) if paths[s] == PathKind.EXCHANGE)
            for s in range(len(densities))]) if self.signs_together else \
            ExchangePath(self.ctx)
        self.ctx.memory.unsettle()  # (eager) a tensor that goes dense may hold a residual
        # per stage, {tensor: its bucket} (Planner.buckets, PyTorch's rule: consecutive
        # tensors in backward order, dense or by allgather, up to fusion_threshold bytes)
        order = list(reversed(planner.tensors))
        self.buckets = [planner.buckets(d, order, self.fusion_threshold) for d in densities]

    def _k(self, tensor, planner, density, paths):
        """Records tensor i sends at ``density``: the planner's k, or on hierarchical DGC
        (every stage: Planner.hierarchical) this rank's share for its slice."""
        k = planner.k(tensor, density)
        if paths[0] != PathKind.HIERARCHICAL:
            return k
        return slice_k(k, tensor.numel, self.by_kind[PathKind.HIERARCHICAL].held(tensor.key))

    def _folds(self, planner, densities):
        """Per dense tensor, per stage, the bits its values take where the synchronous
        step carries it in the allgathers (0: it does not): where some tensor takes the
        allgather and the cost model folds the stage's dense tensors together (PyTorch
        folds a launch's, AllgatherPath.absorb), in the allgather's bits
        (packing.folds_values; not in fp16, whose dense wire clamps). Delayed
        averaging's grouped launches keep them apart."""
        ctx = self.ctx
        if not getattr(ctx.compressor, "codes_positions", False):
            return {}
        folds = {}
        for s, density in enumerate(densities):
            bits = gather_value_bits(ctx.compressor, density)
            dense = [i for i, paths in enumerate(self.stages) if paths[s] == PathKind.DENSE]
            if dense and any(paths[s] in GATHERS for paths in self.stages) and \
                    folds_values(bits, ctx.dense_fp16) and bits != 16 and \
                    planner.prices.folds(sum(ctx.numel(i) for i in dense)):
                for i in dense:
                    folds.setdefault(i, [0] * len(densities))[s] = bits
        return {i: tuple(f) for i, f in folds.items()}

    def _shortcuts(self):
        """The tensors whose synchronous step takes DensePath.shortcut: dense at every
        stage and never folded, on an fp32 wire, averaged (the linearity it rests on
        holds for the mean: a sum would count a shared momentum N times), with SGD's
        momentum (Nesterov's adds the gradient after the momentum, which the average
        cannot give apart) and no Adam taken over (its scales precede the momentum)."""
        ctx, memory = self.ctx, self.ctx.memory
        if ctx.dense_fp16 or ctx.wire.op != Average or memory.nesterov or \
                memory.preconditioner is not None:
            return frozenset()
        folds = self.by_kind[PathKind.DENSE].folds
        return frozenset(i for i, stages in enumerate(self.stages)
                         if not ctx.tensors[i].sliced and i not in folds
                         and all(kind == PathKind.DENSE for kind in stages))

    def finish(self, averages):
        """The step's averages as the optimizer takes them, once the step is known to
        be kept: a shortcut tensor's average gradient with the momentum applied
        (DGCMemory.settle)."""
        out = list(averages)
        for i in sorted(self.shortcuts):
            if isinstance(out[i], tf.IndexedSlices):
                continue
            out[i] = tf.reshape(self.ctx.memory.settle(i, tf.reshape(out[i], [-1])),
                                tf.shape(out[i]))
        return out

    def kinds(self):
        """Every path some tensor may take."""
        return {kind for stages in self.stages for kind in stages}

    def gives_back(self):
        return any(self.by_kind[kind].gives_back for kind in self.kinds())

    def k(self, i, at):
        """The number of records tensor i sends at this step's stage."""
        return tf.gather(tf.constant(self.ks[i], tf.int32), at.stage)

    def choose(self, i, at, branch):
        """``branch(path, k)`` for tensor i's path and k at this step's stage, k a Python
        int where the path's payload has its size (``static_k``: the allgather's
        blocks), else this stage's k as a tensor: where they differ by stage, a
        ``tf.switch_case`` every rank takes alike."""
        options = [(kind, k if self.by_kind[kind].static_k else None)
                   for kind, k in zip(self.stages[i], self.ks[i])]

        def run(option):
            kind, k = option
            return branch(self.by_kind[kind], self.k(i, at) if k is None else k)
        return by_stage(options, at, run, sorted(
            set(options), key=lambda o: (ORDER.index(o[0]), o[1] or 0)))

    def synchronous(self, i, grad, at, poison=None):
        """Tensor i's average this step, shaped as ``grad``, in the step's graph."""
        if isinstance(grad, tf.IndexedSlices):  # sparse already: as Horovod sends it
            return self.by_kind[PathKind.SPARSE_GRAD].synchronous(i, grad, None, at, poison)
        if i in self.shortcuts:
            dense = self.by_kind[PathKind.DENSE]
            return tf.reshape(dense.alone(i, dense.shortcut(i, grad, poison), None),
                              tf.shape(grad))
        v = self.accumulate(i, grad, poison)
        out = self.choose(i, at, lambda path, k: path.synchronous(i, v, k, at, poison))
        return tf.reshape(out, tf.shape(grad))

    def accumulate(self, i, grad, poison=None):
        """Clip and accumulate tensor i's gradient: the memory's ``v``. A path that reads
        the gradient itself (hierarchical DGC, every stage: its memory is a slice of its
        host's sum) accumulates it its own way."""
        path = self.by_kind[self.stages[i][0]]
        if path.reads_gradient:
            return path.accumulate(i, grad, poison)
        return self.ctx.accumulate(i, grad)

    def step(self, grads, at, poison=None):
        """Every tensor's average this step (the synchronous step), in the step's graph:
        each tensor alone (``synchronous``), or where this stage's plan has buckets,
        a bucket's tensors in one grouped collective: one Horovod negotiation for all
        of them, as PyTorch's buckets (hvd_dgc/torch/scheduler.py). A ``tf.switch_case``
        on the stage, which every rank takes alike, where the buckets differ by stage."""
        if not any(self.buckets) and not self.signs_together:
            return [self.synchronous(i, g, at, poison) for i, g in enumerate(grads)]
        out = [self.synchronous(i, g, at, poison) if isinstance(g, tf.IndexedSlices)
               else None for i, g in enumerate(grads)]  # sparse already: no stage
        dense = [i for i, g in enumerate(out) if g is None]
        if len(self.buckets) == 1:
            averages = self._bucketed(grads, dense, 0, at, poison)
        else:
            averages = tf.switch_case(at.stage, [
                lambda s=s: self._bucketed(grads, dense, s, at, poison)
                for s in range(len(self.buckets))])
        for i, avg in zip(dense, averages):
            out[i] = tf.reshape(avg, tf.shape(grads[i]))
        return out

    def _bucketed(self, grads, members, s, at, poison):
        """The averages of tensors ``members`` at stage ``s`` (a Python int): by bucket
        where the plan has one, the sign's compressed allreduce's all together, else
        alone on the stage's path."""
        plan, averages, signs = self.buckets[s], {}, {}
        for i in members:
            if i in averages:
                continue
            bucket = plan.get(i)
            if self.signs_together and self.stages[i][s] == PathKind.EXCHANGE:
                signs[i] = self.accumulate(i, grads[i], poison)
            elif bucket is None and i in self.shortcuts:
                averages[i] = self.synchronous(i, grads[i], at, poison)
            elif bucket is None:
                path, k = self.by_kind[self.stages[i][s]], self.ks[i][s]
                averages[i] = path.synchronous(i, self.accumulate(i, grads[i], poison), k, at,
                                               poison)
            else:
                averages.update(zip(bucket, self._bucket(bucket, grads, s, at, poison)))
        if signs:
            averages.update(zip(signs, self.by_kind[PathKind.EXCHANGE].synchronous_group(
                tuple(signs), tuple(signs.values()), at, f"hvd_dgc.s{s}.signs", poison)))
        return [tf.reshape(averages[i], [-1]) for i in members]

    def _bucket(self, bucket, grads, s, at, poison):
        """One bucket's averages: the allgather's records and the folded dense tensors'
        in one grouped allgather, the other dense tensors in one grouped allreduce."""
        ctx, dense, gather = self.ctx, self.by_kind[PathKind.DENSE], \
            self.by_kind[PathKind.ALLGATHER]
        records, summed, ks = {}, {}, {}
        for i in bucket:
            if i in self.shortcuts:
                summed[i] = dense.shortcut(i, grads[i], poison)
                continue
            v = ctx.accumulate(i, grads[i])
            folded = dense.folds.get(i, (0,) * len(self.buckets))[s]
            if self.stages[i][s] == PathKind.ALLGATHER:
                ks[i] = self.ks[i][s]
                records[i] = gather.take(i, v, ks[i], at, poison)
            elif folded:
                ks[i] = Folded(folded)
                records[i] = dense.fold(i, v, folded, at, poison)
            else:
                summed[i] = dense.take(i, v, None, at, poison)
        averages, name = {}, f"hvd_dgc.s{s}.b{bucket[0]}"
        for path, payloads in ((gather, records), (dense, summed)):  # each one collective
            if payloads:
                part = Part(name, tuple(payloads), tuple(payloads.values()),
                            tuple(ks.get(i) for i in payloads))
                got = path.collect(path.launch(part))
                averages.update(zip(part.members, path.average(part, got)))
        return [averages[i] for i in bucket]

    def take_own(self, i, grad, at, dropped=None, exchanging=None):
        """Delayed averaging, in the step's graph: ``(payload as int32 words, own)``.
        ``dropped``: this rank's tensor i is not finite; it sends the path's nothing
        (every rank joins the same collectives) and its memory does not move.
        ``exchanging`` (``period`` > 1): False on a step between exchanges, which sends
        nothing and applies what the memory took in as its own (the words are empty)."""
        if dropped is not None and self.by_kind[self.stages[i][0]].reads_gradient:
            # its host's ranks wait for this rank's slices: it sends zeros (the others'
            # parts of the sums it owns still enter its memory)
            grad, dropped = tf.where(dropped, tf.zeros_like(grad), grad), None

        def run():
            v = self.accumulate(i, grad)
            return self.choose(i, at, lambda path, k: _words(path, path.take_own(i, v, k, at)))

        def drop():
            return self.choose(i, at, lambda path, k: _words(path, path.nothing(i, k, at)))

        def local():
            return tf.zeros([0], tf.int32), self.ctx.intake(i, grad)

        def local_drop():
            return tf.zeros([0], tf.int32), tf.zeros([self.ctx.numel(i)])
        if exchanging is not None:
            run = (lambda exchange=run: tf.cond(exchanging, exchange, local))
            drop = (lambda exchange=drop: tf.cond(exchanging, exchange, local_drop))
        return run() if dropped is None else tf.cond(dropped, drop, run)

    def groups(self, stage):
        """Delayed averaging's launch at ``stage`` (an int): ``(path, members, ks)`` per
        path used, in hvd_dgc.paths.ORDER, the same on every rank."""
        members = {}
        for i, stages in enumerate(self.stages):
            members.setdefault(stages[stage], []).append(i)
        return [(self.by_kind[kind], tuple(members[kind]),
                 np.asarray([self.ks[i][stage] for i in members[kind]], np.int32))
                for kind in ORDER if kind in members]


def by_stage(options, at, run, used):
    """``run(options[s])`` at this step's stage s: the graph holds one branch for each
    of ``used`` (the distinct options, in that order) and a ``tf.switch_case`` on the
    stage picks it, so every rank takes the same branch and joins the same
    collectives; where one option serves every stage, that branch alone."""
    if len(used) == 1:
        return run(used[0])
    codes = tf.constant([used.index(o) for o in options], tf.int32)
    return tf.switch_case(tf.gather(codes, at.stage), [lambda o=o: run(o) for o in used])


def host_slice(numel, peers):
    """``(start, stop)``: the slice of a tensor of ``numel`` elements this rank owns in
    hierarchical DGC, among its host's ``peers``."""
    return slices(numel, len(peers))[peers.index(_hvd.rank())]


#: the paths whose allgathers Horovod fuses with a folded dense tensor's
GATHERS = (PathKind.ALLGATHER, PathKind.HIERARCHICAL)


def _words(path, sent):
    return path.to_words(sent.payload), sent.own


def _collective(single, grouped, tensors, **kwargs):
    """One Horovod collective over ``tensors``: the op of one tensor (the synchronous
    step's, named per tensor), or the grouped op (delayed averaging's)."""
    if len(tensors) == 1:
        return [single(tensors[0], **kwargs)]
    return grouped(list(tensors), **kwargs)


def poisoned(x, poison):
    """``x`` as this rank sends it: all inf where ``poison`` (its gradient was not finite:
    every rank's sums show it, guard.py), else ``x`` itself. A branch, not an element-wise
    select: the usual step costs no pass over the payload (a dense tensor's is the whole
    velocity)."""
    return tf.cond(poison, lambda: tf.fill(tf.shape(x), tf.cast(float("inf"), x.dtype)),
                   lambda: x)


def _padded(records, k):
    """``records`` (int32 ``[count, 2]``, count <= k) as exactly ``k`` rows, the missing
    ones ``(index 0, value 0)``, which add nothing (PyTorch's AllgatherPath.records
    pads the same way). DGC's selection sends between ``window[0] k`` and ``k``; padded,
    every rank sends the same shape every step and Horovod's response cache answers the
    negotiation: over a 100 ms link an allgather whose size changes from step to step
    waits 7 round trips, one of a fixed size 3 (bench/results/round_trips.md)."""
    missing = tf.maximum(tf.cast(k, tf.int32) - tf.shape(records)[0], 0)
    return tf.pad(records, [[0, missing], [0, 0]])


def _scattered(indices, values, numel):
    return tf.scatter_nd(tf.expand_dims(indices, 1), values, [numel])


def _scaled(records, factor):
    """Records ``[index, value bits]`` with their values multiplied by ``factor``."""
    out = records.copy()
    out[:, 1] = (records[:, 1].view(np.float32) * np.float32(factor)).view(np.int32)
    return out
