"""Region reduce in TensorFlow: sparse aggregation whose bytes per worker stay flat as
workers are added (issue 15; the maths, its formulas and the NumPy reference are in
hvd_dgc/aggregation.py, after Ok-Topk, Shi et al., PPoPP 2022; hvd_dgc/torch/region.py
is the PyTorch side, and both are tested against that reference).

The tensor's index space is cut into R = N regions, or KEEP k where that is fewer
(hvd_dgc.aggregation.regions), rank j owning the indices i with i mod R = j
(interleaved; hvd_dgc.aggregation.region_of says why). One alltoall sends each record
to its region's owner; the owner sums what it got, in source-rank order, and keeps its
``quota = ceil(KEEP k / R)`` largest sums (ties: lower index); one
allgather shares the kept ones, so every rank builds the same update. What the owner
did not keep goes back into its own residual (the caller's ``give_back``): nothing is
lost. About 3k(N-1)/N records per worker, whatever N.

In graph ops, one tensor per call: the tensors of a step are independent ops of one
graph, so TensorFlow runs their collectives concurrently and Horovod negotiates them
together (as it does the allgathers of the other sparse path). Records are the sparse
compressors' ``[int32 index | float32 value bits]`` rows; with ``fp16_values`` they
travel as the compressor puts them on the wire (6 bytes: ``to_wire`` / ``from_wire``)
in both rounds, and an owner's kept sums lose their fp16 rounding into its residual,
as on the PyTorch side.
"""

from typing import NamedTuple

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import global_process_set

from hvd_dgc.aggregation import KEEP
from hvd_dgc.tensorflow.compression import SparseCompressor

__all__ = ["OwnersRound", "RegionResult", "owners", "regions", "quota", "region_reduce",
           "to_owners", "share_kept"]


class RegionResult(NamedTuple):
    total: tf.Tensor             # flat float32 [numel]: the SUM over ranks (divide by N to average)
    returned_indices: tf.Tensor  # int32: this rank's region's sums it did not keep
    returned_values: tf.Tensor   # float32: ... and their values, for its residual
    kept: tf.Tensor              # int64 scalar: records this rank kept, as owner


def owners(indices, regions):
    """The rank owning each index (hvd_dgc.aggregation.region_of in graph ops);
    ``regions``: ``regions(k, N)``."""
    return tf.math.floormod(tf.cast(indices, tf.int64), regions)


def regions(k, world):
    """hvd_dgc.aggregation.regions for a k that is a tensor (it follows the warm-up)."""
    k = tf.cast(k, tf.int64)
    return tf.maximum(tf.constant(1, tf.int64), tf.minimum(tf.constant(int(world), tf.int64),
                                                           KEEP * k))


def quota(k, world):
    """hvd_dgc.aggregation.quota for a k that is a tensor (it follows the warm-up)."""
    k = tf.cast(k, tf.int64)
    return tf.maximum(tf.constant(1, tf.int64), -(-KEEP * k // regions(k, world)))


class OwnersRound(NamedTuple):
    """Region reduce after its first round: what this rank, as owner, keeps and sends on."""

    kept: tf.Tensor              # [count, 2] records: its largest sums
    returned_indices: tf.Tensor  # int32: its region's sums it did not keep
    returned_values: tf.Tensor   # float32
    count: tf.Tensor             # int64 scalar: records kept


#: The records' wire where no codec is given: float32 values, as they are.
_FLOAT32 = SparseCompressor()


def region_reduce(indices, values, numel, k, name, process_set=global_process_set,
                  codec=None):
    """Sum every rank's records ``(indices, values)`` of one flat tensor of ``numel``
    elements (each rank's indices distinct), each owner keeping ``quota(k, N)`` of its
    region's sums. Every rank of ``process_set`` calls it with the same ``numel``, ``k``
    and ``name``. ``codec``: the sparse compressor whose wire the records take (its
    ``to_wire``, ``from_wire`` and ``wire_values``; None: float32 values). Returns a
    ``RegionResult``; ``total`` is bit-identical on every rank."""
    return share_kept(to_owners(indices, values, k, name, process_set, codec), numel, name,
                      process_set, codec)


def to_owners(indices, values, k, name, process_set=global_process_set, codec=None):
    """Round 1: one alltoall sends each record to its region's owner, which sums what it
    got in source-rank order and keeps its ``quota(k, N)`` largest sums (rounded as
    they will travel; the rounding goes back with the sums it does not keep)."""
    codec = codec or _FLOAT32
    world = process_set.size()
    owner = owners(indices, regions(k, world))
    order = tf.argsort(owner, stable=True)
    splits = tf.math.bincount(tf.cast(owner, tf.int32), minlength=world, maxlength=world)
    records = SparseCompressor.pack(tf.gather(values, order), tf.gather(indices, order))
    got, _ = _hvd.alltoall(codec.to_wire(records), splits=splits, name=name + ".split",
                           process_set=process_set)
    got = codec.from_wire(got)
    # sum by index in the alltoall's order (source rank), as the reference does
    unique, inverse = tf.unique(got[:, 0])
    sums = tf.math.unsorted_segment_sum(tf.bitcast(got[:, 1], tf.float32), inverse,
                                        tf.size(unique))
    by_index = tf.argsort(unique, stable=True)
    unique, sums = tf.gather(unique, by_index), tf.gather(sums, by_index)
    # largest |sum| first; top_k puts the lower position, here the lower index, first on ties
    size = tf.size(unique, out_type=tf.int64)
    count = tf.cast(tf.minimum(quota(k, world), size), tf.int32)
    top = tf.math.top_k(tf.abs(sums), k=count, sorted=True).indices
    keep = tf.scatter_nd(tf.expand_dims(top, 1), tf.ones_like(top, tf.bool), tf.shape(unique))
    kept = tf.gather(sums, top)
    sent = codec.wire_values(kept)
    # what does not leave: the sums not kept, and the kept ones' rounding on the wire
    back = tf.tensor_scatter_nd_sub(sums, tf.expand_dims(top, 1), sent)
    rest = tf.logical_or(tf.logical_not(keep), tf.not_equal(back, 0.0))
    return OwnersRound(SparseCompressor.pack(sent, tf.gather(unique, top)),
                       tf.boolean_mask(unique, rest), tf.boolean_mask(back, rest),
                       tf.cast(count, tf.int64))


def share_kept(first, numel, name, process_set=global_process_set, codec=None):
    """Round 2: one allgather shares every owner's kept sums, so every rank builds the
    same total; owners' regions are disjoint, so the scatter has no order."""
    codec = codec or _FLOAT32
    everyone = codec.from_wire(_hvd.allgather(codec.to_wire(first.kept),
                                              name=name + ".gather", process_set=process_set))
    return RegionResult(SparseCompressor.scatter_sum(everyone, numel), first.returned_indices,
                        first.returned_values, first.count)
