"""Elastic Horovod with hvd_dgc.tensorflow: ``hvd.elastic.TensorFlowKerasState``
(and Keras' ``hvd.elastic.KerasState``, hvd_dgc/tensorflow/keras/elastic.py).

Horovod 0.28.1's own state cannot carry hvd_dgc's Keras optimizer: it reads
``optimizer.variables()``, a list (not a method) under Keras 3, and it knows
nothing of DGC's memory, which lives outside the optimizer's variables. This
state commits and restores the model's, the optimizer's and hvd_dgc's variables
(residuals, velocities, step, epoch), and around a reset:

- ``commit``: with ``delay`` or ``period``, what is in flight is applied first
  (``flush``), so every commit is a point every rank agrees on; ``restore`` drops what
  was in flight since;
- ``reset`` (Horovod re-initialised, the world changed, no collective yet): the
  exchange is planned again for the new number of ranks (each tensor's path from
  the cost model; the 1/N scales and bounds are traced into the step, so the
  Keras train function is dropped and ``fit`` traces it again);
- ``sync`` (a worker joined): every rank builds its optimizer (so all hold the
  same variables), takes rank 0's weights and optimizer variables, and rank 0's
  DGC step and epoch, which decide every rank's density and path; residuals stay
  per rank (a newcomer's start empty, as it has sent nothing). With the default
  cost model the link of this world is measured here, where every rank is (a
  worker that joins builds alone: no probe at its build).

Use it as Horovod's: ``state = hvd.elastic.KerasState(model, batch=0, epoch=0)``,
training in a function decorated with ``@hvd.elastic.run`` (this module's: it also
sees a failed collective of hvd_dgc's as a lost worker, below). With a plain Keras
optimizer and ``hvd.DistributedGradientTape`` (Horovod's TF2 elastic example), the
state carries the tape's exchanges instead (``_TapeExchanges``), whose step is traced
once for every world size (exchange.py).
"""

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow.elastic import TensorFlowKerasState as _HorovodKerasState
from horovod.tensorflow.elastic import TensorFlowState  # noqa: F401 (Horovod's API)
from horovod.tensorflow.functions import broadcast_object

from hvd_dgc.tensorflow.keras_optimizers import create_optimizer_variables, \
    optimizer_variables
from hvd_dgc.tensorflow.tape_exchanges import PENDING_SHARED, dgc_state

__all__ = ["TensorFlowKerasState", "TensorFlowState", "run"]


