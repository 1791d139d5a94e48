"""One step of TensorFlow's exchange, traced into the step's graph or run eagerly
(tensorflow/exchange.py ``GradientExchange`` joins it; PyTorch's step is torch/step.py
``ExchangeStep``):

    stage                       the warm-up stage, in TF ops, from step or epoch (elastic:
                                the largest of every rank's, agreed first)
    checks                      the world the step was traced for, before any collective
    local_grad                  dense, or IndexedSlices as Horovod sends them
    guard                       a NaN/Inf on any rank: every rank puts its memory back
                                and skips (guard.py)
    paths.step / paths.finish   each tensor on its path (tensorflow/paths.py)
    delayed                     with delay or period, own now, avg - own D steps later
                                (tensorflow/delayed.py)
"""

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Max

from hvd_dgc.say import say
from hvd_dgc.switch import long_trace_line
from hvd_dgc.tensorflow.guard import values
from hvd_dgc.tensorflow.paths import At

__all__ = ["ExchangeStep", "check_slices_allowed"]


class ExchangeStep:
    """One step of the exchange, traced into the step's graph or run eagerly: the warm-up
    stage, the checks before any collective, the guard, the paths, delayed averaging. A
    part of ``GradientExchange``."""

    def stage(self):
        """This step's index into the densities (the schedule, hvd_dgc.schedule.
        DensitySchedule.__call__, in TF ops): k and the path are looked up by it, so
        they are the ones Python computed."""
        s = self.schedule
        freeze = getattr(s, "freeze", None)  # Adam taken over: FrozenAdamSchedule
        if freeze is None:
            return _stage(s, self.step, self.epoch)
        # density 1 (exact Adam) to the freeze, then the inner schedule from its start
        inner = _stage(s.inner, self.step - freeze, self.epoch)
        return tf.where(self.step < freeze, 0, 1 + inner)

    def density(self, stage=None):
        """The density at ``stage`` (default: this step's)."""
        stage = self.stage() if stage is None else stage
        return tf.gather(tf.constant(self.densities, tf.float64), stage)

    def exchange(self, grads, size=None):
        """``(averaged gradients, skipped)``; ``skipped`` is a boolean tensor, True when
        a non-finite gradient on some rank made every rank skip this step. ``size``:
        the Keras optimizer's ``(rate, decays)`` for this step (delayed.py ``step``:
        what it multiplies the update by, and the decoupled decays before it), where
        delayed averaging takes own steps back; None with a tape, whose optimizer is
        the script's."""
        if tf.inside_function():  # every stage's paths traced now: said if long
            line = long_trace_line(*self.paths.compressed())
            if line:
                say(line, key="hvd_dgc.long_trace")
        checked = tf.group() if self.traced_once else self._check_world()
        if self.elastic:
            with tf.control_dependencies([checked]):
                agreed = self._agree()
            checked = tf.group(checked, agreed)
        with tf.control_dependencies([checked]):
            stage = self.stage()
        base = getattr(self.compression, "seed", 0)
        at = At(stage, self.density(stage),
                tf.stack([tf.cast(self.step, tf.int32) + base, _hvd.rank()]), self.step)
        with tf.control_dependencies([checked]):  # eagerly: None, and no-op
            # in a graph, nothing that leads to a collective starts before the check
            grads = [_after_check(self._local_grad(i, g)) for i, g in enumerate(grads)]
        if self.adam is not None:  # refresh_variance: this rank's v (tensorflow/adam.py)
            self.adam.observe(grads)
        if self.dense_fp16:
            clipped_before = self.statistics.fp16_clipped.read_value()
            with tf.control_dependencies([clipped_before]):
                out, bad = self._guarded(grads, at, size)
            with tf.control_dependencies([values(a) for a in out]):
                self.statistics.warn_fp16(clipped_before, self.step, self.wire.fp16_bound())
        else:
            out, bad = self._guarded(grads, at, size)
        # Python calls in the step are traced on every rank alike, and rank 0 alone speaks:
        # a call in rank 0's graph only left a 2-rank Keras fit with a lagging Adam
        # take-over waiting for good (tests/tensorflow/tf_adam.py fit_digits).
        if self.config.log_every:
            with tf.control_dependencies([values(a) for a in out]):
                tf.py_function(self._log, [self.step.read_value()], [])
        at_step = self.calls.at_step()
        if at_step:
            with tf.control_dependencies([values(a) for a in out]):
                self._trace_check(at_step)
        return out, bad

    def _trace_check(self, at_step):
        """At step ``at_step``, rank 0 says once what the script has not done by then
        (script_calls.py): a Python call each step, on every rank, that compares two
        numbers. (Not a ``tf.cond``: a functional If beside the step's collectives left
        a 2-rank run with 2 inter-op threads waiting for good.)"""
        def judge(step, epoch):
            if int(step) == at_step:
                self.calls.judge(int(step), float(epoch))
        tf.py_function(judge, [self.step.read_value(), self.epoch.read_value()], [])

    def _log(self, step):
        """``log_every``: rank 0 prints the statistics after every N-th step, as PyTorch's
        optimizer does (hvd_dgc/torch/statistics.py ``Progress.maybe_log``)."""
        step = int(step)
        if step and step % self.config.log_every == 0 and _hvd.rank() == 0:
            print(f"[hvd_dgc] step {step}: "
                  f"{self.statistics.format(step, float(self.density().numpy()))}", flush=True)

    def _check_world(self):
        """Stop, before any collective, a step running in another world than the plan
        was made for (an elastic reset): its paths, 1/N scales and bounds would be
        wrong, and ranks that planned differently would wait for each other forever."""
        return tf.debugging.assert_equal(
            _hvd.size_op(process_set_id=self.process_set.process_set_id),
            self.built_world,
            message=f"hvd_dgc: this step was traced for {self.built_world} ranks and "
                    f"runs in a world of another size (an elastic Horovod reset?). Under "
                    f"elastic Horovod use hvd_dgc.tensorflow.keras's DistributedOptimizer "
                    f"with its hvd.elastic.KerasState (model.fit then re-plans and traces "
                    f"its step again), or DistributedGradientTape under horovodrun's "
                    f"elastic mode (its step then holds in every world)")

    def _agree(self):
        """Under elastic Horovod, the first step after a build or a reset takes the
        largest step and epoch of all ranks (one small allreduce), before they decide
        anyone's density and path. A worker that joined may step before the state's
        sync gives it rank 0's (Horovod's elastic Keras example fits a step before
        making its state, and another in a reset callback): at step 0 of a warm-up its
        path could differ from the others' and the collectives would not match."""
        def agree():
            both = _hvd.allreduce(tf.stack([tf.cast(self.step, tf.float64),
                                            tf.cast(self.epoch, tf.float64)]),
                                  op=Max, name="hvd_dgc.elastic.agree",
                                  process_set=self.process_set)
            with tf.control_dependencies([self.step.assign(tf.cast(both[0], tf.int64)),
                                          self.epoch.assign(tf.cast(both[1], tf.float32)),
                                          self.agreeing.assign(False)]):
                return tf.constant(True)
        return tf.cond(self.agreeing, agree, lambda: tf.constant(False))

    @property
    def may_skip(self):
        """Whether a non-finite gradient can make every rank skip a step (guard.py): in
        a synchronous step, and in Adam's exact warm-up with delay (synchronous too);
        under delayed averaging the rank that has it drops it instead."""
        return self.skip_nonfinite and (not self.lags or self.adam is not None)

    def _guarded(self, grads, at, size):
        """skip_nonfinite: a NaN/Inf gradient never enters the memory (guard.py)."""
        if not self.skip_nonfinite:
            return self._step(grads, at, size), tf.constant(False)
        if not self.lags:
            return self._skipping(grads, at)
        if self.adam is None:
            return self._delayed(grads, at, self.guard.drop(grads), size), tf.constant(False)

        def warm_up():  # Adam's exact steps: synchronous, skipped as such
            out, bad = self._skipping(grads, at)
            return out + [bad]

        def frozen():
            return self._delayed(grads, at, self.guard.drop(grads), size) + [tf.constant(False)]
        *out, bad = tf.cond(self.adam.frozen(), frozen, warm_up)
        return out, bad

    def _skipping(self, grads, at):
        """A synchronous step every rank skips when any rank's gradient is not finite
        (the guard counts the step when it is kept)."""
        return self.guard.skip(grads, lambda poison: self.paths.step(grads, at, poison),
                               self.paths.finish, self.paths.shortcuts)

    def _synchronous(self, grads, at):
        return self.paths.finish(self.paths.step(grads, at))

    def _step(self, grads, at, size):
        """A step without the guard: synchronous, or delayed averaging; with Adam taken
        over, delayed from its freeze on (its exact warm-up is not linear in the
        gradient, so nothing of it may be replaced later: every rank takes the same
        branch, the step being theirs)."""
        if not self.lags:
            out = self._synchronous(grads, at)
        elif self.adam is None:
            out = self.dga.step(grads, at, size=size)
        else:
            out = tf.cond(self.adam.frozen(),
                          lambda: self.dga.step(grads, at, size=size),
                          lambda: self._synchronous(grads, at))
        self.step.assign_add(1)
        return out

    def _delayed(self, grads, at, dropped, size):
        """A delayed step, this rank's non-finite tensors ``dropped`` (guard.py)."""
        out = self.dga.step(grads, at, dropped, size)
        self.step.assign_add(1)
        return out

    def _local_grad(self, i, grad):
        """The gradient as it will travel: dense, or IndexedSlices (Horovod's way)."""
        tensor = self.tensors[i]
        if grad is None:
            if tensor.sliced:  # nothing looked up: no rows
                return tf.IndexedSlices(tf.zeros((0,) + tensor.shape[1:]),
                                        tf.zeros([0], tf.int32),
                                        tf.constant(tensor.shape, tf.int64))
            return tf.zeros([tensor.numel])
        if isinstance(grad, tf.IndexedSlices):
            if self.sparse_as_dense:
                return tf.convert_to_tensor(grad)
            check_slices_allowed(self.resolved.config, tensor.name)
            return grad
        if tensor.sliced:
            raise ValueError(
                f"hvd_dgc: variable '{tensor.name}' had a sparse (IndexedSlices) gradient "
                f"when hvd_dgc built its memory and has a dense one now, and it has no "
                f"residual slot. Pass sparse_as_dense=True to hvd_dgc's "
                f"DistributedGradientTape / DistributedOptimizer.")
        return grad


