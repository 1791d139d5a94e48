"""Keras' Adam and AdamW taken over (hvd_dgc/adam.py has the maths and the papers; the
PyTorch side is hvd_dgc/torch/adam.py).

The rebuilt optimizer (tensorflow/optimizer.py) is a subclass of the user's, so Keras keeps
doing what it does around the update: learning-rate schedules, AdamW's decoupled decay
(``_apply_weight_decay``, with its exclusions), constraints, ``iterations``. Two of its
methods change:

- building the optimizer also makes one variable per model variable, the frozen scale
  ``(1 - beta1) P`` (ones until the freeze): an optimizer variable, so ``model.save``,
  ``BroadcastGlobalVariablesCallback`` and the elastic state carry it as they carry
  Adam's moments;
- the update step of a variable DGC exchanges is Adam's own until the freeze, then
  ``x -= lr / (1 - beta1^t) * average`` (t = ``iterations + 1``, Keras' count).

At the end of step ``freeze - 1`` (exchange steps, every rank alike) ``freeze_now()`` sets
the scales from Adam's second moment and moves its first moment into DGC's memory as
``u = P m``; from then on the memory applies ``beta1`` to the scaled gradient, and the
update, linear in it, may be delayed (``delay``; a flush's corrections: ``correct``).

Keras adds eps outside the bias correction (``x -= lr sqrt(1 - beta2^t) / (1 - beta1^t)
m / (sqrt(v) + eps)``), so its preconditioner at the freeze T is
``P = 1 / (sqrt(v / (1 - beta2^T)) + eps / sqrt(1 - beta2^T))``: the step Adam took at
T, kept (tf_keras' ``adaptive_epsilon=True`` puts eps inside, as torch does).
Variables with IndexedSlices gradients (an Embedding) travel as Horovod sends them and
stay on Adam's own update throughout.

With ``refresh_variance``, Adam's ``v`` goes on after the freeze as this rank's estimate
of exact Adam's (``observe``: from the local gradients as the exchange receives them and
the previous ones, one more optimizer variable per model variable), and at the end of a
refresh step the ranks average it and the scales and the memory move to it
(``refresh_now``), as on the PyTorch side.
"""

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Average

from hvd_dgc.adam import NEVER, VARIANCE_FLOOR, observed_weights, refresh_count

__all__ = ["ADAM_CLASSES", "AdamTakeOver", "check_adam", "PREVIOUS_NAME",
           "SCALE_NAME"]

#: Keras optimizers taken over, by class name (Keras 3, tf_keras and tf_keras' legacy).
ADAM_CLASSES = ("Adam", "AdamW")

#: The frozen scale's name among the optimizer's variables (and legacy slots).
SCALE_NAME = "hvd_dgc_scale"

#: This rank's previous gradient's name among them, made where the variance is
#: refreshed (``observe``).
PREVIOUS_NAME = "hvd_dgc_previous_gradient"

#: Keras options that act on what the optimizer receives, with the fix: after the
#: freeze it receives averaged preconditioned momenta, which they would act on wrongly.
_REFUSED = {
    "clipnorm": "hvd_dgc's clip_norm= (DGC's local clipping, before the memory)",
    "clipvalue": "hvd_dgc's clip_norm= (DGC's local clipping, before the memory)",
    "global_clipnorm": "hvd_dgc's clip_norm= (DGC's local clipping, before the memory)",
    "use_ema": "an exponential moving average of the weights kept by a callback",
    "gradient_accumulation_steps": "backward_passes_per_step= on hvd_dgc's "
                                   "DistributedOptimizer (Horovod's accumulation)",
}


def check_adam(name, config):
    """What the take-over cannot honour, refused with the fix (at wrap time)."""
    for option, instead in _REFUSED.items():
        if config.get(option):
            raise ValueError(
                f"hvd_dgc: {name}({option}={config[option]!r}) cannot be taken over: after "
                f"the freeze the optimizer receives averaged preconditioned momenta, which "
                f"{option} would act on. Use {instead}, or pass freeze_variance=False "
                f"(Adam's own update on error feedback).")


