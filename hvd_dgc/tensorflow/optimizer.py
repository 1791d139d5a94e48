"""The Keras ``DistributedOptimizer``: the user's optimizer class joined with hvd_dgc's.

As Horovod's own wrapper does (horovod/_keras ``create_distributed_optimizer``), the
optimizer returned is rebuilt from ``optimizer.get_config()`` as an instance of a class
made for it: the user's optimizer class under hvd_dgc's mixins, joined in one place
(``_join``). The mixins, by concern:

- ``HvdDgcMethods``: what every optimizer of hvd_dgc's shows a script
  (``compression_stats``, ``dgc_state``, ``set_epoch``, ``in_flight``);
- ``DGCOptimizer``: what every version has beside (``flush``, ``register_local_var``),
  the exchange of one call's gradients and the step that applies them;
- where the gradients meet the optimizer, by Keras version: ``Keras3Step`` (``apply``),
  ``Keras2Step`` (tf_keras: ``apply_gradients`` and Horovod's ``_compute_gradients``),
  ``LegacyStep`` (tf_keras' OptimizerV2: ``apply_gradients``);
- ``SGDWithoutSlot``: tf_keras' SGD whose momentum DGC's memory took over;
- Adam and AdamW taken over (tensorflow/adam.py), by Keras version: ``AdamKeras3``,
  ``AdamKeras2``, ``AdamLegacy`` (the frozen scales among the optimizer's variables,
  the update Adam's own until the freeze);
- the outer loop instead (``outer=hvd.OuterLoop(...)``): ``OuterOptimizer`` and its
  ``OuterKeras3``, ``OuterKeras2``, ``OuterLegacy``.

What the join decides (Adam's take-over, the passes summed, the momentum of local
variables) is the class's; the exchange is the instance's (``_hvd_dgc``).
"""

from typing import NamedTuple

import tensorflow as tf

from horovod.tensorflow import Average, global_process_set
import horovod.tensorflow as _hvd

from hvd_dgc.config import DGCConfig
from hvd_dgc.resolve import check_clipping_under_lagging
from hvd_dgc.outer import check_outer
from hvd_dgc.tensorflow.adam import ADAM_CLASSES, PREVIOUS_NAME, SCALE_NAME, \
    AdamTakeOver, check_adam
from hvd_dgc.tensorflow.compression import Compression
from hvd_dgc.tensorflow.exchange import GradientExchange
from hvd_dgc.tensorflow.keras_optimizers import create_optimizer_variables, is_keras3, \
    is_legacy
from hvd_dgc.tensorflow.names import tensor_names, variable_name
from hvd_dgc.tensorflow.outer import OuterRounds
from hvd_dgc.tensorflow.tape_exchanges import variable_ref

__all__ = ["DistributedOptimizer"]

# The methods a training step calls run as written, not converted by AutoGraph: the
# conversion of hvd_dgc, Horovod and json (their Python made into graph control flow
# where nothing needs it) was 20 s of a 26 s first trace, in every process.
_as_written = tf.autograph.experimental.do_not_convert


class Accumulation:
    """``backward_passes_per_step=P`` as Horovod's Keras optimizer does it
    (LocalGradientAggregationHelper): each call adds its gradients to a local sum;
    every P-th call exchanges the sum (divided by P with
    ``average_aggregated_gradients``) and applies it; the calls between only count
    in ``optimizer.iterations``. DGC's memory sees one gradient per exchange.
    ``counter`` is Horovod's name (``opt._agg_helper.counter``): calls since the
    last exchange."""

    def __init__(self, passes, average, sparse_as_dense):
        self.passes, self.average, self.sparse_as_dense = passes, average, sparse_as_dense
        self.sums = None

    def build(self, variables):
        if self.sums is None:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False)
                self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                             for v in variables]

    @property
    def variables(self):
        """The count and the sums (an elastic commit keeps them with the weights)."""
        return [] if self.sums is None else [self.counter] + list(self.sums)

    def agree(self, agreeing, process_set):
        """Elastic Horovod: until the exchange's first step after a build or a reset
        (``agreeing``), every rank counts from the largest count (a worker that joined,
        or that stepped in a reset callback before the state's sync, from where the
        others are), so all exchange at the same call. One small allreduce a call."""
        def largest():
            top = _hvd.allreduce(tf.cast(self.counter, tf.float64), op=_hvd.Max,
                                 name="hvd_dgc.elastic.passes", process_set=process_set)
            return self.counter.assign(tf.cast(top, tf.int64))
        return tf.cond(agreeing, largest, self.counter.read_value)

    def add(self, grads, names):
        """Add this pass's gradients; whether the sum is complete (a bool tensor, made
        after the sums: whatever reads them next waits for it)."""
        added = []
        for s, g, name in zip(self.sums, grads, names):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(
                        f"hvd_dgc: variable '{name}' has a sparse (IndexedSlices) gradient "
                        f"and backward_passes_per_step={self.passes}: its passes are summed "
                        f"densely. Pass sparse_as_dense=True, as Horovod requires.")
                g = tf.convert_to_tensor(g)
            if g is not None:
                added.append(s.assign_add(tf.cast(g, s.dtype)))
        with tf.control_dependencies(added):
            return tf.equal(self.counter.assign_add(1), self.passes)

    def partial(self):
        """The sums so far (what Horovod hands out on the calls between exchanges)."""
        return [s.read_value() for s in self.sums]

    def take(self):
        """The complete sum (over P if averaged), and a fresh start."""
        out = [s.read_value() / self.passes if self.average else s.read_value()
               for s in self.sums]
        with tf.control_dependencies(out):
            for s in self.sums:
                s.assign(tf.zeros_like(s))
            self.counter.assign(0)
        return [tf.identity(g) for g in out]


