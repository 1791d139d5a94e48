"""The outer loop in TensorFlow/Keras (hvd_dgc/outer.py says what and why).

``hvd_dgc.tensorflow.keras.DistributedOptimizer(opt, outer=hvd_dgc.OuterLoop(steps=H))``
returns the user's optimizer class whose step (Keras 3 ``apply``, Keras 2
``apply_gradients``) runs it on this rank's own gradients, with no collective; every
H-th step ends a round, traced into the same step (``tf.cond``: every rank counts alike,
so every rank takes the same branch and joins the same collectives)::

    d = start - x                        this rank's change in the round (per variable)
    v = beta v + d                       this rank's residual (error feedback; beta:
                                         residual_decay, 1 by default)
    send the density's largest |v| of each variable (records), v -= what was sent
    a = sum of every rank's records / N  (density 1.0: an allreduce of d, flat)
    anchor -= lr * outer step(a)         Nesterov momentum, the same on every rank
    x = anchor                           every rank starts the next round alike

``overlap=True``: a TF step cannot leave a collective in flight, so the round's payload
goes to a worker thread (``tf.py_function``, as hvd_dgc/tensorflow/delayed.py does) whose
collectives run during the next round's inner steps; the end of that round waits for the
average and applies it, a round late, and each rank goes on from the shared weights
plus its own latest change (hvd_dgc/outer.py). A checkpoint is refused while an
exchange is in flight (``flush()`` first).

The shared weights start as rank 0's (one broadcast at the first step): Horovod's Keras
callback and its TF2 examples broadcast after the first batch, so the weights a rank
holds at its first step may still be its own. The state is a ``tf.Module``
(``optimizer.dgc_state``: put it in ``tf.train.Checkpoint``; Keras 2 also saves it with
the optimizer); ``hvd.elastic.KerasState`` commits it and a rank that joins takes rank
0's round (hvd_dgc/tensorflow/elastic.py); with ``overlap`` every commit flushes first
and a restore drops what was in flight, as with delayed averaging.
"""

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Average

from hvd_dgc.consistency import check_consistent, outer_consistency
from hvd_dgc.outer import RecordLayout, outer_stats, outer_step, round_bytes, round_ks
from hvd_dgc.tensorflow.delayed import check_inter_op_threads
from hvd_dgc.tensorflow.names import tensor_names
from hvd_dgc.tensorflow.memory import write_at
from hvd_dgc.tensorflow.quantize import pack_planes, unpack_planes
from hvd_dgc.tensorflow.seam import HorovodCollectives

__all__ = ["OuterRounds"]