class AdamTakeOver:
    """One wrapped Keras Adam/AdamW: its hyper-parameters, where its moments and scales
    live (``kind``: "keras3", "keras2" or "legacy"), and the exchange's step that says
    the phase. ``freeze``: the exchange step from which the variance is frozen."""

    def __init__(self, config, freeze, kind, refresh=False):
        self.freeze, self.kind, self.refresh = int(freeze), kind, refresh
        self.declined = False
        self.beta1, self.beta2 = float(config["beta_1"]), float(config["beta_2"])
        self.eps = float(config["epsilon"])
        self.amsgrad = bool(config.get("amsgrad", False))
        self.eps_inside = bool(config.get("adaptive_epsilon", False))
        self.exchange = None        # GradientExchange, bound when it builds its memory
        self.optimizer = None       # the rebuilt Keras optimizer, set when made
        self._taken_ids = set()
        self.variables = ()         # the exchange's, by index
        self.taken = ()             # whether DGC exchanges each (not sliced)

    # -- the phase, from the exchange's step (the same on every rank) -----------------
    def frozen(self):
        """Whether the step being exchanged now runs on the frozen variance (in the
        exchange, before its step counter moves on)."""
        return self.exchange.step >= self.freeze

    def applying_frozen(self):
        """The same, in the optimizer's update (the exchange has counted the step)."""
        return self.exchange.step > self.freeze

    def freeze_at(self, step):
        """Freeze at ``step`` (plan.py ``adam_freeze``: later than planned where every
        tensor goes dense before it on this link), or never (None: exact Adam throughout,
        as with Horovod). Before the first trace."""
        if step is None:
            self.declined, self.freeze = True, NEVER
        else:
            self.freeze = int(step)

    def phase(self, step):
        if self.declined:
            return "exact Adam (not taken over: every tensor dense on this link)"
        return "frozen variance" if step >= self.freeze else "exact Adam"

    def stats(self, step):
        out = {"adam_phase": self.phase(step),
               "adam_freeze": None if self.declined else self.freeze}
        if self.refresh is not False and not self.declined:
            out.update(adam_refresh=self.refresh,
                       adam_refreshes=refresh_count(step, self.freeze, self.refresh))
        return out

    def refreshing(self, step):
        """hvd_dgc/adam.py ``refreshes_at`` in TF ops, at the exchange's count ``step``
        (the end of Adam's step ``step``)."""
        if self.refresh is False:
            return tf.constant(False)
        step = tf.cast(step, tf.int64)
        after = step > self.freeze
        if self.refresh == "auto":
            times = step // self.freeze
            return after & tf.equal(step % self.freeze, 0) & \
                tf.equal(tf.bitwise.bitwise_and(times, times - 1), 0)
        return after & tf.equal((step - self.freeze) % self.refresh, 0)

    # -- variables ---------------------------------------------------------------------
    def bind(self, exchange, variables, sliced):
        """The exchange's variables (after the optimizer built its own) and which are
        sliced; the memory's preconditioner is this object."""
        self.exchange = exchange
        self.variables = tuple(variables)
        self.taken = tuple(not s for s in sliced)
        # Keras 3 hands update_step the tf.Variable inside its Variable: either is known
        self._taken_ids = {id(x) for var, ok in zip(self.variables, self.taken) if ok
                           for x in (var, getattr(var, "value", None)) if x is not None}
        return self

    def scale(self, i):
        """The frozen scale of the exchange's variable i (an optimizer variable)."""
        return self._slot(self.variables[i], "scale")

    def _slot(self, var, what):
        opt = self.optimizer
        if self.kind == "legacy":
            return opt.get_slot(var, {"scale": SCALE_NAME, "previous": PREVIOUS_NAME,
                                      "m": "m", "v": "v", "vhat": "vhat"}[what])
        index = opt._get_variable_index(var) if self.kind == "keras3" else \
            opt._index_dict[opt._var_key(var)]
        lists = {"scale": opt._hvd_dgc_scales, "m": opt._momentums, "v": opt._velocities,
                 "previous": getattr(opt, "_hvd_dgc_previous", None),
                 "vhat": getattr(opt, "_velocity_hats", None)}
        return lists[what][index]

    # -- the freeze ----------------------------------------------------------------------
    def freeze_now(self, iterations):
        """After Adam's step ``freeze - 1`` (in the graph): every scale from Adam's
        second moment (bias-corrected at Keras' count ``iterations``), floored as in
        hvd_dgc/adam.py, and the memory's momentum seeded with ``P m``."""
        t = tf.cast(iterations, tf.float32)
        root = tf.sqrt(1.0 - tf.pow(self.beta2, t))
        eps = self.eps if self.eps_inside else self.eps / root
        taken = [i for i, ok in enumerate(self.taken) if ok]
        seconds = [tf.reshape(tf.cast(self._slot(self.variables[i],
                                                 "vhat" if self.amsgrad else "v"),
                                      tf.float32), [-1]) for i in taken]
        if not seconds:
            return tf.constant(True)
        # a tensor with no gradient in the warm-up (v = 0 everywhere) gets the mean
        # bias-corrected v of the others (1 if none had one), not a scale of 1/eps
        means = tf.stack([tf.reduce_mean(v) for v in seconds]) / (root * root)
        positive = means > 0
        count = tf.reduce_sum(tf.cast(positive, tf.float32))
        typical = tf.where(count > 0, tf.reduce_sum(tf.where(positive, means, 0.0))
                           / tf.maximum(count, 1.0), 1.0)
        memory = self.exchange.memory
        for i, v, mean in zip(taken, seconds, tf.unstack(means)):
            var = self.variables[i]
            precondition = tf.where(mean > 0, _precondition(v, root, eps),
                                    1.0 / (tf.sqrt(typical) + eps))
            scale = self._slot(var, "scale")
            scale.assign(tf.reshape((1.0 - self.beta1) * precondition, scale.shape))
            m = tf.reshape(tf.cast(self._slot(var, "m"), tf.float32), [-1])
            memory.seed(i, precondition * m)
        return tf.constant(True)

    # -- the refresh (0/1 Adam) ------------------------------------------------------
    def observe(self, grads):
        """Once frozen and refreshing, this rank's ``v`` moves on with its own gradient
        (``grads``, the exchange's, by index) and its previous one, in Keras' form ``v
        += (s - v)(1 - beta2)``, ``s = g^2 / N + (1 - 1/N) g g_previous``: averaged over
        the N ranks, an estimate of exact Adam's (hvd_dgc/adam.py ``observed_weights``)."""
        if self.refresh is False:
            return tf.constant(True)
        square, cross = observed_weights(self.exchange.world_size())

        def track():
            for i in (i for i, ok in enumerate(self.taken) if ok):
                v = self._slot(self.variables[i], "v")
                previous = self._slot(self.variables[i], "previous")
                g = tf.reshape(tf.cast(grads[i], v.dtype), v.shape)
                seen = square * g * g + cross * g * tf.cast(previous, v.dtype)
                v.assign_add((seen - v) * (1.0 - self.beta2))
                previous.assign(tf.cast(g, previous.dtype))
            return tf.constant(True)
        return tf.cond(self.frozen(), track, lambda: tf.constant(True))

    def refresh_now(self, iterations):
        """The ranks' ``v`` averaged (every rank goes on from it; a non-finite entry
        takes the tensor's mean), each scale recomputed from it as ``freeze_now`` does,
        and the memory's momentum and residual multiplied by ``new / old`` scale."""
        taken = [i for i, ok in enumerate(self.taken) if ok]
        if not taken:
            return tf.constant(True)
        t = tf.cast(iterations, tf.float32)
        root = tf.sqrt(1.0 - tf.pow(self.beta2, t))
        eps = self.eps if self.eps_inside else self.eps / root
        slots = [self._slot(self.variables[i], "v") for i in taken]
        averaged = _hvd.grouped_allreduce([tf.cast(v, tf.float32) for v in slots], op=Average,
                                          name="hvd_dgc.adam_refresh",
                                          process_set=self.exchange.wire.process_set)
        memory, sent = self.exchange.memory, 0
        for i, slot, v in zip(taken, slots, averaged):
            finite = tf.math.is_finite(v)
            count = tf.reduce_sum(tf.cast(finite, tf.float32))
            mean = tf.where(count > 0, tf.reduce_sum(tf.where(finite, v, 0.0))
                            / tf.maximum(count, 1.0), 1.0)
            v = tf.maximum(tf.where(finite, v, mean), 0.0)  # (below zero: observe)
            slot.assign(tf.cast(v, slot.dtype))
            if self.amsgrad:
                hat = self._slot(self.variables[i], "vhat")
                hat.assign(tf.maximum(hat, tf.cast(v, hat.dtype)))
                v = tf.cast(hat, tf.float32)
            v = tf.reshape(v, [-1])
            scale = self._slot(self.variables[i], "scale")
            old = tf.reshape(tf.cast(scale, tf.float32), [-1])
            new = (1.0 - self.beta1) * _precondition(v, root, eps)
            new = tf.where(tf.reduce_any(v > 0), new, old)  # no gradient since: as it was
            ratio = new / old
            memory.u[i].assign(memory.u[i] * ratio)
            if int(memory.v[i].shape[0]):
                memory.v[i].assign(memory.v[i] * ratio)
            scale.assign(tf.reshape(tf.cast(new, scale.dtype), scale.shape))
            sent += 4 * int(v.shape[0])
        self.exchange.statistics.add(bytes_sent=sent, cause="refresh")
        return tf.constant(True)

    # -- the frozen step -------------------------------------------------------------
    def frozen_step(self, variable, average, lr, local_step):
        """``x -= lr / (1 - beta1^t) * average`` (AdamW's decay: Keras', before)."""
        dtype = variable.dtype
        alpha = tf.cast(lr, dtype) / (1.0 - tf.pow(tf.cast(self.beta1, dtype),
                                                   tf.cast(local_step, dtype)))
        variable.assign_sub(alpha * tf.cast(average, dtype))
        return tf.constant(True)

    def correct(self, corrections, variables, lr, iterations):
        """A flush's corrections (``avg - own`` of the steps in flight), which is not a
        step: ``x -= lr / (1 - beta1^t) * correction`` at Adam's count now, no decay (as
        the PyTorch side's ``correct``)."""
        for correction, variable in zip(corrections, variables):
            self.frozen_step(variable, correction, lr, tf.maximum(iterations, 1))

    def is_taken(self, variable):
        """Whether ``variable``'s update is taken over (DGC exchanges it)."""
        return self.exchange is not None and id(variable) in self._taken_ids


def _precondition(v, root, eps):
    """P from Adam's ``v`` (flat), floored at VARIANCE_FLOOR times its mean
    (hvd_dgc/adam.py); ``root`` = sqrt(1 - beta2^t), ``eps`` as Keras adds it there."""
    floored = tf.maximum(v, tf.reduce_mean(v) * VARIANCE_FLOOR)
    return 1.0 / (tf.sqrt(floored) / root + eps)
