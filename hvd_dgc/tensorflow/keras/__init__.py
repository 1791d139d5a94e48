"""``import hvd_dgc.tensorflow.keras as hvd``: Horovod's Keras API plus a DGC optimizer.

``hvd.DistributedOptimizer(opt, ...)`` keeps Horovod's signature and works with
legacy Keras 2 (tf_keras, ``TF_USE_LEGACY_KERAS=1``) and with Keras 3, which
Horovod 0.28.1 itself does not support (horovod issue #4290: Keras 3 calls
``apply_gradients``/``apply`` directly and its variables have no ``.ref()``).
hvd_dgc hooks the step where the gradients meet the optimizer (``apply`` in
Keras 3, ``apply_gradients`` in Keras 2) and exchanges them with Horovod's TF
collectives, so ``model.fit`` is distributed under both.

Keras 2's legacy optimizers (``tf_keras.optimizers.legacy.*``, OptimizerV2) are
wrapped the same way (their slots are created before the step, as they have no
``build``).

With SGD (legacy or not) the optimizer's momentum is taken over by DGC's momentum
correction (the rebuilt optimizer runs with momentum 0), as on the PyTorch side.
A variable with an IndexedSlices gradient (an Embedding) bypasses DGC, so the
memory keeps a velocity for it alone and hands the SGD ``u = m u + avg``: the
update SGD's own momentum makes of Horovod's averaged slices.

With Adam and AdamW (Keras 3, tf_keras, tf_keras' legacy Adam) exact Adam runs to
``freeze_variance`` steps, then its second moment is frozen and DGC takes its first
moment over (hvd_dgc/adam.py; the Keras side: hvd_dgc/tensorflow/adam.py).

``outer=hvd.OuterLoop(steps=H)`` gives an outer loop instead (DiLoCo, any optimizer):
the optimizer steps locally and every H-th step ends a round that averages the weights'
change (hvd_dgc/tensorflow/outer.py).
"""

import importlib
from typing import NamedTuple

import tensorflow as tf

from horovod.tensorflow.keras import *  # noqa: F401,F403  (the one-line switch)
from horovod.tensorflow import Average, global_process_set
import horovod.tensorflow as _hvd

from hvd_dgc.config import DGCConfig, check_clipping_under_lagging
from hvd_dgc.autodelay import AutoDelay  # noqa: F401 (delay=hvd.AutoDelay(...))
from hvd_dgc.costmodel import CostModel  # noqa: F401 (cost_model=hvd.CostModel(...))
from hvd_dgc.linkwatch import LinkWatch  # noqa: F401 (link_watch=hvd.LinkWatch(...))
from hvd_dgc.schedule import DensitySchedule  # noqa: F401 (density=hvd.DensitySchedule(...))
from hvd_dgc.outer import OuterLoop, check_outer  # noqa: F401 (hvd.OuterLoop)
from hvd_dgc.tensorflow.adam import ADAM_CLASSES, PREVIOUS_NAME, SCALE_NAME, \
    AdamTakeOver, check_adam
from hvd_dgc.tensorflow.compression import Compression
from hvd_dgc.tensorflow.exchange import GradientExchange
from hvd_dgc.tensorflow.names import tensor_names, variable_name
from hvd_dgc.tensorflow.tape_exchanges import variable_ref
from hvd_dgc.tensorflow.keras_optimizers import create_optimizer_variables, is_keras3, \
    is_legacy
from hvd_dgc.tensorflow.outer import OuterRounds
# The methods a training step calls run as written, not converted by AutoGraph: the
# conversion of hvd_dgc, Horovod and json (their Python made into graph control flow
# where nothing needs it) was 20 s of a 26 s first trace, in every process.
_as_written = tf.autograph.experimental.do_not_convert
# Horovod's star import bound `callbacks` to its own module; ours extends it.
callbacks = importlib.import_module("hvd_dgc.tensorflow.keras.callbacks")
elastic = importlib.import_module("hvd_dgc.tensorflow.keras.elastic")  # and its KerasState



