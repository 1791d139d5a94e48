"""Elastic Horovod: hvd_dgc's optimizers in ``hvd.elastic.TorchState``.

Horovod's handler saves and restores ``optimizer.state_dict()`` (which carries
hvd_dgc's memory) and, when workers join, broadcasts rank 0's optimizer state,
which leaves hvd_dgc's own state alone: residuals are per rank, and a newcomer
rightly starts with an empty one. A commit with averages in flight flushes them
first. Its step and epoch, though, decide every
rank's density and path (a mismatch would hang a collective), so after
Horovod's sync they are taken from rank 0 too, with the delay ``delay="auto"``
has reached. Registered in Horovod's handler
registry when hvd_dgc.torch is imported: ``hvd.elastic.TorchState(model=...,
optimizer=...)`` needs no change.

This module is ``hvd.elastic`` under ``import hvd_dgc.torch as hvd``: Horovod's own
(``run``, ``TorchState``, ``ElasticSampler``, ...) with the handler registered.
"""

import abc

from horovod.torch.elastic import *  # noqa: F401,F403  (hvd.elastic, as Horovod's)
from horovod.torch.elastic import state as _state
from horovod.torch.functions import broadcast_object


class DGCOptimizerType(abc.ABC):
    """``isinstance(opt, DGCOptimizerType)``: opt is an hvd_dgc DistributedOptimizer
    (its class is made per wrapped optimizer class, so it is recognised by a marker)."""

    @classmethod
    def __subclasshook__(cls, klass):
        return True if getattr(klass, "_hvd_dgc_optimizer", False) else NotImplemented


class DGCOptimizerStateHandler(_state.OptimizerStateHandler):
    def save(self):
        """A commit. With averages in flight (``delay``, ``period``, the overlapped outer
        loop) they are applied first (``flush``: every rank commits at the same step, as
        Horovod's loop calls ``state.commit()``), so the commit holds weights every rank
        agrees on and ``state_dict`` has nothing in flight to refuse; a restore drops
        what was launched since. Keras' elastic state does the same."""
        if self.value.in_flight:
            self.value.flush()
        super().save()

    def sync(self):
        super().sync()
        self.value.load_shared_state(broadcast_object(
            self.value.shared_state(), root_rank=0, name="hvd_dgc.elastic.counters"))


def register():
    registry = _state.get_handler_registry()
    if not any(handler is DGCOptimizerStateHandler for _, handler in registry):
        _state.set_handler_registry([(DGCOptimizerType, DGCOptimizerStateHandler)] + registry)