class Prepared(NamedTuple):
    """One call's gradients, exchanged and waiting to be applied. Horovod's
    ``_compute_gradients`` hands them out exchanged and the next ``apply_gradients``
    applies what it is given without exchanging again; a plain ``apply_gradients``
    (``model.fit``, a custom loop) prepares and applies at once."""
    grads: list  # every variable's: averaged, or this rank's own (a local variable)
    variables: list
    apply: object  # bool tensor, or None (always): False when every rank skips the step
    counts: object  # bool tensor, or None (never): a pass that only counts in iterations
    graph: object  # where the tensors live (a stale one is not applied)


def _graph():
    """The tf.function being traced (None eagerly); a cond's branch belongs to it."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):  # FuncGraphs
        graph = graph.outer_graph
    return graph


def _no_grad_loss(grad_loss):
    if grad_loss is not None:
        raise ValueError("hvd_dgc: _compute_gradients(grad_loss=...) is not supported by "
                         "Keras 2's optimizers (nor applied by Horovod's); scale the loss "
                         "instead.")


class HvdDgcMethods:
    """What every optimizer of hvd_dgc's shows a script, DGC's and the outer loop's
    alike; their state is ``_hvd_dgc`` (the GradientExchange, or the OuterRounds), the
    passes summed ``_hvd_dgc_passes`` (an Accumulation, or None: one pass a step)."""

    _hvd_dgc_passes = None

    def compression_stats(self):
        """Bytes sent vs dense fp32, density and path counts (this rank), as a dict."""
        return self._hvd_dgc.stats()

    def set_epoch(self, epoch):
        """Epoch-based warm-up (in ``model.fit`` every one of hvd_dgc's callbacks calls it
        at the start of each epoch: callbacks.py ``follow_epoch``)."""
        self._hvd_dgc.set_epoch(epoch)

    @property
    def dgc_state(self):
        """hvd_dgc's state (DGC's memory, step and epoch, or the outer loop's) as a
        tf.Module for tf.train.Checkpoint (``tf.train.Checkpoint(model=model,
        dgc=opt.dgc_state)``; one file per rank). Keras 2 also saves it with the
        optimizer; Keras 3's ``model.save`` does not."""
        return self._hvd_dgc

    @property
    def in_flight(self):
        """Steps whose averages have not been applied yet (delay > 0, or period > 1
        between exchanges; the outer loop's exchange under ``overlap``)."""
        return self._hvd_dgc.in_flight

    @property
    def _agg_helper(self):
        """Horovod's name for the passes summed (``backward_passes_per_step``)."""
        return self._hvd_dgc_passes


