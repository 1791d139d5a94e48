"""``skip_nonfinite`` in TensorFlow: a NaN/Inf gradient on any rank never enters the
memory (the PyTorch side's rule, hvd_dgc/torch/guard.py, in graph ops).

A synchronous step costs no extra collective: the memory and the statistics are saved,
a rank whose gradient is not finite sends inf, so every rank's averages show it, and
then every rank puts its memory and statistics back and skips the step (step count
unchanged), returning NaN gradients (Keras skips the optimizer's step; a tape's user
checks them). Under delayed averaging the other ranks apply their own part of a step
before anyone knows, so only this rank's non-finite tensors are dropped: they carry
nothing, and their memory does not move.
"""

import tensorflow as tf

__all__ = ["NonFiniteGuard", "values"]


class NonFiniteGuard:
    """The guard of one exchange: its memory, statistics and step counter."""

    def __init__(self, memory, statistics, step):
        self.memory, self.statistics, self.step = memory, statistics, step

    @staticmethod
    def not_finite(grads):
        """Per gradient, whether this rank's is not finite (a bool tensor each)."""
        return [tf.logical_not(tf.math.is_finite(tf.reduce_sum(tf.cast(values(g), tf.float32))))
                for g in grads]

    def skip(self, grads, exchange, finish=list, settled=()):
        """``(averages, skipped)`` of ``exchange(poison)``, the step's averages with this
        rank's gradients poisoned where ``poison`` (a bool tensor) is true, made what
        the optimizer applies by ``finish`` where the step is kept. ``settled``: tensors
        whose memory does not move before ``finish`` while it is settled (the dense
        path's shortcut): no copy of it is needed then."""
        # (a dense shortcut's gradient goes into the sums whole: a NaN there shows in
        # every rank's average without a check here)
        local_bad = tf.reduce_any(self.not_finite(
            [g for i, g in enumerate(grads) if i not in settled]) or [False])
        self.memory.snapshot(settled)
        saved = self.statistics.save()
        out = exchange(local_bad)
        bad = tf.logical_not(tf.reduce_all(
            [tf.math.is_finite(tf.reduce_sum(values(a))) for a in out]))

        def skipped():
            self.memory.restore(settled)
            self.statistics.restore(saved)
            self.statistics.add(nonfinite_steps=1)
            return [_nan_like(a) for a in out]

        def kept():
            self.step.assign_add(1)
            return finish(out)

        return tf.cond(bad, skipped, kept), bad

    def drop(self, grads):
        """Delayed averaging: which of this rank's tensors to drop (counted)."""
        bad_here = self.not_finite(grads)
        self.statistics.add(nonfinite_steps=tf.cast(tf.reduce_any(bad_here), tf.int64))
        return bad_here


def values(grad):
    """What a non-finite check looks at: an IndexedSlices' rows, or the tensor."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _nan_like(grad):
    """The skipped step's gradient: NaN, shaped (and sliced) as the real one."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.fill(tf.shape(grad.values), tf.constant(float("nan"),
                                                                            grad.values.dtype)),
                                grad.indices, grad.dense_shape)
    return tf.fill(tf.shape(grad), tf.constant(float("nan"), grad.dtype))