class OuterRounds(tf.Module):
    """The outer loop's state and its round, for one optimizer's variables."""

    # the model's variables, held for flush(): neither this module's nor its checkpoint's
    _TF_MODULE_IGNORED_PROPERTIES = tf.Module._TF_MODULE_IGNORED_PROPERTIES | {"_watched"}

    def __init__(self, outer, density, min_compress_size, process_set):
        super().__init__(name="hvd_dgc_outer")
        self.outer, self.density = outer, density
        self.min_compress_size, self.process_set = min_compress_size, process_set
        self.resuming = False   # an elastic reset happened; DGCCallback reads and clears it
        self._epoch = 0.0
        self._shared = None     # rank 0's round, for a build after an elastic sync
        self.numels = self.ks = None
        self._inflight = None   # overlap: the last round's exchange (a Future)
        self._waited = 0.0      # overlap: seconds the steps waited for it at round ends
        self._function = None   # overlap: its collectives, traced once
        self._pool = None

    # -- set-up (eager, once) -----------------------------------------------------------
    def build(self, variables):
        """The state, made outside any trace: the shared weights, the outer momentum, the
        residuals (density < 1) and the counts."""
        if self.numels is not None:
            if len(variables) != len(self.numels):
                raise ValueError(f"hvd_dgc: the outer loop was built for {len(self.numels)} "
                                 f"variables and is now stepped with {len(variables)}; use "
                                 f"one DistributedOptimizer per set of variables.")
            return
        numels = [int(tf.TensorShape(v.shape).num_elements()) for v in variables]
        names = tensor_names(variables)
        with tf.init_scope():
            # every rank wrapped alike (elastic: a worker that joins builds alone)
            if os.environ.get("HOROVOD_ELASTIC") != "1":
                check_consistent(HorovodCollectives(self.process_set), outer_consistency(
                    self.outer, self.density, self.min_compress_size, names,
                    [v.shape for v in variables]), "hvd_dgc.tensorflow")
        object.__setattr__(self, "_watched", tuple(variables))
        if self.outer.overlap:
            check_inter_op_threads("OuterLoop(overlap=True)", "overlap=False")
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hvd_dgc_outer")
        self.numels = numels
        self.ks = round_ks(numels, self.density, self.min_compress_size)
        self.layout = RecordLayout(sum(self.ks), len(self.ks), self.outer.value_bits)

        def zeros(name):
            return [tf.Variable(tf.zeros([n], tf.float32), trainable=False,
                                name=f"{name}_{i}") for i, n in enumerate(self.numels)]
        with tf.init_scope():
            self.anchor = zeros("anchor")  # the shared weights (taken at the first step)
            # where this rank's round began: the anchor, or (overlap) a round behind it
            self.start = zeros("start") if self.outer.overlap else self.anchor
            self.buffer = zeros("momentum") if self.outer.momentum else []
            self.residual = zeros("residual") if self.density < 1 else []
            self.started = tf.Variable(False, trainable=False, name="started")
            self.inner = tf.Variable(0, dtype=tf.int64, trainable=False, name="inner")
            self.round_began = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="round_began")
            self.rounds = tf.Variable(0, dtype=tf.int64, trainable=False, name="rounds")
            if self._shared is not None:  # a rank that joined, before its first step
                self.load_shared_state(self._shared)

    # -- per step (in the user's tf.function or eagerly) --------------------------------
    def begin(self, variables):
        """Before the first inner step: the shared weights are rank 0's."""
        def take():
            for i, (a, s, v) in enumerate(zip(self.anchor, self.start, variables)):
                a.assign(_hvd.broadcast(_flat(v), 0, name=f"hvd_dgc.outer.anchor.{i}",
                                        process_set=self.process_set))
                if s is not a:
                    s.assign(a)
            self.started.assign(True)
            return tf.constant(True)
        return tf.cond(self.started, lambda: tf.constant(False), take)

    def end_step(self, variables):
        """After an inner step: count it, and end the round every ``steps``-th."""
        inner = self.inner.assign_add(1)
        return tf.cond(tf.equal(inner % self.outer.steps, 0),
                       lambda: self.end_round(variables), lambda: tf.constant(False))

    def end_round(self, variables):
        """This rank's change since the round began, averaged and applied to the shared
        weights; every rank goes on from them (``overlap``: from them plus its own change
        of this round, whose average is on its way)."""
        if self.outer.overlap:
            return self._end_round_overlapped(variables)
        self._apply(self._average_now(self.anchor, variables))
        for a, v in zip(self.anchor, variables):
            v.assign(tf.cast(tf.reshape(a.read_value(), v.shape), v.dtype))
        return self._count_round()

    def _end_round_overlapped(self, variables):
        """Round j's change launched on a worker thread; round j-1's average, waited for
        now (a round of inner steps after its launch), applied a round late."""
        delta = [s - _flat(v) for s, v in zip(self.start, variables)]
        average, had = tf.py_function(self._swap, self._payload(delta),
                                      Tout=[tf.float32, tf.bool])
        average.set_shape([sum(self.numels)])
        applied = tf.cond(had, lambda: self._apply(tf.split(average, self.numels)),
                          lambda: tf.constant(False))
        with tf.control_dependencies([applied]):
            for a, s, d, v in zip(self.anchor, self.start, delta, variables):
                s.assign(a.read_value() - d)  # the common trajectory, and own round
                v.assign(tf.cast(tf.reshape(s.read_value(), v.shape), v.dtype))
        return self._count_round()

    def _count_round(self):
        self.round_began.assign(self.inner)
        self.rounds.assign_add(1)
        return tf.constant(True)

    def _apply(self, average):
        """The outer step on the shared weights, the same on every rank."""
        for i, a in enumerate(self.anchor):
            # the outer momentum's zeros before the first round give b = a exactly
            step, buffer = outer_step(self.outer, average[i],
                                      self.buffer[i].read_value() if self.buffer else None)
            if self.buffer:
                self.buffer[i].assign(buffer)
            a.assign_sub(self.outer.lr * step)
        return tf.constant(True)

    def _average_now(self, starts, variables):
        """Every rank's change since ``starts``, averaged (this step's collectives)."""
        delta = [s - _flat(v) for s, v in zip(starts, variables)]
        return tf.split(self._collectives(*self._payload(delta)), self.numels)

    def _payload(self, delta):
        """What this rank sends: its change whole (one flat tensor; density 1.0), or the
        density's largest coordinates of ``residual + delta`` per variable as records
        (the bytes of hvd_dgc/outer.py ``RecordLayout``), the rest (and the values'
        rounding) kept in the residual. One tensor, so one collective: a Horovod
        operation costs round trips, which a long link makes the exchange's largest
        part."""
        if self.density >= 1:
            return [tf.concat(delta, 0)]
        picks = []
        for v, d, n, k in zip(self.residual, delta, self.numels, self.ks):
            if self.outer.residual_decay != 1:
                v.assign(v * self.outer.residual_decay + d, read_value=False)
            else:
                v.assign_add(d, read_value=False)
            owed = v.read_value()
            if k >= n:
                picked = tf.range(n, dtype=tf.int32)
            else:
                picked = tf.math.top_k(tf.abs(owed), k, sorted=False).indices
            picks.append((picked, tf.gather(owed, picked)))
        payload, sent = pack_records([p for p, _ in picks], tf.concat([s for _, s in picks], 0),
                                     self.ks, self.numels, self.layout)
        for v, (picked, _), arrived in zip(self.residual, picks, tf.split(sent, self.ks)):
            write_at(v, picked, arrived, op=tf.tensor_scatter_nd_sub)  # owed to a later round
        return [payload]

    def _collectives(self, *payload):
        """The average of every rank's payload, flat."""
        if self.density >= 1:
            return _hvd.allreduce(payload[0], op=Average, process_set=self.process_set,
                                  name="hvd_dgc.outer.dense")
        gathered = _hvd.allgather(payload[0], name="hvd_dgc.outer.records",
                                  process_set=self.process_set)
        positions, values = unpack_records(gathered, self.ks, self.layout)
        total = tf.math.unsorted_segment_sum(tf.reshape(values, [-1]),
                                             tf.reshape(positions, [-1]), sum(self.numels))
        return total / tf.cast(self.process_set.size(), tf.float32)

    # -- overlap: the exchange on a worker thread (tf.py_function), as delayed.py's -------
    def _swap(self, *payload):
        """The last round's average (zeros and False before the first), then this round's
        payload launched (after: one collective of each name in flight)."""
        had = self._inflight is not None
        began = time.perf_counter()
        average = self._inflight.result() if had else np.zeros(sum(self.numels), np.float32)
        self._waited += time.perf_counter() - began
        arrays = [t.numpy() for t in payload]
        self._inflight = self._pool.submit(lambda: self._exchange(*arrays).numpy())
        return average, had

    def _exchange(self, *arrays):
        """The collectives in a tf.function of their own: eager Horovod ops are named by
        their type, and the step's graph is waiting on this thread's result."""
        if self._function is None:
            specs = [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in arrays]
            self._function = tf.function(self._collectives, input_signature=specs,
                                         autograph=False)
        return self._function(*arrays)

    def _drain(self):
        """Wait for the exchange in flight and apply it (eager)."""
        if self._inflight is not None:
            average, self._inflight = self._inflight.result(), None
            self._apply(tf.split(tf.constant(average), self.numels))

    def flush(self):
        """Every rank on the same weights: the exchange in flight (``overlap``) applied,
        and the round under way ended now (eagerly, on every rank: the count of inner
        steps is the same everywhere). Returns whether anything was in flight or under
        way."""
        if self.numels is None or not bool(self.started.numpy()):
            return False
        ended = self._inflight is not None
        self._drain()
        if int(self.inner.numpy()) != int(self.round_began.numpy()):
            self._apply(self._average_now(self.start, self._watched))
            self._count_round()
            ended = True
        for a, s, v in zip(self.anchor, self.start, self._watched):
            if s is not a:
                s.assign(a)
            v.assign(tf.cast(tf.reshape(a, v.shape), v.dtype))
        return ended

    @property
    def in_flight(self):
        return int(self._inflight is not None)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if self._inflight is not None and save_type == "checkpoint":
            raise RuntimeError("hvd_dgc: a round's exchange is in flight (OuterLoop(overlap="
                               "True)); its average cannot be saved. Call optimizer.flush() "
                               "after the step, before writing a checkpoint.")
        return super()._trackable_children(save_type, **kwargs)

    # -- statistics, epochs ---------------------------------------------------------------
    def stats(self):
        numels = self.numels or []
        rounds = int(self.rounds.numpy()) if self.numels is not None else 0
        inner = int(self.inner.numpy()) if self.numels is not None else 0
        return outer_stats(self.outer, self.density, inner, rounds,
                           rounds * round_bytes(numels, self.ks or [], self.density,
                                                self.outer.value_bits),
                           numels, self._inflight is not None, self.process_set.size(),
                           self._waited if self.outer.overlap else None)

    def set_epoch(self, epoch):
        """(DGCCallback calls it; the outer loop has no warm-up.)"""
        self._epoch = float(epoch)

    def current_epoch(self):
        return self._epoch

    # -- elastic Horovod (hvd_dgc/tensorflow/elastic.py) ----------------------------------
    def elastic_refusal(self):
        """Why this loop cannot run under elastic Horovod (None: it can)."""
        return None

    @property
    def lags(self):
        """``overlap``: an exchange may be in flight after a step, so every commit of the
        elastic state flushes first (the exchange applied, the round under way ended:
        commit at round ends, ``batches_per_commit`` a multiple of ``steps``, to keep
        rounds whole), and a restore goes back to weights every rank agrees on."""
        return bool(self.outer.overlap)

    def abandon(self):
        """An elastic restore: the exchange in flight belongs to a world that is gone
        (the commit it goes back to was flushed, so nothing of it is lost); its
        collectives fail once Horovod shuts down, on a pool of their own."""
        self._inflight = None
        if self._pool is not None:
            old, self._pool = self._pool, ThreadPoolExecutor(
                1, thread_name_prefix="hvd_dgc_outer")
            old.shutdown(wait=False, cancel_futures=True)
        self._function = None

    def replan(self):
        """After an elastic reset: the average's 1/N follows when the step is traced
        again (the overlapped exchange's function too); the state stays."""
        self._function = None

    def shared_state(self):
        """What every rank must hold alike after an elastic sync: rank 0's counts, shared
        weights and outer momentum (a rank that joins has no residual); None before the
        first step."""
        if self.numels is None:
            return None
        return ([int(t.numpy()) for t in (self.started, self.inner, self.round_began,
                                           self.rounds)],
                [a.numpy() for a in self.anchor], [b.numpy() for b in self.buffer])

    def load_shared_state(self, state):
        """Rank 0's round; this rank goes on from where its weights are (the sync gave it
        rank 0's), its change since the round began kept as its own."""
        if state is None:
            return
        if self.numels is None:
            self._shared = state
            return
        counts, anchor, buffer = state
        for t, value in zip((self.started, self.inner, self.round_began, self.rounds),
                            counts):
            t.assign(bool(value) if t.dtype == tf.bool else value)
        for t, value in zip(list(self.anchor) + list(self.buffer), anchor + buffer):
            t.assign(value)
        for a, s in zip(self.anchor, self.start):  # overlap: the round starts at them
            if s is not a:
                s.assign(a)
        self._inflight = None
        self._shared = None