class DGCOptimizer(HvdDgcMethods):
    """hvd_dgc's part of every Keras version's optimizer. Set by the join (``_join``):
    ``_hvd_dgc_adam`` (an AdamTakeOver, or None), ``_hvd_dgc_passes`` (an Accumulation,
    or None: one pass a step), ``_hvd_dgc_local_momentum`` (SGD's ``(momentum,
    nesterov)`` that the memory took over, or None), ``_hvd_dgc_scale_local``
    (Horovod's ``scale_local_gradients``); per instance ``_hvd_dgc`` (the
    GradientExchange) and ``_hvd_dgc_local`` (``register_local_var``'s)."""

    _hvd_dgc_adam = None
    _hvd_dgc_local_momentum = None
    _hvd_dgc_scale_local = True

    # -- hvd_dgc's methods --------------------------------------------------------------
    def register_local_var(self, var):
        """As Horovod's: ``var``'s gradient stays on this rank, never exchanged (divided by
        the number of ranks with ``scale_local_gradients=True``, Horovod's default). Call
        it before the first step, on every rank alike."""
        if self._hvd_dgc.memory is not None:
            raise ValueError(
                f"hvd_dgc: register_local_var({variable_name(var, 0)!r}) after the first "
                f"step: the exchange was built for the variables it had then. Register "
                f"local variables before training.")
        self._hvd_dgc_local.add(variable_ref(var))

    @_as_written
    def flush(self):
        """Delayed averaging (``delay=D``, ``period=p``): apply the steps still in flight
        (a period's own steps since its last exchange are taken back: their velocity is
        still in the memory) and leave every rank with the same weights.
        ``callbacks.DGCCallback`` calls it before evaluation and at the end of
        ``model.fit``; call it yourself before checkpointing. Returns whether anything
        was in flight."""
        base, adam = super(DGCOptimizer, self), self._hvd_dgc_adam  # the user's class

        def apply(corrections, variables):  # SGD, its momentum taken over: w -= lr * c
            if adam is not None:  # Adam taken over (in flight only after its freeze)
                adam.correct(corrections, variables, self._dgc_current_lr(),
                             self.iterations)
            elif isinstance(self, Keras3Step):
                base.apply(corrections, variables)
            else:
                base.apply_gradients(zip(corrections, variables))
        return self._hvd_dgc.flush(apply, self.iterations,
                                   float(self._dgc_rate(ahead=False)))

    # -- one call's gradients, exchanged --------------------------------------------------
    def _dgc_prepare(self, grads, variables):
        """Exchange one call's gradients. With ``backward_passes_per_step=P`` the call
        adds to a local sum and every P-th call exchanges it (every rank counts alike,
        so every rank takes the same branch and joins the same collectives); the calls
        between hand out the sum so far and only count in ``iterations``, as in
        Horovod."""
        create_optimizer_variables(self, variables)  # no variable may be born in a cond
        local, shared = self._dgc_split(variables)
        accumulation = self._hvd_dgc_passes
        if accumulation is None:
            out, apply = self._dgc_exchange(grads, variables, local, shared)
            return Prepared(out, variables, apply, None, _graph())
        accumulation.build(variables)
        # (after the optimizer's variables: Adam's frozen scales)
        self._hvd_dgc.build([variables[i] for i in shared])
        if local:
            self._dgc_local_velocity([variables[i] for i in local])
        names = tensor_names(variables)
        dgc = self._hvd_dgc  # elastic: every rank's count the largest first
        agreed = [accumulation.agree(dgc.agreeing, dgc.process_set)] if dgc.elastic else []
        with tf.control_dependencies(agreed):
            complete = accumulation.add(grads, names)

        def exchange():
            out, apply = self._dgc_exchange(accumulation.take(), variables, local, shared)
            return [tf.identity(g) for g in out], \
                tf.constant(True) if apply is None else apply

        def wait():
            return accumulation.partial(), tf.constant(False)
        out, apply = tf.cond(complete, exchange, wait)
        return Prepared(out, variables, apply, tf.logical_not(complete), _graph())

    def _dgc_split(self, variables):
        """Positions of the variables ``register_local_var`` kept on their rank, and of
        the shared ones."""
        refs = [variable_ref(v) for v in variables]
        return ([i for i, r in enumerate(refs) if r in self._hvd_dgc_local],
                [i for i, r in enumerate(refs) if r not in self._hvd_dgc_local])

    def _dgc_exchange(self, grads, variables, local, shared):
        """``(gradients to apply, apply)``: the ``shared`` variables' averaged through
        DGC, the ``local`` ones' kept (``register_local_var``); ``apply`` is False when a
        non-finite gradient on some rank made every rank skip the step (None: no such
        check)."""
        exchange = self._hvd_dgc
        exchanged = [variables[i] for i in shared]
        exchange.build(exchanged, [grads[i] for i in shared])
        size = self._dgc_step_size(exchanged) if exchange.lags else None
        averaged, skipped = exchange.exchange([grads[i] for i in shared], size)
        apply = tf.logical_not(skipped) if exchange.may_skip else None
        out = list(grads)
        for i, g in zip(shared, averaged):
            out[i] = g
        if local:
            kept = self._dgc_keep_local([grads[i] for i in local],
                                        [variables[i] for i in local], apply)
            for i, g in zip(local, kept):
                out[i] = g
        return out, apply

    def _dgc_keep_local(self, grads, variables, apply):
        """``register_local_var``: those variables' gradients stay on this rank, as in
        Horovod (divided by the number of ranks with ``scale_local_gradients``,
        Horovod's default; with SGD's momentum taken over, the momentum SGD would have
        applied, kept in ``dgc_state``, which a skipped step leaves alone)."""
        velocity = self._dgc_local_velocity(variables)
        scale = (1.0 / self._hvd_dgc.world_size()) if self._hvd_dgc_scale_local else 1.0

        def own(g, u):
            if isinstance(g, tf.IndexedSlices) and u is None:
                return tf.IndexedSlices(g.values * scale, g.indices, g.dense_shape)
            g = tf.convert_to_tensor(g) * scale
            if u is None:
                return g
            momentum, nesterov = self._hvd_dgc_local_momentum
            # as the memory's velocity (hvd_dgc/tensorflow/memory.py)
            moved = momentum * (u + g) if nesterov else momentum * u + g
            u.assign(moved if apply is None else tf.where(apply, moved, u))
            return u.read_value() + g if nesterov else u.read_value()
        return [own(g, velocity[j] if velocity else None) for j, g in enumerate(grads)]

    def _dgc_local_velocity(self, variables):
        """SGD's momentum for the local variables when DGC took it over (else [])."""
        if self._hvd_dgc_local_momentum is None:
            return []
        holder = getattr(self._hvd_dgc, "local_velocity", None)
        if holder is None:
            with tf.init_scope():
                holder = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False,
                                      name=f"local_velocity_{i}")
                          for i, v in enumerate(variables)]
            self._hvd_dgc.local_velocity = holder  # tracked: checkpoints and KerasState
        return holder

    # -- the step that applies them ---------------------------------------------------------
    def _dgc_finish(self, prepared, apply, grads=None):
        """``apply(grads)`` (the prepared ones by default) unless every rank skips this
        step (as Keras' LossScaleOptimizer: a cond around the inner optimizer's step); a
        pass that only counts adds one to ``iterations``."""
        grads = prepared.grads if grads is None else grads
        if self._hvd_dgc_adam is not None:
            apply = self._dgc_then_freeze(apply)
        if prepared.apply is None:
            return apply(grads)

        def step():  # (the gradients made anew in the branch's graph)
            apply([tf.identity(g) if isinstance(g, tf.Tensor) else g for g in grads])
            return tf.constant(True)

        def count():
            self.iterations.assign_add(1)
            return tf.constant(False)

        def other():
            if prepared.counts is None:
                return tf.constant(False)
            return tf.cond(prepared.counts, count, lambda: tf.constant(False))
        return tf.cond(prepared.apply, step, other)

    def _dgc_then_freeze(self, apply):
        """``apply``, then, at the end of step ``freeze - 1`` (the exchange has counted
        it), Adam's variance frozen and its first moment moved into DGC's memory; at the
        end of a refresh step (``refresh_variance``), the ranks' variances averaged into
        it."""
        adam = self._hvd_dgc_adam

        def applied(grads):
            out = apply(grads)
            step = self._hvd_dgc.step
            tf.cond(tf.equal(step, adam.freeze),
                    lambda: adam.freeze_now(self.iterations), lambda: tf.constant(False))
            tf.cond(adam.refreshing(step),
                    lambda: adam.refresh_now(self.iterations), lambda: tf.constant(False))
            return out
        return applied

    # -- what the optimizer multiplies an update by ----------------------------------------
    def _dgc_rate(self, ahead=True):
        """What this optimizer multiplies an update by: SGD's ``lr`` (its momentum taken
        over), frozen Adam's ``lr / (1 - beta1^t)`` at the coming step (``ahead``:
        Keras' ``t = iterations + 1``) or a flush's (``correct``'s count), float32 as
        they step."""
        lr = tf.cast(self._dgc_current_lr(), tf.float32)
        adam = self._hvd_dgc_adam
        if adam is None:
            return lr
        t = self.iterations + 1 if ahead else tf.maximum(self.iterations, 1)
        return lr / (1.0 - tf.pow(tf.constant(adam.beta1, tf.float32),
                                  tf.cast(t, tf.float32)))

    def _dgc_step_size(self, variables):
        """``(rate, decays)`` of the coming step (delayed.py ``step``): the rate, and per
        exchanged variable the ``lr wd`` of the decoupled decay Keras applies before the
        update (``weight_decay``, with its exclusions; 0 where none)."""
        wd = getattr(self, "weight_decay", None)
        if not wd or is_legacy(self):
            return self._dgc_rate(), tf.zeros([len(variables)])
        lr = tf.cast(self._dgc_current_lr(), tf.float32) * float(wd)
        return self._dgc_rate(), tf.stack([lr if self._use_weight_decay(v) else tf.zeros([])
                                           for v in variables])

    def _dgc_current_lr(self):
        """The learning rate Keras would step with now (its schedule at ``iterations``)."""
        if is_legacy(self):
            return self._decayed_lr(tf.float32)
        if isinstance(self, Keras3Step):
            return self._get_current_learning_rate()
        schedule = getattr(self, "_learning_rate", None)  # tf_keras: its learning_rate
        if callable(schedule) and not isinstance(schedule, tf.Variable):  # is the last
            return schedule(self.iterations)                             # step's until
        return self.learning_rate                                        # it steps

    def _dgc_adam_update(self, variable, gradient, lr, adams):
        """``adams()``: Adam's own update of ``variable``, until its variance is frozen;
        then ``x -= lr / (1 - beta1^t) * average`` (tensorflow/adam.py)."""
        take = self._hvd_dgc_adam
        if not take.is_taken(variable) or isinstance(gradient, tf.IndexedSlices):
            return adams()

        def own():
            adams()
            return tf.constant(True)
        return tf.cond(take.applying_frozen(),
                       lambda: take.frozen_step(variable, gradient, lr(),
                                                self.iterations + 1), own)


