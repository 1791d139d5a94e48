"""Keras callbacks with Horovod 0.28.1's names, signatures and behaviour, working on
TF 2.21 under Keras 2 (tf_keras, ``TF_USE_LEGACY_KERAS=1``) and Keras 3, plus the
DGC warm-up/statistics callback.

Horovod's own versions go through ``keras.backend`` (``constant``, ``get_value``,
``set_value``), which TF 2.21's ``keras`` (Keras 3) no longer has, and through
``Variable.ref()``, which Keras 3 variables lack; these use the optimizer's and the
variables' own API instead.
"""

import time
import warnings

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd

from hvd_dgc.tensorflow.keras_optimizers import optimizer_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "BestModelCheckpoint", "DGCCallback"]


def _variable_types():
    types = [tf.Variable]
    try:
        import keras
        types.append(keras.Variable)  # Keras 3 (also importable under TF_USE_LEGACY_KERAS=1)
    except (ImportError, AttributeError):
        pass
    return tuple(types)


def _identities(var):
    """A Keras 3 Variable and the tf.Variable it wraps name the same state."""
    inner = None if isinstance(var, tf.Variable) else getattr(var, "value", None)
    return {id(var), id(inner)} if isinstance(inner, tf.Variable) else {id(var)}


class _StepTimer:
    """Times ``fit``'s train steps for the link watch of an hvd_dgc optimizer (hvd_dgc/
    tensorflow/link.py ``LinkWatchInFit``) and its trial of the plans (plan_trial.py
    ``DenseTrial``), and has ``fit`` trace its step again where the paths changed.
    ``DGCCallback`` drives it; so does ``BroadcastGlobalVariablesCallback``, which a
    Horovod script switched by one line already passes, unless a ``DGCCallback`` runs in
    the same ``fit`` (it claims the watch at the start of training, so no step is
    observed twice)."""

    def __init__(self, claims):
        self.claims = claims  # DGCCallback's: the watch is this timer's during its fit
        self.began = None

    @staticmethod
    def _exchange(model):
        return getattr(getattr(model, "optimizer", None), "_hvd_dgc", None)

    def claim(self, model, on):
        """DGCCallback's, at the start (``on``) and end of its ``fit``."""
        exchange = self._exchange(model)
        if self.claims and exchange is not None:
            exchange.watch_claimed = on

    def begin(self):
        self.began = time.perf_counter()

    def end(self, model):
        exchange = self._exchange(model)
        parts = [p for p in (getattr(exchange, "watcher", None),
                             getattr(exchange, "trial", None)) if p is not None]
        if not parts or self.began is None or \
                (not self.claims and getattr(exchange, "watch_claimed", False)):
            return
        seconds, self.began = time.perf_counter() - self.began, None
        step = int(exchange.step.numpy())
        changed = [part.observe(seconds, step) for part in parts]  # (each its own turn)
        if any(changed):
            model.make_train_function(force=True)  # the paths changed: they are in the graph


def _dgc_optimizer(model):
    """The model's hvd_dgc optimizer (inside a LossScaleOptimizer too), or None."""
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None:
        if getattr(optimizer, "_hvd_dgc", None) is not None and hasattr(optimizer, "set_epoch"):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def follow_epoch(model, epoch):
    """``fit``'s epoch, at its start, to the hvd_dgc optimizer's warm-up: every one of
    hvd_dgc's callbacks calls it in ``on_epoch_begin``, so a Horovod script switched by
    one line (BroadcastGlobalVariablesCallback, MetricAverageCallback, the learning-rate
    callbacks) advances an epoch-counted warm-up without a ``DGCCallback``. Several in
    one ``fit`` set the same epoch: after an elastic reset (``fit`` counts from 0 again)
    the first to run takes the offset to the epoch the warm-up had reached and clears
    ``resuming``; the offset lives on the optimizer's exchange, so the others, and later
    epochs, add the same one."""
    optimizer = _dgc_optimizer(model)
    if optimizer is None:
        return
    exchange = optimizer._hvd_dgc
    if getattr(exchange, "resuming", False):  # fit again after an elastic reset
        exchange.epoch_offset = max(0, int(exchange.current_epoch()) - epoch)
        exchange.resuming = False
    optimizer.set_epoch(epoch + getattr(exchange, "epoch_offset", 0))