def _flat(variable):
    return tf.reshape(tf.cast(tf.convert_to_tensor(variable), tf.float32), [-1])


# -- a round's records on the wire (hvd_dgc/outer.py RecordLayout) -------------------------
def pack_records(picked, values, ks, numels, layout):
    """``(payload, sent)``: the uint8 bytes of this rank's records (``picked``: each
    tensor's positions in it), and each value as it arrives (``values`` itself, or its
    low-bit level)."""
    offsets = np.cumsum([0] + list(numels[:-1]))
    positions = tf.concat([p + int(o) for p, o in zip(picked, offsets)], 0)
    as_bytes = [tf.reshape(tf.bitcast(positions, tf.uint8), [-1])]
    if layout.value_bits == 32:
        return tf.concat(as_bytes + [tf.reshape(tf.bitcast(values, tf.uint8), [-1])], 0), values
    owner = _owners(ks)
    mags = tf.abs(values)
    lo = tf.math.unsorted_segment_min(mags, owner, len(ks))
    hi = tf.math.unsorted_segment_max(mags, owner, len(ks))
    step = (hi - lo) / float(layout.levels - 1)
    step_r, lo_r = tf.gather(step, owner), tf.gather(lo, owner)
    level = tf.clip_by_value(
        tf.where(step_r > 0, tf.round((mags - lo_r) / tf.where(step_r > 0, step_r, 1.0)), 0.0),
        0.0, float(layout.levels - 1))
    negative = values < 0
    arrived = lo_r + level * step_r
    codes = tf.bitwise.bitwise_or(tf.cast(level, tf.int32), tf.bitwise.left_shift(
        tf.cast(negative, tf.int32), layout.value_bits - 1))
    scales = tf.reshape(tf.bitcast(tf.reshape(tf.stack([lo, hi], 1), [-1]), tf.uint8), [-1])
    return (tf.concat(as_bytes + [scales, pack_planes(codes, layout.value_bits)], 0),
            tf.where(negative, -arrived, arrived))