# -- where the gradients meet the optimizer, by Keras version ------------------------------
class Keras3Step(DGCOptimizer):
    """Keras 3: ``apply`` exchanges the gradients, then applies them."""

    @_as_written
    def apply(self, grads, trainable_variables=None):
        variables = list(self._trainable_variables if trainable_variables is None
                         else trainable_variables)
        base = super(DGCOptimizer, self)
        return self._dgc_finish(self._dgc_prepare(list(grads), variables),
                                lambda g: base.apply(g, trainable_variables))


class LegacyStep(DGCOptimizer):
    """tf_keras' legacy optimizers (OptimizerV2): ``apply_gradients`` exchanges first
    (their own ``minimize`` calls their own ``_compute_gradients``)."""

    @_as_written
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Applies the gradients ``_compute_gradients`` just handed out (exchanged
        there, as in Horovod) as they are given; any others are exchanged first."""
        grads_and_vars = list(grads_and_vars)
        grads, variables = [g for g, _ in grads_and_vars], [v for _, v in grads_and_vars]
        base = super(DGCOptimizer, self)

        def apply(gs):
            return base.apply_gradients(zip(gs, variables), *args, **kwargs)
        prepared = self.__dict__.pop("_hvd_dgc_prepared", None)
        if prepared is None or prepared.graph is not _graph():
            return self._dgc_finish(self._dgc_prepare(grads, variables), apply)
        if [variable_ref(v) for v in prepared.variables] != \
                [variable_ref(v) for v in variables]:
            raise ValueError(
                "hvd_dgc: apply_gradients got other variables than _compute_gradients "
                "exchanged the gradients of just before: pass apply_gradients the "
                "(gradient, variable) pairs _compute_gradients returned (the gradients "
                "may be changed in between; the variables must be the same, in the same "
                "order).")
        return self._dgc_finish(prepared, apply, grads)


class Keras2Step(LegacyStep):
    """tf_keras (Keras 2): ``apply_gradients`` as the legacy one, and Horovod's
    ``_compute_gradients``."""

    @_as_written
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's aggregation API (its own tests and scripts call it): the gradients
        come back averaged (through DGC here) and the next ``apply_gradients`` applies
        them as given, without a second exchange. With ``backward_passes_per_step=P``
        the calls between exchanges return the local sum so far, and their
        ``apply_gradients`` only counts. (Keras' public ``compute_gradients`` returns
        this rank's gradients, which ``apply_gradients`` exchanges: a
        LossScaleOptimizer around this one calls it with the scaled loss, and DGC's
        memory must not keep scaled gradients.)"""
        _no_grad_loss(grad_loss)
        # (no tape made here: Keras refuses a Tensor loss without the tape that computed
        # it, where a fresh tape would give None gradients)
        grads_and_vars = list(super().compute_gradients(loss, var_list, tape=tape))
        variables = [v for _, v in grads_and_vars]
        prepared = self._dgc_prepare([g for g, _ in grads_and_vars], variables)
        self.__dict__["_hvd_dgc_prepared"] = prepared  # (untracked: not a Keras attribute)
        return list(zip(prepared.grads, variables))