class _Accumulation:
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


class _Prepared(NamedTuple):
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


def _prepare(self, grads, variables):
    """Exchange one call's gradients. With ``backward_passes_per_step=P`` the call adds
    to a local sum and every P-th call exchanges it (every rank counts alike, so every
    rank takes the same branch and joins the same collectives); the calls between hand
    out the sum so far and only count in ``iterations``, as in Horovod."""
    create_optimizer_variables(self, variables)  # no variable may be born in a cond below
    local, shared = _split(self, variables)
    accumulation = self._hvd_dgc_passes
    if accumulation is None:
        out, apply = _exchange(self, grads, variables, local, shared)
        return _Prepared(out, variables, apply, None, _graph())
    accumulation.build(variables)
    # (after the optimizer's variables: Adam's frozen scales)
    self._hvd_dgc.build([variables[i] for i in shared])
    if local:
        _local_velocity(self, [variables[i] for i in local])
    names = tensor_names(variables)
    dgc = self._hvd_dgc  # elastic: every rank's count the largest first
    agreed = [accumulation.agree(dgc.agreeing, dgc.process_set)] if dgc.elastic else []
    with tf.control_dependencies(agreed):
        complete = accumulation.add(grads, names)

    def exchange():
        out, apply = _exchange(self, accumulation.take(), variables, local, shared)
        return [tf.identity(g) for g in out], tf.constant(True) if apply is None else apply

    def wait():
        return accumulation.partial(), tf.constant(False)
    out, apply = tf.cond(complete, exchange, wait)
    return _Prepared(out, variables, apply, tf.logical_not(complete), _graph())


def _split(self, variables):
    """Positions of the variables ``register_local_var`` kept on their rank, and of the
    shared ones."""
    refs = [variable_ref(v) for v in variables]
    return ([i for i, r in enumerate(refs) if r in self._hvd_dgc_local],
            [i for i, r in enumerate(refs) if r not in self._hvd_dgc_local])


def _exchange(self, grads, variables, local, shared):
    """``(gradients to apply, apply)``: the ``shared`` variables' averaged through DGC,
    the ``local`` ones' kept (``register_local_var``); ``apply`` is False when a
    non-finite gradient on some rank made every rank skip the step (None: no such
    check)."""
    exchange = self._hvd_dgc
    exchange.build([variables[i] for i in shared], [grads[i] for i in shared])
    averaged, skipped = exchange.exchange([grads[i] for i in shared])
    apply = tf.logical_not(skipped) if exchange.may_skip else None
    out = list(grads)
    for i, g in zip(shared, averaged):
        out[i] = g
    if local:
        kept = _keep_local(self, [grads[i] for i in local], [variables[i] for i in local],
                           apply)
        for i, g in zip(local, kept):
            out[i] = g
    return out, apply


def _keep_local(self, grads, variables, apply):
    """``register_local_var``: those variables' gradients stay on this rank, as in
    Horovod (divided by the number of ranks with ``scale_local_gradients``, Horovod's
    default; with SGD's momentum taken over, the momentum SGD would have applied, kept
    in ``dgc_state``, which a skipped step leaves alone)."""
    velocity = _local_velocity(self, variables)
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


def _finish(self, prepared, apply, grads=None):
    """``apply(grads)`` (the prepared ones by default) unless every rank skips this
    step (as Keras' LossScaleOptimizer: a cond around the inner optimizer's step); a
    pass that only counts adds one to ``iterations``."""
    grads = prepared.grads if grads is None else grads
    if self._hvd_dgc_adam is not None:
        apply = _then_freeze(self, apply, self._hvd_dgc_adam)
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