def unpack_records(gathered, ks, layout):
    """Every rank's ``(positions, values)``, ``[world, count]`` each, from the allgather
    of ``pack_records``' payloads."""
    rows = tf.reshape(gathered, [-1, layout.nbytes])
    positions = tf.bitcast(tf.reshape(rows[:, :4 * layout.count], [-1, layout.count, 4]),
                           tf.int32)
    at = layout.values_at
    if layout.value_bits == 32:
        return positions, tf.bitcast(tf.reshape(rows[:, at:], [-1, layout.count, 4]),
                                     tf.float32)
    scales = tf.bitcast(tf.reshape(rows[:, 4 * layout.count:at], [-1, len(ks), 2, 4]),
                        tf.float32)
    lo, hi = scales[:, :, 0], scales[:, :, 1]
    step = (hi - lo) / float(layout.levels - 1)
    codes = tf.map_fn(functools.partial(_row_codes, layout), rows[:, at:],
                      fn_output_signature=tf.int32)
    owner = _owners(ks)
    level = tf.cast(tf.bitwise.bitwise_and(codes, layout.levels - 1), tf.float32)
    arrived = tf.gather(lo, owner, axis=1) + level * tf.gather(step, owner, axis=1)
    negative = tf.bitwise.right_shift(codes, layout.value_bits - 1) > 0
    return positions, tf.where(negative, -arrived, arrived)


@tf.autograph.experimental.do_not_convert  # (nothing to convert; no AutoGraph line in logs)
def _row_codes(layout, row):
    """One rank's codes from its bit planes (``unpack_planes``)."""
    return unpack_planes(row, layout.value_bits, layout.count)


def _owners(ks):
    """Each record's tensor (0 .. len(ks) - 1)."""
    return tf.constant(np.repeat(np.arange(len(ks), dtype=np.int32), ks))