class SGDWithoutSlot:
    """tf_keras' SGD whose momentum DGC took over: ``w -= lr g`` in one in-place pass
    (TF's gradient-descent kernel). tf_keras' own step keeps its momentum slot at
    momentum 0 and updates it every step (``m = -g lr + m 0; w += m``): four
    temporaries of the tensor's size and two writes, the same values (Keras 3's SGD and
    the legacy one already skip the slot at momentum 0)."""

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices) or not isinstance(variable, tf.Variable) \
                or gradient.dtype != variable.dtype:
            return super().update_step(gradient, variable)
        return tf.raw_ops.ResourceApplyGradientDescent(
            var=variable.handle, alpha=tf.cast(self.learning_rate, variable.dtype),
            delta=gradient, use_locking=False)


# -- Adam and AdamW taken over (tensorflow/adam.py), by Keras version --------------------
class AdamKeras3(DGCOptimizer):
    def build(self, var_list):
        fresh = not self.built
        super().build(var_list)
        if fresh:
            self._hvd_dgc_scales = self.add_optimizer_variables(var_list, SCALE_NAME,
                                                                initializer="ones")
            if self._hvd_dgc_adam.refresh is not False:
                self._hvd_dgc_previous = self.add_optimizer_variables(
                    var_list, PREVIOUS_NAME, initializer="zeros")

    def update_step(self, gradient, variable, learning_rate):
        return self._dgc_adam_update(
            variable, gradient, lambda: learning_rate,
            lambda: super(AdamKeras3, self).update_step(gradient, variable, learning_rate))