def _momentum_free_step(base):
    """tf_keras' SGD whose momentum DGC took over: ``w -= lr g`` in one in-place pass
    (TF's gradient-descent kernel). tf_keras' own step keeps its momentum slot at
    momentum 0 and updates it every step (``m = -g lr + m 0; w += m``): four temporaries
    of the tensor's size and two writes, the same values (Keras 3's SGD and the legacy
    one already skip the slot at momentum 0)."""
    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices) or not isinstance(variable, tf.Variable) \
                or gradient.dtype != variable.dtype:
            return base.update_step(self, gradient, variable)
        return tf.raw_ops.ResourceApplyGradientDescent(
            var=variable.handle, alpha=tf.cast(self.learning_rate, variable.dtype),
            delta=gradient, use_locking=False)
    return update_step


def _local_velocity(self, variables):
    """SGD's momentum for the local variables when DGC took it over (else [])."""
    if self._hvd_dgc_local_momentum is None:
        return []
    holder = getattr(self._hvd_dgc, "local_velocity", None)
    if holder is None:
        with tf.init_scope():
            holder = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False,
                                  name=f"local_velocity_{i}") for i, v in enumerate(variables)]
        self._hvd_dgc.local_velocity = holder  # tracked: checkpoints and KerasState
    return holder


def _register_local_var(self, var):
    """As Horovod's: ``var``'s gradient stays on this rank, never exchanged (divided by
    the number of ranks with ``scale_local_gradients=True``, Horovod's default). Call it
    before the first step, on every rank alike."""
    if self._hvd_dgc.memory is not None:
        raise ValueError(f"hvd_dgc: register_local_var({variable_name(var, 0)!r}) after the "
                         f"first step: the exchange was built for the variables it had "
                         f"then. Register local variables before training.")
    self._hvd_dgc_local.add(variable_ref(var))


def _then_freeze(self, apply, adam):
    """``apply``, then, at the end of step ``freeze - 1`` (the exchange has counted it),
    Adam's variance frozen and its first moment moved into DGC's memory; at the end of
    a refresh step (``refresh_variance``), the ranks' variances averaged into it."""
    def applied(grads):
        out = apply(grads)
        step = self._hvd_dgc.step
        tf.cond(tf.equal(step, adam.freeze),
                lambda: adam.freeze_now(self.iterations), lambda: tf.constant(False))
        tf.cond(adam.refreshing(step),
                lambda: adam.refresh_now(self.iterations), lambda: tf.constant(False))
        return out
    return applied


# -- Adam and AdamW taken over (tensorflow/adam.py): the frozen scales among the optimizer's
# variables, and each exchanged variable's update Adam's own until the freeze, then
# x -= lr / (1 - beta1^t) * average
def _adam_update(self, variable, gradient, lr, adams):
    """``adams()``: Adam's own update of ``variable``."""
    take = self._hvd_dgc_adam
    if not take.is_taken(variable) or isinstance(gradient, tf.IndexedSlices):
        return adams()

    def own():
        adams()
        return tf.constant(True)
    return tf.cond(take.applying_frozen(),
                   lambda: take.frozen_step(variable, gradient, lr(), self.iterations + 1), own)


def _build3(self, var_list):  # Keras 3
    fresh = not self.built
    super(self.__class__, self).build(var_list)
    if fresh:
        self._hvd_dgc_scales = self.add_optimizer_variables(var_list, SCALE_NAME,
                                                            initializer="ones")
        if self._hvd_dgc_adam.refresh is not False:
            self._hvd_dgc_previous = self.add_optimizer_variables(var_list, PREVIOUS_NAME,
                                                                  initializer="zeros")


def _update_step3(self, gradient, variable, learning_rate):  # Keras 3
    base = super(self.__class__, self)
    return _adam_update(self, variable, gradient, lambda: learning_rate,
                        lambda: base.update_step(gradient, variable, learning_rate))


def _build2(self, var_list):  # tf_keras
    fresh = not getattr(self, "_built", False)
    super(self.__class__, self).build(var_list)
    if fresh:
        self._hvd_dgc_scales = [self.add_variable_from_reference(
            var, SCALE_NAME, initial_value=tf.ones(var.shape, var.dtype)) for var in var_list]
        if self._hvd_dgc_adam.refresh is not False:
            self._hvd_dgc_previous = [self.add_variable_from_reference(
                var, PREVIOUS_NAME, initial_value=tf.zeros(var.shape, var.dtype))
                for var in var_list]


