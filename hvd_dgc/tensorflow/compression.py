"""Compressors for TensorFlow, subclassing Horovod's ``Compressor`` (what is sent).

The same choices as the PyTorch side (hvd_dgc/torch/compression.py): DGC's
sampled-threshold top-k and an exact top-k, with the same options. On the allgather
a tensor's records travel coded (positions.py: the positions in Elias-Fano or a
bitmap, the values in ``value_bits``: 8 by default, float8 and a scale, the rounding
kept in the memory). Region reduce and hierarchical DGC send records as int32 pairs
``[index, bitcast(value)]``: an int32 tensor carries any float's bits untouched (a
float tensor carrying indices could see them flushed as denormals). With
``fp16_values`` (Horovod's ``Compression.fp16`` sets it, as in PyTorch) such a record
travels as three int16s ``[index low, index high, fp16 bits]``: 6 bytes, as
PyTorch's; ``to_wire`` / ``from_wire`` convert around the collective.

Written in TF ops with a dynamic ``k`` so a density that changes during
warm-up needs no retrace of the user's ``tf.function``.
"""

import tensorflow as tf
from horovod.tensorflow.compression import Compressor, FP16Compressor, NoneCompressor

from hvd_dgc.config import CompressorOptions
from hvd_dgc.packing import check_value_bits
from hvd_dgc._guard import called_from_horovod_allreduce, sparse_under_allreduce_error
from hvd_dgc.sampling import DGCSampling
from hvd_dgc.tensorflow.powersgd import PowerSGDCompressor
from hvd_dgc.tensorflow.quantize import BF16Compressor, QSGDCompressor, SignCompressor
from hvd_dgc.tensorflow.positions import traced_once

__all__ = ["Compression", "DGCCompressor", "TopKCompressor", "PowerSGDCompressor",
           "SignCompressor", "QSGDCompressor", "BF16Compressor", "is_sparse"]


class SparseCompressor(CompressorOptions, Compressor):
    """Base of the sparse compressors. Options, copies and identity as PyTorch's
    (hvd_dgc/config.py): hashable by their options, as Horovod's TF code keys on the
    compression it is given; an option a compressor does not have is refused.

    Args:
        seed: seed of the selection's draws (ranks offset it by their rank).
        fp16_values: values as float16 (what Horovod's ``Compression.fp16`` turns on):
            the allgather's at most 16 bits, region reduce's and hierarchical DGC's
            6-byte records.
        value_bits: bits of each value the allgather sends: 8 (float8 e4m3 and a float32
            scale per tensor, what the rounding loses kept in the memory), 16 or 32; at
            most 16 with ``fp16_values``; whole at density 1.
    """

    name = "sparse"
    sparse = True  # selects records from the memory (hvd_dgc.paths.compressor_kind)
    codes_positions = True  # the allgather path codes its records (positions.py)
    codes_regions = False   # region reduce and hierarchical DGC send int32 records
    INDEX_BYTES = 4

    def __init__(self, seed=0, fp16_values=False, value_bits=8):
        self.seed = int(seed)
        self.fp16_values = bool(fp16_values)
        self.value_bits = check_value_bits(value_bits)

    def _options(self):
        return {"seed": self.seed, "fp16_values": self.fp16_values,
                "value_bits": self.value_bits}

    @property
    def value_bytes(self):
        return 2 if self.fp16_values else 4

    @property
    def record_bytes(self):
        return self.INDEX_BYTES + self.value_bytes

    def wire_values(self, values):
        """``values`` as the others will read them (float32): rounded to fp16 with
        ``fp16_values``, so what a rank counts as sent (delayed averaging's own) is
        what arrives."""
        if not self.fp16_values:
            return values
        return tf.cast(tf.cast(values, tf.float16), tf.float32)

    def to_wire(self, records):
        """Packed records as they travel: as they are, or [k, 3] int16 (fp16 values)."""
        if not self.fp16_values:
            return records
        index = tf.bitcast(records[:, 0], tf.int16)  # [k, 2]
        value = tf.bitcast(tf.cast(tf.bitcast(records[:, 1], tf.float32), tf.float16),
                           tf.int16)
        return tf.concat([index, value[:, None]], axis=1)

    def from_wire(self, wire):
        """Inverse of ``to_wire``: int32 [m, 2] records with float32 value bits."""
        if not self.fp16_values:
            return wire
        index = tf.bitcast(wire[:, :2], tf.int32)
        value = tf.cast(tf.bitcast(wire[:, 2], tf.float16), tf.float32)
        return tf.stack([index, tf.bitcast(value, tf.int32)], axis=1)

    def __repr__(self):
        return f"hvd_dgc.tensorflow.Compression.{self.name}"

    # Horovod's interface: only reached if Horovod's own allreduce path was given us.
    def compress(self, tensor):
        if called_from_horovod_allreduce(depth=2):
            raise sparse_under_allreduce_error(repr(self), "tensorflow")
        raise TypeError(f"{self!r} is used by hvd_dgc.tensorflow's DistributedGradientTape and "
                        f"keras.DistributedOptimizer, which call select/pack themselves.")

    def decompress(self, tensor, ctx):
        raise TypeError(f"{self!r}.decompress: use scatter_sum on the gathered records")

    # hvd_dgc's interface
    def select(self, flat, k, seed):
        """int32 indices of about ``k`` large-magnitude entries of ``flat`` (k a tensor)."""
        raise NotImplementedError

    @staticmethod
    def pack(values, indices):
        """One int32 [k, 2] buffer of (index, value bits) records."""
        bits = tf.bitcast(tf.cast(values, tf.float32), tf.int32)
        return tf.stack([tf.cast(indices, tf.int32), bits], axis=1)

    @staticmethod
    def scatter_sum(records, numel):
        """Sum of everybody's records as a dense flat float32 tensor (duplicates add)."""
        values = tf.bitcast(records[:, 1], tf.float32)
        return tf.scatter_nd(records[:, :1], values, [numel])