class AdamKeras2(DGCOptimizer):
    def build(self, var_list):
        fresh = not getattr(self, "_built", False)
        super().build(var_list)
        if fresh:
            self._hvd_dgc_scales = [self.add_variable_from_reference(
                var, SCALE_NAME, initial_value=tf.ones(var.shape, var.dtype))
                for var in var_list]
            if self._hvd_dgc_adam.refresh is not False:
                self._hvd_dgc_previous = [self.add_variable_from_reference(
                    var, PREVIOUS_NAME, initial_value=tf.zeros(var.shape, var.dtype))
                    for var in var_list]

    def update_step(self, gradient, variable):
        return self._dgc_adam_update(
            variable, gradient, lambda: self.learning_rate,
            lambda: super(AdamKeras2, self).update_step(gradient, variable))


class AdamLegacy(DGCOptimizer):
    def _create_slots(self, var_list):
        super()._create_slots(var_list)
        for var in var_list:
            self.add_slot(var, SCALE_NAME, initializer="ones")
            if self._hvd_dgc_adam.refresh is not False:
                self.add_slot(var, PREVIOUS_NAME, initializer="zeros")

    def _resource_apply_dense(self, grad, var, apply_state=None):
        def lr():
            key = (var.device, var.dtype.base_dtype)
            return ((apply_state or {}).get(key) or self._fallback_apply_state(*key))["lr_t"]
        return self._dgc_adam_update(
            var, grad, lr,
            lambda: super(AdamLegacy, self)._resource_apply_dense(grad, var, apply_state))


# -- the outer loop (outer=hvd_dgc.OuterLoop(...), hvd_dgc/tensorflow/outer.py) ----------
class OuterOptimizer(HvdDgcMethods):
    """The user's optimizer steps on this rank's own gradients; every H-th step ends a
    round (``_hvd_dgc``: the OuterRounds; one pass a step)."""

    @_as_written
    def flush(self):
        """Apply the exchange in flight (``overlap``) and end the round under way now,
        so every rank holds the same weights (before evaluating, checkpointing, or at
        the end; ``callbacks.DGCCallback`` calls it before evaluation and when ``fit``
        ends)."""
        return self._hvd_dgc.flush()

    def register_local_var(self, var):
        raise ValueError(f"hvd_dgc: register_local_var({variable_name(var, 0)!r}) with "
                         f"outer=OuterLoop(...): the outer loop averages the change of "
                         f"every variable it steps. Step a local variable with an "
                         f"optimizer of its own.")

    def _outer_step(self, variables, apply):
        rounds = self._hvd_dgc
        rounds.build(variables)
        rounds.begin(variables)  # (the first step: the shared weights are rank 0's)
        out = apply()
        rounds.end_step(variables)
        return out