def _update_step2(self, gradient, variable):  # tf_keras
    base = super(self.__class__, self)
    return _adam_update(self, variable, gradient, lambda: self.learning_rate,
                        lambda: base.update_step(gradient, variable))


def _create_slots_legacy(self, var_list):  # tf_keras' legacy (OptimizerV2)
    super(self.__class__, self)._create_slots(var_list)
    for var in var_list:
        self.add_slot(var, SCALE_NAME, initializer="ones")
        if self._hvd_dgc_adam.refresh is not False:
            self.add_slot(var, PREVIOUS_NAME, initializer="zeros")


def _resource_apply_dense_legacy(self, grad, var, apply_state=None):
    base = super(self.__class__, self)

    def lr():
        key = (var.device, var.dtype.base_dtype)
        return ((apply_state or {}).get(key) or self._fallback_apply_state(*key))["lr_t"]
    return _adam_update(self, var, grad, lr,
                        lambda: base._resource_apply_dense(grad, var, apply_state))


def _adam_methods(optimizer):
    """The take-over's kind ("keras3", "keras2", "legacy") and its methods there."""
    kind = "keras3" if is_keras3(optimizer) else "legacy" if is_legacy(optimizer) else "keras2"
    methods = {"keras3": {"build": _build3, "update_step": _update_step3},
               "keras2": {"build": _build2, "update_step": _update_step2},
               "legacy": {"_create_slots": _create_slots_legacy,
                          "_resource_apply_dense": _resource_apply_dense_legacy}}[kind]
    return kind, methods


@_as_written
def _apply(self, grads, trainable_variables=None):  # Keras 3
    variables = list(self._trainable_variables if trainable_variables is None
                     else trainable_variables)
    base = super(self.__class__, self)
    return _finish(self, _prepare(self, list(grads), variables),
                   lambda g: base.apply(g, trainable_variables))


@_as_written
def _apply_gradients(self, grads_and_vars, *args, **kwargs):  # Keras 2 (tf_keras)
    """Applies the gradients ``_compute_gradients`` just handed out (exchanged there,
    as in Horovod) as they are given; any others are exchanged first."""
    grads_and_vars = list(grads_and_vars)
    grads, variables = [g for g, _ in grads_and_vars], [v for _, v in grads_and_vars]
    base = super(self.__class__, self)

    def apply(gs):
        return base.apply_gradients(zip(gs, variables), *args, **kwargs)
    prepared = self.__dict__.pop("_hvd_dgc_prepared", None)
    if prepared is None or prepared.graph is not _graph():
        return _finish(self, _prepare(self, grads, variables), apply)
    if [variable_ref(v) for v in prepared.variables] != [variable_ref(v) for v in variables]:
        raise ValueError(
            "hvd_dgc: apply_gradients got other variables than _compute_gradients "
            "exchanged the gradients of just before: pass apply_gradients the "
            "(gradient, variable) pairs _compute_gradients returned (the gradients may "
            "be changed in between; the variables must be the same, in the same order).")
    return _finish(self, prepared, apply, grads)


def _own_gradients(self, loss, var_list, grad_loss, tape):
    """This rank's (gradient, variable) pairs, by Keras 2's ``compute_gradients``."""
    if grad_loss is not None:
        raise ValueError("hvd_dgc: _compute_gradients(grad_loss=...) is not supported by "
                         "Keras 2's optimizers (nor applied by Horovod's); scale the loss "
                         "instead.")
    # (no tape made here: Keras refuses a Tensor loss without the tape that computed it,
    # where a fresh tape would give None gradients)
    return list(super(self.__class__, self).compute_gradients(loss, var_list, tape=tape))


