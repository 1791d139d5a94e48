"""PowerSGD (Vogels et al., NeurIPS 2019) for TensorFlow: rank-r compression by one power
iteration, the maths of hvd_dgc/torch/powersgd.py in graph ops::

    P = M Q          allreduce(P, Sum)      P <- orthonormal columns of P
    Q = M^T P        allreduce(Q, Average)  average ~ P Q^T

M is the tensor viewed as shape[0] x the rest. Q lives in a tf.Variable per tensor
(warm start: the checkpoint keeps it), drawn at first from TF's stateless normal
seeded by the compressor's seed and the variable's name, alike on every rank (its
own stream: PyTorch's generator draws other numbers). Error feedback: the memory
keeps M - P Q^T. Dense allreduce before ``start_iter``; a tensor is compressed only
where (n + m) r min_rate < n m (1-D tensors never).
"""

import zlib

import tensorflow as tf

from hvd_dgc.lowrank import LowRankPlan
from hvd_dgc.tensorflow.collective import Average, ExchangeCompressor, Step, Sum

__all__ = ["PowerSGDCompressor", "orthogonalize"]


def orthogonalize(matrix, epsilon=0.0):
    """``matrix`` (rows x r) with orthonormal columns: Gram-Schmidt for r <= 2 (as
    PyTorch's, column by column in the same order), QR above (same subspace)."""
    r = int(matrix.shape[1])
    if r > 2:
        return tf.linalg.qr(matrix).q
    cols = [matrix[:, j:j + 1] for j in range(r)]
    for i in range(r):
        cols[i] = cols[i] / (tf.norm(cols[i], axis=0, keepdims=True) + epsilon)
        for j in range(i + 1, r):
            cols[j] = cols[j] - tf.reduce_sum(cols[i] * cols[j], axis=0, keepdims=True) * cols[i]
    return tf.concat(cols, axis=1)


class PowerSGDCompressor(LowRankPlan, ExchangeCompressor):
    """PowerSGD with error feedback and warm start; the options of PyTorch's
    ``Compression.powersgd`` (rank, start_iter, min_rate, warm_start, epsilon, seed)."""

    name = "powersgd"

    def __init__(self, rank=1, start_iter=1000, min_rate=2.0, warm_start=True, epsilon=1e-8,
                 seed=0):
        super().__init__(seed)
        self._set_plan(rank, start_iter, min_rate, warm_start, epsilon)

    def compressible(self, shape, step=None):  # the start is decided in the graph
        return self.saves(shape)

    def _seed(self, name):
        return [self.seed, zlib.crc32(name.encode()) & 0x7FFFFFFF]

    def slot(self, shape, name, world=1):
        """Q (m x r): the warm start, every rank's first one alike."""
        n, m = self.matrix_shape(shape)
        first = tf.random.stateless_normal([m, self.effective_rank(shape)], self._seed(name))
        return _QSlot(tf.Variable(first, trainable=False, name="powersgd_q"), self._seed(name))

    def exchange(self, v, shape, slot, comm, at):
        n, m = self.matrix_shape(shape)
        r = self.effective_rank(shape)

        def dense():  # early training: sensitive to compression (start_iter)
            mean = comm.allreduce(v, "dense", Average)
            return Step(mean, v, tf.constant(4 * n * m, tf.int64))

        def power():
            matrix = tf.reshape(v, [n, m])
            if self.warm_start:
                q = slot.q.read_value()
            else:  # a fresh Q every step
                q = tf.random.stateless_normal([m, r], [slot.seed[0] ^ slot.seed[1], at.step])
            q = orthogonalize(q, self.epsilon)
            p = comm.allreduce(tf.matmul(matrix, q), "p", Sum)
            p = orthogonalize(p, self.epsilon)
            q = comm.allreduce(tf.matmul(matrix, p, transpose_a=True), "q", Average)
            if self.warm_start:  # an overflowed step keeps the last Q
                slot.q.assign(tf.where(tf.reduce_all(tf.math.is_finite(q)), q, slot.q))
            approx = tf.reshape(tf.matmul(p, q, transpose_b=True), [-1])
            return Step(approx, approx, tf.constant(self.wire_bytes(shape), tf.int64))

        if self.start_iter == 0:
            return power()
        return tf.cond(at.step >= self.start_iter, power, dense)


class _QSlot(tf.Module):
    """One tensor's Q, tracked so a checkpoint keeps the warm start."""

    def __init__(self, q, seed):
        super().__init__(name="powersgd")
        self.q = q
        self.seed = tuple(seed)
