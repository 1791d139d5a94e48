"""Quantising compressors for TensorFlow: EF-SignSGD, QSGD and bfloat16.

The payloads are byte for byte PyTorch's (hvd_dgc/torch/quantize.py; layouts and
sizes in hvd_dgc/packing.py), so either framework decodes the other's. Each rank's
payload is allgathered (Horovod 0.28.1 cannot sum them: sign and QSGD carry
per-rank scales, and it has no bfloat16 allreduce) and every rank decodes and
averages them all in rank order: every rank gets the same average, bit for bit.
Error feedback as in PyTorch: the memory keeps ``v - decode(encode(v))``
(hvd_dgc/tensorflow/paths.py, ExchangePath), momentum correction
included with the Keras SGD.
"""

import tensorflow as tf

from hvd_dgc.aggregation import sign_rows
from hvd_dgc.packing import SCALE_BYTES, check_qsgd, check_sign_collective, level_bits, \
    num_buckets, plane_bytes, qsgd_payload_bytes, sign_payload_bytes, sign_reduces, sign_shares
from hvd_dgc.tensorflow.collective import ExchangeCompressor, Step

__all__ = ["GatherCompressor", "SignCompressor", "QSGDCompressor", "BF16Compressor",
           "pack_planes", "unpack_planes"]



def _shifts():
    """0..7, made when used: a tensor made at import would start TF's runtime before the
    script sets its threading."""
    return tf.range(8, dtype=tf.int32)


def pack_planes(codes, width):
    """Codes of ``width`` bits (an integer tensor) -> ``width`` bit planes of
    ceil(n/8) uint8 each (plane j holds bit j of every code, 8 codes a byte)."""
    n = int(codes.shape[0])
    padded = tf.pad(tf.cast(codes, tf.int32), [[0, plane_bytes(n) * 8 - n]])
    groups = tf.reshape(padded, [-1, 8])
    planes = [tf.reduce_sum(tf.bitwise.left_shift(tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(groups, j), 1), _shifts()), axis=1) for j in range(width)]
    return tf.cast(tf.concat(planes, 0), tf.uint8)


def unpack_planes(packed, width, n):
    """Inverse of ``pack_planes``: the first ``n`` codes as int32."""
    bits = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.reshape(tf.cast(packed, tf.int32), [width, -1, 1]), _shifts()),
        1)
    bits = tf.reshape(bits, [width, -1])[:, :n]
    return tf.add_n([tf.bitwise.left_shift(bits[j], j) for j in range(width)])


def _float_bytes(t):
    return tf.reshape(tf.bitcast(tf.reshape(tf.cast(t, tf.float32), [-1, 1]), tf.uint8), [-1])


def _floats(raw):
    return tf.bitcast(tf.reshape(raw, [-1, SCALE_BYTES]), tf.float32)


class GatherCompressor(ExchangeCompressor):
    """One allgather of per-rank uint8 payloads, decoded and averaged on every rank.
    Subclasses give ``payload_bytes(n)``, ``encode(flat, seed)`` and ``decode(payload,
    n)``. Horovod's own allreduce cannot carry them: a clear error if it is given one."""

    summable_why = ("its payloads carry per-rank scales (or need a bfloat16 kernel), so "
                    "summing them is meaningless; they are allgathered and decoded")

    sent_at_launch = True

    def exchange(self, v, shape, slot, comm, at):
        n = int(v.shape[0])
        payload, sent = self.launch(v, at)
        mean = self.finish(comm.allgather(payload, "exchange"), n, comm.size())
        return Step(mean, sent, tf.constant(self.payload_bytes(n), tf.int64))

    def launch(self, v, at):
        """This rank's payload and what it stands for (the memory keeps ``v - sent``)."""
        payload = self.encode(v, at.seed)
        return payload, self.decode(payload, int(v.shape[0]))

    def finish(self, gathered, n, world):
        """Mean of the decoded payloads of ``world`` ranks, allgathered (``gathered``: their
        concatenation), in rank order."""
        rows = tf.reshape(gathered, [world, self.payload_bytes(n)])
        total = self.decode(rows[0], n)
        for r in range(1, world):
            total = total + self.decode(rows[r], n)
        return total / world