@_as_written
def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):  # Keras 2
    """Horovod's aggregation API (its own tests and scripts call it): the gradients
    come back averaged (through DGC here) and the next ``apply_gradients`` applies them
    as given, without a second exchange. With ``backward_passes_per_step=P`` the calls
    between exchanges return the local sum so far, and their ``apply_gradients`` only
    counts. (Keras' public ``compute_gradients`` returns this rank's gradients, which
    ``apply_gradients`` exchanges: a LossScaleOptimizer around this one calls it with
    the scaled loss, and DGC's memory must not keep scaled gradients.)"""
    grads_and_vars = _own_gradients(self, loss, var_list, grad_loss, tape)
    variables = [v for _, v in grads_and_vars]
    prepared = _prepare(self, [g for g, _ in grads_and_vars], variables)
    self.__dict__["_hvd_dgc_prepared"] = prepared  # (untracked: not a Keras attribute)
    return list(zip(prepared.grads, variables))


def _compression_stats(self):
    """Bytes sent vs dense fp32, density and path counts (this rank), as a dict."""
    return self._hvd_dgc.stats()


def _dgc_state(self):
    """The DGC memory, step and epoch as a tf.Module for tf.train.Checkpoint
    (``tf.train.Checkpoint(model=model, dgc=opt.dgc_state)``; one file per rank).
    Keras 2 also saves it with the optimizer; Keras 3's ``model.save`` does not."""
    return self._hvd_dgc


@_as_written
def _flush(self):
    """Delayed averaging (``delay=D``, ``period=p``): apply the steps still in flight
    (a period's own steps since its last exchange are taken back: their velocity is
    still in the memory) and leave
    every rank with the same weights. ``callbacks.DGCCallback`` calls it before
    evaluation and at the end of ``model.fit``; call it yourself before
    checkpointing. Returns whether anything was in flight."""
    base, adam = super(self.__class__, self), self._hvd_dgc_adam

    def apply(corrections, variables):  # SGD, its momentum taken over: w -= lr * c
        if adam is not None:  # Adam taken over (in flight only after its freeze)
            adam.correct(corrections, variables, _current_lr(self), self.iterations)
        elif self._hvd_dgc_keras3:
            base.apply(corrections, variables)
        else:
            base.apply_gradients(zip(corrections, variables))
    return self._hvd_dgc.flush(apply, self.iterations, float(_rate(self, ahead=False)))


def _rate(self, ahead=True):
    """What this optimizer multiplies an update by: SGD's ``lr`` (its momentum taken
    over), frozen Adam's ``lr / (1 - beta1^t)`` at the coming step (``ahead``: Keras'
    ``t = iterations + 1``) or a flush's (``correct``'s count), float32 as they step."""
    lr = tf.cast(_current_lr(self), tf.float32)
    adam = self._hvd_dgc_adam
    if adam is None:
        return lr
    t = self.iterations + 1 if ahead else tf.maximum(self.iterations, 1)
    return lr / (1.0 - tf.pow(tf.constant(adam.beta1, tf.float32), tf.cast(t, tf.float32)))


def _step_size(self, variables):
    """``(rate, decays)`` of the coming step (delayed.py ``step``): the rate, and per
    exchanged variable the ``lr wd`` of the decoupled decay Keras applies before the
    update (``weight_decay``, with its exclusions; 0 where none)."""
    wd = getattr(self, "weight_decay", None)
    if not wd or is_legacy(self):
        return _rate(self), tf.zeros([len(variables)])
    lr = tf.cast(_current_lr(self), tf.float32) * float(wd)
    return _rate(self), tf.stack([lr if self._use_weight_decay(v) else tf.zeros([])
                                  for v in variables])


def _current_lr(self):
    """The learning rate Keras would step with now (its schedule at ``iterations``)."""
    if is_legacy(self):
        return self._decayed_lr(tf.float32)
    if self._hvd_dgc_keras3:
        return self._get_current_learning_rate()
    schedule = getattr(self, "_learning_rate", None)  # tf_keras: its learning_rate is
    if callable(schedule) and not isinstance(schedule, tf.Variable):  # the last step's
        return schedule(self.iterations)                               # until it steps
    return self.learning_rate


