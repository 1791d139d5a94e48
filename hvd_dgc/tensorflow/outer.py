"""The outer loop in TensorFlow/Keras (hvd_dgc/outer.py says what and why).

``hvd_dgc.tensorflow.keras.DistributedOptimizer(opt, outer=hvd_dgc.OuterLoop(steps=H))``
returns the user's optimizer class whose step (Keras 3 ``apply``, Keras 2
``apply_gradients``) runs it on this rank's own gradients, with no collective; every
H-th step ends a round, traced into the same step (``tf.cond``: every rank counts alike,
so every rank takes the same branch and joins the same collectives)::

    d = start - x                        this rank's change in the round (per variable)
    v += d                               this rank's residual (error feedback)
    send the density's largest |v| of each variable (records), v -= what was sent
    a = sum of every rank's records / N  (density 1.0: a grouped allreduce of d)
    anchor -= lr * outer step(a)         Nesterov momentum, the same on every rank
    x = anchor                           every rank starts the next round alike

The shared weights start as rank 0's (one broadcast at the first step): Horovod's Keras
callback and its TF2 examples broadcast after the first batch, so the weights a rank
holds at its first step may still be its own. The state is a ``tf.Module``
(``optimizer.dgc_state``: put it in ``tf.train.Checkpoint``; Keras 2 also saves it with
the optimizer); ``hvd.elastic.KerasState`` commits it and a rank that joins takes rank
0's round (hvd_dgc/tensorflow/elastic.py).
"""

import os

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Average

from hvd_dgc.outer import outer_stats, outer_step, round_bytes
from hvd_dgc.schedule import num_selected
from hvd_dgc.tensorflow.exchange import _check_consistent_config, variable_name

__all__ = ["OuterRounds"]


class OuterRounds(tf.Module):
    """The outer loop's state and its round, for one optimizer's variables."""

    # the model's variables, held for flush(): neither this module's nor its checkpoint's
    _TF_MODULE_IGNORED_PROPERTIES = tf.Module._TF_MODULE_IGNORED_PROPERTIES | {"_watched"}

    def __init__(self, outer, density, min_compress_size, process_set):
        super().__init__(name="hvd_dgc_outer")
        self.outer, self.density = outer, density
        self.min_compress_size, self.process_set = min_compress_size, process_set
        self.delay = 0          # (what the elastic state asks of an exchange)
        self.resuming = False   # an elastic reset happened; DGCCallback reads and clears it
        self._epoch = 0.0
        self._shared = None     # rank 0's round, for a build after an elastic sync
        self.numels = self.ks = None

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
        names = [variable_name(v, i) for i, v in enumerate(variables)]
        with tf.init_scope():
            # every rank wrapped alike (elastic: a worker that joins builds alone)
            if os.environ.get("HOROVOD_ELASTIC") != "1":
                _check_consistent_config({
                    "outer": list(self.outer), "density": self.density,
                    "min_compress_size": self.min_compress_size,
                    "tensors": [[n, list(v.shape)] for n, v in zip(names, variables)]},
                    self.process_set)
        object.__setattr__(self, "_watched", tuple(variables))
        self.numels = numels
        self.ks = [n if self.density >= 1 or n < self.min_compress_size
                   else num_selected(n, self.density) for n in numels]

        def zeros(name):
            return [tf.Variable(tf.zeros([n], tf.float32), trainable=False,
                                name=f"{name}_{i}") for i, n in enumerate(self.numels)]
        with tf.init_scope():
            self.anchor = zeros("anchor")  # the shared weights (taken at the first step)
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
            for i, (a, v) in enumerate(zip(self.anchor, variables)):
                a.assign(_hvd.broadcast(_flat(v), 0, name=f"hvd_dgc.outer.anchor.{i}",
                                        process_set=self.process_set))
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
        weights; every rank goes on from them."""
        average = self._average([a - _flat(v) for a, v in zip(self.anchor, variables)])
        for i, (a, v) in enumerate(zip(self.anchor, variables)):
            # the outer momentum's zeros before the first round give b = a exactly
            step, buffer = outer_step(self.outer, average[i],
                                      self.buffer[i].read_value() if self.buffer else None)
            if self.buffer:
                self.buffer[i].assign(buffer)
            a.assign_sub(self.outer.lr * step)
            v.assign(tf.cast(tf.reshape(a.read_value(), v.shape), v.dtype))
        self.round_began.assign(self.inner)
        self.rounds.assign_add(1)
        return tf.constant(True)

    def _average(self, delta):
        """Every rank's ``delta`` averaged: whole (density 1.0), or the density's largest
        coordinates of ``residual + delta`` per variable, the rest kept in the residual."""
        if self.density >= 1:
            return _hvd.grouped_allreduce(delta, op=Average, process_set=self.process_set,
                                          name="hvd_dgc.outer.dense")
        positions, values, offset = [], [], 0
        for v, d, n, k in zip(self.residual, delta, self.numels, self.ks):
            v.assign_add(d, read_value=False)
            owed = v.read_value()
            if k >= n:
                picked = tf.range(n, dtype=tf.int32)
            else:
                picked = tf.math.top_k(tf.abs(owed), k, sorted=False).indices
            values.append(tf.gather(owed, picked))
            v.scatter_nd_update(picked[:, None], tf.zeros([k], tf.float32))  # sent
            positions.append(picked + offset)
            offset += n
        positions = _hvd.allgather(tf.concat(positions, 0), name="hvd_dgc.outer.positions",
                                   process_set=self.process_set)
        values = _hvd.allgather(tf.concat(values, 0), name="hvd_dgc.outer.values",
                                process_set=self.process_set)
        total = tf.math.unsorted_segment_sum(values, positions, offset)
        total /= tf.cast(self.process_set.size(), tf.float32)
        return tf.split(total, self.numels)

    def flush(self):
        """Every rank on the same weights: the round under way ended now (eagerly, on
        every rank: the count of inner steps is the same everywhere). Returns whether a
        round was ended."""
        if self.numels is None or not bool(self.started.numpy()) or \
                int(self.inner.numpy()) == int(self.round_began.numpy()):
            return False
        self.end_round(self._watched)
        return True

    # -- statistics, epochs ---------------------------------------------------------------
    def stats(self):
        numels = self.numels or []
        rounds = int(self.rounds.numpy()) if self.numels is not None else 0
        inner = int(self.inner.numpy()) if self.numels is not None else 0
        return outer_stats(self.outer, self.density, inner, rounds,
                           rounds * round_bytes(numels, self.ks or [], self.density),
                           numels, False, self.process_set.size())

    def set_epoch(self, epoch):
        """(DGCCallback calls it; the outer loop has no warm-up.)"""
        self._epoch = float(epoch)

    def current_epoch(self):
        return self._epoch

    # -- elastic Horovod (hvd_dgc/tensorflow/elastic.py) ----------------------------------
    def replan(self):
        """After an elastic reset: the average's 1/N follows when the step is traced
        again; the state stays."""

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
        self._shared = None


def _flat(variable):
    return tf.reshape(tf.cast(tf.convert_to_tensor(variable), tf.float32), [-1])