class SignCompressor(GatherCompressor):
    """EF-SignSGD / 1-bit SGD (Seide et al. 2014; Karimireddy et al., ICML 2019): sign(p)
    at one bit per element and the scale ||p||_1 / n; decodes to scale * sign(p). The
    residual p - scale * sign(p) is what makes it converge.

    ``collective`` as PyTorch's (hvd_dgc/torch/quantize.py): "auto" (the default) sends
    it from 3 ranks as 1-bit Adam's compressed allreduce (``exchange``), byte for byte
    PyTorch's; "allgather" or "allreduce" forces one. A step's tensors go in one
    exchange (``exchange_group``): in the synchronous step's graph, or with ``delay`` or
    ``period`` on delayed averaging's threads (paths.py ``SignGroupPath``)."""

    name = "sign"

    def __init__(self, seed=0, collective="auto"):
        super().__init__(seed)
        self.collective = check_sign_collective(collective)

    def _options(self):
        return {"seed": self.seed, "collective": self.collective}

    def payload_bytes(self, n):
        return sign_payload_bytes(n)

    def encode(self, flat, seed=None):
        scale = tf.reduce_mean(tf.abs(flat))
        return tf.concat([_float_bytes(scale), pack_planes(tf.cast(flat >= 0, tf.int32), 1)], 0)

    def decode(self, payload, n):
        scale = _floats(payload[:SCALE_BYTES])[0]
        signs = tf.cast(unpack_planes(payload[SCALE_BYTES:], 1, n), tf.float32) * 2.0 - 1.0
        return signs * scale

    def slot(self, shape, name, world=1):
        """Where the compressed allreduce runs on ``world`` ranks, the server error of the
        chunk this rank averages: as long as the tensor (its chunk's share written,
        whatever the world), tracked so a checkpoint keeps it."""
        if not sign_reduces(self.collective, world):
            return None
        numel = 1
        for d in shape:
            numel *= int(d)
        return _ErrorSlot(tf.Variable(tf.zeros([numel]), trainable=False,
                                      name="sign_server_error"))

    def exchange(self, v, shape, slot, comm, at):
        """The compressed allreduce where ``sign_reduces`` (``exchange_group`` of this
        tensor alone); else the allgather of every rank's signs."""
        world = comm.size()
        if slot is None or not sign_reduces(self.collective, world):
            return super().exchange(v, shape, slot, comm, at)
        return self.exchange_group([v], [shape], [slot], comm, at)[0]

    def exchange_group(self, vs, shapes, slots, comm, at):
        """The compressed allreduce of a step's tensors (flat ``vs``) at once
        (aggregation.sign_rows, as PyTorch's launch): their chunks signed to their
        owners (an alltoall), this rank's chunk averaged, its server error (its part of
        each tensor's slot) added, signed again to every rank (an allgather). A
        ``Step`` per tensor, its bytes its share of the group's."""
        world, rank = comm.size(), comm.rank()
        numels = [int(v.shape[0]) for v in vs]
        rows = sign_rows(numels, world)
        segment = tf.constant(rows.segment, tf.int32)
        payloads, arrived = _sign_rows(tf.gather(tf.concat(list(vs) + [tf.zeros([1])], 0),
                                                 rows.gather), segment, rows.segment_lengths)
        sent = tf.split(tf.gather(tf.reshape(arrived, [-1]), rows.scatter), numels)
        width = int(payloads.shape[1])
        got = tf.reshape(comm.alltoall(tf.reshape(payloads, [-1]), [width] * world, "owners"),
                         [world, width])
        mine_segment = tf.tile(segment[rank:rank + 1], [world, 1])
        total = tf.reduce_sum(tf.cast(_unsign_rows(got, rows.length, mine_segment),
                                      tf.float64), 0)
        count, spans = int(rows.lengths[rank]), rows.spans[rank]
        error = tf.concat([slots[t].error[lo:hi] for t, lo, hi in spans] + [tf.zeros([0])], 0)
        average = tf.cast(total / world, tf.float32)[:count] + error
        mine, resigned = _sign_rows(tf.pad(average, [[0, rows.length - count]])[None],
                                    segment[rank:rank + 1], rows.segment_lengths[rank:rank + 1])
        everyone = tf.reshape(comm.allgather(tf.reshape(mine, [-1]), "gather"), [world, width])
        means = tf.split(tf.gather(tf.reshape(_unsign_rows(everyone, rows.length, segment),
                                              [-1]), rows.scatter), numels)
        kept = average - resigned[0, :count]
        # a step whose average is not finite (the guard skips it) keeps the errors it had
        finite = tf.reduce_all(tf.math.is_finite(tf.concat(means, 0)))
        at_ = 0
        for t, lo, hi in spans:
            slots[t].error[lo:hi].assign(tf.where(finite, kept[at_:at_ + hi - lo],
                                                  slots[t].error[lo:hi]))
            at_ += hi - lo
        return [Step(mean, own, tf.constant(share, tf.int64))
                for mean, own, share in zip(means, sent, sign_shares(numels, world))]


class _ErrorSlot(tf.Module):
    """One tensor's server error, tracked so a checkpoint keeps it."""

    def __init__(self, error):
        super().__init__(name="sign")
        self.error = error