def _in_flight(self):
    """Steps whose averages have not been applied yet (delay > 0, or period > 1
    between exchanges)."""
    return self._hvd_dgc.in_flight


def _set_epoch(self, epoch):
    """Epoch-based warm-up (in ``model.fit`` every one of hvd_dgc's callbacks calls it at
    the start of each epoch: callbacks.py ``follow_epoch``)."""
    self._hvd_dgc.set_epoch(epoch)


# -- the outer loop (outer=hvd_dgc.OuterLoop(...), hvd_dgc/tensorflow/outer.py): the
# user's optimizer steps on this rank's own gradients; every H-th step ends a round
def _outer_step(self, variables, apply):
    rounds = self._hvd_dgc
    rounds.build(variables)
    rounds.begin(variables)  # (the first step: the shared weights are rank 0's)
    out = apply()
    rounds.end_step(variables)
    return out


@_as_written
def _outer_apply(self, grads, trainable_variables=None):  # Keras 3
    variables = self._trainable_variables if trainable_variables is None else trainable_variables
    base = super(self.__class__, self)
    return _outer_step(self, list(variables), lambda: base.apply(grads, trainable_variables))


@_as_written
def _outer_apply_gradients(self, grads_and_vars, *args, **kwargs):  # Keras 2 (tf_keras)
    grads_and_vars = list(grads_and_vars)
    base = super(self.__class__, self)
    return _outer_step(self, [v for _, v in grads_and_vars],
                       lambda: base.apply_gradients(grads_and_vars, *args, **kwargs))


@_as_written
def _outer_flush(self):
    """Apply the exchange in flight (``overlap``) and end the round under way now, so
    every rank holds the same weights (before evaluating, checkpointing, or at the end;
    ``callbacks.DGCCallback`` calls it before evaluation and when ``fit`` ends)."""
    return self._hvd_dgc.flush()


def _outer_local_var(self, var):
    raise ValueError(f"hvd_dgc: register_local_var({variable_name(var, 0)!r}) with "
                     f"outer=OuterLoop(...): the outer loop averages the change of every "
                     f"variable it steps. Step a local variable with an optimizer of its own.")


@_as_written
def _outer_compute_gradients(self, loss, var_list, grad_loss=None, tape=None):  # Keras 2
    """Horovod's ``_compute_gradients``: this rank's own gradients (the inner steps are
    local; the round exchanges the weights' change)."""
    return _own_gradients(self, loss, var_list, grad_loss, tape)