class TensorFlowKerasState(_HorovodKerasState):
    """Horovod's ``TensorFlowKerasState`` for a model trained with hvd_dgc's Keras
    ``DistributedOptimizer`` (Keras 2 and 3, eager TF 2).

    Args:
        model: the Keras model, built.
        optimizer: hvd_dgc's DistributedOptimizer (default: ``model.optimizer``), or a
            plain Keras optimizer, as Horovod's state takes (then the weights and its
            variables are committed and synced, as Horovod does).
        kwargs: further values to commit and sync (``batch``, ``epoch``...), as Horovod's.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not tf.executing_eagerly():
            raise ValueError("hvd_dgc's elastic state needs TF 2's eager mode (TF 1 graph "
                             "sessions are not supported).")
        optimizer = optimizer or getattr(model, "optimizer", None)
        # a plain optimizer (Horovod's state takes one): weights and its variables only
        exchange = getattr(optimizer, "_hvd_dgc", None)
        if exchange is None:  # a tape's exchanges (Horovod's TF2 elastic example), if any
            exchange = _TapeExchanges()
        refused = exchange.elastic_refusal()  # what a reset would lose
        if refused:
            raise ValueError(refused)
        self._exchange = exchange
        super().__init__(model, optimizer=optimizer, backend=backend, **kwargs)

    def save(self):
        """A commit: with delayed averaging or ``period``, first every step in flight
        applied and the ranks' weights averaged (``flush``: every rank commits at the
        same batch), so a restore goes back to weights every rank agrees on."""
        flush = getattr(self.optimizer, "flush", None)
        if flush is not None and getattr(self._exchange, "lags", False):
            flush()
        super().save()

    def restore(self):
        """Back to the last commit; what was in flight since is dropped (it belongs to
        steps that will be done again, in whatever world comes next)."""
        abandon = getattr(self._exchange, "abandon", None)
        if abandon is not None:
            abandon()
        super().restore()

    def _tracked(self):
        """Everything a restore puts back: weights, optimizer and DGC variables, and the
        sums and count of ``backward_passes_per_step`` (a commit may fall between)."""
        passes = getattr(self.optimizer, "_hvd_dgc_passes", None)
        return (list(self.model.variables) + optimizer_variables(self.optimizer)
                + list(self._exchange.variables)
                + (passes.variables if passes is not None else []))

    def _save_model(self):
        # by variable, not by position: the optimizer's and DGC's variables are made at
        # the first step, after the state was
        self._saved = [(v, tf.identity(v)) for v in self._tracked()]

    def _load_model(self):
        for var, value in self._saved:
            var.assign(value)
        self._exchange.set_epoch(self._exchange.current_epoch())  # (its variable too)

    def reset(self):
        """The world changed: plan the exchange for it and trace the step again."""
        self._exchange.replan()
        self._exchange.resuming = True  # DGCCallback: go on from this epoch
        if hasattr(self.model, "train_function"):
            self.model.train_function = None  # fit makes (and traces) a new one
        super().reset()

    def sync(self):
        # a worker that joined has not stepped yet: its optimizer's slots are made now
        if self.optimizer is not None:
            create_optimizer_variables(self.optimizer, self.model.trainable_variables)
        for i, v in enumerate(list(self.model.variables) + optimizer_variables(self.optimizer)):
            v.assign(_hvd.broadcast(tf.convert_to_tensor(v), 0, name=f"hvd_dgc.elastic.{i}"))
        self._exchange.load_shared_state(broadcast_object(
            self._exchange.shared_state(), root_rank=0, name="hvd_dgc.elastic.shared"))
        measure = getattr(self._exchange, "measure_at_sync", None)  # every rank is here
        if measure is not None and measure() and hasattr(self.model, "train_function"):
            self.model.train_function = None  # other paths: fit traces its step again
        self._exchange.resuming = True
        self._save_model()
        ObjectState.sync(self)


class _TapeExchanges:
    """What the state asks of hvd_dgc's exchange, for an optimizer without one (Horovod's
    state accepts a plain Keras optimizer: its weights and variables are committed and
    synced as Horovod does): this process's ``DistributedGradientTape`` exchanges, looked
    up at each call (Horovod's TF2 elastic example makes its tape inside its
    ``tf.function``, after the state). Their memories, step and epoch are committed and
    restored with the weights; at a sync every rank takes rank 0's step and epoch, a
    worker that joined for the exchange its first tape step will make. Their step is
    traced once for every world size (exchange.py: ``traced_once``), so a reset keeps
    its paths and reads the number of ranks when it runs. None: nothing of hvd_dgc's."""

    resuming, lags = False, False

    @staticmethod
    def _exchanges():
        return dgc_state.by_name()

    @property
    def variables(self):
        return [v for e in self._exchanges().values() if e.memory is not None
                for v in e.variables]

    def elastic_refusal(self):
        return None  # (what a traced-once step cannot hold is refused at its build)

    def set_epoch(self, epoch):
        for e in self._exchanges().values():
            e.set_epoch(epoch)

    def current_epoch(self):
        return next((e.current_epoch() for e in self._exchanges().values()), 0.0)

    def replan(self):
        for e in self._exchanges().values():
            e.replan()

    def abandon(self):
        for e in self._exchanges().values():
            e.abandon()

    def shared_state(self):
        return {name: e.shared_state() for name, e in self._exchanges().items()}

    def load_shared_state(self, state):
        mine = self._exchanges()
        for name, shared in (state or {}).items():
            if name in mine:
                mine[name].load_shared_state(shared)
            elif shared is not None:  # made at this rank's first tape step
                PENDING_SHARED[name] = shared


#: What the message of a collective that lost a peer holds: Horovod's op names (what
#: Horovod's own ``run`` looks for), its shutdown notice, or hvd_dgc's op names.
_LOST_PEER = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast", "HorovodAlltoall",
              "Horovod has been shut down", "hvd_dgc.")


def run(func):
    """Horovod's ``hvd.elastic.run``, which also recognises a failed collective of
    hvd_dgc's. Horovod 0.28.1's TF wrapper turns an ``UnknownError`` into a reset
    only when the message names one of its ops by their default names, and
    otherwise returns None as if training had ended: hvd_dgc names its collectives
    (``hvd_dgc.<i>.dense``...), so a worker lost mid-step would end the survivors'
    training silently. Here such an error restores the last commit and resets, and
    any other error is raised."""
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as error:
            if any(mark in str(error) for mark in _LOST_PEER):
                raise HorovodInternalError(error) from error
            raise
    return run_fn(wrapper, _reset)


def _reset():
    _hvd.shutdown()
    _hvd.init()