class OuterKeras3(OuterOptimizer):
    @_as_written
    def apply(self, grads, trainable_variables=None):
        variables = self._trainable_variables if trainable_variables is None \
            else trainable_variables
        return self._outer_step(list(variables),
                                lambda: super(OuterKeras3, self).apply(grads,
                                                                       trainable_variables))


class OuterLegacy(OuterOptimizer):
    @_as_written
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        return self._outer_step(
            [v for _, v in grads_and_vars],
            lambda: super(OuterLegacy, self).apply_gradients(grads_and_vars, *args,
                                                             **kwargs))


class OuterKeras2(OuterLegacy):
    @_as_written
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's ``_compute_gradients``: this rank's own gradients (the inner steps
        are local; the round exchanges the weights' change)."""
        _no_grad_loss(grad_loss)
        return list(super().compute_gradients(loss, var_list, tape=tape))


def _version(optimizer):
    return "keras3" if is_keras3(optimizer) else "legacy" if is_legacy(optimizer) \
        else "keras2"


_STEPS = {"keras3": Keras3Step, "keras2": Keras2Step, "legacy": LegacyStep}
_ADAMS = {"keras3": AdamKeras3, "keras2": AdamKeras2, "legacy": AdamLegacy}
_OUTERS = {"keras3": OuterKeras3, "keras2": OuterKeras2, "legacy": OuterLegacy}


def _join(optimizer, mixins, attributes, keras_config, name, state):
    """The one join: a class of the user's optimizer's name under ``mixins`` (with
    ``attributes``), built from ``keras_config`` (its ``get_config()``) as Horovod
    does, holding ``state`` (the exchange, or the outer loop's rounds) as ``_hvd_dgc``
    and an empty set of ``register_local_var``'s variables."""
    cls = type(optimizer.__class__.__name__, (*mixins, optimizer.__class__), attributes)
    if name is not None:
        keras_config["name"] = name
    new = cls.from_config(keras_config)
    if is_keras3(optimizer):
        # Keras 3 would make it a checkpoint dependency of the optimizer (its per-rank
        # memory is saved by dgc_state instead): set past its attribute tracking
        object.__setattr__(new, "_hvd_dgc", state)
    else:
        new._hvd_dgc = state  # tracked: tf.train.Checkpoint saves it with the optimizer
    object.__setattr__(new, "_hvd_dgc_local", set())  # (no Keras tracked set)
    return new


def _outer_optimizer(optimizer, name, outer, config, process_set, passes):
    """The user's optimizer class, stepping locally, with the outer loop's round."""
    if passes > 1:
        raise ValueError(f"outer=OuterLoop(...) with backward_passes_per_step={passes}: "
                         f"the inner steps are local already; use "
                         f"OuterLoop(steps=...) for fewer exchanges and "
                         f"backward_passes_per_step=1.")
    density = 1.0 if config.density is None else float(config.density)
    rounds = OuterRounds(outer, density, config.min_compress_size, process_set)
    new = _join(optimizer, (_OUTERS[_version(optimizer)],), {}, optimizer.get_config(),
                name, rounds)
    if process_set.included() and _hvd.rank() == 0:  # short; the whole story with verbose
        from hvd_dgc.say import verbose
        from hvd_dgc.switch import outer_line
        print(outer_line("tensorflow", outer, density, type(optimizer).__name__,
                         verbose(config.verbose)), flush=True)
    return new


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                         compression=None, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True,
                         outer=None, **options):
    """Horovod's Keras DistributedOptimizer with Deep Gradient Compression.

    Returns a new optimizer of the same class built from ``optimizer.get_config()``, as
    Horovod does; Horovod's arguments keep their meaning. ``compression`` not given, or
    Horovod's ``Compression.none`` / ``fp16``, mean DGC (fp32 / fp16 values);
    ``density=1.0`` dense averaging. With Keras' Adam or AdamW and no option of DGC's
    top-k: exact Adam, then the scaled sign after the freeze, an exchange every 4th
    step (0/1 Adam, hvd_dgc/adam.py). hvd_dgc's options are keyword only, as in
    ``hvd_dgc.torch.DistributedOptimizer`` (docs/options.md); an unknown one is refused
    with the closest name. Under Keras 3 call ``model.compile(..., jit_compile=False)``:
    Horovod's collectives have no XLA kernels.

    With SGD the memory applies its momentum (the rebuilt optimizer runs with momentum
    0). ``delay=D`` and ``period=p`` (delayed averaging, temporally sparse updates)
    need SGD or Adam/AdamW taken over; ``opt.flush()`` (``callbacks.DGCCallback`` calls
    it before evaluation and when ``fit`` ends) applies what is in flight and leaves
    every rank with the same weights. ``skip_nonfinite`` (default True): a NaN/Inf
    gradient on any rank makes every rank skip the step. IndexedSlices gradients travel
    as in Horovod (``sparse_as_dense=True`` sends them through DGC);
    ``backward_passes_per_step`` sums passes locally, as Horovod's.
    ``outer=hvd_dgc.OuterLoop(steps=H)``: an outer loop instead (DiLoCo,
    hvd_dgc/tensorflow/outer.py). All of it: docs/tensorflow.md.
    """
    config = DGCConfig.from_options(options, "tensorflow", "DistributedOptimizer")
    if outer is not None:
        check_outer(outer, config, compression in (None, Compression.dgc, Compression.none),
                    op == Average)
        return _outer_optimizer(optimizer, name, outer, config, process_set,
                                backward_passes_per_step)
    keras_config = optimizer.get_config()
    check_clipping_under_lagging(config, type(optimizer).__name__, {
        option: keras_config[option] for option in ("clipnorm", "clipvalue", "global_clipnorm")
        if keras_config.get(option)})
    momentum = _momentum_taken_over(type(optimizer).__name__ == "SGD", keras_config)
    exchange = _exchange(optimizer, config, momentum, compression=compression, op=op,
                         gradient_predivide_factor=gradient_predivide_factor,
                         sparse_as_dense=sparse_as_dense, process_set=process_set,
                         backward_passes_per_step=backward_passes_per_step, groups=groups)
    mixins, adam = _mixins(optimizer, keras_config, exchange, momentum[0])
    attributes = {
        "_hvd_dgc_adam": adam, "_hvd_dgc_scale_local": bool(scale_local_gradients),
        "_hvd_dgc_local_momentum": momentum if momentum[0] else None,
        "_hvd_dgc_passes": Accumulation(backward_passes_per_step,
                                        average_aggregated_gradients, sparse_as_dense)
        if backward_passes_per_step > 1 else None}
    new = _join(optimizer, mixins, attributes, keras_config, name, exchange)
    if adam is not None:
        adam.optimizer = new
    return new


