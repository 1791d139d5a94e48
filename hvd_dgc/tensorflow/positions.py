"""A tensor's records as bytes, coded near their information content, in graph ops: the
positions in Elias-Fano or a bitmap, whichever is smaller, then the values in 8, 16 or 32
bits (the format and its sizes: hvd_dgc/packing.py; the NumPy reference this is held to:
tests/reference.py ``encode_positions`` and ``fp8_values``). The same module, with the
same functions, is hvd_dgc/torch/positions.py; TensorFlow's allgather path sends its
records so (paths.py ``AllgatherPath``). TensorFlow cannot bitcast float8, so the codes
are made from the float8 values' float32 bits and read back through a table."""

import numpy as np
import tensorflow as tf

from hvd_dgc.packing import FP8_MAX, SCALE_BYTES, elias_fano_low_bits, index_bytes, index_code

__all__ = ["encode_positions", "decode_positions", "decode_positions_many", "encode_records",
           "decode_records", "encode_values", "decode_values", "traced_once"]

FP8 = tf.dtypes.experimental.float8_e4m3fn


def traced_once(function):
    """``function`` (TF ops on tensors, plus Python numbers) as a ``tf.function``:
    traced once for each shape and Python argument, then one call in the step's graph
    however many tensors and density stages share it. A step's graph holds every
    stage's paths of every tensor, and a step that makes variables is traced twice:
    inline, each tensor's selection and code would be traced at every stage, each time."""
    return tf.function(function, autograph=False)


def _bytes_of(bits):
    """int32 bits (any length) -> uint8 bytes, least significant bit first."""
    bits = tf.pad(bits, [[0, -int(bits.shape[0]) % 8]])
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(bits, [-1, 8]),
                                                       tf.range(8)), axis=1), tf.uint8)


def encode_positions(positions, n, k=None):
    """``positions`` (sorted, distinct, in 0..n-1; an integer tensor of k of them, k
    its static length where not given) as a uint8 tensor of ``packing.index_bytes(n, k)``
    bytes."""
    p = tf.reshape(tf.cast(positions, tf.int64), [-1] if k is None else [k])
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
    return tf.reshape(decode_positions_many(tf.reshape(blob, [1, -1]), n, k), [-1])


def decode_positions_many(blobs, n, k):
    """``decode_positions`` of each row of ``blobs`` (rows of one length: every rank's
    code of k positions among n): ``(rows, k)`` int64. Each row holds exactly k ones
    where they are looked for, so ``tf.where`` finds them row after row."""
    bits = tf.reshape(tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.cast(blobs, tf.int32)[:, :, None], tf.range(8)), 1), [tf.shape(blobs)[0], -1])
    if index_code(n, k) == "bitmap":
        return tf.reshape(tf.where(bits[:, :n] > 0)[:, 1], [-1, k])
    low = elias_fano_low_bits(n, k)
    lows = tf.reduce_sum(tf.bitwise.left_shift(
        tf.cast(tf.reshape(bits[:, :k * low], [-1, k, low]), tf.int64),
        tf.range(low, dtype=tf.int64)), axis=2)
    ones = tf.reshape(tf.where(bits[:, k * low:] > 0)[:, 1], [-1, k])
    return tf.bitwise.bitwise_or(
        tf.bitwise.left_shift(ones - tf.range(k, dtype=tf.int64), low), lows)


def _fp8_table():
    """Every float8 e4m3 (``fn``: no infinities) code's value, by code (float32; 0x7f and
    0xff are NaN): 3 bits of mantissa, exponent bias 7, subnormals below 2**-6."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6,
                         (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    magnitude[(codes & 127) == 127] = np.nan
    return np.where(codes >= 128, -magnitude, magnitude).astype(np.float32)


_FP8_TABLE = _fp8_table()


def _fp8_codes(x):
    """The e4m3 code (uint8) of each float32 in ``x``, each a float8 value already (a
    cast to float8 and back) or NaN: from its float32 bits, sign, exponent and the top
    three bits of the mantissa; below 2**-6 a subnormal, 1/512 a step."""
    bits = tf.bitcast(x, tf.int32)
    sign = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 24), 128)
    magnitude = tf.abs(x)
    exponent = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 23), 255)
    normal = tf.bitwise.bitwise_or(
        tf.bitwise.left_shift(exponent - 120, 3),
        tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 20), 7))
    small = tf.cast(magnitude * 512.0, tf.int32)
    code = tf.bitwise.bitwise_or(tf.where(magnitude >= 2.0 ** -6, normal, small), sign)
    return tf.cast(tf.where(tf.math.is_nan(x), 127, code), tf.uint8)


def encode_values(values, bits):
    """One tensor's ``values`` (float32) in ``bits``: ``(bytes, each value as it
    arrives)``. 8: float8 e4m3 of value / scale (the largest finite magnitude / 448, 1
    where there is none), then the float32 scale, as PyTorch's ``encode_values``; a value
    that is not finite goes as NaN. 16: fp16 (the caller clamps); 32: as they are."""
    if bits == 32:
        return tf.reshape(tf.bitcast(values, tf.uint8), [-1]), values
    if bits == 16:
        half = tf.cast(values, tf.float16)
        return tf.reshape(tf.bitcast(half, tf.uint8), [-1]), tf.cast(half, tf.float32)
    finite = tf.math.is_finite(values)
    largest = tf.reduce_max(tf.concat([tf.where(finite, tf.abs(values), 0.0), [0.0]], 0))
    # a true division: in a graph, constant folding makes ``x / c`` a product by 1/c,
    # one ulp off the reference's scale (DivNoNan it leaves alone)
    scale = tf.where(largest > 0, tf.math.divide_no_nan(largest, FP8_MAX), 1.0)
    scaled = tf.where(finite, values / scale, float("nan"))
    rounded = tf.cast(tf.cast(scaled, FP8), tf.float32)
    codes = _fp8_codes(rounded)
    return tf.concat([codes, tf.bitcast(tf.reshape(scale, [1]), tf.uint8)[0]], 0), \
        rounded * scale


def decode_values(blobs, k, bits):
    """Inverse of ``encode_values`` for each row of ``blobs`` (its first bytes a row's k
    values): ``(rows, k)`` float32."""
    if bits == 32:
        return tf.bitcast(tf.reshape(blobs[:, :4 * k], [-1, k, 4]), tf.float32)
    if bits == 16:
        return tf.cast(tf.bitcast(tf.reshape(blobs[:, :2 * k], [-1, k, 2]), tf.float16),
                       tf.float32)
    scales = tf.bitcast(blobs[:, k:k + SCALE_BYTES], tf.float32)
    return tf.gather(_FP8_TABLE, tf.cast(blobs[:, :k], tf.int32)) * scales[:, None]


@traced_once
def encode_records(positions, values, n, k, bits):
    """k records as bytes: their ``positions`` (sorted, distinct, in 0..n-1) coded, then
    their ``values`` (``encode_values``): ``(bytes, each value as it arrives)``."""
    coded, arrived = encode_values(values, bits)
    return tf.concat([encode_positions(positions, n, k), coded], 0), arrived


@traced_once
def decode_records(blobs, n, k, bits):
    """Every row of ``blobs`` (each rank's bytes, one length) as ``encode_records``
    wrote k records first: ``(positions, values)``, ``(rows, k)`` each."""
    code = index_bytes(n, k)
    return decode_positions_many(blobs[:, :code], n, k), decode_values(blobs[:, code:], k, bits)