def _sign_rows(rows, segment, segment_lengths):
    """Rows of chunks (zero past each one's length) as packing.sign_chunk_bytes lays them
    out: ``(payloads [rows, 4 S + ceil(length / 8)] uint8, the rows as they arrive)``;
    ``segment`` [rows, length] each element's segment, ``segment_lengths`` [rows, S]
    (NumPy) their lengths. A segment's scale is its mean |x|, summed in float64
    (PyTorch's ``_sign_rows``)."""
    count, length = int(rows.shape[0]), int(rows.shape[1])
    width_s = int(segment_lengths.shape[1])
    ids = segment + width_s * tf.range(count)[:, None]
    sums = tf.math.unsorted_segment_sum(tf.reshape(tf.cast(tf.abs(rows), tf.float64), [-1]),
                                        tf.reshape(ids, [-1]), count * width_s)
    scale = tf.cast(tf.reshape(sums, [count, width_s])
                    / tf.maximum(tf.constant(segment_lengths, tf.float64), 1.0), tf.float32)
    positive = rows >= 0  # (the padding too: 1 bits)
    width = plane_bytes(length)
    bits = tf.concat([tf.cast(positive, tf.int32),
                      tf.ones([count, width * 8 - length], tf.int32)], 1)
    packed = tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(bits, [count, width, 8]),
                                                 _shifts()), 2)
    scales = tf.reshape(tf.bitcast(scale, tf.uint8), [count, SCALE_BYTES * width_s])
    payloads = tf.concat([scales, tf.cast(packed, tf.uint8)], 1)
    each = tf.gather(scale, segment, batch_dims=1)
    return payloads, tf.where(positive, each, -each)


def _unsign_rows(payloads, length, segment):
    """Inverse of ``_sign_rows``: the rows as they arrive, from their payloads
    (``segment``: each row element's segment, as the rows were signed)."""
    count = tf.shape(payloads)[0]
    scale_bytes = int(payloads.shape[1]) - plane_bytes(length)
    scale = tf.bitcast(tf.reshape(payloads[:, :scale_bytes], [count, -1, SCALE_BYTES]),
                       tf.float32)  # [rows, S]
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.cast(payloads[:, scale_bytes:], tf.int32)[:, :, None], _shifts()), 1)
    positive = tf.reshape(bits, [count, -1])[:, :length] > 0
    each = tf.gather(scale, segment, batch_dims=1)
    return tf.where(positive, each, -each)


class QSGDCompressor(GatherCompressor):
    """QSGD (Alistarh et al., NeurIPS 2017): per bucket of ``bucket_size`` elements its
    L2 norm, and per element a sign and a level in 0..``levels`` rounded stochastically
    (E[decoded] = v). The default 128-element buckets keep it a contraction, which
    error feedback needs (hvd_dgc/torch/quantize.py). The noise is TF's stateless
    generator, seeded by (seed + step, rank): its own stream, not PyTorch's."""

    name = "qsgd"

    def __init__(self, levels=7, bucket_size=128, seed=0):
        check_qsgd(levels, bucket_size)
        super().__init__(seed)
        self.levels, self.bucket_size = levels, bucket_size

    def _options(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}

    def payload_bytes(self, n):
        return qsgd_payload_bytes(n, self.levels, self.bucket_size)

    def encode(self, flat, seed, noise=None):
        """``noise``: uniform [0, 1) of the buckets' shape (tests); else drawn from ``seed``."""
        n = int(flat.shape[0])
        rows = num_buckets(n, self.bucket_size)
        x = tf.reshape(tf.pad(flat, [[0, rows * self.bucket_size - n]]), [rows, -1])
        norms = tf.norm(x, axis=1)
        safe = tf.where(norms > 0, norms, 1.0)
        per_level = tf.where(norms > 0, self.levels / safe, 0.0)
        if noise is None:
            noise = tf.random.stateless_uniform(tf.shape(x), seed)
        level = tf.clip_by_value(tf.floor(tf.abs(x) * per_level[:, None] + noise), 0,
                                 self.levels)
        bits = level_bits(self.levels)
        codes = tf.bitwise.bitwise_or(tf.cast(level, tf.int32),
                                      tf.bitwise.left_shift(tf.cast(x < 0, tf.int32), bits))
        return tf.concat([_float_bytes(norms),
                          pack_planes(tf.reshape(codes, [-1])[:n], 1 + bits)], 0)

    def decode(self, payload, n):
        rows = num_buckets(n, self.bucket_size)
        norms = _floats(payload[:rows * SCALE_BYTES])
        bits = level_bits(self.levels)
        codes = unpack_planes(payload[rows * SCALE_BYTES:], 1 + bits, n)
        level = tf.cast(tf.bitwise.bitwise_and(codes, (1 << bits) - 1), tf.float32)
        sign = 1.0 - 2.0 * tf.cast(tf.bitwise.right_shift(codes, bits), tf.float32)
        step = tf.repeat(norms / self.levels, self.bucket_size)[:n]
        return level * sign * step


class BF16Compressor(GatherCompressor):
    """bfloat16: fp32's range, 8 bits of mantissa, 2 bytes an element; its rounding error
    stays in the residual. Allgathered (Horovod 0.28.1 has no bfloat16 allreduce)."""

    name = "bf16"

    def payload_bytes(self, n):
        return 2 * n

    def encode(self, flat, seed=None):
        return tf.reshape(tf.bitcast(tf.cast(flat, tf.bfloat16), tf.uint8), [-1])

    def decode(self, payload, n):
        return tf.cast(tf.bitcast(tf.reshape(payload, [n, 2]), tf.bfloat16), tf.float32)