class TopKCompressor(SparseCompressor):
    """Exact top-k by magnitude."""

    name = "topk"

    def select(self, flat, k, seed):
        return tf.math.top_k(tf.abs(flat), k, sorted=False).indices


class DGCCompressor(SparseCompressor, DGCSampling):
    """DGC's sampled threshold (Lin et al., ICLR 2018, Sec. 3.1, as its reference code),
    the rule of PyTorch's CPU form (hvd_dgc/torch/compression.py): estimate the
    magnitude that ``window[1]*k`` entries pass from a random sample; if more than
    ``k`` pass, take the exact top-k of those candidates only; if fewer than
    ``window[0]*k`` pass, lower the threshold by ``threshold_decay``, at most
    ``max_adapt_rounds`` times, then fall back to an exact top-k. Between
    ``window[0]*k`` and ``k`` records: never more bytes than an exact top-k."""

    name = "dgc"

    def __init__(self, seed=0, sample_ratio=0.01, window=(0.8, 1.3), threshold_decay=0.8,
                 max_adapt_rounds=10, min_sample=2048, fp16_values=False, value_bits=8):
        SparseCompressor.__init__(self, seed, fp16_values, value_bits)
        DGCSampling.__init__(self, sample_ratio, window, threshold_decay, max_adapt_rounds,
                             min_sample)

    def _options(self):
        return dict(SparseCompressor._options(self), **self.sampling_options())

    @traced_once  # hundreds of tensors in every warm-up stage: positions.py
    def select(self, flat, k, seed):
        n = int(flat.shape[0])
        magnitude = tf.abs(flat)
        num_samples = int(min(n, max(self.min_sample, -(-n * self.sample_ratio // 1))))
        if num_samples >= n:
            sample = magnitude
        else:
            positions = tf.random.stateless_uniform([num_samples], seed, 0, n, dtype=tf.int32)
            sample = tf.gather(magnitude, positions)
        aim = self.window[1] * tf.cast(k, tf.float32)  # as PyTorch's: aim above k
        k_sample = tf.clip_by_value(tf.cast(tf.math.ceil(num_samples * aim / n), tf.int32),
                                    1, num_samples)
        threshold = tf.reduce_min(tf.math.top_k(sample, k_sample, sorted=False).values)
        return self.adapt(magnitude, k, threshold)

    def adapt(self, magnitude, k, threshold):
        """Indices of ``|flat|`` (``magnitude``) chosen from a first ``threshold``: the
        rounds of lowering, the window and the fallbacks of the class docstring."""
        low = self.window[0] * tf.cast(k, tf.float32)

        def passing(t):
            return tf.reduce_sum(tf.cast(magnitude >= t, tf.int32))

        def too_few(rounds, t, count):
            return tf.logical_and(tf.cast(count, tf.float32) < low,
                                  rounds < self.max_adapt_rounds)

        def lower(rounds, t, count):
            t = t * self.threshold_decay
            return rounds + 1, t, passing(t)

        _, threshold, count = tf.while_loop(too_few, lower,
                                            (tf.constant(0), threshold, passing(threshold)))
        candidates = tf.cast(tf.where(magnitude >= threshold)[:, 0], tf.int32)

        def exact():
            return tf.math.top_k(magnitude, k, sorted=False).indices

        def trim():
            top = tf.math.top_k(tf.gather(magnitude, candidates), k, sorted=False).indices
            return tf.gather(candidates, top)

        return tf.case([(count > k, trim), (tf.cast(count, tf.float32) < low, exact)],
                       default=lambda: candidates)


def is_sparse(compression):
    return isinstance(compression, SparseCompressor)


class Compression:
    """Horovod's ``none`` and ``fp16``, DGC's sparse compressors, PowerSGD and the
    quantisers (hvd_dgc/tensorflow/collective.py: their own collectives, error feedback)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    dgc = DGCCompressor()
    topk = TopKCompressor()
    powersgd = PowerSGDCompressor()
    sign = SignCompressor()
    qsgd = QSGDCompressor()
    bf16 = BF16Compressor()
