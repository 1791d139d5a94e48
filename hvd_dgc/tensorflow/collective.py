"""Compressors that run their own collectives in TensorFlow: the exchange path's protocol.

A quantiser's payloads cannot be summed (they are allgathered and decoded) and
PowerSGD needs two allreduces with local maths in between, so, as on the PyTorch
side (hvd_dgc/torch/collective.py), these compressors communicate themselves.
In TF a step's graph runs its collectives in order, so one call does it::

    slot = compressor.slot(shape, name)          # at build, outside any trace (or None)
    step = compressor.exchange(v, shape, slot, comm, at)   # at.step, at.seed: the step's
    step.mean      # the average over the ranks (flat)
    step.sent      # what this rank's input became (flat): the memory keeps v - sent
    step.bytes     # what this rank put on the wire

Error feedback is the path's (hvd_dgc/tensorflow/paths.py ExchangePath): the memory
keeps ``v - sent``, so ``sent + residual = input + old residual`` whatever the
compressor.
"""

from typing import NamedTuple

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.compression import Compressor
from horovod.tensorflow.mpi_ops import Average, Sum

from hvd_dgc._guard import called_from_horovod_allreduce, not_summable_error
from hvd_dgc.config import CompressorOptions

__all__ = ["Comm", "ExchangeCompressor", "Step", "is_exchange", "Average", "Sum"]


class Step(NamedTuple):
    """One tensor's exchange: the mean over ranks, this rank's ``sent``, bytes sent."""

    mean: tf.Tensor
    sent: tf.Tensor
    bytes: tf.Tensor


class Comm:
    """Horovod's TF collectives on one process set, named per tensor."""

    def __init__(self, process_set, name):
        self.process_set, self.name = process_set, name

    def size(self):
        return self.process_set.size()

    def rank(self):
        return self.process_set.rank()

    def allgather(self, tensor, tag):
        return _hvd.allgather(tensor, name=f"{self.name}.{tag}", process_set=self.process_set)

    def alltoall(self, tensor, splits, tag):
        """Rows ``splits[j]`` of ``tensor`` to rank j; what every rank sent this one."""
        got, _ = _hvd.alltoall(tensor, splits=tf.constant(splits, tf.int32),
                               name=f"{self.name}.{tag}", process_set=self.process_set)
        return got

    def allreduce(self, tensor, tag, op):
        return _hvd.allreduce(tensor, op=op, name=f"{self.name}.{tag}",
                              process_set=self.process_set)


class ExchangeCompressor(CompressorOptions, Compressor):
    """Base of the compressors that communicate themselves (see the module doc)."""

    exchanges = True
    summable_why = "it runs its own collectives"
    #: One round, so what this rank sent is known at launch: delayed averaging's own.
    #: Such compressors also give ``launch(v, at) -> (uint8 payload, sent)`` and
    #: ``finish(gathered, n, world) -> mean``, which delay=D runs on its threads.
    sent_at_launch = False

    def __init__(self, seed=0):
        self.seed = int(seed)

    def _options(self):
        return {"seed": self.seed}

    def __repr__(self):
        return f"hvd_dgc.tensorflow.Compression.{self.name}"

    def compressible(self, shape, step=None):
        """Whether a tensor of ``shape`` takes this path (else it goes dense); ``step``:
        the planner's argument (hvd_dgc/plan.py), unused: a graph decides the start."""
        return True

    def slot(self, shape, name, world=1):
        """Per-tensor state (tf.Variables made at build, outside any trace, for ``world``
        ranks), or None."""
        return None

    def exchange(self, v, shape, slot, comm, at):
        raise NotImplementedError

    # Horovod's interface: only reached if Horovod's own allreduce path was given us.
    def compress(self, tensor):
        if called_from_horovod_allreduce(depth=2):
            raise not_summable_error(repr(self), self.summable_why, "tensorflow")
        raise TypeError(f"{self!r} is used by hvd_dgc.tensorflow's DistributedGradientTape "
                        f"and keras.DistributedOptimizer, which run its collectives.")

    def decompress(self, tensor, ctx):
        raise TypeError(f"{self!r}.decompress: hvd_dgc's exchange path decodes it")


def is_exchange(compression):
    return isinstance(compression, ExchangeCompressor)