def _exchange(optimizer, config, momentum, **horovods):
    """The GradientExchange for ``optimizer``: it resolves and checks every option and
    Horovod argument (``horovods``), once."""
    kind = type(optimizer).__name__
    return GradientExchange(config=config, momentum=momentum[0], nesterov=momentum[1],
                            optimizer=(kind == "SGD", kind, kind in ADAM_CLASSES),
                            **horovods)


def _mixins(optimizer, keras_config, exchange, sgd_momentum):
    """hvd_dgc's mixins for ``optimizer``'s Keras version, most specific first, and
    Adam's take-over where the exchange resolved one (tensorflow/adam.py);
    ``sgd_momentum``: SGD's, taken over by the memory (0: none)."""
    version = _version(optimizer)
    mixins, adam = [_STEPS[version]], None
    if exchange.resolved.freeze is not None:
        check_adam(type(optimizer).__name__, keras_config)
        adam = AdamTakeOver(keras_config, exchange.resolved.freeze, version,
                            exchange.resolved.refresh)
        exchange.take_over_adam(adam)
        mixins.insert(0, _ADAMS[version])
    if sgd_momentum and version == "keras2":
        mixins.insert(0, SGDWithoutSlot)
    return mixins, adam


def _momentum_taken_over(is_sgd, keras_config):
    """SGD's momentum and nesterov, which DGC's memory takes over: read from the Keras
    config, and set to none there."""
    if not (is_sgd and keras_config.get("momentum")):
        return 0.0, False
    momentum = float(keras_config["momentum"])
    nesterov = bool(keras_config.get("nesterov", False))
    keras_config.update(momentum=0.0, nesterov=False)
    return momentum, nesterov