def _stage(schedule, step, epoch):
    """A DensitySchedule's stage at ``step`` / ``epoch``, in TF ops (as its Python
    ``__call__`` counts the stages ended); its final density's index after the warm-up."""
    s = schedule
    if s.warmup <= 0:
        return tf.constant(0, tf.int32)
    t = tf.cast(epoch if s.unit == "epoch" else step, tf.float64)
    ends = tf.constant(s.boundaries, tf.float64)
    stage = tf.minimum(tf.reduce_sum(tf.cast(t >= ends, tf.int32)),
                       len(s.warmup_densities) - 1)
    return tf.where(t >= s.warmup, len(s.warmup_densities), stage)


def _after_check(grad):
    """``grad`` through an identity, so it depends on the control context it is made in."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


def check_slices_allowed(config, name):
    """A variable with IndexedSlices gradients cannot lag (``config.lagging``)."""
    if config.lagging:
        raise ValueError(
            f"hvd_dgc: variable '{name}' has a sparse (IndexedSlices) gradient (an "
            f"embedding lookup?) and {config.lagging}: a rank's own steps replaced by "
            f"the average later need dense gradients. Pass sparse_as_dense=True to "
            f"hvd_dgc's DistributedGradientTape / DistributedOptimizer, or "
            f"{config.undo_lagging}.")
