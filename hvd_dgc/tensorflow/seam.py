"""hvd_dgc/seam.py's ``Collectives`` with Horovod's TensorFlow collectives (eager, outside
any trace)."""

import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Max, Sum

from hvd_dgc.seam import ProcessSet, split_blobs

__all__ = ["HorovodCollectives"]


class HorovodCollectives(ProcessSet):
    """Horovod's TensorFlow collectives within ``process_set`` (hvd_dgc/seam.py)."""

    def __init__(self, process_set):
        super().__init__(process_set, _hvd.rank())

    def allgather_bytes(self, blob, name):
        mine = np.frombuffer(bytes(blob), np.uint8)
        sizes = _hvd.allgather(tf.constant([mine.size], tf.int64), name=f"{name}.size",
                               process_set=self.process_set).numpy().tolist()
        everything = _hvd.allgather(tf.constant(mine), name=name,
                                    process_set=self.process_set).numpy().tobytes()
        return split_blobs(sizes, everything)

    def max(self, values, name):
        return _hvd.allreduce(tf.constant(values, tf.float64), op=Max, name=name,
                              process_set=self.process_set).numpy().tolist()

    def max_async(self, values, name):  # (eager TensorFlow has no handle: done here)
        return self.max(values, name)

    def wait(self, handle):
        return handle

    def timed_allreduce(self, numel, name):
        tensor = tf.zeros([numel])
        start = time.perf_counter()
        _hvd.allreduce(tensor, op=Sum, name=name, process_set=self.process_set).numpy()
        return time.perf_counter() - start

    def timed_allgather(self, numel, name):
        tensor = tf.zeros([numel])
        start = time.perf_counter()
        _hvd.allgather(tensor, name=name, process_set=self.process_set).numpy()
        return time.perf_counter() - start

    def timed_alltoall(self, splits, name):
        tensor = tf.zeros([int(sum(splits))])
        start = time.perf_counter()
        _hvd.alltoall(tensor, splits=tf.constant(list(splits), tf.int32), name=name,
                      process_set=self.process_set)[0].numpy()
        return time.perf_counter() - start
