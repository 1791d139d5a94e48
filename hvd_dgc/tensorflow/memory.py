"""Gradient memory for TensorFlow: what stays behind on this worker between steps.

The maths of hvd_dgc/torch/memory.py (DGC momentum correction, momentum factor
masking, error feedback, local clipping) on tf.Variables. The variables are
created under ``tf.init_scope`` (outside any trace) the first time shapes are
known, so the memory works inside ``tf.function`` and is saved by
``tf.train.Checkpoint`` with whatever tracks it.
"""

import tensorflow as tf

__all__ = ["DGCMemory", "local_gradient", "write_at", "UNSETTLED"]

#: DGCMemory.apart of a tensor whose residual may not be empty
UNSETTLED = 2


def local_gradient(grad, clip_norm=None, world_size=1):
    """Flat float32 gradient, clipped per tensor at ``clip_norm / sqrt(N)`` (DGC Sec. 3.3)."""
    g = tf.reshape(tf.cast(grad, tf.float32), [-1])
    if clip_norm is not None:
        limit = clip_norm / (world_size ** 0.5)
        g = g * tf.minimum(1.0, limit / (tf.norm(g) + 1e-6))
    return g


def write_at(var, indices, values, value=None, op=tf.tensor_scatter_nd_update):
    """``var[indices] = values`` (``op``: or ``+=``, ``-=``) as one write of a whole new
    value (``value``: ``var``'s, if read already). TF's resource scatter ops
    (``Variable.scatter_nd_update``, even ``tf.gather`` on a variable) update in place,
    but put the variable in copy-on-read mode for good: every dense read after them
    copies it (a 128 MB memory: a read 9 -> 135 ms), and a step reads its memory densely
    several times. This costs one copy a call (~80 ms for 128 MB) and no read after it."""
    if value is None:
        value = var.read_value()
    var.assign(op(value, tf.expand_dims(indices, 1), values), read_value=False)


