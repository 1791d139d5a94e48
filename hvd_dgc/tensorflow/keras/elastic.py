"""``hvd.elastic`` for ``import hvd_dgc.tensorflow.keras as hvd``: Horovod's elastic
Keras API, with a ``KerasState`` that commits and restores hvd_dgc's DGC memory and
re-plans the exchange after a reset (hvd_dgc/tensorflow/elastic.py)."""

from horovod.tensorflow.keras.elastic import (  # noqa: F401 (Horovod's API, unchanged)
    CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback)

from hvd_dgc.tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """Horovod's ``KerasState(model, optimizer=None, **kwargs)`` for a model compiled
    with hvd_dgc's ``DistributedOptimizer``: weights, optimizer and DGC state committed
    together; ``model.fit`` traces its step again after a reset."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)