def _outer_optimizer(optimizer, name, outer, config, process_set, passes):
    """The user's optimizer class, stepping locally, with the outer loop's round."""
    if passes > 1:
        raise ValueError(f"outer=OuterLoop(...) with backward_passes_per_step={passes}: "
                         f"the inner steps are local already; use "
                         f"OuterLoop(steps=...) for fewer exchanges and "
                         f"backward_passes_per_step=1.")
    density = 1.0 if config.density is None else float(config.density)
    rounds = OuterRounds(outer, density, config.min_compress_size, process_set)
    methods = {"compression_stats": lambda self: self._hvd_dgc.stats(),
               "set_epoch": lambda self, epoch: self._hvd_dgc.set_epoch(epoch),
               "dgc_state": property(_dgc_state), "flush": _outer_flush,
               "register_local_var": _outer_local_var,
               "in_flight": property(lambda self: self._hvd_dgc.in_flight),
               "_hvd_dgc_passes": None, "_agg_helper": None,  # (Horovod's, with P = 1)
               "_hvd_dgc_keras3": is_keras3(optimizer)}
    if is_keras3(optimizer):
        methods["apply"] = _outer_apply
    else:
        methods["apply_gradients"] = _outer_apply_gradients
        if not is_legacy(optimizer):
            methods["_compute_gradients"] = _outer_compute_gradients
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    keras_config = optimizer.get_config()
    if name is not None:
        keras_config["name"] = name
    new = cls.from_config(keras_config)
    if is_keras3(optimizer):
        object.__setattr__(new, "_hvd_dgc", rounds)  # keep it out of Keras 3's tracker
    else:
        new._hvd_dgc = rounds  # tracked: tf.train.Checkpoint saves the outer state
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

    Returns a new optimizer of the same class built from ``optimizer.get_config()``
    (as Horovod does). hvd_dgc's options, by keyword, as in
    ``hvd_dgc.torch.DistributedOptimizer`` (hvd_dgc.config.DGCConfig; ``log_every``
    runs in PyTorch only so far);
    Horovod's ``Compression.none`` / ``fp16`` mean DGC (fp32 values / fp16 values in
    the records and on the dense path, as in PyTorch), ``density=1.0`` dense averaging;
    for Keras' Adam or AdamW with no option of DGC's top-k, the scaled sign after the
    freeze (1-bit Adam), with no ``delay`` or ``period`` an exchange every 4th step: 0/1
    Adam (hvd_dgc/adam.py ``ZERO_ONE_PERIOD``).
    Call ``model.compile(..., jit_compile=False)`` under Keras 3: Horovod's
    collectives have no XLA kernels here.

    ``delay=D``: delayed gradient averaging (needs SGD, whose momentum DGC takes
    over, or Adam/AdamW taken over: delayed from its freeze on, its exact warm-up
    synchronous): each step applies ``own_i - own_(i-D) + avg_(i-D)`` while the average
    of step i travels; ``opt.flush()`` (``callbacks.DGCCallback`` calls it before
    evaluation and when ``fit`` ends) applies the rest and leaves every rank with
    the same weights. ``period=p`` (temporally sparse updates, as in PyTorch;
    hvd_dgc/lagging.py): every p-th step exchanges; in between each rank steps with
    what its memory took in and sends nothing, and the exchange's average replaces
    those own steps when it is applied (at once, or ``delay`` steps later).

    ``skip_nonfinite`` (default True): a NaN/Inf gradient on any rank never enters
    the DGC memory and every rank skips the step (weights, optimizer state, memory
    and step unchanged; that rank sends inf, so every rank sees it); counted in
    ``compression_stats()["nonfinite_steps"]``. With ``delay`` > 0 the rank that has
    it sends zeros instead (the others applied their part of the step already).

    IndexedSlices gradients (an Embedding) travel as in Horovod: rows and indices
    allgathered, no DGC, no residual; ``sparse_as_dense=True`` densifies them first
    (then DGC). They need ``delay=0``.

    ``backward_passes_per_step=P`` (and ``average_aggregated_gradients``) as in
    Horovod: P calls' gradients are summed locally (their mean with
    ``average_aggregated_gradients=True``), then exchanged through DGC and applied
    once; ``iterations`` counts every call. With ``delay=D`` each exchange is one
    step of delayed averaging (applied D exchanges later).

    ``outer=hvd_dgc.OuterLoop(steps=H, lr=0.7, momentum=0.9)``: an outer loop instead
    (DiLoCo; hvd_dgc/outer.py, hvd_dgc/tensorflow/outer.py): ``optimizer`` (AdamW, SGD,
    anything) steps on this rank's gradients, and every H-th step the weights' change
    is averaged over the ranks (whole, or as records at ``density`` with error
    feedback) and applied by outer Nesterov momentum. ``opt.flush()`` ends the round
    under way (every rank then holds the same weights).
    """
    config = DGCConfig.from_options(options, "tensorflow", "DistributedOptimizer")
    if outer is not None:
        check_outer(outer, config, compression in (None, Compression.dgc, Compression.none),
                    op == Average)
        return _outer_optimizer(optimizer, name, outer, config, process_set,
                                backward_passes_per_step)
    is_sgd = type(optimizer).__name__ == "SGD"
    keras_config = optimizer.get_config()
    check_clipping_under_lagging(config, type(optimizer).__name__, {
        option: keras_config[option] for option in ("clipnorm", "clipvalue", "global_clipnorm")
        if keras_config.get(option)})
    momentum, nesterov = _momentum_taken_over(is_sgd, keras_config)
    exchange = GradientExchange(  # resolves and checks every option and argument, once
        compression=compression, momentum=momentum, nesterov=nesterov, op=op,
        gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
        process_set=process_set, config=config,
        optimizer=(is_sgd, type(optimizer).__name__,
                   type(optimizer).__name__ in ADAM_CLASSES),
        backward_passes_per_step=backward_passes_per_step, groups=groups)
    adam, adam_methods = None, {}
    if exchange.resolved.freeze is not None:  # Adam/AdamW taken over (tensorflow/adam.py)
        check_adam(type(optimizer).__name__, keras_config)
        kind, adam_methods = _adam_methods(optimizer)
        adam = AdamTakeOver(keras_config, exchange.resolved.freeze, kind,
                            exchange.resolved.refresh)
        exchange.momentum = adam.beta1  # the memory's, once frozen
    methods = _dgc_methods(optimizer, (momentum, nesterov) if momentum else None, adam,
                           _Accumulation(backward_passes_per_step,
                                         average_aggregated_gradients, sparse_as_dense)
                           if backward_passes_per_step > 1 else None,
                           scale_local_gradients)
    methods.update(adam_methods)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    if name is not None:
        keras_config["name"] = name
    return _joined(cls.from_config(keras_config), exchange, adam)


def _momentum_taken_over(is_sgd, keras_config):
    """SGD's momentum and nesterov, which DGC's memory takes over: read from the Keras
    config, and set to none there."""
    if not (is_sgd and keras_config.get("momentum")):
        return 0.0, False
    momentum = float(keras_config["momentum"])
    nesterov = bool(keras_config.get("nesterov", False))
    keras_config.update(momentum=0.0, nesterov=False)
    return momentum, nesterov


def _dgc_methods(optimizer, local_momentum, adam, passes, scale_local_gradients):
    """What the wrapped class adds to the user's optimizer class: hvd_dgc's methods,
    Horovod's names, and the apply step of its Keras version."""
    methods = {"compression_stats": _compression_stats, "set_epoch": _set_epoch,
               "register_local_var": _register_local_var,
               "_hvd_dgc_scale_local": bool(scale_local_gradients),
               "_hvd_dgc_local_momentum": local_momentum,
               "dgc_state": property(_dgc_state), "flush": _flush,
               "in_flight": property(_in_flight), "_hvd_dgc_keras3": is_keras3(optimizer),
               "_hvd_dgc_passes": passes,
               "_agg_helper": property(lambda self: self._hvd_dgc_passes),  # Horovod's name
               "_hvd_dgc_adam": adam}
    if local_momentum and not is_keras3(optimizer) and not is_legacy(optimizer):
        methods["update_step"] = _momentum_free_step(optimizer.__class__)
    if is_keras3(optimizer):
        methods["apply"] = _apply
    else:
        methods["apply_gradients"] = _apply_gradients
        if not is_legacy(optimizer):  # (OptimizerV2's own minimize calls its own)
            methods["_compute_gradients"] = _compute_gradients
    return methods


def _joined(new, exchange, adam):
    """The new optimizer and its exchange, joined."""
    if adam is not None:
        adam.optimizer = new
        object.__setattr__(exchange, "adam", adam)
    object.__setattr__(exchange, "step_size", lambda variables: _step_size(new, variables))
    if new._hvd_dgc_keras3:
        object.__setattr__(new, "_hvd_dgc", exchange)  # keep it out of Keras 3's tracker
    else:
        new._hvd_dgc = exchange  # tracked: tf.train.Checkpoint saves the memory
    object.__setattr__(new, "_hvd_dgc_local", set())  # register_local_var's
    return new