class DGCMemory(tf.Module):
    """Per-tensor velocity ``u`` and accumulation ``v`` as flat float32 variables."""

    def __init__(self, numels, momentum=0.0, nesterov=False, momentum_masking=True,
                 snapshots=False, no_residual=(), preconditioner=None, name="hvd_dgc_memory"):
        """``no_residual[i]``: tensor i bypasses DGC (an IndexedSlices gradient), so its
        ``v`` is empty; its ``u`` stays, for the momentum taken over (``velocity``).
        ``preconditioner``: Adam taken over (hvd_dgc/tensorflow/adam.py): until
        its ``frozen()`` the momentum is off (exact Adam, dense); from then on the
        gradient entering tensor i is ``scale(i) * g`` and ``momentum`` is beta1."""
        super().__init__(name=name)
        self.momentum = float(momentum)
        object.__setattr__(self, "preconditioner", preconditioner)  # not tracked: its
        # scales are the optimizer's variables
        self.nesterov = bool(nesterov)
        self.momentum_masking = momentum_masking  # True, False or "auto" (masking.py)
        no_residual = list(no_residual) + [False] * (len(numels) - len(no_residual))
        with tf.init_scope():
            self.v = [tf.Variable(tf.zeros([0 if skip else n]), trainable=False, name=f"v{i}")
                      for i, (n, skip) in enumerate(zip(numels, no_residual))]
            self.u = [tf.Variable(tf.zeros([n]), trainable=False, name=f"u{i}")
                      for i, n in enumerate(numels)] if self.momentum else []
            # Per tensor, how far its memory is from one every rank holds alike, for the
            # dense path's shortcut (paths.DensePath.shortcut): 2 = v may hold a
            # residual; 1 = v is empty, u is this rank's own momentum; 0 = v is empty
            # and u is the ranks' average momentum, the same on every rank. Starts, and
            # starts again after anything that may change the paths (``unsettle``), at 2.
            self.apart = tf.Variable(tf.fill([len(numels)], UNSETTLED), trainable=False,
                                     name="apart")
            # Copies of v and u taken before a step that may be undone (skip_nonfinite).
            # Scratch, kept out of checkpoints (set past tf.Module's attribute tracking).
            object.__setattr__(self, "_saved", tuple(
                tuple(tf.Variable(tf.zeros_like(x), trainable=False) for x in self._of(i))
                for i in range(len(numels))) if snapshots else ())

    def _of(self, i):
        return (self.v[i],) + ((self.u[i],) if self.u else ())

    def snapshot(self, settled=()):
        """Copies of every tensor's ``v`` and ``u`` before a step that may be undone.
        Tensors in ``settled`` whose memory is settled (``apart`` 0) need none: it
        does not move before the step is known to be kept (DensePath.shortcut)."""
        self._each(settled, lambda saved, x: saved.assign(x))

    def restore(self, settled=()):
        """Back to ``snapshot``'s copies (``apart`` has not moved since: it moves when a
        step is kept, ``settle``)."""
        self._each(settled, lambda saved, x: x.assign(saved))

    def _each(self, settled, copy):
        for i, saved in enumerate(self._saved):
            def run(i=i, saved=saved):
                for a, b in zip(saved, self._of(i)):
                    copy(a, b)
                return tf.constant(True)
            if i in settled:
                tf.cond(self.settled(i), lambda: tf.constant(False), run)
            else:
                run()

    def settled(self, i):
        """Whether tensor i's memory is the same on every rank (``apart`` 0)."""
        return tf.equal(self.apart[i], 0)

    def unsettle(self):
        """The paths may change (a relink, an elastic reset): every tensor goes back to
        the dense path's full exchanges until its memory is settled again."""
        self.apart.assign(tf.fill(tf.shape(self.apart), UNSETTLED))

    def settle(self, i, mean):
        """Tensor i's dense average, ``mean``, taken where the step is kept: what the
        optimizer applies, and one step closer to settled. Settled, ``mean`` is the
        ranks' average gradient and the momentum is applied to it here (the average
        of every rank's u = m u + g is m u + mean where every rank holds the same u);
        one step from settled (v was empty), ``mean`` is the average of every rank's
        new u, which each rank keeps (u is now alike everywhere); else ``mean``
        carried v's residual too, now sent (v is empty)."""
        apart = self.apart[i]
        if self.u:
            mean = tf.switch_case(tf.minimum(apart, UNSETTLED), [
                lambda: self._momentum(i, mean),
                lambda: self._adopt(i, mean),
                lambda: tf.identity(mean)])
        with tf.control_dependencies([mean]):
            self.apart.scatter_nd_update([[i]], [tf.maximum(apart - 1, 0)])
        return tf.identity(mean)

    def _momentum(self, i, mean):
        """u = m u + mean, in place: TF's momentum kernel on u, its ``var`` the settled
        (empty) v with lr = 0, which leaves it empty (TF's ops would make m u a fresh
        buffer, a pass and, from TF's CPU allocator, page faults of its own)."""
        tf.raw_ops.ResourceApplyMomentum(
            var=self.v[i].handle, accum=self.u[i].handle, lr=tf.constant(0.0), grad=mean,
            momentum=tf.constant(self.momentum), use_locking=False, use_nesterov=False)
        return self.u[i].read_value()

    def _adopt(self, i, u):
        self.u[i].assign(u)
        return tf.identity(u)

    def accumulate(self, i, g):
        """u = m u + g; v += u (Nesterov: u = m (u + g); v += u + g). Returns v's value."""
        self.intake(i, g)
        return self.v[i].read_value()

    def intake(self, i, g):
        """``accumulate``'s update; returns what ``v`` took in (u; Nesterov: u + g): a
        step between exchanges (``period``) applies it as this rank's own."""
        v, momentum = self.v[i], self.momentum
        if self.preconditioner is not None:
            frozen, scale = self.preconditioner.frozen(), self.preconditioner.scale(i)
            g = tf.where(frozen, g * tf.reshape(scale, [-1]), g)
            momentum = tf.where(frozen, momentum, 0.0)
        if self.momentum and not self.nesterov:
            # One pass over u, g and v where TF's ops take four (u = m u + g, then
            # v += u, each a pass of its own): TF's momentum kernel with lr = -1
            # (accum = m accum + grad; var -= lr accum).
            u = self.u[i]
            tf.raw_ops.ResourceApplyMomentum(
                var=v.handle, accum=u.handle, lr=tf.constant(-1.0), grad=g,
                momentum=tf.cast(momentum, tf.float32), use_locking=False,
                use_nesterov=False)
            return u.read_value()
        if self.momentum:
            u = self.u[i]
            u.assign(momentum * (u + g))
            taken = u.read_value() + g
        else:
            taken = g
        v.assign_add(taken)
        return taken

    @property
    def sgd_momentum(self):
        """The momentum of an SGD taken over (0: none; Adam's is applied to the
        preconditioned gradient only, and its sliced tensors stay Adam's own)."""
        return self.momentum if self.preconditioner is None else 0.0

    def seed(self, i, u):
        """Tensor i's momentum starts at ``u`` (Adam's first moment, at the freeze)."""
        self.u[i].assign(tf.reshape(tf.cast(u, tf.float32), [-1]))

    def velocity(self, i, g):
        """Momentum alone, on an average that bypassed DGC (an IndexedSlices gradient):
        u = m u + g (Nesterov: u = m (u + g), returns u + g), what the SGD whose momentum
        was taken over would have applied."""
        u = self.u[i]
        if self.nesterov:
            u.assign(self.momentum * (u + g))
            return u.read_value() + g
        u.assign(self.momentum * u + g)
        return u.read_value()

    def sent(self, i, indices, mask_momentum=None):
        """Coordinates ``indices`` left this worker: clear them, and their momentum where
        ``mask_momentum`` (a bool tensor: "auto" masking depends on the density, which
        is a tensor in the warm-up; None: the ``momentum_masking`` setting)."""
        zeros = tf.zeros(tf.shape(indices), tf.float32)
        write_at(self.v[i], indices, zeros)
        if self.momentum and self.momentum_masking is not False:
            if mask_momentum is None:
                write_at(self.u[i], indices, zeros)
            else:
                u = self.u[i].read_value()
                write_at(self.u[i], indices, tf.where(mask_momentum, zeros,
                                                      tf.gather(u, indices)), u)

    def give_back(self, i, indices, values):
        """Add ``values`` at ``indices`` into tensor i's residual: what an aggregation took
        but did not deliver (region reduce's owner keeps what it did not send on), so
        error feedback sends it later (as hvd_dgc/torch/memory.py)."""
        write_at(self.v[i], indices, values, op=tf.tensor_scatter_nd_add)

    def keep(self, i, remainder):
        """Dense path with fp16 on the wire: what did not leave (fp16's rounding, values
        beyond its range: hvd_dgc/fp16wire.py) is the new residual."""
        self.v[i].assign(remainder)

    def sent_all(self, i):
        """Dense path: everything left, ``v`` clears, ``u`` stays (density 1 == momentum SGD)."""
        self.v[i].assign(tf.zeros_like(self.v[i]))
