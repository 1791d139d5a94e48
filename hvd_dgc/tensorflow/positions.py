"""A tensor's selected positions as bytes, coded near their information content: Elias-Fano
or a bitmap, whichever is smaller (the format and its sizes: hvd_dgc/packing.py; the
NumPy reference this is held to: tests/reference.py ``encode_positions``), in graph ops.
The same module, with the same functions, is hvd_dgc/torch/positions.py. Not yet used by
a path: the wire still carries int32 positions."""

import tensorflow as tf

from hvd_dgc.packing import elias_fano_low_bits, index_code

__all__ = ["encode_positions", "decode_positions"]


def _bytes_of(bits):
    """int32 bits (any length) -> uint8 bytes, least significant bit first."""
    bits = tf.pad(bits, [[0, -int(bits.shape[0]) % 8]])
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(bits, [-1, 8]),
                                                       tf.range(8)), axis=1), tf.uint8)


def _bits_of(blob):
    return tf.reshape(tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.reshape(tf.cast(blob, tf.int32), [-1, 1]), tf.range(8)), 1), [-1])


def encode_positions(positions, n):
    """``positions`` (sorted, distinct, in 0..n-1; an integer tensor of static length k)
    as a uint8 tensor of ``packing.index_bytes(n, k)`` bytes."""
    p = tf.cast(tf.reshape(positions, [-1]), tf.int64)
    k = int(p.shape[0])
    if index_code(n, k) == "bitmap":
        return _bytes_of(tf.scatter_nd(tf.reshape(p, [-1, 1]), tf.ones([k], tf.int32), [n]))
    low = elias_fano_low_bits(n, k)
    lows = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.reshape(p, [-1, 1]), tf.range(low, dtype=tf.int64)), 1)  # position i: [i L, ..)
    at = tf.bitwise.right_shift(p, low) + tf.range(k, dtype=tf.int64)
    high = tf.scatter_nd(tf.reshape(at, [-1, 1]), tf.ones([k], tf.int32),
                         [k + ((n - 1) >> low) + 1])
    return _bytes_of(tf.concat([tf.cast(tf.reshape(lows, [-1]), tf.int32), high], 0))


def decode_positions(blob, n, k):
    """Inverse of ``encode_positions``: the k sorted positions (int64)."""
    bits = _bits_of(blob)
    if index_code(n, k) == "bitmap":
        return tf.reshape(tf.where(bits[:n] > 0), [-1])
    low = elias_fano_low_bits(n, k)
    lows = tf.reduce_sum(tf.bitwise.left_shift(
        tf.cast(tf.reshape(bits[:k * low], [k, low]), tf.int64),
        tf.range(low, dtype=tf.int64)), axis=1)
    ones = tf.reshape(tf.where(bits[k * low:] > 0), [-1])[:k]
    return tf.bitwise.bitwise_or(
        tf.bitwise.left_shift(ones - tf.range(k, dtype=tf.int64), low), lows)
