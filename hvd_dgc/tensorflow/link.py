"""The link probe (hvd_dgc/linkprobe.py) with Horovod's TensorFlow allreduce (eager)."""

import time

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Max, Sum

from hvd_dgc.linkprobe import measure_link

__all__ = ["measure"]


def measure(process_set):
    """The agreed ``LinkMeasurement`` of ``process_set``'s ranks (None for one rank); eager,
    outside any trace, every rank at the same point (the exchange's build)."""
    def allreduce(numel):
        tensor = tf.zeros([numel])
        start = time.perf_counter()
        _hvd.allreduce(tensor, op=Sum, name=f"hvd_dgc.probe.{numel}",
                       process_set=process_set).numpy()
        return time.perf_counter() - start

    def agree(values):
        return _hvd.allreduce(tf.constant(values, tf.float64), op=Max,
                              name="hvd_dgc.probe.agree", process_set=process_set).numpy().tolist()
    return measure_link(allreduce, agree, process_set.size())