def _in_fit(model):
    """Tell the hvd_dgc optimizer that a callback which flushes it and times its steps
    is in this ``fit`` (BroadcastGlobalVariablesCallback, DGCCallback): it then does not
    warn that nothing flushes or times them (hvd_dgc/script_calls.py)."""
    optimizer = _dgc_optimizer(model)
    calls = getattr(getattr(optimizer, "_hvd_dgc", None), "calls", None)
    if calls is not None:  # (the outer loop's rounds need no call)
        calls.fit_callback = True


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Broadcast the model's and optimizer's variables from ``root_rank`` so every rank
    starts from the same weights (random initialisation or a checkpoint on one rank).

    Horovod's version calls ``Variable.ref()``, which Keras 3 variables lack; this one
    assigns the broadcast values and works with Keras 2 and 3. It runs before the first
    step when the model is built by then, else after the first batch (as Horovod).
    ``local_variables``: variables (tf.Variable or Keras 3 Variable) left as they are
    on every rank, e.g. per-rank state. hvd_dgc's DGC memory is never broadcast: it is
    each rank's own residual. With hvd_dgc's optimizer and the link measured, it also
    times the train steps for the link watch, where no ``DGCCallback`` does (a script
    switched by one line passes this callback and no other of hvd_dgc's). Where the
    optimizer lags (``delay``, ``period``; with Adam/AdamW 0/1 Adam's period by default)
    it flushes before each evaluation, at the end of each epoch (before a
    ``ModelCheckpoint`` after it in the list saves) and at the end of ``fit``, as
    ``DGCCallback`` does: every rank evaluates and saves the weights they agree on."""

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, _variable_types()):
            local_variables = [local_variables]
        else:
            local_variables = list(local_variables)
        bad = [v for v in local_variables if not isinstance(v, _variable_types())]
        if bad:
            raise ValueError(f"BroadcastGlobalVariablesCallback: local_variables must hold "
                             f"variables (tf.Variable or keras.Variable), got "
                             f"{type(bad[0]).__name__} {bad[0]!r}; pass the variable "
                             f"objects themselves, e.g. layer.kernel.")
        self.local_variables = local_variables
        self.done = False
        self._timer = _StepTimer(claims=False)

    def _broadcast(self):
        local = set().union(*(_identities(v) for v in self.local_variables))
        variables, seen = [], set()
        for v in list(self.model.variables) + optimizer_variables(
                getattr(self.model, "optimizer", None)):
            ids = _identities(v)
            if ids & seen:
                continue
            seen |= ids
            if not ids & local:
                variables.append(v)
        missing = [v for v in self.local_variables if not _identities(v) & seen]
        if missing:
            warnings.warn(f"BroadcastGlobalVariablesCallback: local_variables "
                          f"{[getattr(v, 'name', v) for v in missing]} are not among the "
                          f"model's or optimizer's variables, so nothing is kept local for "
                          f"them; pass the model's own variable objects.", UserWarning)
        with tf.device(self.device):
            for i, v in enumerate(variables):
                v.assign(_hvd.broadcast(tf.convert_to_tensor(v), self.root_rank,
                                        name=f"hvd_dgc.bcast.{i}"))
        self.done = True

    def on_train_begin(self, logs=None):
        _in_fit(self.model)
        if self.model.built and not self.done:
            self._broadcast()

    def on_epoch_begin(self, epoch, logs=None):
        follow_epoch(self.model, epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self._timer.begin()

    def on_train_batch_end(self, batch, logs=None):
        if not self.done:
            self._broadcast()
        self._timer.end(self.model)

    def _settle(self):
        """The steps in flight applied (a collective: every rank runs this callback at
        the same point of ``fit``), where hvd_dgc's optimizer lags."""
        optimizer = getattr(self.model, "optimizer", None)
        exchange = getattr(optimizer, "_hvd_dgc", None)
        if exchange is not None and getattr(exchange, "memory", None) is not None and \
                exchange.lags:
            optimizer.flush()

    def on_test_begin(self, logs=None):
        self._settle()

    def on_epoch_end(self, epoch, logs=None):
        self._settle()

    def on_train_end(self, logs=None):
        self._settle()


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """Replace every value in the epoch's logs with its mean over the ranks, so that
    ReduceLROnPlateau, EarlyStopping, checkpoints and History see the same numbers on
    every rank. Put it before those callbacks in the list (as with Horovod)."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_begin(self, epoch, logs=None):
        follow_epoch(self.model, epoch)

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(logs)
        values = []
        for key in keys:
            try:
                values.append(float(np.asarray(logs[key], dtype=np.float64)))
            except (TypeError, ValueError):
                raise TypeError(f"MetricAverageCallback: logs[{key!r}] = {logs[key]!r} is not "
                                f"a number and cannot be averaged over ranks; keep non-scalar "
                                f"values out of the epoch logs.") from None
        # One collective; the name carries the keys, so ranks logging different metrics
        # wait on different names (Horovod's stall warning lists them) instead of
        # averaging unrelated numbers.
        with tf.device(self.device):
            mean = _hvd.allreduce(tf.constant(values, tf.float64), op=_hvd.Average,
                                  name="hvd_dgc.metrics." + ".".join(keys)).numpy()
        for key, value in zip(keys, mean):
            logs[key] = float(value)


def _learning_rate_of(optimizer):
    """The optimizer's own learning-rate object: a variable, a number or a schedule."""
    hyper = getattr(optimizer, "_hyper", None)  # tf_keras legacy (OptimizerV2)
    if isinstance(hyper, dict) and "learning_rate" in hyper:
        return hyper["learning_rate"]
    return getattr(optimizer, "_learning_rate", None)


def _value(x):
    return float(x.numpy()) if hasattr(x, "numpy") else float(x)


class LearningRateScheduleCallback(tf.keras.callbacks.Callback):
    """Horovod's learning-rate schedule: ``lr = initial_lr * multiplier(epoch)`` for
    ``start_epoch <= epoch < end_epoch`` (a constant ``multiplier`` m means
    ``m ** (epoch - start_epoch)``). ``staircase=True``: set at each epoch's first batch
    with an integer epoch; ``False``: at every batch with
    ``epoch + batch / steps_per_epoch``. Outside the range the rate is left as it is.

    It sets the learning-rate variable the optimizer reads in its compiled step (with
    hvd_dgc's DistributedOptimizer, the rebuilt optimizer's own), so the change takes
    effect at that very batch; an optimizer built on a LearningRateSchedule is refused.

    ``momentum_correction`` (Goyal et al. 2017): Keras' momentum buffer holds
    ``lr``-scaled steps, so on a change of rate the momentum is scaled by
    ``new_lr / old_lr`` for that batch. With hvd_dgc's SGD nothing needs correcting:
    DGC takes the momentum over and its velocity ``u = m u + g`` holds no ``lr``
    (the rebuilt optimizer runs momentum 0 and applies ``lr * u``), which is exactly
    what the correction achieves. A tf_keras legacy optimizer's momentum (a variable)
    is corrected as in Horovod. A nonzero momentum stored as a Python number (Keras 3
    and tf_keras' new optimizers other than hvd_dgc's SGD, e.g. RMSprop(momentum=0.9))
    is baked into the compiled step and cannot be changed per batch: refused at the
    start of ``fit``; pass ``momentum_correction=False`` there.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"{type(self).__name__}: initial_lr is required (the learning "
                             f"rate the optimizer was built with, scaled as you like).")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.current_epoch = None
        self._momentum = None      # the momentum variable to correct, if any
        self._restore = None       # its value before this batch's correction

    def _check_optimizer(self):
        opt = self.model.optimizer
        lr = _learning_rate_of(opt)
        if lr is None or (callable(lr) and not isinstance(lr, _variable_types())):
            raise ValueError(f"{type(self).__name__} sets the learning rate each "
                             f"{'epoch' if self.staircase else 'batch'}, but "
                             f"{type(opt).__name__}'s learning rate is "
                             f"{type(lr).__name__ if lr is not None else 'missing'}, not a "
                             f"number or variable; build the optimizer with a float "
                             f"learning_rate or drop this callback.")
        self._momentum = None
        if not self.momentum_correction:
            return
        momentum = getattr(opt, "momentum", None)
        if momentum is None or isinstance(momentum, bool):
            return
        if _value(momentum) == 0.0:
            return  # nothing to correct (hvd_dgc's SGD: DGC holds the momentum)
        if isinstance(momentum, _variable_types()):
            self._momentum = momentum  # tf_keras legacy: read by the step at each batch
        else:
            raise ValueError(
                f"{type(self).__name__}(momentum_correction=True): {type(opt).__name__}'s "
                f"momentum {_value(momentum):g} is a Python number compiled into the train "
                f"step and cannot be rescaled per batch. Pass momentum_correction=False, or "
                f"use SGD wrapped by hvd_dgc's DistributedOptimizer (DGC's momentum needs no "
                f"correction) or a tf_keras.optimizers.legacy optimizer.")

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if not steps:
            raise ValueError(f"{type(self).__name__}: fit does not know the number of steps "
                             f"per epoch (a dataset of unknown length?); pass "
                             f"steps_per_epoch= to the callback.")
        return steps

    def _set_learning_rate(self, epoch):
        opt = self.model.optimizer
        old = _value(opt.learning_rate)
        new = self.initial_lr * self.multiplier(epoch)
        opt.learning_rate = new
        if self._momentum is not None and old != 0.0:
            self._restore = _value(self._momentum)
            self._momentum.assign(self._restore * new / old)

    def on_train_begin(self, logs=None):
        self._check_optimizer()
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        follow_epoch(self.model, epoch)

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if not self.staircase:
            self._set_learning_rate(epoch + float(batch) / self.steps_per_epoch)
        elif batch == 0:
            self._set_learning_rate(epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore is not None:
            self._momentum.assign(self._restore)
            self._restore = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up (Goyal et al. 2017): the rate grows linearly from
    ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``, set at every batch:
    ``lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`` with
    ``e = epoch + (batch + 1) / steps_per_epoch`` (Horovod's offset, so that the last
    warm-up batch runs at ``initial_lr``). Momentum correction as in
    LearningRateScheduleCallback."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            size = _hvd.size()
            epoch += 1.0 / self.steps_per_epoch
            return (epoch * (size - 1) / warmup_epochs + 1) / size

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.end_epoch - 1 and _hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_value(self.model.optimizer.learning_rate):g}.", flush=True)


class BestModelCheckpoint(tf.keras.callbacks.ModelCheckpoint):
    """Horovod's ModelCheckpoint with ``save_best_only=True``, writing on rank 0 only
    (the other ranks hold the same weights; one writer avoids clobbered files).

    Horovod leaves ``filepath`` unset for its Spark estimator to fill in; here pass
    ``filepath=`` or set ``.filepath`` before ``fit`` (Keras 3: ending in ``.keras``,
    or ``.weights.h5`` with ``save_weights_only=True``). Put MetricAverageCallback
    before it so that "best" means the same epoch on every rank."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", *, filepath=None):
        # Keras 3 checks the file extension at construction: a placeholder until set.
        placeholder = "unset.weights.h5" if save_weights_only else "unset.keras"
        super().__init__(filepath=filepath if filepath is not None else placeholder,
                         monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def _writes(self):
        return _hvd.rank() == 0

    def on_train_begin(self, logs=None):
        if not self._writes():
            return
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no filepath: pass filepath= to it or "
                             "set its .filepath before fit (rank 0 writes there).")
        super().on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        follow_epoch(self.model, epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._writes():
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._writes():
            super().on_epoch_end(epoch, logs)


class DGCCallback(tf.keras.callbacks.Callback):
    """Drives an epoch-based sparsity warm-up, logs compression statistics and, with
    delayed averaging (``delay=D``), flushes the steps in flight before each
    evaluation (so every rank evaluates the same weights) and when ``fit`` ends.
    After an elastic reset (``hvd.elastic.KerasState``) ``fit`` counts epochs from 0
    again; the warm-up goes on from the epoch it had reached. Where the link was
    measured at wrap time (the default cost model), it times each train step for the
    link watch (``link_watch``; hvd_dgc/tensorflow/link.py ``LinkWatchInFit``) and, where
    the link changed enough to change the paths, has ``fit`` trace its step again.

    Args:
        verbose: print the statistics at the end of each epoch on rank 0.
    """

    def __init__(self, verbose=1):
        super().__init__()
        self.verbose = verbose
        self.history = []
        self._timer = _StepTimer(claims=True)  # the link watch's step times

    def on_train_begin(self, logs=None):
        _in_fit(self.model)
        self._timer.claim(self.model, True)

    def on_train_batch_begin(self, batch, logs=None):
        self._timer.begin()

    def on_train_batch_end(self, batch, logs=None):
        self._timer.end(self.model)

    def on_test_begin(self, logs=None):
        self.model.optimizer.flush()

    def on_train_end(self, logs=None):
        self._timer.claim(self.model, False)
        self.model.optimizer.flush()

    def on_epoch_begin(self, epoch, logs=None):
        follow_epoch(self.model, epoch)  # (after an elastic reset: from the epoch reached)

    def on_epoch_end(self, epoch, logs=None):
        stats = self.model.optimizer.compression_stats()
        self.history.append(stats)
        if logs is not None:  # the density in effect now, as the line below says it
            logs["dgc_density"] = stats["current_density"]
        if self.verbose and _hvd.rank() == 0:
            ratio = stats["compression_ratio"]
            less = f"{ratio:.1f}x less than dense fp32" if ratio != float("inf") else \
                "nothing sent"
            print(f"[hvd_dgc] epoch {epoch}: density {stats['current_density']:.4g} now; "
                  f"sent {stats['bytes_sent'] / 1e6:.3f} MB so far ({less}); paths so far "
                  f"{stats['paths']}", flush=True)
