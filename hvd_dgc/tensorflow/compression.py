"""Compressors for TensorFlow, subclassing Horovod's ``Compressor`` (what is sent).

The same choices as the PyTorch side (hvd_dgc/torch/compression.py): DGC's
sampled-threshold top-k and an exact top-k, each tensor packed into one
buffer so it costs one allgather. Records are int32 pairs ``[index,
bitcast(value)]``: an int32 tensor carries any float's bits untouched (a
float tensor carrying indices could see them flushed as denormals).

Written in TF ops with a dynamic ``k`` so a density that changes during
warm-up needs no retrace of the user's ``tf.function``.
"""

import tensorflow as tf
from horovod.tensorflow.compression import Compressor, FP16Compressor, NoneCompressor

from hvd_dgc._guard import called_from_horovod_allreduce, sparse_under_allreduce_error

__all__ = ["Compression", "DGCCompressor", "TopKCompressor", "is_sparse"]


class SparseCompressor(Compressor):
    """Base of the sparse compressors. Instances are hashable by their options, as
    Horovod's TF code keys on the compression it is given."""

    name = "sparse"
    value_bytes = 4
    record_bytes = 8

    def __init__(self, seed=0):
        self.seed = int(seed)

    def __call__(self, **options):
        """A copy with some options changed: ``Compression.dgc(sample_ratio=0.001)``."""
        merged = dict(self._options())
        merged.update(options)
        return type(self)(**merged)

    def _options(self):
        return {"seed": self.seed}

    def config(self):
        return (type(self).__name__, tuple(sorted(self._options().items())))

    def __hash__(self):
        return hash(self.config())

    def __eq__(self, other):
        return isinstance(other, SparseCompressor) and self.config() == other.config()

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


class DGCCompressor(SparseCompressor):
    """DGC's sampled threshold (Lin et al., ICLR 2018, Sec. 3.1, as its reference code):
    estimate the k-th largest magnitude from a random sample, keep what passes it;
    if more than ``window[1]*k`` pass, take the exact top-k of those candidates only;
    if fewer than ``window[0]*k`` pass, fall back to an exact top-k of the tensor."""

    name = "dgc"

    def __init__(self, seed=0, sample_ratio=0.01, window=(0.8, 1.3), min_sample=2048):
        super().__init__(seed)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio!r}")
        lo, hi = window
        if not 0.0 < lo <= 1.0 <= hi:
            raise ValueError(f"window must be (low, high) with 0 < low <= 1 <= high, got {window!r}")
        self.sample_ratio = float(sample_ratio)
        self.window = (float(lo), float(hi))
        self.min_sample = int(min_sample)

    def _options(self):
        opts = super()._options()
        opts.update(sample_ratio=self.sample_ratio, window=self.window,
                    min_sample=self.min_sample)
        return opts

    def select(self, flat, k, seed):
        n = int(flat.shape[0])
        magnitude = tf.abs(flat)
        num_samples = min(n, max(self.min_sample, -(-n * self.sample_ratio // 1)))
        num_samples = int(num_samples)
        if num_samples >= n:
            sample = magnitude
        else:
            positions = tf.random.stateless_uniform([num_samples], seed, 0, n, dtype=tf.int32)
            sample = tf.gather(magnitude, positions)
        kf = tf.cast(k, tf.float32)
        k_sample = tf.maximum(1, tf.cast(tf.math.ceil(num_samples * kf / n), tf.int32))
        threshold = tf.reduce_min(tf.math.top_k(sample, k_sample, sorted=False).values)
        candidates = tf.cast(tf.where(magnitude >= threshold)[:, 0], tf.int32)
        count = tf.cast(tf.shape(candidates)[0], tf.float32)

        def exact():
            return tf.math.top_k(magnitude, k, sorted=False).indices

        def trim():
            top = tf.math.top_k(tf.gather(magnitude, candidates), k, sorted=False).indices
            return tf.gather(candidates, top)

        return tf.case([(count < self.window[0] * kf, exact),
                        (count > self.window[1] * kf, trim)],
                       default=lambda: candidates)


def is_sparse(compression):
    return isinstance(compression, SparseCompressor)


class Compression:
    """Horovod's ``none`` and ``fp16``, plus DGC's sparse compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
    dgc = DGCCompressor()
    topk = TopKCompressor()
